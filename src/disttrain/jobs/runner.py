"""A job from spec to record: Pending → Staging → Running → Uploading → Completed | Failed | Stopped.

Every state change is recorded in the store as it happens, so a job that fails, is stopped or whose
runner dies leaves its state, logs and root cause behind. Job names: each run of a spec is
named ``<name>-<YYYYMMDD-HHMMSS>-<4 hex>`` (SageMaker appends a timestamp to a base job name
the same way), so reruns never collide and sort by time.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from ..checkpoint_check import check_location
from ..errors import DisttrainError
from ..home import disttrain_home
from ..launch import Events, Facts, Launcher, Outcome
from ..launch.membership_record import load_record
from ..plan.launch import LaunchPlan
from ..private import private_opener, write_private
from ..process_start import this_process
from ..store import JobRecord, JobState, JobStore, TransitionError
from ..tracking import sink_class
from ..tracking.follower import RunTracker
from ..tracking.sink import PARENT_ENV
from ..wire import JobClient
from . import container  # SageMaker's container around the script (hooks marked "container:")
from .launchers import launcher_for
from .layout import JobLayout, instance_names
from .planner import JobPlanner
from .results import final_metrics, upload_artifacts
from .spec import JobSpec, check_name, spec_from_mapping
from .staging import check_inputs, code_folder, stage_channels, stage_source


class JobStopped(BaseException):
    """SIGTERM/SIGINT outside the launch (staging, uploading): unwinds like KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def new_job_name(base: str) -> str:
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def jobs_home() -> Path:
    return disttrain_home()


def run_job(spec: JobSpec, *, store: JobStore | str | os.PathLike | None = None,
            job_name: str | None = None, checked: bool = False) -> JobRecord:
    """Run ``spec`` to the end and return its record (Completed, Failed or Stopped).

    Bad input (a missing channel or entry point) raises UsageError before anything is
    recorded; an error after that (staging, launching, uploading) is recorded as the job's
    failure and raised. ``job_name``: the run's full name (an estimator's ``fit(job_name=)``);
    default: the spec's name with a timestamp. ``checked``: :func:`check_job` ran already, in the
    process that started this one (a notebook's ``fit``), and is not run twice.
    """
    name, launcher = _checked(spec, job_name, checked)
    owned = not isinstance(store, JobStore)
    db = JobStore(store) if owned else store
    try:
        layout = job_layout(spec, name)
        record = db.create(
            name=name, spec=spec.to_record(), job_dir=str(layout.root), log_dir=str(layout.logs),
            runner_host=socket.gethostname(), runner_pid=os.getpid(), runner_started=this_process(),
        )
        output_path = spec.container.output_path or str(jobs_home() / "artifacts")
        return JobRun(spec, db, record, layout, launcher, output_path).run()
    finally:
        if owned:
            db.close()


def dry_run_job(spec: JobSpec, *, job_name: str | None = None) -> str:
    """The plan :func:`run_job` would launch (its JSON, as ``plan.json`` keeps it), after the same
    checks, without recording, staging or starting anything; for a Slurm job, the batch script
    (its nodes are placed inside the allocation)."""
    name, launcher = _checked(spec, job_name)
    layout = job_layout(spec, name)
    ready = container.foresee(spec, layout, Events().say)
    planner = JobPlanner(spec=spec, layout=layout, name=name, cwd=code_folder(spec, layout), ready=ready,
                         environ=os.environ)
    return launcher.dry_run(planner.launch_spec(), planner.context()).text()


def check_job(spec: JobSpec, job_name: str | None = None) -> tuple[str, Launcher]:
    """Every check made before anything is recorded (the one place they are written): the run's
    name and its launcher (chosen once) when the inputs, entry point and container are all there."""
    if job_name is not None:
        check_name(job_name, "job_name")
    name = job_name or new_job_name(spec.name)
    check_inputs(spec)
    if spec.container.checkpoint_s3_uri:  # the same check as --checkpoint-dir's: now, not at the first sync
        check_location(spec.container.checkpoint_s3_uri, what="checkpoint_s3_uri",
                       storage_options=dict(spec.container.storage_options))
    launcher = launcher_for(spec, job_name=name)
    if spec.container.track:  # its client is there: said now, not once the job ran
        sink_class(spec.container.track, where="track:")
    container.preflight(spec)  # container: mpirun, Keras, mount namespace
    return name, launcher


