"""Regroup in place: when an elastic job (``--nnodes MIN:MAX``) loses a host, the survivors' worker
processes stay alive and go on from memory, instead of being killed, started again and loaded
from the newest checkpoint.

Armed by :func:`disttrain.resume` (and the Trainer's loop) in a worker of an elastic launch (the agent sets
:data:`~disttrain.workerenv.REGROUP_SOCKET`); a plain torchrun script is never armed and keeps
the restart. What happens when the launcher decides a regroup:

1. The agent sends each of its workers the new membership (:class:`Plan`) on the worker's own
   Unix socket; a thread here, blocked on it, wakes. That the socket accepts is how the agent
   knows this worker is armed: one that is not gets today's restart.
2. The thread shuts the process group's TCP connections down (:func:`.groupsockets.tracking`
   noted them when the group was made). A collective waiting for a host that lost power -- no reset
   ever comes, gloo would wait out its timeout, and its own ``abort()`` does not end a blocked
   collective -- fails at once; a rank between collectives fails at its next one, or at the
   step's end (:func:`check`).
3. The failure leaves the loop. Where it comes back in:

   - a re-entry point (:func:`reentered`: ``Trainer.fit``, or a function decorated with
     :func:`elastic`, the script's ``main``): the failure reaches it, and it asks one question of
     it -- was a round announced (at once, or within :data:`SETTLE_S`)? -- and not what its text
     says. If so it takes the state the loop stood at
     (:class:`Carry`: the objects given to ``resume()``, the step, the epoch's samples consumed,
     this rank's generators), drops the old group, forms the new one on the launcher's store
     within :data:`~disttrain.inplace.JOIN_TIMEOUT_S` and calls the function again (the Trainer first prepares its
     model, optimizer and loaders for the new world): the imports, the module's data, open files
     and trackers stay as they are;
   - any other script (the fallback): the failure leaves it as an uncaught exception, and this
     module's ``excepthook`` does the same and then runs the whole script again in the same
     process (``runpy``), for errors whose text names the process group. Python, torch, CUDA and
     the page cache stay warm; the script's own setup runs again.

   A worker that fails before the agent's word (a peer's reset) waits :data:`SETTLE_S` for it.
4. ``resume()`` in the function's (or script's) second run takes the state from memory (:func:`adopt`): the ranks agree on
   the last step every survivor completed, the rank(s) holding it send it to those that do not,
   and the epoch goes on from the samples consumed, re-cut for the new world size.

What cannot go on from memory says so in one line: sharded models (the lost rank's shard is held
nowhere else), Local SGD / DiLoCo state, the Trainer's accumulated gradients, a regroup between
two epochs' steps with a checkpoint folder (the script's epoch-end code ran part-way) -- the
survivors stay and load the newest checkpoint; a group that does not form in time exits
:data:`~disttrain.inplace.FALLBACK_EXIT`, which the agent answers with the restart.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import os
import runpy
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .. import torchcompat
from ..inplace import FALLBACK_EXIT, STACKS_SIGNAL_OFFSET, Plan, join_timeout_s, say_formed, socket_path
from ..process_end import exit_after_atexit
from ..workerenv import REGROUP_SOCKET, WorkerEnv
from . import groupsockets

SETTLE_S = 5.0  # a worker whose collective failed waits this long for the agent's word
CUT_AGAIN_S = 0.1  # a forming group that a newer word ended: its sockets are cut again this often
IN_PLACE_KEY = "in_place"  # in a round's store: survivors of an in-place regroup are in it
_DIST_WORDS = ("gloo", "connection closed", "connection reset", "broken pipe", "nccl", "process group",
               "socket", "timed out")


@dataclass
class Carry:
    """Where the loop stood when the regroup came, kept across the script's second run."""

    objects: dict[str, Any]  # name -> state_dict()
    step: int
    progress: dict[str, Any]  # as a checkpoint's: epoch, epoch_step, epoch_samples, epoch_done, world_size
    rank_state: dict[str, Any]  # this process's generators
    adoptable: bool = True
    why_not: str = ""


