"""Hidden subcommands a launcher runs on each host over ssh: ``agent``, ``probe``, ``receive``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from ..errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    agent = sub.add_parser("agent")
    source = agent.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", help="the launch plan as JSON")
    # A file on the shared filesystem (Slurm): one argv word holds at most 128 KiB.
    source.add_argument("--plan-file", help="a file holding the launch plan as JSON")
    agent.add_argument("--node-rank", type=int, required=True)
    agent.add_argument("--watch-stdin", action="store_true",
                       help="stop the workers when stdin closes (the launcher went away)")
    agent.set_defaults(handler=handle_agent)

    probe = sub.add_parser("probe")
    probe.add_argument("--master", default="127.0.0.1")
    probe.add_argument("--port", type=int, default=None)
    probe.add_argument("--path", action="append", default=[])
    probe.add_argument("--cwd", default=None, help="the folder --path is relative to (the launcher's)")
    probe.add_argument("--listen", default=None, help="comma-separated ports to listen on (0: any)")
    probe.add_argument("--connect", default=None, help="comma-separated addr:port to connect to")
    probe.set_defaults(handler=handle_probe)

    receive = sub.add_parser("receive")
    receive.add_argument("dir", help="where the launcher's working directory is copied to")
    receive.set_defaults(handler=handle_receive)


def _stop_when_stdin_closes() -> None:
    # ssh gives the remote command the launcher's pipe as stdin: EOF means the launcher
    # is gone or wants us to stop. SIGTERM lets torch's agent stop the workers cleanly.
    # A raw os.read, not sys.stdin: a daemon thread blocked inside a buffered reader
    # aborts the interpreter at exit ("could not acquire lock ... at interpreter shutdown").
    def watch() -> None:
        fd = sys.stdin.fileno()
        while os.read(fd, 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def handle_agent(args: argparse.Namespace) -> int:
    from ..agent.lifeline import follow_parent

    # The launcher (ssh session, job runner, srun) gone, even SIGKILLed: stop the workers. Set
    # before importing torch (seconds), so that a launcher dying meanwhile is not missed.
    follow_parent(signal.SIGTERM)
    from ..agent.node import run_node
    from ..plan.launch import plan_from_json

    plan = plan_from_json(args.plan if args.plan is not None else Path(args.plan_file).read_text())
    nodes = [n for n in plan.nodes if n.node_rank == args.node_rank]
    if not nodes:
        raise UsageError(f"the plan has no node rank {args.node_rank}")
    Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
    if args.watch_stdin:
        _stop_when_stdin_closes()
    return run_node(plan, nodes[0])


def handle_probe(args: argparse.Namespace) -> int:
    from ..preflight import reach
    from ..preflight.facts import node_facts

    if args.listen is not None:
        return reach.listen([int(p) for p in args.listen.split(",")])
    if args.connect is not None:
        print(json.dumps(reach.connect(args.connect.split(","))), flush=True)
        return 0

    print(json.dumps(node_facts(master=args.master, port=args.port, paths=args.path, cwd=args.cwd)), flush=True)
    return 0


def handle_receive(args: argparse.Namespace) -> int:
    from ..backends.sync import receive

    return receive(args.dir, sys.stdin.buffer, sys.stdout)
