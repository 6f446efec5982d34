"""Hidden subcommands a launcher runs on each node: ``agent``, ``receive``, ``batch-step``.

Each only parses its flags and calls the module that owns the process: a node's agent
(:mod:`disttrain.agent.entry`), ``--sync``'s receiving end (:mod:`disttrain.launch.sync`),
a Slurm batch job's batch step (:mod:`disttrain.launch.slurm_alloc`).
"""

from __future__ import annotations

import argparse
import os
import sys


def _ports(text: str) -> list[int]:
    try:
        return [int(port) for port in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated port numbers, got {text!r}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    # A launch's one process per node: its facts, the reachability round, then its plan -- all on
    # stdin/stdout (the plan holds the user's variables: never on a command line, which `ps` shows).
    agent = sub.add_parser("agent")
    agent.add_argument("--master", default="127.0.0.1", help="the master's address (this host's route to it)")
    agent.add_argument("--port", type=int, default=None, help="the rendezvous port (checked free on the master)")
    agent.add_argument("--path", action="append", default=[], help="a path that must exist (relative to --cwd)")
    agent.add_argument("--cwd", default=None, help="the folder --path is relative to (the launcher's)")
    agent.add_argument("--listen", type=_ports, default=[], help="comma-separated ports to listen on (0: any)")
    agent.set_defaults(handler=handle_agent)

    receive = sub.add_parser("receive")
    receive.add_argument("dir", help="where the launcher's working directory is copied to")
    receive.set_defaults(handler=handle_receive)

    # The one command of a Slurm batch script (disttrain.launch.slurm): runs in the allocation,
    # its batch step in the job's environment.
    # launch-step: its old name, in the scripts of jobs queued before an upgrade.
    batch_step = sub.add_parser("batch-step", aliases=["launch-step"])
    batch_step.set_defaults(handler=handle_batch_step)


def handle_agent(args: argparse.Namespace) -> int:
    from ..agent.entry import agent_main

    agent_main(master=args.master, port=args.port, paths=args.path, cwd=args.cwd, listen=args.listen)


def handle_batch_step(args: argparse.Namespace) -> int:
    from ..launch.slurm_alloc import run_batch_step
    from .batch_step import client_for_batch_step

    return run_batch_step(os.environ, client_for_batch_step)


def handle_receive(args: argparse.Namespace) -> int:
    from ..launch.sync import receive

    return receive(args.dir, sys.stdin.buffer, sys.stdout)