@dataclass
class _Armed:
    sock: socket.socket
    path: str
    plan: Plan | None = None
    arrived: threading.Event = field(default_factory=threading.Event)
    # A word and its cut, or a plan's take: never between them. Taken between a word and its cut,
    # a plan would start forming on sockets the cut, still going, then shut down (numbers reused).
    lock: threading.Lock = field(default_factory=threading.Lock)


_armed: _Armed | None = None
_carry: Carry | None = None  # set for the second run's resume()
_second_run = False
_final = False  # the script's last run failed for good: the excepthook only reports
_training: Any = None  # the TrainingState armed (what a regroup carries)
_entry = False  # a re-entry point runs (reentered()): a regroup comes back in there

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class Regrouping(BaseException):
    """Raised at a step's end once a regroup is on its way: out of the script, into the new world
    (a BaseException: a script's ``except Exception`` around its step must not swallow it)."""


# -- armed -------------------------------------------------------------------------------------


def arm(training: Any) -> bool:
    """Listen for the agent's word (see the module); True once armed. Only in a worker of an elastic
    launch whose group the runtime made (so that its connections are known)."""
    global _armed, _training
    folder = os.environ.get(REGROUP_SOCKET)
    path = socket_path(folder, os.environ.get("LOCAL_RANK", "0")) if folder else None
    runnable = os.path.isfile(sys.argv[0]) or "-m" in getattr(sys, "orig_argv", [])[1:]  # not python -c
    if not (path and (runnable or _entry) and dist.is_initialized() and groupsockets.known()) \
            or threading.current_thread() is not threading.main_thread():
        return False
    _training = training
    if _armed is not None:
        return True
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        return False
    _armed = _Armed(sock=sock, path=path)
    with contextlib.suppress(ValueError, OSError, AttributeError, RuntimeError):  # stderr without a descriptor
        # from a C handler, without the GIL: the agent asks before it ends a worker stuck in the regroup
        faulthandler.register(signal.SIGRTMIN + STACKS_SIGNAL_OFFSET, file=sys.stderr, all_threads=True)
    threading.Thread(target=_listen, args=(_armed,), name="disttrain-regroup", daemon=True).start()
    if not _entry:  # the fallback's way back in; a decorated function is its own
        sys.excepthook = _Hook(sys.excepthook)
    atexit.register(_disarm)
    return True


def _listen(armed: _Armed) -> None:
    while True:
        try:
            data = armed.sock.recv(1 << 16)
            plan = Plan.from_bytes(data)
        except (OSError, ValueError, KeyError):
            return
        with armed.lock:
            armed.plan = plan
            armed.arrived.set()
            groupsockets.cut()


def _disarm() -> None:
    """At exit: nobody may send to a process that is going (the agent then restarts instead)."""
    if _armed is not None:
        with contextlib.suppress(OSError):
            os.unlink(_armed.path)


def check() -> None:
    """At a step's end: leave the script if a regroup is on its way."""
    if _armed is not None and _armed.plan is not None:
        raise Regrouping


def elastic(function: F) -> F:
    """The function an in-place regroup re-enters: called again in the same process, in the new
    world, with the state its ``resume()`` loop stood at.

    Put in it what depends on the world -- ``disttrain.init()``, ``prepare()``, ``resume()`` and the
    loop; leave outside it what does not (imports, reading the dataset, a tracker). Outside an
    elastic launch it is a plain call. A failure is taken as the regroup's only when a round was
    announced; anything else is raised as it came (after :data:`SETTLE_S`, in an elastic job, for
    the agent's word).
    """

    @functools.wraps(function)
    def entry(*args: Any, **kwargs: Any) -> Any:
        return reentered(functools.partial(function, *args, **kwargs))

    return entry  # type: ignore[return-value]


def reentered(call: Callable[[], T], *, rejoined: Callable[[], None] | None = None) -> T:
    """``call()``; after each in-place regroup it ends with, ``rejoined()`` and ``call()`` again, in
    the new world: a worker's one re-entry point (:func:`elastic`'s, ``Trainer.fit``'s). The
    innermost one running takes the regroup."""
    global _entry
    outer, _entry = _entry, True
    try:
        while True:
            try:
                return call()
            except (Exception, Regrouping) as err:
                if not _announced(err):
                    raise
                err.__traceback__ = None
                del err
            _rejoin()
            if rejoined is not None:
                rejoined()
    finally:
        _entry = outer


