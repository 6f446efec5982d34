"""The worker environment contract.

torch's elastic agent sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``). disttrain adds its own in :func:`launcher_env`, the one
place they are written, and :class:`WorkerEnv` is the one place any of them is read.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DIST_BACKEND = "DISTTRAIN_BACKEND"
RUN_DIR = "DISTTRAIN_RUN_DIR"
CHECKPOINT_DIR = "DISTTRAIN_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "DISTTRAIN_CHECKPOINT_EVERY"
CHECKPOINT_RETRY_S = "DISTTRAIN_CHECKPOINT_RETRY_S"
PG_TIMEOUT = "DISTTRAIN_PG_TIMEOUT"
CONNECT_TIMEOUT = "DISTTRAIN_CONNECT_TIMEOUT"
HEARTBEAT_DIR = "DISTTRAIN_HEARTBEAT_DIR"
# The worker group's attempt in the whole job: one per rendezvous round, the same number on every
# node. torch's TORCHELASTIC_RESTART_COUNT counts failures only, so with --nnodes MIN:MAX two
# rounds (a host lost, a host joining) can share it; logs, stores and stacks are named by this.
ATTEMPT = "DISTTRAIN_ATTEMPT"
# What disttrain.resume() says on rank 0 when it loads a checkpoint: the launcher reads the step
# from it for an elastic job's membership line (the runtime and the launch side share no module).
RESUMED_MARKER = "disttrain: resuming from step "
# An elastic launch's workers: the folder where each, once disttrain.resume() armed it, listens for its
# agent's word of an in-place regroup (disttrain.runtime.regroup), on ``regroup.local<LOCAL_RANK>.sock``.
REGROUP_SOCKET = "DISTTRAIN_REGROUP_SOCKETS"
# An elastic launch's workers: host:port of the launcher's store, where the runtime's process groups meet
# under each round's own prefix (so that the survivors of an in-place regroup and new workers can meet).
GROUP_STORE = "DISTTRAIN_GROUP_STORE"
# The launcher's: "restart" has an elastic job's survivors restart their workers on a regroup, as
# before in-place regroups (for comparison; the default keeps them: "in-place").
REGROUP_MODE = "DISTTRAIN_REGROUP"
# The rendezvous store's key counting the job's rounds (one number per round, every node alike).
ROUND_COUNTER = "disttrain/attempts"
# --hang-timeout: the folder of the ranks' worker-server sockets (disttrain/_worker_site reads it),
# and the Flight Recorder's size (torch's own variable; ring entries per process).
HANG_SOCKETS = "DISTTRAIN_HANG_SOCKETS"
FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
DEFAULT_FR_BUFFER_SIZE = 500  # the agent reads it whole every second: ~350 kB of JSON
# ``disttrain run --grad-compression`` / ``--bucket-mb``: prepare()'s defaults (runtime.comm).
GRAD_COMPRESSION = "DISTTRAIN_GRAD_COMPRESSION"
BUCKET_MB = "DISTTRAIN_BUCKET_MB"
# TensorFlow workers: the cluster's ``host:port`` list in task order, and the node's first
# task; disttrain.tfconfig turns them into each worker's TF_CONFIG.
TF_WORKERS = "DISTTRAIN_TF_WORKERS"
TF_FIRST_TASK = "DISTTRAIN_TF_FIRST_TASK"
# Set by ``disttrain bench``; read by the runtime's step timer (BenchSettings).
BENCH_STEPS = "DISTTRAIN_BENCH_STEPS"
BENCH_WARMUP = "DISTTRAIN_BENCH_WARMUP"
BENCH_EXIT = "DISTTRAIN_BENCH_EXIT"
# Set by ``disttrain bench --comm`` for its compute reference: DDP exchanges no gradients every
# other step (torch's no-op hook), to time the same steps with and without communication side by side.
BENCH_NO_SYNC = "DISTTRAIN_BENCH_NO_SYNC"
# Set by ``disttrain bench --comm`` for its compute reference: denormal floats flushed to zero,
# the fastest the same arithmetic can go (see disttrain.scaling.comm).
BENCH_FLUSH_DENORMAL = "DISTTRAIN_BENCH_FLUSH_DENORMAL"
# ``--track``: workers print their metrics as track lines (disttrain.trackline) for the launcher's
# tracker: "reduced" (rank 0, the mean over ranks) or "ranks" (every rank its own, and the mean).
TRACK = "DISTTRAIN_TRACK"
TRACK_MODES = ("reduced", "ranks")
BENCH_MARKER = "disttrain-bench:"  # rank 0's result line on stdout starts with it
DEFAULT_PG_TIMEOUT_S = 300

# Interface variables that pin gloo/NCCL to the network that reaches the master.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# The environment rule, the same for every launcher: what the launching shell exports
# reaches every rank, as under Slurm (--export=ALL) and horovodrun, except what describes the
# launching host, session or account rather than the job (another host has its own).
NOT_FORWARDED_NAMES = frozenset({
    "HOSTNAME", "HOST", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "HOME", "USER", "LOGNAME", "MAIL",
    "SHELL", "TERM", "TERMCAP", "COLUMNS", "LINES", "TMPDIR", "PS1", "PS2", "PROMPT_COMMAND", "TMUX",
    "TMUX_PANE", "STY", "WINDOW", "DBUS_SESSION_BUS_ADDRESS", "KRB5CCNAME", "MOTD_SHOWN", "LS_COLORS",
    "WSL_DISTRO_NAME", "WAYLAND_DISPLAY",
})
NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_", "SLURM_", "SLURMD_", "SRUN_", "TORCHELASTIC_")
# With the rule turned off (--no-forward-env): only what the job's communication needs.
ESSENTIAL_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")
ESSENTIAL_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS", "LOGLEVEL")
# Needed before the agent on another host can read its plan (its own import path): these
# go on the remote command line; every other value travels with the plan on the agent's stdin.
BOOTSTRAP_NAMES = ("PYTHONPATH",)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # Debian's login PATH


def forwarded_env(environ: Mapping[str, str], *, everything: bool = True) -> dict[str, str]:
    """The launching shell's variables that follow the job to every host.

    ``everything``: all of them but the host-, session- and account-specific ones (the
    rule); False (``--no-forward-env``): the communication settings and PYTHONPATH only.
    """
    if not everything:
        return {k: v for k, v in environ.items() if k in ESSENTIAL_NAMES or k.startswith(ESSENTIAL_PREFIXES)}
    return {
        key: value
        for key, value in environ.items()
        if key not in NOT_FORWARDED_NAMES and not key.startswith(NOT_FORWARDED_PREFIXES)
    }


def login_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a login on this host would have set and ``environ`` lacks: the account's HOME,
    USER, LOGNAME and SHELL, and a default PATH. ssh gives an agent these itself; ``srun
    --export`` of the bootstrap names only does not, and they are not forwarded (they
    belong to the host and account, not the job)."""
    try:
        account = pwd.getpwuid(os.getuid())
        login = {"HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name,
                 "SHELL": account.pw_shell or "/bin/sh"}
    except KeyError:  # a uid without a passwd entry (some containers)
        login = {}
    login["PATH"] = DEFAULT_PATH
    return {key: value for key, value in login.items() if not environ.get(key)}


