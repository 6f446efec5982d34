"""What a SageMaker container does around the script, for a job's instances on your machines.

The runner calls three hooks, in order:

- :func:`prepare` (while Staging): ``requirements.txt`` into the job's own environment,
  checkpoints restored from ``checkpoint_s3_uri``, whether this machine can make a private
  ``/opt/ml`` (for its own instances: launcher local and mpi);
- :func:`instance_plan` (once placed): each instance's ``SM_*`` contract and config files,
  the distribution's worker command, and the folder its processes see at ``/opt/ml`` (made
  private where they run: :mod:`disttrain.agent.optml`);
- :class:`Watch` (around the launch): metrics (in the store and, live, in TensorBoard event
  files), checkpoint sync, ``max_run``; then :func:`mark_success` (``output/success``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..agent.optml import available
from ..errors import UsageError
from ..plan.launch import LaunchPlan
from .checkpoints import Syncer, local_dir, restore
from .distribution import Distribution, parse_distribution, ps_tf_config
from .layout import JobLayout
from .metrics import MetricWatcher
from .requirements import isolated_python
from .sagemaker import Instance, sm_env, write_config
from .spec import JobSpec

PS_SHIM = "disttrain.jobs.psshim"
MAX_RUNTIME = "MaxRuntimeExceeded"


@dataclass
class Prepared:
    """What :func:`prepare` found, for the later hooks."""

    distribution: Distribution
    python: str | None = None  # the job's venv interpreter (requirements.txt), else the launcher's
    private_opt_ml: bool = True  # False: off, or this machine (launcher local/mpi) cannot make one
    notes: list[str] = field(default_factory=list)


def preflight(spec: JobSpec) -> None:
    """What this machine must have for the job, checked before anything is recorded: mpirun for
    distribution mpi, a Keras whose fit works for multi_worker_mirrored_strategy, a mount
    namespace when private_opt_ml is required and the instances run here (on other hosts, each
    instance's agent checks its own machine)."""
    dist = parse_distribution(spec.distribution, framework=spec.framework)
    if dist.kind == "mpi":
        if spec.launcher != "local":
            raise UsageError(f"distribution mpi runs the instances of launcher local only (this job: {spec.launcher}); "
                             "use torch_distributed, or run mpirun yourself")
        from ..launch.mpi import find_mpirun

        find_mpirun()
    if dist.kind == "multi_worker_mirrored_strategy" and spec.instance_count > 1:
        _check_keras(spec)
    if spec.private_opt_ml == "required":
        _namespace(spec, lambda _line: None)


def prepare(spec: JobSpec, layout: JobLayout, cwd: Path, say: Callable[[str], None]) -> Prepared:
    dist = parse_distribution(spec.distribution, framework=spec.framework)
    ready = Prepared(distribution=dist)
    if dist.note():
        say(dist.note())
    ready.private_opt_ml = _namespace(spec, say)
    ready.python = isolated_python(cwd, layout.root / "venv", say)
    if spec.checkpoint_s3_uri:
        for inst in layout.instances:
            count = restore(spec.checkpoint_s3_uri, local_dir(inst, spec.checkpoint_local_path),
                            spec.storage_options)
        say(f"disttrain: restored {count} checkpoint file(s) from {spec.checkpoint_s3_uri}" if count else
            f"disttrain: no checkpoints at {spec.checkpoint_s3_uri} yet; starting fresh")
    return ready


def _check_keras(spec: JobSpec) -> None:
    """Keras 3's model.fit fails under MultiWorkerMirroredStrategy: say so now, not after 40 lines
    of tensors. TF_USE_LEGACY_KERAS set by the user (e.g. 0 for a custom strategy.run loop) wins."""
    from ..tfconfig import LEGACY_KERAS, have_tf_keras, keras2_install_hint

    if LEGACY_KERAS in {**os.environ, **spec.env} or have_tf_keras():
        return
    raise UsageError(f"distribution multi_worker_mirrored_strategy: tf.keras here is Keras 3, whose model.fit fails "
                     f"under that strategy; install Keras 2 (disttrain selects it for the workers): "
                     f"{keras2_install_hint()} (a custom strategy.run loop: set environment TF_USE_LEGACY_KERAS=0)")


def _namespace(spec: JobSpec, say: Callable[[str], None]) -> bool:
    """Whether the instances get a private /opt/ml. Instances on this machine: checked here, once
    for all of them, before anything is recorded; on hosts or Slurm nodes: by each one's agent."""
    if spec.private_opt_ml == "off":
        return False
    if spec.launcher == "local":  # distribution mpi included (it runs launcher local only)
        return available(required=spec.private_opt_ml == "required", where="this machine", say=say)
    return True


def instance_plan(spec: JobSpec, layout: JobLayout, plan: LaunchPlan, *, job_name: str, cwd: Path,
                  ready: Prepared, ifnames, gpus, cpus) -> LaunchPlan:
    """Instance K (the plan's node K): its SM_* variables and config files, and its /opt/ml folder."""
    dist = ready.distribution
    nodes = []
    addresses = [node.address or plan.master_addr for node in plan.nodes]
    for k, (node, host, ifname, ngpu, ncpu) in enumerate(zip(plan.nodes, layout.hosts, ifnames, gpus, cpus)):
        inst = Instance(job_name=job_name, host=host, hosts=layout.hosts, instance_type=spec.instance_type,
                        ifname=ifname, num_gpus=ngpu, num_cpus=ncpu, entry_point=spec.entry_point,
                        module_dir=str(cwd), hyperparameters=spec.hyperparameters,
                        framework_params=dist.framework_params, channels=tuple(spec.inputs))
        paths = layout.instance(host)
        write_config(inst, paths)
        env = sm_env(inst, paths)
        # The toolkit puts the code folder on PYTHONPATH, so the script imports its neighbours.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(cwd), node.env.get("PYTHONPATH")
                                                          or os.environ.get("PYTHONPATH"))))
        if dist.kind == "parameter_server":
            env["DISTTRAIN_PS_TF_CONFIG"] = ps_tf_config(addresses, plan.master_port, k, ps_task=False)
            env["DISTTRAIN_PS_TASK_TF_CONFIG"] = ps_tf_config(addresses, plan.master_port, k, ps_task=True)
        if spec.framework == "tensorflow":
            from ..tfconfig import have_tf_keras, keras_env

            env.update(keras_env({**os.environ, **node.env, **spec.env}, have_tf_keras=have_tf_keras()))
        # The spec's own env wins, as --env does for `disttrain run`.
        nodes.append(replace(node, env={**node.env, **env, **spec.env},
                             opt_ml=str(paths.root) if ready.private_opt_ml else None,
                             opt_ml_required=spec.private_opt_ml == "required"))
    argv = list(plan.argv)
    if ready.python:
        argv[0] = ready.python
    if dist.kind == "parameter_server":  # python -u SCRIPT ARGS → python -u -m psshim SCRIPT ARGS
        argv = [argv[0], "-u", "-m", PS_SHIM, *argv[2:]]
    return replace(plan, nodes=tuple(nodes), argv=tuple(argv))


