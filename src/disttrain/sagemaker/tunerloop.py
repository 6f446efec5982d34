"""The loop that runs a tuning job's trials: ``python -m disttrain.sagemaker.tunerloop NAME``.

One process per tuning job (the tuner's ``fit``/``tune`` starts it, ``disttrain tune resume``
too). It keeps up to ``max_parallel_jobs`` trials running, each an ordinary recorded job run by
its own runner process (placed like any job: this machine's cores split between the parallel
trials, or the estimator's ``disttrain=`` placement), asks Optuna for each new trial's
hyperparameters and tells it each result. While a trial runs, the objective's live points
(the job store's metric series) are reported to Optuna, whose pruner may stop it early.

SIGTERM (``stop_tuning_job()``, ``disttrain tune stop``) stops the running trials and records the
tuning job Stopped. A tuning job whose loop was killed outright is resumed by starting the loop
again: trials whose jobs still run are followed to their end, the others counted as failed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from ..errors import DisttrainError, UsageError
from ..process_start import same_process, this_process
from . import tuning
from .tuning import ENDED, RUNNER, STATE

POLL_S = 0.5
STOP_GRACE_S = 120.0  # a trial's runner stops its instances within its own grace; then it is killed


@dataclass
class Running:
    trial: Any  # optuna.trial.Trial
    job: Any  # trainingjob.TrainingJob
    reported: int = 0
    stopping: str | None = None  # why it is being stopped: "pruned" | "stopped"
    stop_sent: float = 0.0


def trial_job_name(tuning_name: str, number: int) -> str:
    import secrets

    return f"{tuning_name}-{number + 1:03d}-{secrets.token_hex(4)}"


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


class TuningRun:
    def __init__(self, name: str, say=print) -> None:
        self.name, self.say = name, say
        self.study, self.config = tuning.load_study(name)
        self.optuna = tuning._optuna()
        self.running: dict[int, Running] = {}
        self.stop_requested = False
        self.tracked = None  # the tuning job's tracker run (its trials are its children), with track:

    # -- the runner's claim on the study ---------------------------------------------------------
    def claim(self) -> None:
        """One loop per tuning job: refuse to start while another one is alive."""
        runner = self.study.user_attrs.get(RUNNER)
        if runner and runner.get("host") == socket.gethostname() and runner.get("pid") != os.getpid():
            if same_process(runner["pid"], runner.get("started")):
                raise UsageError(f"tuning job {self.name} is being run by pid {runner['pid']}; "
                                 f"stop it first (disttrain tune stop {self.name})")
        self.study.set_user_attr(RUNNER, {"host": socket.gethostname(), "pid": os.getpid(), "started": this_process()})
        self.study.set_user_attr(STATE, "InProgress")

    def adopt(self) -> None:
        """Trials a previous loop left running: followed if their job still runs, else failed."""
        from .trainingjob import TrainingJob

        for frozen in self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,)):
            job = frozen.user_attrs.get("job")
            record = TrainingJob(job)._try_record() if job else None
            if record is None:
                self.study.tell(frozen.number, state=self.optuna.trial.TrialState.FAIL)
                continue
            trial = self.optuna.trial.Trial(self.study, frozen._trial_id)
            self.running[frozen.number] = Running(trial, TrainingJob(job), reported=len(frozen.intermediate_values))
            self.say(f"disttrain: tuning job {self.name}: following trial {frozen.number + 1} ({job}), "
                     f"{record.state}")

    # -- trials ------------------------------------------------------------------------------------
    def started(self) -> int:
        """Trials counted against max_jobs: every one asked for (waiting grid points are not)."""
        waiting = self.optuna.trial.TrialState.WAITING
        return sum(1 for t in self.study.get_trials(deepcopy=False) if t.state != waiting)

    def distributions(self) -> dict[str, Any]:
        dist = self.optuna.distributions
        found = {}
        for name, data in self.config.ranges.items():
            log = data.get("scaling") == "Logarithmic"
            if data["type"] == "Categorical":
                found[name] = dist.CategoricalDistribution(data["values"])
            elif data["type"] == "Integer":
                found[name] = dist.IntDistribution(int(data["min"]), int(data["max"]), log=log)
            else:
                found[name] = dist.FloatDistribution(float(data["min"]), float(data["max"]), log=log)
        return found

    def start_trial(self) -> None:
        from .trainingjob import start_job

        trial = self.study.ask(self.distributions())
        job = trial_job_name(self.name, trial.number)
        trial.set_user_attr("job", job)
        fields = dict(self.config.job)
        fields["hyperparameters"] = {**(fields.get("hyperparameters") or {}), **trial.params}
        fields["env"] = {**self._core_share(fields), **(fields.get("env") or {})}
        if fields.get("checkpoint_s3_uri"):  # each trial its own checkpoints, never another trial's
            fields["checkpoint_s3_uri"] = f"{fields['checkpoint_s3_uri'].rstrip('/')}/{job}"
        try:
            running = start_job(fields, job, logs=False, source=f"tuning job {self.name}")
        except DisttrainError as err:
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            raise UsageError(f"tuning job {self.name}: trial {trial.number + 1} cannot start: {err}") from None
        self.running[trial.number] = Running(trial, running)
        self.say(f"disttrain: tuning job {self.name}: trial {trial.number + 1}/{self.config.max_jobs} {job} "
                 f"started: {_shown(trial.params)}")

    def _core_share(self, fields: dict[str, Any]) -> dict[str, str]:
        """This machine's cores split between the parallel trials' instances (launcher local)."""
        if fields.get("launcher", "local") != "local" or "OMP_NUM_THREADS" in os.environ:
            return {}
        share = (os.cpu_count() or 1) // (self.config.max_parallel_jobs * int(fields.get("instance_count") or 1))
        return {"OMP_NUM_THREADS": str(max(1, share))}

    def follow(self, number: int, run: Running) -> bool:
        """Report new points of a running trial; stop it when the pruner says so. True once it ended."""
        metric = self.config.objective_metric_name
        if run.job.done():
            self.finish(number, run)
            return True
        record = run.job._try_record()
        if record is None or run.stopping:
            self._escalate(run)
            return False
        from ..store import JobStore

        with JobStore() as store:
            points = store.metric_series(record.id).get(metric, [])
        for step in range(run.reported, len(points)):
            run.trial.report(points[step][1], step)
        run.reported = max(run.reported, len(points))
        if run.reported and run.trial.should_prune():
            last = points[run.reported - 1][1]
            self.say(f"disttrain: tuning job {self.name}: stopping trial {number + 1} ({run.job.name}) early at "
                     f"point {run.reported}: {metric}={last:.4g} is behind the earlier trials")
            self._stop(run, "pruned")
        return False

    def _stop(self, run: Running, why: str) -> None:
        run.stopping, run.stop_sent = why, time.monotonic()
        run.job.request_stop()

    def _escalate(self, run: Running) -> None:
        if run.stopping and time.monotonic() - run.stop_sent > STOP_GRACE_S:
            run.job.request_stop(kill=True)

    def finish(self, number: int, run: Running) -> None:
        states = self.optuna.trial.TrialState
        try:
            record = run.job.wait_done()
        except UsageError as err:  # stopped before its runner recorded it
            self.study.tell(run.trial, state=states.FAIL)
            self.say(f"disttrain: tuning job {self.name}: trial {number + 1} ({run.job.name}) failed: {err}")
            return
        metric = self.config.objective_metric_name
        from ..store import JobStore

        with JobStore() as store:
            points = store.metric_series(record.id).get(metric, [])
        for step in range(run.reported, len(points)):
            run.trial.report(points[step][1], step)
        state = str(record.state)
        if run.stopping == "pruned":
            self.study.tell(run.trial, state=states.PRUNED)
            return
        if state == "Completed" and points:
            value = points[-1][1]
            self.study.tell(run.trial, value)
            if self.tracked is not None:
                self._tell_tracker("metrics", {metric: value}, number, time.time())
            best = self.study.best_trial.number == number
            self.say(f"disttrain: tuning job {self.name}: trial {number + 1} ({run.job.name}) Completed: "
                     f"{metric}={value:.6g}{' (best so far)' if best else ''}")
            return
        self.study.tell(run.trial, state=states.FAIL)
        reason = (record.failure or "").strip().splitlines()
        why = (f"no {metric} point matched its metric definition" if state == "Completed"
               else f"{state}{': ' + reason[0] if reason else ''} (disttrain jobs logs {run.job.name})")
        self.say(f"disttrain: tuning job {self.name}: trial {number + 1} ({run.job.name}) failed: {why}")

    # -- the loop ----------------------------------------------------------------------------------
    def track(self) -> None:
        """With ``track:`` in the trials' job: the tuning job as a tracker run, named in the environment
        of the trials' runners (tracking.sink.PARENT_ENV), which make theirs its children."""
        tracker = self.config.job.get("track")
        if not tracker or self.tracked is not None:
            return
        import json

        from ..tracking.sink import PARENT_ENV, open_or_say

        self.tracked = open_or_say(tracker, self.name, params={
            "objective": f"{self.config.objective_type} {self.config.objective_metric_name}",
            "max_jobs": str(self.config.max_jobs), "max_parallel_jobs": str(self.config.max_parallel_jobs),
            "ranges": json.dumps(self.config.ranges, sort_keys=True)}, say=self.say)
        if self.tracked is not None:
            os.environ[PARENT_ENV] = self.tracked.child_key

    def _tell_tracker(self, what: str, *args) -> None:
        """A call to the tuning job's tracker run: one that fails is said once, then left (never the loop's end)."""
        try:
            getattr(self.tracked, what)(*args)
        except Exception as err:
            from ..private import redact_urls

            self.say(redact_urls(f"disttrain: warning: the tuning job's tracker failed ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:200] if str(err) else ''}); going on untracked"))
            self.tracked = None

    def run(self) -> str:
        self.claim()
        self.track()
        deadline = (time.monotonic() + self.config.max_runtime_in_seconds
                    if self.config.max_runtime_in_seconds else None)
        previous = signal.signal(signal.SIGTERM, self._on_stop)
        try:
            self.adopt()
            self._loop(deadline)
        except BaseException:
            for run in self.running.values():  # no trial outlives its tuning loop
                run.job.request_stop()
            self.study.set_user_attr(STATE, "Failed")
            self.study.set_user_attr(ENDED, time.time())
            if self.tracked is not None:
                self._tell_tracker("finish", 1)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        state = "Stopped" if self.stop_requested or (deadline is not None and time.monotonic() > deadline) \
            else "Completed"
        return self.end(state)

    def _loop(self, deadline: float | None) -> None:
        while True:
            for number, run in list(self.running.items()):
                if self.follow(number, run):
                    del self.running[number]
            over = deadline is not None and time.monotonic() > deadline
            if self.stop_requested or over:
                for run in self.running.values():
                    if not run.stopping:
                        self._stop(run, "stopped")
                if not self.running:
                    break
            else:
                while len(self.running) < self.config.max_parallel_jobs and self.started() < self.config.max_jobs:
                    self.start_trial()
                if not self.running:
                    break
            time.sleep(POLL_S)

    def _on_stop(self, signum, _frame) -> None:
        self.stop_requested = True

    def end(self, state: str) -> str:
        self.study.set_user_attr(STATE, state)
        self.study.set_user_attr(ENDED, time.time())
        trials = tuning.summaries(self.study, self.config)
        top = tuning.best(trials, self.config)
        line = f"disttrain: tuning job {self.name} {state}: {len(trials)} trial(s)"
        if top is not None:
            line += (f"; best {top.job}: {self.config.objective_metric_name}={top.value:.6g} "
                     f"({_shown(top.params)})")
        self.say(line)
        if self.tracked is not None:
            self._tell_tracker("finish", 0 if state == "Completed" else 143)
        return state


def run_tuning(name: str, say=print) -> str:
    return TuningRun(name, say=say).run()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m disttrain.sagemaker.tunerloop TUNING_JOB_NAME", file=sys.stderr)
        return 2
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        state = run_tuning(args[0], say=say)
    except DisttrainError as err:
        print(f"disttrain: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0 if state == "Completed" else 1


if __name__ == "__main__":
    sys.exit(main())
