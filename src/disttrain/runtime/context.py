"""This process's place in the job: rank, world, device, and the process group's lifetime."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import DisttrainError
from ..placement import choose_device, choose_dist_backend
from ..workerenv import BENCH_FLUSH_DENORMAL, CONNECT_TIMEOUT, WorkerEnv, mark_raised
from . import groupsockets, heartbeat
from .state import Runtime

CONNECT_FAILED_EXIT = 75  # EX_TEMPFAIL: the network, not the script, is at fault


@contextlib.contextmanager
def _connect_watchdog(env: WorkerEnv):
    """End the process with a clear error if joining the group outlasts the connect timeout.

    After the rendezvous, gloo and NCCL connect every pair of ranks on random ports; when a
    firewall drops those packets the connect waits forever, whatever the process group's
    timeout. A stuck native call cannot be interrupted, so the watchdog exits the process.
    """
    done = threading.Event()

    def watch() -> None:
        if done.wait(env.connect_timeout_s):
            return
        sys.stderr.write(
            f"disttrain: rank {env.rank} on {socket.gethostname()} could not connect to the other "
            f"{env.world_size - 1} rank(s) within {env.connect_timeout_s:.0f} s after the rendezvous at "
            f"{env.master_addr}:{env.master_port}. The master port answered, so the direct connections "
            "between ranks (random TCP ports) are being dropped: allow all TCP between the hosts "
            f"(`disttrain doctor --hosts ...` names the pair). {CONNECT_TIMEOUT} sets this limit.\n"
        )
        sys.stderr.flush()
        os._exit(CONNECT_FAILED_EXIT)

    threading.Thread(target=watch, name="disttrain-connect-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _attempt_store(env: WorkerEnv, timeout: timedelta) -> dist.Store | None:
    """The store the group meets on, under a prefix of this round's own; None: use ``env://``.

    An elastic launch's workers meet on the launcher's store (``env.group_store``: the survivors
    of an in-place regroup meet new workers there). Otherwise torch's elastic agent's, where it
    keeps one store for the whole job with static rendezvous (and shares its c10d one), and
    ``env://`` adds no per-restart prefix: after a restart (``--max-restarts``) the ranks can read
    the previous attempt's addresses and the process group fails with "Connection refused" --
    often, not always.
    """
    if env.group_store:
        host, _, port = env.group_store.rpartition(":")
    elif env.agent_store and env.master_addr is not None and env.master_port is not None:
        host, port = env.master_addr, str(env.master_port)
    else:
        return None
    store = dist.TCPStore(host, int(port), env.world_size, is_master=False, timeout=timeout)
    groupsockets.store = dist.PrefixStore(f"/disttrain/attempt_{env.attempt}", store)
    return groupsockets.store


@dataclass(frozen=True, kw_only=True)
class Context:
    """Where this process stands; the same object for the whole life of the script."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    dist_backend: str | None  # None for a world of one: there is no process group
    is_main: bool
    distributed: bool
    # What the runtime remembers (prepared models, tracked loaders, the training state):
    # mutable, so outside equality; it lives and dies with this context.
    runtime: Runtime = field(default_factory=Runtime, compare=False, repr=False)
    # The launcher's contract, read once by init(): every default the runtime takes from the
    # environment (checkpoint folder, gradient compression...) comes from here.
    env: WorkerEnv = field(default_factory=lambda: WorkerEnv.from_environ({}), compare=False, repr=False)

    @property
    def backend(self) -> str | None:
        """The old name of :attr:`dist_backend`, which scripts written for it still read."""
        return self.dist_backend