class Watch:
    """Around the launch: metrics from the live output, checkpoint sync, the ``max_run`` limit."""

    def __init__(self, spec: JobSpec, layout: JobLayout, store_path: Path, job_id: int,
                 say: Callable[[str], None]) -> None:
        self.spec, self.layout, self.say = spec, layout, say
        # TensorBoard event files in the job folder: tensorboard --logdir ~/.disttrain/jobs shows every job
        self.metrics = MetricWatcher(spec.metric_definitions, store_path, job_id, events_dir=layout.root / "tensorboard")
        self.syncer = (Syncer(spec.checkpoint_s3_uri, self._checkpoint_dirs(), spec.storage_options, say)
                       if spec.checkpoint_s3_uri else None)
        self.timed_out = False
        self._timer: threading.Timer | None = None
        # max_run and the end of the launch (or a stop) race; the first to take this decides.
        self._decide = threading.Lock()
        self._settled = False

    def _checkpoint_dirs(self) -> list[Path]:
        return list(dict.fromkeys(local_dir(i, self.spec.checkpoint_local_path) for i in self.layout.instances))

    def _expire(self) -> None:
        with self._decide:
            if self._settled:  # the launch ended, or a stop got there first: that is the outcome
                return
            self.timed_out = True
            # Said before the signal: once it is sent, the runner may end and close the job's log.
            self.say(f"disttrain: {MAX_RUNTIME}: the job ran for max_run={self.spec.max_run} s; stopping it")
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
        if self.spec.max_run:
            self._timer = threading.Timer(self.spec.max_run, self._expire)
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
            self.say(f"disttrain: checkpoints synced to {self.spec.checkpoint_s3_uri} ({uploaded} file(s) at the end)")

    def failure(self) -> str | None:
        if self.timed_out:
            return (f"{MAX_RUNTIME}: the job was stopped after max_run={self.spec.max_run} s "
                    "(raise max_run, or checkpoint and resume)")
        return None


def mark_success(layout: JobLayout) -> None:
    """``output/success`` on every instance, as SageMaker's toolkit writes it after the script."""
    for inst in layout.instances:
        if inst.output.is_dir():
            inst.success.write_text("")
