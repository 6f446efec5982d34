"""Run one node's share of a launch with torch's elastic agent, in this process.

torch's ``LocalElasticAgent`` starts, monitors, restarts and stops the workers; disttrain
adds the worker environment, per-rank log files named by global rank, a ``[rankN]``
prefix on every line, and a root-cause report when a rank fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousClosedError
from torch.distributed.launcher.api import elastic_launch

from .. import torchcompat
from ..errors import DisttrainError, UsageError
from ..net import busy_rendezvous
from ..plan.launch import LaunchPlan, NodePlan
from ..tfconfig import tf_node_env
from ..wire import AttemptStarted
from ..workerenv import HEARTBEAT_DIR, REGROUP_MODE, REGROUP_SOCKET, attempt_library_env
from . import elastic_agent, flight, lifeline
from .attempt_store import AttemptStores
from .cgroup import Container
from .elastic_config import endpoint, launch_config
from .exit_abort import aborts_after_return
from .exit_grace import exits_awaited
from .link import Role, Standalone
from .log_tail import tails_end_at_once
from .oom import OomWatch
from .optml import instance_prefix
from .rendezvous_wait import RendezvousWait
from .report import RankFailure, failed_line, failure_lines, format_failure, lost_a_peer, rank_failure, root_cause
from .runpath import run_path
from .scratch import node_scratch
from .watchdog import HANG_EXIT, Attempt, Watchdog

NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's switch (dynamic_rendezvous.py)


@contextlib.contextmanager
def _exported(env: Mapping[str, str]) -> Iterator[None]:
    """Workers inherit the agent's environment; set ours for the launch, then restore."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _handlers_kept() -> Iterator[None]:
    """torch's worker group sets its own handlers for the stop signals and leaves them set; a
    node run in a program's own process (the local launcher) gives the program its own back."""
    if threading.current_thread() is not threading.main_thread():
        yield  # torch sets no handler outside the main thread either
        return
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set from C, cannot be put back from Python
                signal.signal(sig, handler)


def _quiet_torch_elastic() -> None:
    # The agent logs every shutdown step at WARNING and each failure at ERROR; disttrain
    # prints one root-cause block instead. LOGLEVEL=INFO (torch's own knob) brings them back.
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def line_prefix(plan: LaunchPlan, node: NodePlan) -> str:
    """``[rank3] `` on one node, ``[node1 rank3] `` when several nodes share the terminal; the user's
    ``--log-line-prefix-template`` where given."""
    if plan.agent.log_line_prefix_template:
        return plan.agent.log_line_prefix_template
    if plan.nnodes > 1:
        return f"[{node.name} rank${{rank}}] "
    return "[rank${rank}] "


def awaited(plan: LaunchPlan, node: NodePlan) -> str:
    """What this node waits for before its workers can start, for the progress line."""
    where = endpoint(plan)
    if plan.nnodes == 1:
        return f"starting the rendezvous at {where}"
    if plan.rdzv_backend != "static":  # nodes take their ranks as they join
        count = f"{plan.min_nnodes} to {plan.nnodes}" if plan.min_nnodes and plan.min_nnodes < plan.nnodes \
            else f"all {plan.nnodes}"
        return f"waiting at {where} for {count} nodes to join {plan.rendezvous_id!r} ({plan.rdzv_backend})"
    if node.node_rank == 0 and plan.rdzv_backend == "static":
        others = plan.nnodes - 1
        return f"waiting at {where} for the other {others} node{'s' if others > 1 else ''} of {plan.nnodes} to join"
    return f"waiting as node {node.node_rank} of {plan.nnodes} to join the rendezvous at {where}"


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _per_attempt(stores: AttemptStores, seen: Attempt, group: Container):
    """What each attempt's workers get once their world is known: a fresh store, and Lightning's
    node count where it could not be planned (``--nnodes MIN:MAX``); the watchdog learns their ranks,
    and what the previous attempt's workers left running is killed."""
    def hook(envs: dict[int, dict[str, str]], attempt: int) -> None:
        if attempt:
            group.kill()
        stores(envs, attempt)
        seen(envs, attempt)
        for env in envs.values():
            env.update(attempt_library_env(env, os.environ))
    return hook


def _failures(err: ChildFailedError, host: str, attempt: int, run_dir: str) -> list[RankFailure]:
    return [rank_failure(rank=rank, host=host, raw_code=failure.exitcode, pid=failure.pid,
                         timestamp=failure.timestamp, attempt=attempt, run_dir=run_dir)
            for rank, failure in err.failures.items()]


