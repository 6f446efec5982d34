"""Hosts for multi-node runs: ``--hosts a,b`` or a hostfile in DeepSpeed/Horovod form.

A hostfile line is ``[user@]host[:sshport] [slots=N]``; ``#`` starts a comment and blank
lines are skipped. Hosts are kept as the user wrote them so that ``~/.ssh/config``
aliases, users and ports keep working through the system ssh client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

# The rendezvous port on the first host when --master-port is not given (torchrun's default).
DEFAULT_MULTIHOST_PORT = 29500

# A user or host may not start with "-": ssh would read "-V" or "-oProxyCommand=..." as an option.
_HOST = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*)@)?"
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._][A-Za-z0-9._-]*))"
    r"(?::(?P<port>\d{1,5}))?$"
)
SSH_DEFAULT_PORT = 22
# More processes than any one machine runs; beyond it a slots= value is a typo, not a plan.
MAX_SLOTS = 4096


@dataclass(frozen=True, kw_only=True)
class Host:
    name: str
    user: str | None = None
    port: int | None = None
    slots: int | None = None

    @property
    def destination(self) -> str:
        """What ssh is given: ``user@name`` or ``name`` (the port goes to ``-p``)."""
        return f"{self.user}@{self.name}" if self.user else self.name


def parse_host(text: str, *, slots: int | None = None, where: str = "--hosts") -> Host:
    if text.strip().startswith("-"):
        raise UsageError(f"{where}: {text!r} starts with '-', which ssh would read as an option; "
                         "use [user@]host[:port]")
    match = _HOST.match(text.strip())
    if not match:
        raise UsageError(f"{where}: {text!r} is not a host; use [user@]host[:port]")
    port = int(match["port"]) if match["port"] else None
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"{where}: ssh port {port} of {text!r} is not in 1..65535")
    return Host(name=match["v6"] or match["name"], user=match["user"], port=port, slots=slots)


def unique_hosts(hosts: list[Host], where: str) -> tuple[Host, ...]:
    """``hosts`` as a tuple, refusing one machine named twice (``node0`` and ``node0:22`` too)."""
    seen: set[tuple[str, int]] = set()
    for host in hosts:
        key = (host.name.lower(), host.port or SSH_DEFAULT_PORT)
        if key in seen:
            raise UsageError(f"{where}: host {host.name!r} (ssh port {key[1]}) is listed twice; list each host once")
        seen.add(key)
    if not hosts:
        raise UsageError(f"{where}: no hosts given")
    return tuple(hosts)


def parse_hosts(text: str) -> tuple[Host, ...]:
    """``node0,node1`` or ``root@10.0.0.1:2222,node1``."""
    return unique_hosts([parse_host(part) for part in text.split(",") if part.strip()], "--hosts")


def parse_hostfile(path: str | Path) -> tuple[Host, ...]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"--hostfile {path}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"--hostfile {path}: not UTF-8 text (byte {err.start}); "
                         "write one [user@]host[:port] [slots=N] per line") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        host_text, *options = line.split()
        slots = None
        for option in options:
            key, _, value = option.partition("=")
            if key != "slots" or not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_SLOTS:
                raise UsageError(f"{where}: {option!r} is not understood; the only option is slots=N "
                                 f"(1 <= N <= {MAX_SLOTS})")
            if slots is not None:
                raise UsageError(f"{where}: slots= is given twice; give it once")
            slots = int(value)
        hosts.append(parse_host(host_text, slots=slots, where=where))
    return unique_hosts(hosts, str(path))