def comm_env(grad_compression: str | None, bucket_mb: float | None) -> dict[str, str]:
    """The variables that carry ``--grad-compression`` / ``--bucket-mb`` to every worker
    (through the launch spec's ``env``, which reaches every host and Slurm node)."""
    env = {}
    if grad_compression:
        env[GRAD_COMPRESSION] = grad_compression
    if bucket_mb is not None:
        env[BUCKET_MB] = f"{bucket_mb:g}"
    return env


# accelerate and Lightning decide from CUDA alone whether a launched process joins a process
# group: on a node without CUDA each rank would train alone on the whole dataset (accelerate
# "Num processes: 1", Fabric and Trainer one device), exit 0, no warning. These are the
# libraries' own switches (accelerate launch and `fabric run` set them the same way); set only
# where the node has no CUDA GPU, and never over the user's own value.
ACCELERATE_USE_CPU = "ACCELERATE_USE_CPU"  # accelerate.state.AcceleratorState: MULTI_CPU on gloo
LIGHTNING_DEVICES = ("LT_DEVICES", "PL_TRAINER_DEVICES")  # Fabric's CLI variable; Trainer's default
LIGHTNING_NUM_NODES = ("LT_NUM_NODES", "PL_TRAINER_NUM_NODES")


def cpu_library_env(*, local_world_size: int, nnodes: int | None, inherited: Mapping[str, str]) -> dict[str, str]:
    """What accelerate and Lightning read to use every process on a node without CUDA.

    ``nnodes`` None: the node count is known only once the rendezvous is over (``--nnodes
    MIN:MAX``, or nodes with different counts); :func:`attempt_library_env` then adds it.
    """
    env = {ACCELERATE_USE_CPU: "true", **dict.fromkeys(LIGHTNING_DEVICES, str(local_world_size))}
    if nnodes is not None:
        env.update(dict.fromkeys(LIGHTNING_NUM_NODES, str(nnodes)))
    return {key: value for key, value in env.items() if key not in inherited}


