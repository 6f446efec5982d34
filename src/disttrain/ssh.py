"""The ssh boundary: argv lists in, one ``ssh`` argv out, quoted exactly once here.

The system OpenSSH client is used so that ``~/.ssh/config``, agents and jump hosts work as
users expect. Host-key checking stays as the user configured it; disttrain only adds
``BatchMode=yes`` (a password prompt would be a silent hang), a connect timeout and
keep-alives (a host that loses power closes no connection: without them the launcher
would wait for it forever), after the user's own ``-o`` options so that theirs win (ssh
keeps the first value it sees).
"""

from __future__ import annotations

import shlex
import socket
import subprocess
from collections.abc import Mapping, Sequence

from .config.hosts import Host
from .errors import DisttrainError, UsageError

DEFAULT_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=5", "ServerAliveCountMax=3")
# The client's notices on stderr ("Warning: Permanently added 'h' (ED25519) to the list of known
# hosts.", OpenSSH 9.9's "** WARNING: connection is not using a post-quantum key exchange..."):
# printed when a connection opens, never the cause of its end, so never taken as a last word.
NOTICE_PREFIXES = ("Warning: ", "** ")


def is_notice(line: str) -> bool:
    """Whether ``line`` is one of ssh's own notices (see :data:`NOTICE_PREFIXES`), not a cause."""
    return line.lstrip().startswith(NOTICE_PREFIXES)


def last_word(lines: Sequence[str]) -> str:
    """The last line of ``lines`` that says something: blank lines and ssh's notices skipped."""
    return next((line for line in reversed(lines) if line.strip() and not is_notice(line)), "")


def parse_ssh_options(items: Sequence[str]) -> tuple[str, ...]:
    """``--ssh-option KEY=VALUE`` (repeatable) → ``KEY=VALUE`` strings for ``ssh -o``."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isalnum() or not value:
            raise UsageError(f"--ssh-option takes KEY=VALUE like IdentityFile=~/.ssh/id_ed25519, got {item!r}")
    return tuple(items)


def remote_command(argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """One shell command line for the remote login shell, every word quoted."""
    words = list(argv)
    if env:
        words = ["env", *(f"{key}={value}" for key, value in env.items()), *words]
    command = "exec " + shlex.join(words)
    if cwd:
        command = f"cd {shlex.quote(cwd)} && {command}"
    return command


def ssh_config(host: Host, options: Sequence[str] = ()) -> dict[str, str]:
    """How ssh would connect to ``host`` (``ssh -G``: ``~/.ssh/config`` applied), keys in lower case."""
    argv = ["ssh", "-G", *(w for o in options for w in ("-o", o)), *(["-p", str(host.port)] if host.port else []),
            "--", host.destination]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise DisttrainError(f"cannot ask ssh how to reach {host.name}: {err}") from None
    return dict(line.split(None, 1) for line in out.splitlines() if " " in line)


def ssh_address(host: Host, options: Sequence[str] = ()) -> tuple[str, int] | None:
    """The IPv4 address and port ssh connects to for ``host``; None through a jump host or a proxy
    command (that port is not the host's), or when ssh or the resolver cannot say."""
    try:
        config = ssh_config(host, options)
        if config.get("proxyjump", "none") != "none" or "proxycommand" in config:
            return None
        address = socket.getaddrinfo(config.get("hostname", host.name), None, socket.AF_INET)[0][4][0]
        return address, int(config.get("port", 22))
    except (DisttrainError, OSError, ValueError):
        return None


def ssh_argv(
    host: Host,
    argv: Sequence[str],
    *,
    options: Sequence[str] = (),
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    ssh: str = "ssh",
) -> list[str]:
    """The local argv that runs ``argv`` on ``host`` in ``cwd`` with ``env`` added."""
    out = [ssh, "-T"]
    for option in (*options, *DEFAULT_OPTIONS):
        out += ["-o", option]
    if host.port is not None:
        out += ["-p", str(host.port)]
    # "--" before the destination: nothing after it is read as an ssh option, whatever the name.
    out += ["--", host.destination, remote_command(argv, cwd=cwd, env=env)]
    return out
