"""Flags shared by the subcommands that talk to several hosts (``run``, ``doctor``)."""

from __future__ import annotations

import argparse
import sys

from ..config.hosts import DEFAULT_MULTIHOST_PORT, Host, parse_hostfile, parse_hosts  # noqa: F401 (re-exported)
from ..errors import UsageError


def add_host_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", default=None,
                   help="hosts to use over ssh, e.g. node0,node1 or user@host:port; the first is the master")
    p.add_argument("--hostfile", default=None,
                   help="a file of hosts, one per line: [user@]host[:port] [slots=N]; # comments")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to ssh as -o KEY=VALUE (repeatable), e.g. IdentityFile=~/.ssh/key")
    p.add_argument("--python", default=sys.executable,
                   help="the python on the hosts (default: this one, at the same path)")


def hosts_from_args(args: argparse.Namespace) -> tuple[Host, ...] | None:
    if args.hosts and args.hostfile:
        raise UsageError("give --hosts or --hostfile, not both")
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    return None