def _checked(spec: JobSpec, job_name: str | None, checked: bool = False) -> tuple[str, Launcher]:
    """:func:`check_job`, unless the caller's process ran it already (``checked``: a notebook's fit,
    whose child process runs the job): then only the launcher is chosen."""
    if not checked or job_name is None:
        return check_job(spec, job_name)
    check_name(job_name, "job_name")
    return job_name, launcher_for(spec, job_name=job_name)


def job_layout(spec: JobSpec, name: str) -> JobLayout:
    return JobLayout(jobs_home() / "jobs" / name, instance_names(spec.placement.instance_count))


class JobBatchStepEvents(Events):
    """A job's sink where its instances start: each instance's config files, the plan kept, the banner.
    (What the container adds to the plan is the planner's input, ``planner.context()``.)"""

    def joining(self, plan: LaunchPlan, facts: Facts) -> None:
        """An instance of an elastic job joins: its config files too, before its agent gets its plan."""
        _joining(self, plan, facts)

    def __init__(self, planner: JobPlanner | None = None) -> None:
        self.planner = planner

    @classmethod
    def from_batch_step(cls, client: JobClient) -> JobBatchStepEvents:
        """Inside a Slurm allocation, from what :meth:`JobRun.batch_step_client` shipped (each node's agent
        makes its instance's private /opt/ml, as over ssh)."""
        cwd = Path(client.cwd)
        spec = spec_from_mapping(client.spec, base_dir=cwd, source="the batch step")
        layout = JobLayout(Path(client.job_dir), instance_names(spec.placement.instance_count))
        # requirements.txt was installed by the runner (container.ready_container) before it submitted
        ready = container.ReadyContainer(python=str(layout.venv_python) if layout.venv_python.exists() else None,
                                         private_opt_ml=spec.container.private_opt_ml != "off")
        return cls(JobPlanner(spec=spec, layout=layout, name=client.name, cwd=cwd, ready=ready,
                              environ=os.environ))

    def starting(self, plan: LaunchPlan, facts: Facts, note: str = "") -> None:
        planner = self.planner
        planner.write_config(facts.nodes if isinstance(facts.nodes, tuple) else (facts.nodes,), facts.node_ranks,
                             master_addr=plan.master_addr, master_port=plan.master_port)
        write_private(planner.layout.logs / "plan.json", plan.to_json())
        where = ", ".join(f"{i} on {w}" if i != w else i for i, w in zip(_instances(planner.layout, facts), facts.where))
        how = {"mpi": "mpirun", "none": "once per instance"}.get(planner.spec.distribution.kind, plan.dist_backend)
        self.say(f"disttrain: {plan.world_size} worker(s) ({how}) on {where}"
                 f"{f' ({note})' if note else ''}, rendezvous {plan.master_addr}:{plan.master_port}; "
                 f"logs: {planner.layout.logs}")


def _joining(events: JobBatchStepEvents, plan: LaunchPlan, facts: Facts) -> None:
    events.planner.write_config(facts.nodes, facts.node_ranks, master_addr=plan.master_addr,
                                master_port=plan.master_port)


def _instances(layout: JobLayout, facts: Facts) -> list[str]:
    """The instances the nodes of ``facts`` are (an elastic job may start without some)."""
    ranks = facts.node_ranks if facts.node_ranks is not None else range(len(facts.where))
    return [layout.instance_names[rank] for rank in ranks]


