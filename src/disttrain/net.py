"""Small socket facts the launcher needs before it starts anything."""

from __future__ import annotations

import errno
import ipaddress
import socket

from .errors import UsageError


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _family(host: str) -> int:
    """AF_INET6 for an IPv6 address, else AF_INET (names are bound as IPv4, as before)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails because something already listens there."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR mirrors what torch's TCPStore does, so a port in TIME_WAIT
        # (free for the store) is not reported as busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def resolve(host: str) -> tuple[str, ...]:
    """The IPv4/IPv6 addresses ``host`` resolves to here; () when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, ValueError):
        return ()
    return tuple(dict.fromkeys(info[4][0] for info in infos))


def local_addresses() -> set[str]:
    """Every address of this machine's interfaces (in this network namespace), loopback included."""
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: a loopback address, or an address one of its interfaces has.

    Never by comparing host names: on many machines (this one) the host name resolves to
    127.0.0.1, which would make every machine "the master"."""
    addresses = resolve(host)
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return True
    return bool(set(addresses) & local_addresses())


def hosts_c10d_store(host: str) -> bool | None:
    """Whether this machine hosts the c10d rendezvous store at ``host`` (c10d's ``is_host``).

    True: ``host`` is one of its non-loopback addresses (torch's own guess compares host names
    and would say no); False: another machine's. None: loopback, left to torch, which hosts the
    store or, when another process on this machine already does, joins it as a client."""
    addresses = resolve(host)
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return None
    return bool(set(addresses) & local_addresses())


def check_master(host: str, *, flag: str, must_be_here: bool, why: str) -> None:
    """One line (exit 2) for a rendezvous address that cannot work: it does not resolve, or this
    node must host the rendezvous there (``why``) and it is not an address of this machine."""
    if not resolve(host):
        raise UsageError(f"{flag} {host} does not resolve here: give node 0's IP address, or a name this "
                         "machine resolves")
    if must_be_here and not is_local(host):
        own = sorted(a for a in local_addresses() if ":" not in a and not ipaddress.ip_address(a).is_loopback)
        raise UsageError(f"{flag} {host} is not an address of this machine, and {why}: give this machine's "
                         f"address{f' ({own[0]})' if own else ''}, or start this node on {host}")