def _announced(err: BaseException) -> bool:
    """Whether ``err`` is the regroup's: raised at a step's end for it, or a failure while a round is
    announced (the agent's word may follow a peer's reset by a moment)."""
    armed = _armed
    if armed is None or _final:
        return False
    return isinstance(err, Regrouping) or armed.arrived.wait(SETTLE_S)


# -- the second run ----------------------------------------------------------------------------


def _distributed_failure(value: BaseException) -> bool:
    if isinstance(value, Regrouping) or isinstance(value, getattr(dist, "DistError", ())):
        return True
    return isinstance(value, RuntimeError) and any(w in str(value).lower() for w in _DIST_WORDS)


class _Hook:
    """``sys.excepthook`` while armed: a failure the regroup explains runs the script again."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, kind, value, tb) -> None:
        if not _distributed_failure(value) or not _announced(value):
            self.previous(kind, value, tb)
            return
        value.__traceback__ = None
        del tb, value
        _run_again()


def _take_carry() -> Carry | None:
    """The armed loop's state (None: it never got to ``resume()``, or its state cannot be read: the
    other ranks', or the checkpoint, then)."""
    if _training is None:
        return None
    try:
        return _training._carry()
    except Exception as err:  # noqa: BLE001
        print(f"disttrain: note: the state before the regroup could not be kept ({type(err).__name__}: {err})",
              file=sys.stderr, flush=True)
        return None


def _drop_old_world(training: Any) -> None:
    global _training
    from . import context, heartbeat, preemption

    _training = None
    if training is not None:
        training.close()
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    torchcompat.abandon_process_groups()
    context.forget()
    heartbeat.forget()
    preemption.uninstall()


