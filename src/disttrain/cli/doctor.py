"""``disttrain doctor``: why would a job on these hosts fail or hang? Checked in parallel."""

from __future__ import annotations

import argparse
import json
import os

from ..errors import UsageError
from ..launch.ssh import check_hosts, master_address
from ..preflight.checks import CheckResult, local_checks
from ..ssh import parse_ssh_options
from .common import DEFAULT_MULTIHOST_PORT, add_host_args, hosts_from_args

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine, or --hosts, for what would make a job fail or hang")
    add_host_args(p)
    p.add_argument("--master-addr", default=None, help="the master's address (default: as ssh resolves the first host)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MULTIHOST_PORT)
    p.add_argument("--path", action="append", default=[], help="a script or data path that must exist on every host")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(handler=handle)


def print_table(results: list[CheckResult]) -> None:
    width = max(len(r.check) for r in results)
    hostw = max(len(r.host) for r in results)
    for r in results:
        print(f"{MARK[r.status]}  {r.check:<{width}}  {r.host:<{hostw}}  {r.detail}")
        if r.fix:
            print(f"{'':4}  {'':<{width}}  {'':<{hostw}}  fix: {r.fix}")


def handle(args: argparse.Namespace) -> int:
    hosts = hosts_from_args(args)
    if not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
    if not hosts:
        from ..preflight.facts import node_facts  # imports torch, for its versions and GPUs

        fact = node_facts(master="127.0.0.1", port=args.master_port, paths=args.path, cwd=os.getcwd())
        return report(local_checks(fact, master_port=args.master_port), as_json=args.json)
    options = parse_ssh_options(args.ssh_option)
    master = args.master_addr or master_address(hosts[0], options)
    results = check_hosts(hosts, python=args.python, master=master, port=args.master_port, paths=args.path,
                          cwd=os.getcwd(), options=options, environ=os.environ)
    return report(results, as_json=args.json)


def report(results: list[CheckResult], *, as_json: bool) -> int:
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print_table(results)
    return 1 if any(r.status == "fail" for r in results) else 0