class JobRun(JobBatchStepEvents):
    """One job from staging to its record; the launch's event sink on this side."""

    def __init__(self, spec: JobSpec, store: JobStore, record: JobRecord, layout: JobLayout,
                 launcher: Launcher, output_path: str) -> None:
        super().__init__()
        self.spec, self.layout, self.cwd = spec, layout, layout.root
        self.store, self.record = store, record
        self.launcher, self.output_path = launcher, output_path
        self.transcript: TextIO | None = None
        self.watch: container.Watch | None = None
        self.tracker: RunTracker | None = None  # the job's records (goodput) and its tracker run
        self.parent = os.environ.get(PARENT_ENV) or None  # a tuning job's tracker run: this job is its child

    @property
    def id(self) -> int:
        return self.record.id

    def run(self) -> JobRecord:
        self.layout.create()
        with open(self.layout.transcript, "a", opener=private_opener) as self.transcript, _signals_stop():
            try:
                return self._run()
            except JobStopped as stop:
                timed_out = self.watch.settle() if self.watch else None  # the timer's own SIGTERM?
                if timed_out:
                    return self._end(JobState.FAILED, 128 + stop.signum, failure=timed_out)
                return self._end(JobState.STOPPED, 128 + stop.signum, failure=f"stopped by {stop}")
            except KeyboardInterrupt:
                return self._end(JobState.STOPPED, 130, failure="stopped by SIGINT")
            except DisttrainError as err:
                self._end(JobState.FAILED, err.exit_code, failure=str(err))
                raise
            except Exception as err:
                self._end(JobState.FAILED, 1, failure=f"disttrain bug: {type(err).__name__}: {err}")
                raise

    def _run(self) -> JobRecord:
        spec, layout = self.spec, self.layout
        self.store.transition(self.id, JobState.STAGING)
        self.say(f"disttrain: job {self.record.name} (id {self.id}), {spec.placement.instance_count} instance(s), "
                 f"{spec.placement.launcher} launcher; job dir: {layout.root}")
        self.cwd = stage_source(spec, layout)
        stage_channels(spec, layout, self.say)
        ready = container.ready_container(spec, layout, self.cwd, self.say)  # container: venv, checkpoints, /opt/ml
        self.planner = JobPlanner(spec=spec, layout=layout, name=self.record.name, cwd=self.cwd, ready=ready,
                                  environ=os.environ)
        # container: metrics, checkpoint sync and max_run (under Slurm, time in the queue counts too)
        self.watch = container.Watch(spec, layout, self.store.path, self.id, self.say)
        self.transcript = self.watch.metrics.tap(self.transcript)  # each line timed as the launch writes it
        self.tracker = RunTracker(layout.logs, tracker=spec.container.track, name=self.record.name,
                                  params=job_params(spec), parent=self.parent, say=self.say)
        self.transcript = self.tracker.tap(self.transcript)
        with self.watch:
            outcome = self.launcher.run(self.planner.launch_spec(), self.planner.context(), self)
            timed_out = self.watch.settle()  # decided: a max_run that fires from now on is too late
        return self._finish(outcome, timed_out)

    # -- the launch's events: the record follows the launch --------------------------------

    def starting(self, plan: LaunchPlan, facts: Facts, note: str = "") -> None:
        hosts = [{"instance": i, "host": w} for i, w in zip(_instances(self.layout, facts), facts.where)]
        self.store.transition(self.id, JobState.RUNNING, hosts=hosts)
        if self.tracker is not None:
            self.tracker.starting(len(plan.nodes))
        super().starting(plan, facts, note)

    def submitted(self, job_id: str, run_dir: str) -> None:
        self.store.transition(self.id, JobState.RUNNING, slurm_job_id=job_id)
        if self.tracker is not None:
            self.tracker.starting(self.spec.placement.instance_count)
        self.say(f"disttrain: submitted Slurm job {job_id} ({self.spec.placement.instance_count} node(s)); "
                 f"logs: {run_dir}")

    def ran_on(self, where: tuple[str, ...]) -> None:
        self.store.update(self.id, hosts=[{"instance": i, "host": w}
                                          for i, w in zip(self.layout.instance_names, where)])

    def batch_step_client(self) -> JobClient:
        return JobClient(name=self.record.name, job_dir=str(self.layout.root), cwd=str(self.cwd),
                         spec=self.spec.to_dict())  # whole (masking is for records): the batch step runs it

    def _finish(self, outcome: Outcome, timed_out: str | None) -> JobRecord:
        layout = self.layout
        metrics = final_metrics(layout.logs)
        series = self.store.metric_series(self.id)
        if series:  # container: metric_definitions' last values
            metrics = {**(metrics or {}), **{name: points[-1][1] for name, points in series.items()}}
        if timed_out:
            return self._end(JobState.FAILED, outcome.exit_code or 1, metrics=metrics, failure=timed_out)
        if outcome.signal:
            return self._end(JobState.STOPPED, outcome.exit_code, metrics=metrics,
                             failure=f"stopped by {signal.Signals(outcome.signal).name}")
        if outcome.exit_code:
            instance = layout.instance_names[outcome.failed] if outcome.failed is not None else "an instance"
            failure = outcome.report or f"disttrain: {instance} exited with code {outcome.exit_code}"
            return self._end(JobState.FAILED, outcome.exit_code, metrics=metrics, failure=failure)
        self.store.transition(self.id, JobState.UPLOADING, metrics=metrics)
        artifacts = upload_artifacts(layout, output_path=self.output_path, job_name=self.record.name,
                                     storage_options=self.spec.container.storage_options)
        container.mark_success(layout)
        return self._end(JobState.COMPLETED, 0, metrics=metrics, artifacts=artifacts)

    def _plot(self) -> list[Path]:
        if self.tracker is None or self.tracker.sink is None:
            return []
        return _plot_series(self.store, self.id, self.layout.logs / "metrics.png", self.record.name)

    def _end(self, state: JobState, exit_code: int, *, failure: str | None = None, **fields) -> JobRecord:
        changes = load_record(self.layout.logs)  # an elastic job's membership changes, if any
        if changes:
            fields["membership"] = changes
        if self.tracker is not None:
            artifacts = [self.layout.packed / "model.tar.gz", *self._plot()]
            fields["goodput"] = self.tracker.finish(exit_code, report=failure, artifacts=artifacts)
            self.tracker = None
        if state is JobState.FAILED and failure:
            for inst in self.layout.instances:
                if inst.output.is_dir():
                    with open(inst.failure, "a") as fh:  # after any text the script wrote itself
                        fh.write(failure.rstrip("\n") + "\n")
        try:
            record = self.store.transition(self.id, state, exit_code=exit_code, failure=failure, **fields)
        except TransitionError:  # `jobs stop` recorded the end first (the runner was unresponsive)
            record = self.store.get(self.id)
        took = (record.ended or time.time()) - record.created
        line = f"{last_line_start(record)} in {took:.1f} s"
        if record.state is JobState.COMPLETED:
            line += f"; model: {record.artifacts['model']}"
        else:
            line += f", exit code {exit_code}; see `disttrain jobs show {record.id}`"
        self.say(line)
        return record


