"""What a SageMaker container does around the script, for a job's instances on your machines.

The runner calls, in order:

- :func:`preflight` (before anything is recorded): what this machine must have;
- :func:`ready_container` (while Staging): ``requirements.txt`` into the job's own environment,
  checkpoints restored from ``checkpoint_s3_uri``, whether this machine can make a private
  ``/opt/ml`` (for its own instances: launcher local and mpi); :func:`foresee` says what it
  would find without doing it (``--dry-run``);
- what the container adds to each instance (its ``SM_*`` contract, the distribution's worker
  command, the folder its processes see at ``/opt/ml``) is an input of the launcher's planner:
  :mod:`disttrain.jobs.planner`;
- :class:`Watch` (around the launch): metrics (in the store and, live, in TensorBoard event
  files), checkpoint sync, ``max_run``; then :func:`mark_success` (``output/success``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..agent.optml import available
from ..errors import UsageError
from .checkpoints import Syncer, local_dir, restore
from .layout import JobLayout
from .metrics import MetricWatcher
from .requirements import FILENAME, isolated_python
from .spec import JobSpec
from .staging import TARBALL_SUFFIXES, local_path

PS_SHIM = "disttrain.jobs.psshim"
MAX_RUNTIME = "MaxRuntimeExceeded"


@dataclass(frozen=True, kw_only=True)
class ReadyContainer:
    """What :func:`ready_container` found (or :func:`foresee` expects), for the plan."""

    python: str | None = None  # the job's venv interpreter (requirements.txt), else the launcher's
    private_opt_ml: bool = True  # False: off, or this machine (launcher local/mpi) cannot make one


def preflight(spec: JobSpec) -> None:
    """What this machine must have for the job, checked before anything is recorded: mpirun for
    distribution mpi, a Keras whose fit works for multi_worker_mirrored_strategy, a mount
    namespace when private_opt_ml is required and the instances run here (on other hosts, each
    instance's agent checks its own machine)."""
    dist = spec.distribution
    if dist.kind == "mpi":  # launcher local only: the spec refused any other
        from ..launch.mpi import find_mpirun

        find_mpirun()
    if dist.kind == "multi_worker_mirrored_strategy" and spec.placement.instance_count > 1:
        _check_keras(spec)
    if spec.container.private_opt_ml == "required":
        _namespace(spec, lambda _line: None)


def ready_container(spec: JobSpec, layout: JobLayout, cwd: Path, say: Callable[[str], None]) -> ReadyContainer:
    if spec.distribution.note():
        say(spec.distribution.note())
    ready = ReadyContainer(private_opt_ml=_namespace(spec, say), python=isolated_python(cwd, layout.venv, say))
    box = spec.container
    if box.checkpoint_s3_uri:
        for inst in layout.instances:
            count = restore(box.checkpoint_s3_uri, local_dir(inst, box.checkpoint_local_path), box.storage_options)
        say(f"disttrain: restored {count} checkpoint file(s) from {box.checkpoint_s3_uri}" if count else
            f"disttrain: no checkpoints at {box.checkpoint_s3_uri} yet; starting fresh")
    return ready


def foresee(spec: JobSpec, layout: JobLayout, say: Callable[[str], None]) -> ReadyContainer:
    """What :func:`ready_container` will find, without installing or restoring anything (``--dry-run``)."""
    if spec.distribution.note():
        say(spec.distribution.note())
    return ReadyContainer(private_opt_ml=_namespace(spec, say),
                          python=str(layout.venv_python) if _installs_requirements(spec, say) else None)


def _installs_requirements(spec: JobSpec, say: Callable[[str], None]) -> bool:
    """Whether the staged code will hold a requirements.txt (:func:`ready_container` installs it)."""
    source = spec.program.source_dir
    path = local_path(source)
    if not source.endswith(TARBALL_SUFFIXES):
        return (Path(path or source) / FILENAME).is_file()
    if path is None:
        say(f"disttrain: note: source_dir {source} is fetched when the job runs; this plan assumes it holds "
            f"no {FILENAME} (with one, the workers run the job's own interpreter)")
        return False
    import tarfile

    with tarfile.open(path) as tar:
        return any(name.removeprefix("./") == FILENAME for name in tar.getnames())


def _check_keras(spec: JobSpec) -> None:
    """Keras 3's model.fit fails under MultiWorkerMirroredStrategy: say so now, not after 40 lines
    of tensors. TF_USE_LEGACY_KERAS set by the user (e.g. 0 for a custom strategy.run loop) wins."""
    from ..tfconfig import LEGACY_KERAS, have_tf_keras, keras2_install_hint

    if LEGACY_KERAS in {**os.environ, **spec.program.env} or have_tf_keras():
        return
    raise UsageError(f"distribution multi_worker_mirrored_strategy: tf.keras here is Keras 3, whose model.fit fails "
                     f"under that strategy; install Keras 2 (disttrain selects it for the workers): "
                     f"{keras2_install_hint()} (a custom strategy.run loop: set environment TF_USE_LEGACY_KERAS=0)")


def _namespace(spec: JobSpec, say: Callable[[str], None]) -> bool:
    """Whether the instances get a private /opt/ml. Instances on this machine: checked here, once
    for all of them, before anything is recorded; on hosts or Slurm nodes: by each one's agent."""
    if spec.container.private_opt_ml == "off":
        return False
    if spec.placement.launcher == "local":  # distribution mpi included (it runs launcher local only)
        return available(required=spec.container.private_opt_ml == "required", where="this machine", say=say)
    return True


class Watch:
    """Around the launch: metrics from the live output, checkpoint sync, the ``max_run`` limit."""

    def __init__(self, spec: JobSpec, layout: JobLayout, store_path: Path, job_id: int,
                 say: Callable[[str], None]) -> None:
        self.spec, self.layout, self.say = spec, layout, say
        # TensorBoard event files in the job folder: tensorboard --logdir ~/.disttrain/jobs shows every job
        box = spec.container
        self.metrics = MetricWatcher(box.metric_definitions, store_path, job_id, events_dir=layout.root / "tensorboard",
                                     say=say)
        self.syncer = (Syncer(box.checkpoint_s3_uri, self._checkpoint_dirs(), box.storage_options, say)
                       if box.checkpoint_s3_uri else None)
        self.timed_out = False
        self._timer: threading.Timer | None = None
        # max_run and the end of the launch (or a stop) race; the first to take this decides.
        self._decide = threading.Lock()
        self._settled = False

    def _checkpoint_dirs(self) -> list[Path]:
        local = self.spec.container.checkpoint_local_path
        return list(dict.fromkeys(local_dir(i, local) for i in self.layout.instances))

    def _expire(self) -> None:
        with self._decide:
            if self._settled:  # the launch ended, or a stop got there first: that is the outcome
                return
            self.timed_out = True
            # Said before the signal: once it is sent, the runner may end and close the job's log.
            self.say(f"disttrain: {MAX_RUNTIME}: the job ran for max_run={self.spec.container.max_run} s; stopping it")
            os.kill(os.getpid(), signal.SIGTERM)  # the launch stops every instance, as on `jobs stop`

    def settle(self) -> str | None:
        """The launch has ended, or the runner is stopping (a SIGTERM it cannot tell from the
        timer's own): from now on max_run cannot decide the outcome. Its failure if it had."""
        with self._decide:
            self._settled = True
        if self._timer:
            self._timer.cancel()
        return self.failure()

    def __enter__(self) -> Watch:
        self.metrics.__enter__()
        if self.syncer:
            self.syncer.__enter__()
        if self.spec.container.max_run:
            self._timer = threading.Timer(self.spec.container.max_run, self._expire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.settle()
        self.metrics.__exit__(*exc)
        if self.metrics.error:
            self.say(self.metrics.error)
        if self.syncer:
            self.syncer.__exit__(*exc)
            uploaded = self.syncer.sync()  # the last files, after every process ended
            self.say(f"disttrain: checkpoints synced to {self.spec.container.checkpoint_s3_uri} "
                     f"({uploaded} file(s) at the end)")

    def failure(self) -> str | None:
        if self.timed_out:
            return (f"{MAX_RUNTIME}: the job was stopped after max_run={self.spec.container.max_run} s "
                    "(raise max_run, or checkpoint and resume)")
        return None


def mark_success(layout: JobLayout) -> None:
    """``output/success`` on every instance, as SageMaker's toolkit writes it after the script."""
    for inst in layout.instances:
        if inst.output.is_dir():
            inst.success.write_text("")