def _elastic(plan: LaunchPlan, node: NodePlan, link: Role, attempt: Attempt, stores: AttemptStores,
             sockets: str | None) -> contextlib.AbstractContextManager:
    """With ``--nnodes MIN:MAX``, torch's agent that regroups (in place where the workers are armed:
    ``sockets``) and numbers rounds (see elastic_agent)."""
    if not plan.elastic:
        return contextlib.nullcontext([])

    def on_attempt(number: int, group, in_place: bool, why: str) -> None:
        ranks = tuple(w.global_rank for w in group.workers)
        world = group.workers[0].world_size
        if in_place:  # torch's agent started nobody: the watchdog and the new nodes learn the round here
            attempt.number, attempt.ranks, attempt.world_size = number, tuple(sorted(ranks)), world
            stores.kept(ranks, number)
        link.send(AttemptStarted(host=node.name, attempt=number, nodes=group.group_world_size, world_size=world,
                                 ranks=ranks, in_place=in_place, why=why).to_line())

    store = f"{plan.master_addr}:{plan.master_port}"
    # The launcher holds the store and started the nodes, unless they were started by hand (a node that
    # joins a running job learns it there too: its first round waits for as many as come).
    gather = None if plan.by_hand else (store, len(plan.nodes))
    return elastic_agent.installed(regroups=link.regroups, on_attempt=on_attempt, host=node.name, sockets=sockets,
                                   store=store if sockets else "", gather=gather)


def _regroup_sockets(plan: LaunchPlan, env: dict[str, str], scratch: Path) -> str | None:
    """An elastic PyTorch job: a folder of the node's scratch where each worker armed by ``disttrain.resume()``
    listens for an in-place regroup (disttrain.runtime.regroup), in the workers' environment."""
    if not plan.elastic or plan.framework != "pytorch" or plan.run_path or env.get(REGROUP_MODE) == "restart":
        return None
    folder = scratch / "rg"
    folder.mkdir()
    env[REGROUP_SOCKET] = str(folder)
    return str(folder)


@contextlib.contextmanager
def _watchdog(plan: LaunchPlan, node: NodePlan, link: Role, attempt: Attempt,
              sockets: str | None) -> Iterator[Watchdog | None]:
    """Alone, the node judges its hangs (under --hang-timeout); linked, it reports its ranks' progress."""
    if not link.linked and not plan.hang_timeout_s:
        yield None
        return
    recorders = flight.Recorders(sockets, plan.dist_backend, hang_timeout_s=plan.hang_timeout_s, say=link.say) \
        if sockets else None
    if recorders is not None and flight.fr_handler(plan.dist_backend) not in torchcompat.worker_handlers():
        link.say(f"disttrain: note: torch {torchcompat.torch_version()} on {node.name} does not serve a record of "
                 f"{plan.dist_backend}'s collectives (torch {flight.FR_SINCE} does): --hang-timeout sees the progress "
                 "of a script on disttrain's runtime (its batches), not of a plain script's collectives")
    # SIGTERM to ourselves: torch's agent then stops the workers as on any stop request.
    with Watchdog(node.env[HEARTBEAT_DIR], plan.hang_timeout_s, node.name,
                  on_hang=lambda: os.kill(os.getpid(), signal.SIGTERM), attempt=attempt, recorders=recorders,
                  dist_backend=plan.dist_backend, report_to_launcher=link.send if link.linked else None) as dog:
        link.dog = dog
        yield dog


@contextlib.contextmanager
def _worker_group(plan: LaunchPlan, node: NodePlan) -> Iterator[Container]:
    """The node's workers and all they start, stopped together at the end (see cgroup.py)."""
    group = Container.create(f"disttrain-{plan.run_id}-node{node.node_rank}-{os.getpid()}",
                             joinable=not plan.run_path)
    try:
        yield group
    finally:
        group.close()


def _recorder_sockets(plan: LaunchPlan, env: dict[str, str], scratch: Path) -> str | None:
    """Under --hang-timeout: a folder of the node's scratch for the ranks' worker servers, and the
    bootstrap that starts them (disttrain/_worker_site) in the workers' environment."""
    if not plan.hang_timeout_s or plan.framework != "pytorch":
        return None
    folder = scratch / "fr"
    folder.mkdir()
    env.update(flight.worker_env(sockets=str(folder), inherited={**os.environ, **env}))
    return str(folder)


