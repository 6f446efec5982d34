"""A recorded job seen from a notebook: the child process that runs it, its record, its logs.

``TrainingJob.start`` runs one job spec to its end in a child process
(``python -m disttrain.sagemaker.runjob``), so the job's signal handling (stop, ``max_run``)
never touches the notebook's kernel; everything else reads the job store. Estimators
(``latest_training_job``), ModelTrainer (``_latest_training_job``) and the tuner's trials
all are one of these.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import DisttrainError, UsageError
from .buckets import present

# DescribeTrainingJob's TrainingJobStatus for each of disttrain's states.
STATUS = {"Pending": "InProgress", "Staging": "InProgress", "Running": "InProgress", "Uploading": "InProgress"}


class UnexpectedStatusException(DisttrainError):
    """``fit(wait=True)`` on a job that ended Failed or Stopped, as the SDK raises."""


def check_job(fields: dict[str, Any], *, source: str, job_name: str | None = None):
    """The one check of a job the SDK surface makes (an estimator's fit, a ModelTrainer's train, a
    tuner's trial or dry run), in the notebook's process: the job spec, its entry point under the
    SDK's own name for it, every input, the launcher and the container (``jobs.runner.check_job``).
    Bad input raises here, one line, before anything is recorded; the job's own process trusts it."""
    from ..jobs.runner import check_job as check_spec
    from ..jobs.spec import spec_from_mapping

    spec = spec_from_mapping(fields, base_dir=os.getcwd(), source=source)
    entry, folder = spec.program.entry_point, Path(spec.program.source_dir)
    if entry and folder.is_dir() and not (folder / entry).is_file():
        from ..jobs.contract import contract_for

        raise UsageError(f"{contract_for(spec.container.contract).entry_name}: {entry} not found in source_dir "
                         f"{folder}")
    check_spec(spec, job_name)
    return spec


def start_job(fields: dict[str, Any], name: str, *, logs: bool, source: str) -> TrainingJob:
    """:func:`check_job`, then run ``fields`` (a job spec's keys) as job ``name`` in a child process."""
    return TrainingJob.start(check_job(fields, source=source, job_name=name), name, logs=logs)


def _sent(spec: dict[str, Any]) -> dict[str, str]:
    """HyperParameters as the job's hyperparameters.json holds them (its contract's encoding)."""
    from ..jobs.contract import contract_for

    return contract_for(spec.get("contract", "toolkit")).encoded_hyperparameters(spec.get("hyperparameters") or {})


class TrainingJob:
    """``estimator.latest_training_job``: ``.name``, ``.wait()``, ``.describe()``, ``.logs()``."""

    def __init__(self, name: str, process: subprocess.Popen | None = None) -> None:
        self.name, self.job_name = name, name
        self._process = process
        self._relay_thread = None

    @classmethod
    def start(cls, spec, name: str, *, logs: bool) -> TrainingJob:
        from ..wire import FitRequest

        fd, spec_file = tempfile.mkstemp(prefix="disttrain-fit-", suffix=".json")  # 0600
        with os.fdopen(fd, "w") as fh:
            fh.write(FitRequest(spec=spec.to_dict()).to_line() + "\n")
        # Without logs, nothing reads the runner's output (its transcript keeps it): the job then
        # outlives this process (a tuner's loop killed and resumed) with no pipe to break.
        process = subprocess.Popen(
            [sys.executable, "-m", "disttrain.sagemaker.runjob", spec_file, name],
            stdout=subprocess.PIPE if logs else subprocess.DEVNULL, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,  # a Ctrl-C in the notebook interrupts the wait, not the job
        )
        job = cls(name, process)
        if logs:
            job._relay()
        return job

    def _relay(self) -> None:
        import threading

        def pump() -> None:
            for line in self._process.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()

        self._relay_thread = threading.Thread(target=pump, daemon=True)
        self._relay_thread.start()

    def _record(self):
        from ..jobs.control import refresh
        from ..store import JobStore

        with JobStore() as store:
            return refresh(store, store.get(self.name))

    def _try_record(self):
        """The record, or None while the runner has not created it yet."""
        try:
            return self._record()
        except UsageError:
            return None

    def _wait_recorded(self, timeout_s: float = 60.0):
        """The record, once the child process has created it."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._record()
            except UsageError:
                if self._process is not None and self._process.poll() is not None:
                    raise UsageError(f"job {self.name} never started (exit code {self._process.returncode}); "
                                     "see the output above") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def done(self) -> bool:
        """Whether the job has ended (its runner process too, when this notebook started it)."""
        if self._process is not None:
            return self._process.poll() is not None
        return self._record().state.final

    def wait_done(self, timeout_s: float | None = None):
        """The record once the job has ended (None if ``timeout_s`` passed first)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._process is not None:
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None
            if self._relay_thread is not None:
                self._relay_thread.join(timeout=10)
        else:
            while not self._record().state.final:
                if deadline is not None and time.monotonic() > deadline:
                    return None
                time.sleep(0.5)
        return self._wait_recorded()

    def wait(self, logs: Any = True) -> None:
        """Until the job ends; raises UnexpectedStatusException when it did not complete."""
        record = self.wait_done()
        if str(record.state) != "Completed":
            reason = (record.failure or "").strip().splitlines()
            raise UnexpectedStatusException(
                f"Error for Training job {self.name}: {record.state}. Reason: {reason[0] if reason else '?'} "
                f"(disttrain jobs show {record.id})")

    def request_stop(self, *, kill: bool = False) -> None:
        """Ask the job's runner to stop (SIGTERM; SIGKILL with ``kill``) and return at once."""
        import signal

        sig = signal.SIGKILL if kill else signal.SIGTERM
        if self._process is not None:
            if self._process.poll() is None:
                os.kill(self._process.pid, sig)
            return
        from ..jobs.control import runner_alive

        record = self._try_record()
        if record is not None and runner_alive(record):
            os.kill(record.runner_pid, sig)

    def stop(self) -> None:
        """Stop the job (its runner stops every instance; the record says Stopped)."""
        from ..jobs.control import stop_job
        from ..store import JobStore

        self._wait_recorded()
        with JobStore() as store:
            stop_job(store, self.name)
        if self._process is not None:
            self._process.wait()

    def describe(self) -> dict[str, Any]:
        """The record in DescribeTrainingJob's shape (the keys notebooks read)."""
        from ..store import JobStore

        record = self._wait_recorded()
        with JobStore() as store:
            series = store.metric_series(record.id)
        status = STATUS.get(str(record.state), str(record.state))
        spec = record.spec
        described = {
            "TrainingJobName": record.name,
            "TrainingJobStatus": status,
            "SecondaryStatus": str(record.state),
            "HyperParameters": _sent(spec),
            "ResourceConfig": {"InstanceCount": spec.get("instance_count"),
                               "InstanceType": spec.get("instance_type", "local")},
            "StoppingCondition": {"MaxRuntimeInSeconds": spec.get("max_run")},
            "CreationTime": record.created,
            "TrainingStartTime": record.started,
            "TrainingEndTime": record.ended,
            "FinalMetricDataList": [{"MetricName": n, "Value": p[-1][1], "Timestamp": p[-1][0]}
                                    for n, p in sorted(series.items())],
            "OutputDataConfig": {"S3OutputPath": present(spec.get("output_path"))},
            "CheckpointConfig": {"S3Uri": present(spec.get("checkpoint_s3_uri")),
                                 "LocalPath": spec.get("checkpoint_local_path") or "/opt/ml/checkpoints"},
            "JobDir": record.job_dir,
            "Environment": dict(spec.get("env") or {}),
        }
        if record.failure:
            described["FailureReason"] = record.failure.strip()
        if "model" in record.artifacts:
            described["ModelArtifacts"] = {"S3ModelArtifacts": present(record.artifacts["model"])}
        return described

    def logs(self, follow: bool = False) -> None:
        record = self._wait_recorded()
        path = record.logs / "job.log"
        offset = 0
        while True:
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except FileNotFoundError:
                data = b""
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
            offset += len(data)
            if not follow or self._record().state.final:
                if follow and data:
                    continue  # what was written while we looked at the state
                return
            time.sleep(0.3)