def resolve(env: WorkerEnv, *, cuda_devices: int, backend: str | None = None,
            nccl_version: tuple[int, ...] | None = None) -> Context:
    """The Context for ``env`` on a node with ``cuda_devices`` GPUs (and NCCL ``nccl_version``,
    which says whether ranks may share a GPU); pure, no side effects.

    The launcher's process-group backend (``DISTTRAIN_BACKEND``) wins over the script's
    (``disttrain.init(backend=...)``), so that ``disttrain run --dist-backend`` can override a
    script written for one kind of machine.
    """
    distributed = env.world_size > 1
    if distributed and not env.launched:
        raise DisttrainError(
            f"WORLD_SIZE={env.world_size} but MASTER_ADDR is not set: start the script with "
            "`disttrain run` (or torchrun), which sets up the rendezvous"
        )
    chosen = choose_dist_backend(env.dist_backend or backend, cuda_available=cuda_devices > 0)
    device = choose_device(local_rank=env.local_rank, cuda_devices=cuda_devices, dist_backend=chosen,
                           nccl_version=nccl_version, nccl_multi_rank_gpu=env.nccl_multi_rank_gpu)
    return Context(
        rank=env.rank,
        local_rank=env.local_rank,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        device=torch.device(device),
        dist_backend=chosen if distributed else None,
        is_main=env.rank == 0,
        distributed=distributed,
        env=env,
    )


def _nccl_version(cuda_devices: int) -> tuple[int, ...] | None:
    """This build's NCCL version, e.g. ``(2, 27, 3)``, or None without GPUs or NCCL."""
    if cuda_devices <= 0 or not dist.is_nccl_available():
        return None
    try:
        found = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):  # a CUDA build without NCCL
        return None
    return tuple(found)


# The one module global of the runtime: the context, which owns all other state.
_current: Context | None = None
_atexit_registered = False
last_backend: str | None = None  # the dropped context's, for the group a regroup makes
_regrouped = False
# Long enough for a descheduled gloo thread to run; exit is slower by this much, once.
_DRAIN_S = 0.1


class _OneLineErrors:
    """An uncaught DisttrainError (a refused checkpoint, a full disk) is one line, as the CLI
    prints it: its message is the whole story, a traceback through disttrain's code is noise.
    So is Ctrl-C: every rank gets it, and a traceback per rank buries the launcher's line."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, kind, value, tb) -> None:
        if isinstance(value, DisttrainError):
            print(f"disttrain: error: {value}", file=sys.stderr, flush=True)
        elif isinstance(value, KeyboardInterrupt):
            print(f"disttrain: rank {current_rank()}: interrupted by Ctrl-C (SIGINT) at {_where(tb)}, "
                  "without saving a checkpoint", file=sys.stderr, flush=True)
        else:  # the worker bootstrap's hook, last in the chain, marks it (an in-place regroup's runs the script again)
            self.previous(kind, value, tb)
            return
        mark_raised()


def _where(tb) -> str:
    """``file:line`` of the script's innermost frame in ``tb`` (else the innermost one)."""
    frames = list(traceback.walk_tb(tb))  # (frame, line), outermost first
    library = (str(Path(__file__).resolve().parent.parent), *sysconfig.get_paths().values())
    mine = [(f, n) for f, n in frames if not f.f_code.co_filename.startswith(library)] or frames
    if not mine:
        return "?"
    frame, line = mine[-1]
    return f"{Path(frame.f_code.co_filename).name}:{line}"