def _started(stack: contextlib.ExitStack, plan: LaunchPlan, node: NodePlan, env: dict[str, str], say,
             terminal: bool = True):
    """Start: what the workers need before torch's agent starts them -- the program's signal handlers
    kept, their exits awaited, their process group, the node's scratch folder (scratch.py) holding the
    recorders' sockets (``--hang-timeout``: this adds the bootstrap to ``env``) and the regroups', the abort
    at exit prevented, ``env`` exported, the output tails ended at the workers' end. Undone by ``stack``."""
    stack.enter_context(_handlers_kept())
    early = stack.enter_context(exits_awaited())
    stack.enter_context(tails_end_at_once(terminal=terminal))  # under a launcher: its channel, wire lines kept
    group = stack.enter_context(_worker_group(plan, node))
    scratch = stack.enter_context(node_scratch())
    sockets = _recorder_sockets(plan, env, scratch)
    regroups = _regroup_sockets(plan, env, scratch)
    stack.enter_context(aborts_after_return(env, say, scratch / "exit"))
    stack.enter_context(_exported(env))
    return early, group, sockets, regroups


def _monitored(stack: contextlib.ExitStack, plan: LaunchPlan, node: NodePlan, link: Role, attempt: Attempt,
               stores: AttemptStores, sockets: str | None, regroups: str | None, report_to: TextIO):
    """Monitor, in the node's role: its watchdog (alone it judges hangs; linked it reports its ranks'
    progress), the elastic rounds (``--nnodes MIN:MAX``), the wait for the rendezvous."""
    dog = stack.enter_context(_watchdog(plan, node, link, attempt, sockets))
    agents = stack.enter_context(_elastic(plan, node, link, attempt, stores, regroups))
    wait = stack.enter_context(RendezvousWait(awaited(plan, node), timeout_s=plan.rdzv_timeout_s, report_to=report_to))
    return dog, agents, wait


def _node_env(plan: LaunchPlan, node: NodePlan, report_to: TextIO) -> dict[str, str]:
    env = plan.worker_env(node)
    if plan.elastic:
        # torch's agents share their rendezvous store with the workers (the workers here get a store
        # of each attempt's own: attempt_store.py), and a node that joins a later round then waits
        # for MASTER_ADDR, which the round's node 0 set only in its first round: a grown job hangs.
        env.setdefault(NO_SHARED_STORE, "1")
    if plan.framework == "pytorch":  # the worker bootstrap: a script's own process group is checked
        env.update(flight.site_env({**os.environ, **env}))
    if plan.framework == "tensorflow":  # ports checked and Keras chosen here, where the workers run
        env.update(tf_node_env(dict(env), host=node.name, nproc=node.nproc, world_size=plan.world_size,
                               report_to=report_to))
    return env