def cpu_library_warning(source: str, script: str) -> str | None:
    """The one case the variables above cannot fix, found in the script's text: accelerate's
    ``PartialState()`` alone reads no variable (only ``Accelerator``/``AcceleratorState`` read
    ``ACCELERATE_USE_CPU``), so on a node without CUDA every rank would run alone."""
    if "PartialState(" in source and "Accelerator(" not in source and "cpu=True" not in source:
        return (f"{script} creates accelerate's PartialState(), which joins the process group on CPU only when "
                "told: each rank would run alone here; use PartialState(cpu=True) (or an Accelerator())")
    return None


def rank_file(run_dir: str | os.PathLike, rank: int, attempt: int, suffix: str) -> Path:
    """``<run_dir>/attempt_<k>/rank<R>.<suffix>``: one rank's file of one attempt, written by its worker or
    its agent (``stdout``, ``stderr``, ``error.json``, ``stacks``, ``raised``)."""
    return Path(run_dir) / f"attempt_{attempt}" / f"rank{rank}.{suffix}"


def mark_raised() -> None:
    """An exception ends this worker, now: its ``raised`` file's mtime tells its agent when. Called from the
    excepthook, which runs before ``atexit`` closes the process group, so a peer that dies of the
    closed connection always raises after this, even when it exits, and is seen, first."""
    env = WorkerEnv.from_environ()
    if env.run_dir:
        try:
            rank_file(env.run_dir, env.rank, env.attempt, "raised").touch()
        except OSError:  # the run folder is gone: the agent orders by the logs
            pass