def _plot_series(store: JobStore, job_id: int, png: Path, title: str) -> list[Path]:
    """The job's metric_definitions series drawn into ``png`` for its tracker; none without series
    or matplotlib (a plot is a nicety: it never fails the job)."""
    from .metrics import plot_series

    series = store.metric_series(job_id)
    if not series:
        return []
    try:
        return [plot_series(series, png, title)]
    except (DisttrainError, OSError, ValueError):
        return []


def job_params(spec: JobSpec) -> dict[str, str]:
    """A job's parameters for its tracker: its hyperparameters (``hp.NAME``) and what it ran where."""
    program, where = spec.program, spec.placement
    return {"entry_point": program.entry_point, "instance_count": str(where.instance_count),
            "launcher": where.launcher, "distribution": program.distribution.kind,
            **{f"hp.{k}": str(v) for k, v in program.hyperparameters.items()}}


def last_line_start(record: JobRecord) -> str:
    """How the runner's last line of a job's log begins (written just after the end is recorded,
    so a follower of the log waits for it)."""
    return f"disttrain: job {record.name} (id {record.id}) {record.state}"


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """SIGTERM (``disttrain jobs stop``) unwinds the runner as JobStopped, so the record says Stopped.

    While the instances run, the launch flow's own handler takes over and stops them first.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame) -> None:
        raise JobStopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