def run_node(plan: LaunchPlan, node: NodePlan, *, report_to: TextIO = sys.stderr,
             link: Role | None = None) -> int:
    """Start, monitor and stop this node's workers; return the exit code for the launcher. ``link``:
    the node's role under a launcher; None: alone (:class:`~disttrain.agent.link.Standalone`)."""
    link = link or Standalone()
    say = lambda line: print(line, file=report_to, flush=True)  # noqa: E731
    config = launch_config(plan, node, cuda_devices=_cuda_devices(), prefix=line_prefix(plan, node), say=say)
    _quiet_torch_elastic()
    # torch's TailLog writes worker lines without flushing; through a pipe (ssh, a job
    # runner, a test) they would sit in this process's buffer instead of streaming.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    env = _node_env(plan, node, report_to)
    # A job instance's workers see its folder at /opt/ml; the tool is checked here, on their machine.
    opt_ml = (instance_prefix(node.opt_ml, required=node.opt_ml_required, host=node.name, say=say)
              if node.opt_ml else [])
    stores = AttemptStores(plan, node)
    attempt = Attempt(plan.run_dir, plan.world_size)
    with contextlib.ExitStack() as stack:  # stop: all of it undone, in reverse order
        early, group, sockets, regroups = _started(stack, plan, node, env, say, terminal=not link.linked)
        dog, agents, wait = _monitored(stack, plan, node, link, attempt, stores, sockets, regroups, report_to)
        config.logs_specs.on_start = wait.workers_started
        config.logs_specs.on_envs = _per_attempt(stores, attempt, group)
        if plan.nnodes > 1:
            link.watch_success(node.name, lambda: attempt.ranks, config.role)
        try:
            if plan.run_path:  # a function entrypoint: started by multiprocessing (--start-method)
                entry, args = run_path, list(plan.argv[2:])
            else:  # each worker dies with this agent, even when it is SIGKILLed (see lifeline.py)
                entry, *args = lifeline.wrap([*opt_ml, *plan.argv], python=sys.executable, join=group.join_file)
            oom = OomWatch()  # the kernel's OOM kills from now on: a worker's SIGKILL may be one
            elastic_launch(config, entry)(*args)
            if agents:  # an elastic job: the rendezvous store's host stays until the others have left it
                stores.farewell(agents[-1].get_worker_group().group_world_size,
                                hosts_store=bool(config.rdzv_configs.get("is_host")))
        except ChildFailedError as err:
            return _failed(err, plan, node, link, attempt, oom, report_to)
        except SignalException as err:
            return _stopped(err, plan, node, link, early, dog, report_to)
        except KeyboardInterrupt:
            return 130
        except Exception as err:  # rendezvous/store failures: name them, no traceback
            busy = busy_rendezvous(plan.master_addr, plan.master_port)  # a port the user chose: exit 2
            # torch's RendezvousTimeoutError and RendezvousClosedError come with no message: say what
            # was waited for, on whom, or why nobody is left to wait for.
            wanted = f"--nnodes {plan.min_nnodes}:{plan.nnodes}" if plan.elastic else f"--nnodes {plan.nnodes}"
            rendezvous = f"the rendezvous {plan.master_addr}:{plan.master_port}"
            said = str(err).strip() or (
                f"{rendezvous} was closed: another node's agent ended (the job finished or failed there)"
                if isinstance(err, RendezvousClosedError)
                else f"waited {plan.rdzv_timeout_s:g} s for the other nodes at {rendezvous} ({wanted})")
            raise (UsageError if busy else DisttrainError)(
                f"the elastic agent on {node.name} failed before the workers finished: "
                f"{type(err).__name__}: {said}{busy}"
            ) from err
    return 0


def _failed(err: ChildFailedError, plan: LaunchPlan, node: NodePlan, link: Role, attempt: Attempt, oom: OomWatch,
            report_to: TextIO) -> int:
    """A worker failed: the root cause, its line for the launcher (which orders the nodes' failures by
    these times) and its block; the first failure's exit code."""
    failures = _failures(err, node.name, attempt=plan.max_restarts, run_dir=plan.run_dir)
    first = root_cause(failures, plan.run_dir)
    failed = {f.rank for f in failures}
    finished = tuple((rank, node.name) for rank in attempt.ranks if rank not in failed)
    if plan.nnodes > 1:  # a rank of another node may have left first
        finished += link.done_elsewhere(wait=not finished and lost_a_peer(failure_lines(first, plan.run_dir)))
    link.send(failed_line(first, plan.run_dir))  # for a launcher above (none: not shown)
    print(format_failure(first, failures, plan.run_dir, finished=finished, oom=oom), file=report_to, flush=True)
    return first.exit_code


def _stopped(err: SignalException, plan: LaunchPlan, node: NodePlan, link: Role, early, dog: Watchdog | None,
             report_to: TextIO) -> int:
    """torch's agent stopped on a signal: a worker that failed first (its block), the hang verdict, or the
    stop itself, said as it was (the launcher's reason, else the signal)."""
    if early.failed and (dog is None or dog.fired is None):
        # the launcher stopped this node for another's failure, but one here failed first, maybe
        failures = [rank_failure(rank=rank, host=node.name, raw_code=code, pid=pid, timestamp=time.time(),
                                 attempt=plan.max_restarts, run_dir=plan.run_dir) for rank, code, pid in early.failed]
        first = root_cause(failures, plan.run_dir)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop's second signal: said and decided
        link.send(failed_line(first, plan.run_dir))
        print(format_failure(first, failures, plan.run_dir), file=report_to, flush=True)
        return first.exit_code
    if dog is not None and dog.fired is not None:
        if dog.fired:  # judged here; under a launcher, the launcher prints the verdict
            print(f"{dog.fired}\ndisttrain: stopped the job (exit {HANG_EXIT})", file=report_to, flush=True)
        return HANG_EXIT
    said = (f"disttrain: stopped all {node.nproc} workers on {node.name}: {link.stop_reason}"
            if link.stop_reason else f"disttrain: got {err.sigval.name}, stopped all {node.nproc} workers "
            f"on {node.name}")
    print(said, file=report_to, flush=True)
    return 128 + int(err.sigval)