def _join(plan: Plan, backend: str) -> bool:
    """The new group, on the launcher's store under the attempt's own prefix; False when a newer round
    was announced while it formed (a member lost meanwhile: the word cut the forming group's
    connections), to be joined instead. Not formed within :data:`~disttrain.inplace.JOIN_TIMEOUT_S` (a member lost, and
    no newer word): one line and :data:`FALLBACK_EXIT` -- gloo's own wait for its peers is the
    group's timeout, minutes."""
    os.environ.update(plan.env)
    limit = join_timeout_s(os.environ)
    formed = threading.Event()
    armed = _armed

    def watch() -> None:
        # A newer word's own cut finds only the sockets open when it came: one that arrives before the
        # store's connection exists (or while it connects) cuts nothing, and the forming group would
        # wait for the lost member until the limit. Cut again until the join gives up.
        end = time.monotonic() + limit
        while not formed.wait(CUT_AGAIN_S):
            if time.monotonic() >= end:
                _fall_back(plan, f"not every member came within {limit:g} s")
                return
            if armed is not None:
                with armed.lock:
                    if armed.plan is not None and not formed.is_set():
                        groupsockets.cut()

    threading.Thread(target=watch, name="disttrain-regroup-join", daemon=True).start()
    try:
        with groupsockets.tracking():  # the store's connection too: a newer word cuts a wait on it
            if _armed is not None and _armed.plan is not None:
                raise RuntimeError("a newer round was announced before this one formed")
            store = dist.TCPStore(plan.env["MASTER_ADDR"], int(plan.env["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=limit))
            prefixed = dist.PrefixStore(f"/disttrain/attempt_{plan.attempt}", store)
            prefixed.set(IN_PLACE_KEY, "1")  # for new workers of the round (a host joining): take the state from us
            groupsockets.store = prefixed
            dist.init_process_group(backend, store=prefixed, rank=plan.rank, world_size=plan.world_size,
                                    timeout=timedelta(seconds=WorkerEnv.from_environ().pg_timeout_s))
    except Exception as err:  # noqa: BLE001 -- any failure to form: a newer round, else the restart path
        formed.set()
        if _armed is not None and _armed.plan is not None:
            return False
        _fall_back(plan, str(err).splitlines()[0] if str(err) else type(err).__name__)
    formed.set()
    with contextlib.suppress(OSError):  # for the agent, which ends a told worker that never gets here
        say_formed(os.environ[REGROUP_SOCKET], os.environ.get("LOCAL_RANK", "0"), plan.attempt)
    return True


def _fall_back(plan: Plan, why: str) -> None:
    print(f"disttrain: rank {plan.rank}: the in-place regroup (round {plan.attempt}) did not form ({why}; store "
          f"{plan.env.get('MASTER_ADDR')}:{plan.env.get('MASTER_PORT')}): restarting from the newest checkpoint",
          file=sys.stderr, flush=True)
    os._exit(FALLBACK_EXIT)


def _run_script() -> int:
    """The script once more, as ``python script.py`` / ``python -m module`` ran it; its exit code."""
    orig = getattr(sys, "orig_argv", [])
    try:
        if "-m" in orig[1:]:
            runpy.run_module(orig[orig.index("-m") + 1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    except SystemExit as err:
        code = err.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1


def _rejoin() -> None:
    """The state carried over, the old world dropped, the new one joined: what a second run needs."""
    global _carry, _second_run
    from . import context

    backend = context.last_backend or "gloo"
    armed = _armed
    carry = _take_carry() or _carry
    _drop_old_world(_training)
    gc.collect()
    while True:
        with armed.lock:
            plan, armed.plan = armed.plan, None
            armed.arrived.clear()
        if _join(plan, backend):
            break
        torchcompat.abandon_process_groups()  # whatever of the group the failed join made
    _carry, _second_run = carry, True


def _run_again() -> None:
    """The fallback: join the new world and run the script again (and again, while regroups come);
    then end the process as the interpreter would, with the script's exit code."""
    global _final
    while True:
        _rejoin()
        try:
            code = _run_script()
            break
        except BaseException as err:  # noqa: BLE001 -- as the interpreter would treat it
            if _distributed_failure(err) and _announced(err):
                err.__traceback__ = None
                continue
            _final = True  # the hooks say it as for any failure; no more running again
            sys.excepthook(type(err), err, err.__traceback__)
            code = 1
            break
    exit_after_atexit(code)  # the runtime's shutdown, the bootstrap's mark that the script returned


# -- the second run's resume() -----------------------------------------------------------------


def carried() -> tuple[bool, Carry | None]:
    """Whether this run of the script follows an in-place regroup (its first ``resume()`` then agrees
    on the state with every other rank: :func:`adopt`), and the state its loop stood at, if it got
    that far; once."""
    global _carry, _second_run
    found = _second_run, _carry
    _second_run, _carry = False, None
    return found


def joining() -> bool:
    """A worker's first run, in a round that survivors of an in-place regroup are in (a host that
    joins): its ``resume()`` takes the state from them (:func:`adopt`), not from the checkpoint."""
    store = groupsockets.store
    if store is None or not os.environ.get(REGROUP_SOCKET):
        return False
    try:
        return store.check([IN_PLACE_KEY])
    except Exception:  # noqa: BLE001 -- a store gone: nobody to take it from
        return False


def adopt(carry: Carry | None, *, rank: int) -> tuple[Carry | None, int | None]:
    """Agree with the other ranks on the state to go on from: the last step every survivor completed,
    held by at least one rank (a rank that completed one step more than another is the one to follow:
    its peers' collectives of that step finished too). Every rank gets it -- from memory, or sent by
    the lowest rank holding it; (None, None) when no rank can give it (the checkpoint then).
    The second value: the rank it came from, None when every rank had it."""
    mine = carry.step if carry is not None and carry.adoptable else -1
    steps = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    best, lowest = int(steps[0]), -int(steps[1])
    if best < 0:
        return None, None
    holder = torch.tensor([rank if mine == best else dist.get_world_size()], dtype=torch.int64)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN)
    source = int(holder)
    if lowest == best:
        return carry, None
    box = [None]
    if rank == source:
        box[0] = {"objects": carry.objects, "step": carry.step, "progress": carry.progress}
    dist.broadcast_object_list(box, src=source)
    sent = box[0]
    own_rng = carry.rank_state if carry is not None else {}
    return Carry(objects=sent["objects"], step=sent["step"], progress=sent["progress"], rank_state=own_rng), source
