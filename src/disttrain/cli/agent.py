"""Hidden subcommands a launcher runs on each node: ``agent``, ``probe``, ``receive``, ``launch-step``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..errors import UsageError
from ..launch import Context
from ..wire import DumpRequest, LaunchStep, PlanMessage, StepEnded, WireError
from ..workerenv import login_env

STOP_MARGIN_S = 10  # after the workers' stop grace, for the agent's own shutdown


def add_parser(sub: argparse._SubParsersAction) -> None:
    agent = sub.add_parser("agent")
    # The plan holds the user's variables: it comes on stdin, never on the command line
    # (which `ps` shows to every user of the host). stdin closing then stops the workers.
    agent.add_argument("--plan-stdin", action="store_true", required=True,
                       help="read {node_rank, plan} as one JSON line on stdin; stop when stdin closes")
    agent.set_defaults(handler=handle_agent, exit_at_once=True)

    probe = sub.add_parser("probe")
    probe.add_argument("--master", default="127.0.0.1")
    probe.add_argument("--port", type=int, default=None)
    probe.add_argument("--path", action="append", default=[])
    probe.add_argument("--cwd", default=None, help="the folder --path is relative to (the launcher's)")
    probe.add_argument("--listen", default=None, help="comma-separated ports to listen on (0: any)")
    probe.add_argument("--connect", default=None, help="comma-separated addr:port to connect to")
    # A launch's one remote round per host: facts and listeners, the connects, then the agent.
    probe.add_argument("--session", action="store_true",
                       help="print facts (+ --listen ports) as one JSON line, then read the targets to "
                       "connect to, then the plan, and run this node's agent (all on stdin/stdout)")
    probe.set_defaults(handler=handle_probe, exit_at_once=True)  # --session runs an agent

    receive = sub.add_parser("receive")
    receive.add_argument("dir", help="where the launcher's working directory is copied to")
    receive.set_defaults(handler=handle_receive)

    # The one command of a Slurm batch script (disttrain.launch.slurm): runs in the allocation,
    # its step in the job's environment.
    step = sub.add_parser("launch-step")
    step.set_defaults(handler=handle_launch_step)


class _Lines:
    """Lines from a raw descriptor, without a buffered reader (see _stop_when_stdin_closes)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def next(self) -> bytes | None:
        """The next line; None when the launcher closed the stream first (it went away or is done)."""
        while b"\n" not in self.buffer:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def _watch_stdin(lines: _Lines, on_request, *, signalled_by: int | None, host: str, grace_s: float) -> None:
    # ssh/srun give the agent the launcher's pipe as stdin: a line is a request (``dump``),
    # EOF means the launcher is gone or wants us to stop. SIGTERM lets torch's agent stop the
    # workers cleanly. Raw reads, not sys.stdin: a daemon thread blocked inside a buffered
    # reader aborts the interpreter at exit ("could not acquire lock ... at interpreter shutdown").
    def watch() -> None:
        while (line := lines.next()) is not None:
            on_request(line)
        # A launcher that died has had the kernel send us SIGTERM already (PR_SET_PDEATHSIG).
        # A second one, landing while torch's agent stops the workers, cuts that short and can
        # leave it waiting at exit for log tailers that were never stopped: one signal only.
        if signalled_by is None or not _parent_gone(signalled_by):
            os.kill(os.getpid(), signal.SIGTERM)
        # Stopping is bounded whatever happens in torch's shutdown: its grace, then a margin.
        time.sleep(grace_s + STOP_MARGIN_S)
        try:  # the launcher may be gone, and its pipe with it
            print(f"disttrain: the agent on {host} was still running {grace_s + STOP_MARGIN_S:.0f} s after it "
                  "was asked to stop; exiting (its workers die with it)", file=sys.stderr, flush=True)
        except OSError:
            pass
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def _parent_gone(parent: int, wait_s: float = 0.2) -> bool:
    """Whether ``parent`` has exited: the kernel re-parents us just after it closed our stdin."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def handle_agent(args: argparse.Namespace) -> int:
    from ..agent.lifeline import follow_parent

    # The launcher (ssh session, job runner, srun) gone, even SIGKILLed: stop the workers. Set
    # before importing torch (seconds), so that a launcher dying meanwhile is not missed.
    parent = os.getppid()
    armed = follow_parent(signal.SIGTERM, parent=parent)
    fd = sys.stdin.fileno()
    lines = _Lines(fd)
    line = lines.next()  # the launcher writes the plan first
    if line is None:
        raise UsageError("disttrain agent: stdin closed before the plan arrived (the launcher went away)")
    return _run_agent(PlanMessage.from_line(line), lines, signalled_by=parent if armed else None)


def _run_agent(message: PlanMessage, lines: _Lines, *, signalled_by: int | None = None) -> int:
    """``signalled_by``: the parent whose death already sends this process SIGTERM."""
    from ..agent.node import LauncherLink, run_node  # torch's elastic agent: not for every command

    plan = message.plan
    if message.cwd:
        try:
            os.chdir(message.cwd)
        except OSError as err:
            raise UsageError(f"cannot work in {message.cwd}: {err.strerror}") from None
    nodes = [n for n in plan.nodes if n.node_rank == message.node_rank]
    if not nodes:
        raise UsageError(f"the plan has no node rank {message.node_rank}")
    os.environ.update(login_env(os.environ))  # an agent started without a login (srun --export)
    Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
    link = LauncherLink()
    _watch_stdin(lines, lambda line: _request(line, link, plan), signalled_by=signalled_by, host=nodes[0].host,
                 grace_s=plan.stop_grace_s)
    return run_node(plan, nodes[0], link=link)


def _request(line: bytes, link, plan) -> None:
    """A line from the launcher after the plan: only the dump request is expected."""
    try:
        DumpRequest.from_line(line)
    except WireError as err:
        print(f"disttrain: warning: ignored a line from the launcher: {err}", file=sys.stderr, flush=True)
        return
    link.dump(plan)


def handle_launch_step(args: argparse.Namespace) -> int:
    """Inside a Slurm batch job: the spec the submitting side shipped, launched on the allocation."""
    from ..launch.slurm import STEP_ENV, SlurmAllocationLauncher, record_end
    from ..launch.slurm_env import SlurmAllocation
    from .steps import events_for_step

    alloc = SlurmAllocation.from_environ(os.environ)
    if alloc is None:
        raise UsageError("disttrain launch-step runs inside the Slurm job that `disttrain run --launcher slurm` "
                         "or `disttrain job run` submits")
    shipped = os.environ.pop(STEP_ENV, None)  # popped: not one of the user's variables to forward
    if not shipped:
        raise UsageError(f"disttrain launch-step: {STEP_ENV} is not in the job's environment: run it only as the "
                         "command of the batch script that `disttrain run --launcher slurm` submits")
    step = LaunchStep.from_line(shipped)
    run_dir = step.run_dir
    if alloc.restart_count:  # a requeued job: the first run's logs stay as they were
        run_dir = str(Path(run_dir) / f"requeue_{alloc.restart_count}")
    ctx = Context(run_id=step.run_id, run_dir=run_dir, cwd=step.cwd, python=step.python, paths=step.paths,
                  environ=dict(os.environ))
    launcher = SlurmAllocationLauncher(alloc, nodes=step.nodes)
    outcome = launcher.run(step.spec, ctx, events_for_step(step.client))
    record_end(step.run_dir, StepEnded(outcome=outcome, where=launcher.names))
    return outcome.exit_code


def handle_probe(args: argparse.Namespace) -> int:
    from ..preflight import reach
    from ..preflight.facts import node_facts

    if args.session:
        return _session(args)
    if args.listen is not None:
        return reach.listen([int(p) for p in args.listen.split(",")])
    if args.connect is not None:
        print(json.dumps(reach.connect(args.connect.split(","))), flush=True)
        return 0

    print(json.dumps(node_facts(master=args.master, port=args.port, paths=args.path, cwd=args.cwd)), flush=True)
    return 0


def _session(args: argparse.Namespace) -> int:
    """One process per host for a whole launch: one ssh connection, one Python start, torch
    imported once (for the facts, then by the agent). EOF at any step ends it quietly."""
    from ..preflight import reach
    from ..preflight.facts import node_facts

    fact = node_facts(master=args.master, port=args.port, paths=args.path, cwd=args.cwd)
    ports = [int(p) for p in args.listen.split(",")] if args.listen else []
    socks, answer = reach.open_listeners(ports) if ports else ([], {"ports": []})
    print(json.dumps({"facts": fact, "listen": answer}), flush=True)
    lines = _Lines(sys.stdin.fileno())
    try:
        line = lines.next()
        if line is None:
            return 0
        targets = json.loads(line)["connect"]
        print(json.dumps(reach.connect(targets) if targets else {}), flush=True)
        line = lines.next()
    finally:
        reach.close_listeners(socks)  # the master port is the rendezvous' next
    if line is None:
        return 0
    return _run_agent(PlanMessage.from_line(line), lines)


def handle_receive(args: argparse.Namespace) -> int:
    from ..launch.sync import receive

    return receive(args.dir, sys.stdin.buffer, sys.stdout)