def init(*, backend: str | None = None, timeout_s: float | None = None) -> Context:
    """Join the job the launcher started and return this process's :class:`Context`.

    Reads the worker environment, picks backend and device (``cuda:<local_rank>`` when the
    node has GPUs), and with more than one process initialises the default process group
    (``env://``; ``timeout_s`` defaults to the launcher's ``DISTTRAIN_PG_TIMEOUT``).
    A plain ``python train.py`` is a world of one: nothing is set up.
    Later calls return the first Context; their arguments are ignored.
    """
    global _current, _atexit_registered
    if _current is not None:
        if backend is not None and _current.dist_backend not in (None, backend):
            warnings.warn(
                f"disttrain.init(backend={backend!r}) ignored: already initialised "
                f"with {_current.dist_backend!r}",
                stacklevel=2,
            )
        return _current
    if os.environ.get(BENCH_FLUSH_DENORMAL) == "1":  # bench --comm's reference; before any thread pool starts
        torch.set_flush_denormal(True)
    env = WorkerEnv.from_environ()
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ctx = resolve(env, cuda_devices=cuda_devices, backend=backend, nccl_version=_nccl_version(cuda_devices))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if ctx.distributed and dist.is_initialized():  # the script set up its own group (or a regroup did)
        ctx = replace(ctx, dist_backend=dist.get_backend())
        ctx.runtime.owns_group = _regrouped
    elif ctx.distributed:
        timeout = timedelta(seconds=env.pg_timeout_s if timeout_s is None else timeout_s)
        ctx.runtime.pg_timeout_s = timeout.total_seconds()
        extra = {"device_id": ctx.device} if ctx.dist_backend == "nccl" else {}
        # torch's init_process_group makes every traceback line read "[rankN]: ..."; disttrain's
        # launcher already puts "[rankN] " before each line, so keep Python's own hook there.
        hook = sys.excepthook
        with _connect_watchdog(env), groupsockets.tracking():
            store = _attempt_store(env, timeout)
            if store is None:
                dist.init_process_group(ctx.dist_backend, init_method="env://", timeout=timeout, **extra)
            else:
                dist.init_process_group(ctx.dist_backend, store=store, rank=env.rank,
                                        world_size=env.world_size, timeout=timeout, **extra)
        if env.run_dir:
            sys.excepthook = hook
        ctx.runtime.owns_group = True
    heartbeat.start(env)
    if env.run_dir and not isinstance(sys.excepthook, _OneLineErrors):  # under disttrain's launcher
        sys.excepthook = _OneLineErrors(sys.excepthook)
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True
    _current = ctx
    return ctx


def forget() -> None:
    """An in-place regroup (:mod:`.regroup`) dropped the group: the next :func:`init` joins the new one
    it made, which it then owns."""
    global _current, last_backend, _regrouped
    if _current is not None:
        last_backend = _current.dist_backend
    _current, _regrouped = None, True


def context() -> Context:
    """The current :class:`Context`, initialising with defaults on first use."""
    return _current if _current is not None else init()


def current() -> Context | None:
    """The current :class:`Context`, or None before :func:`init` (initialises nothing)."""
    return _current


def current_runtime() -> Runtime | None:
    """The current context's runtime state, or None before :func:`init` (initialises nothing)."""
    return _current.runtime if _current is not None else None


def current_rank() -> int:
    """This process's rank without initialising anything (for printing before init)."""
    return _current.rank if _current is not None else WorkerEnv.from_environ().rank


def shutdown() -> None:
    """Tear down the process group; registered with atexit by :func:`init`, safe to repeat.

    Gloo's worker threads free each finished collective's work object themselves, a moment
    after the main thread has moved on, and freeing it takes the GIL (it holds Python-owned
    state). A thread that asks for the GIL once the interpreter is finalizing is unwound
    mid-destructor, and the worker dies with SIGABRT ("terminate called without an active
    exception") after training finished -- the last DDP backward makes this likely.
    ``destroy_process_group`` alone does not help: the user's DDP model still references
    the group, so its threads live on. Hence: ``gc.collect()`` frees cyclic garbage that
    holds DDP objects or tensors (the runtime itself keeps only weak references to what
    prepare() returned), and a short sleep after the destroy hands the GIL to any thread
    still finishing a work while the interpreter is whole. No barrier: if another rank
    has failed, a barrier would hang this one for the whole process-group timeout, and
    its own work object would need draining too.
    """
    global _current
    owns_group = _current is not None and _current.runtime.owns_group
    if _current is not None:
        _finish_pending(_current.runtime)
    threads_may_run = dist.is_initialized() or (_current is not None and _current.distributed)
    if threads_may_run:
        gc.collect()
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()
    if threads_may_run:
        time.sleep(_DRAIN_S)
    _current = None


def _finish_pending(runtime: Runtime) -> None:
    """Wait for an asynchronous checkpoint still being written, so that exiting does not
    cut it short (it would not count, but the run would lose its last checkpoint)."""
    pending, runtime.pending_save = runtime.pending_save, None
    if pending is not None:
        try:
            pending.wait()
        except Exception as err:  # the process is ending: say so, do not raise from atexit
            sys.stderr.write(f"disttrain: rank {current_rank()}: the last checkpoint was not "
                             f"written: {err}\n")