def attempt_library_env(worker: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Lightning's node count from an attempt's world (torch elastic's ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE`` in ``worker``), for workers whose inherited ``environ`` got
    :func:`cpu_library_env` without one."""
    if ACCELERATE_USE_CPU not in environ or all(key in environ for key in LIGHTNING_NUM_NODES):
        return {}
    world, local = _int(worker, "WORLD_SIZE", 0), _int(worker, "LOCAL_WORLD_SIZE", 0)
    if not local or world % local:
        return {}  # nodes of different sizes: Lightning cannot describe that world anyway
    return {key: str(world // local) for key in LIGHTNING_NUM_NODES if key not in environ}


def launcher_env(
    *,
    dist_backend: str,
    run_dir: str,
    omp_threads: int,
    inherited: Mapping[str, str],
    socket_ifname: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    checkpoint_retry_s: float | None = None,
    heartbeat_dir: str | None = None,
    hang_timeout_s: int = 0,
    tf_workers: Sequence[str] = (),
    tf_first_task: int = 0,
    grad_compression: str | None = None,
    bucket_mb: float | None = None,
    cuda_devices: int = 0,
    local_world_size: int = 1,
    nnodes: int | None = 1,
    track: str | None = None,
) -> dict[str, str]:
    """Variables a node's agent exports to its workers, on top of torch elastic's own.

    User settings win: an ``OMP_NUM_THREADS`` or socket interface already in ``inherited``
    is kept. The user's own variables (forwarded, ``--env``) are not
    here: they are the plan's ``env_forwarded``/``env_set``, whose values are never printed.
    """
    env = {DIST_BACKEND: dist_backend, RUN_DIR: run_dir, **comm_env(grad_compression, bucket_mb)}
    if checkpoint_dir:
        env[CHECKPOINT_DIR] = checkpoint_dir
    if checkpoint_every is not None:
        env[CHECKPOINT_EVERY] = str(checkpoint_every)
    if checkpoint_retry_s is not None:
        env[CHECKPOINT_RETRY_S] = f"{checkpoint_retry_s:g}"
    if heartbeat_dir:
        env[HEARTBEAT_DIR] = heartbeat_dir
    if track:
        env[TRACK] = track
    if hang_timeout_s and PG_TIMEOUT not in inherited:
        # A collective must outlast the watchdog, or it would fail first, without the verdict.
        env[PG_TIMEOUT] = str(max(DEFAULT_PG_TIMEOUT_S, hang_timeout_s + 60))
    if hang_timeout_s and FR_BUFFER_SIZE not in inherited:
        env[FR_BUFFER_SIZE] = str(DEFAULT_FR_BUFFER_SIZE)
    if tf_workers:
        env[TF_WORKERS] = ",".join(tf_workers)
        env[TF_FIRST_TASK] = str(tf_first_task)
    if "OMP_NUM_THREADS" not in inherited:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if socket_ifname:
        for name in SOCKET_IFNAME_VARS:
            if name not in inherited:
                env[name] = socket_ifname
    if cuda_devices <= 0:
        env.update(cpu_library_env(local_world_size=local_world_size, nnodes=nnodes, inherited=inherited))
    return env


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    try:
        return max(0.0, float(environ.get(name) or "x"))
    except ValueError:  # unset, or not a number: the default
        return None


def _int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What a training process learns from its environment.

    Without a launcher (a plain ``python train.py``) this is a world of one.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    attempt: int = 0  # ATTEMPT when the launcher numbers rounds, else the restart count
    # torch's agent hosts the store the workers rendezvous through (it sets
    # TORCHELASTIC_USE_AGENT_STORE), so keys outlive a restart.
    agent_store: bool = False
    group_store: str | None = None  # GROUP_STORE: an elastic launch's, host:port
    dist_backend: str | None = None
    run_dir: str | None = None
    checkpoint_dir: str | None = None
    # Steps between checkpoints for disttrain.resume(); 0: at the end of each epoch.
    checkpoint_every: int | None = None
    # How long a checkpoint store may stay unreachable before a save fails (None: the runtime's default).
    checkpoint_retry_s: float | None = None
    heartbeat_dir: str | None = None
    pg_timeout_s: float = float(DEFAULT_PG_TIMEOUT_S)
    connect_timeout_s: float = 120.0
    # prepare()'s defaults, as given (validated by disttrain.runtime.comm).
    grad_compression: str | None = None
    bucket_mb: str | None = None
    bench_no_sync: bool = False
    # NCCL's own NCCL_MULTI_RANK_GPU_ENABLE=1: ranks may share a GPU (placement.choose_device).
    nccl_multi_rank_gpu: bool = False
    track: str | None = None  # TRACK: print track lines (None: no tracker listens)

    @property
    def launched(self) -> bool:
        """True when a launcher (disttrain, torchrun, Slurm+torchrun...) set up a world."""
        return self.master_addr is not None and self.world_size >= 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        environ = os.environ if environ is None else environ
        port = environ.get("MASTER_PORT")
        return cls(
            rank=_int(environ, "RANK", 0),
            local_rank=_int(environ, "LOCAL_RANK", 0),
            world_size=_int(environ, "WORLD_SIZE", 1),
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE", 1),
            group_rank=_int(environ, "GROUP_RANK", 0),
            master_addr=environ.get("MASTER_ADDR") if "WORLD_SIZE" in environ else None,
            master_port=int(port) if port else None,
            restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
            attempt=_int(environ, ATTEMPT, _int(environ, "TORCHELASTIC_RESTART_COUNT", 0)),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            group_store=environ.get(GROUP_STORE) or None,
            dist_backend=environ.get(DIST_BACKEND) or None,
            run_dir=environ.get(RUN_DIR) or None,
            checkpoint_dir=environ.get(CHECKPOINT_DIR) or None,
            checkpoint_every=_int(environ, CHECKPOINT_EVERY, None),
            checkpoint_retry_s=_seconds(environ, CHECKPOINT_RETRY_S),
            heartbeat_dir=environ.get(HEARTBEAT_DIR) or None,
            pg_timeout_s=float(environ.get(PG_TIMEOUT) or DEFAULT_PG_TIMEOUT_S),
            connect_timeout_s=float(environ.get(CONNECT_TIMEOUT) or 120.0),
            grad_compression=environ.get(GRAD_COMPRESSION) or None,
            bucket_mb=environ.get(BUCKET_MB) or None,
            bench_no_sync=environ.get(BENCH_NO_SYNC) == "1",
            nccl_multi_rank_gpu=environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1",
            track=environ.get(TRACK) if environ.get(TRACK) in TRACK_MODES else None,
        )
