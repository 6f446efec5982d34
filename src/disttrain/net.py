"""Small socket facts the launcher needs before it starts anything."""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import socket
from pathlib import Path

from .errors import UsageError

# Ports handed out start here, below the kernel's ephemeral range (see free_port).
PORTS_FROM = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host``, below the ephemeral range where there is room.

    A port the OS picks (bind to 0) comes from the range it also gives outgoing connections, and
    one of those can take it before the process it was chosen for binds it: a job's
    ``SM_MASTER_PORT``, bound by the user's torchrun seconds later, was taken so beside the suite's
    other lane (``EADDRINUSE``). Below that range only a listener can take it."""
    top = _ephemeral_start()
    for port in random.sample(range(PORTS_FROM, top), k=min(32, max(0, top - PORTS_FROM))):
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port`` here, as far as the system tells: ``pid 123 (bob: fabric run ...)``,
    or only the socket's owner (``/proc/net/tcp`` shows every user's socket, not its process), or None."""
    import psutil

    try:
        listening = [c for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError):
        listening = []
    for conn in listening:
        if conn.pid:
            try:
                proc = psutil.Process(conn.pid)
                command = " ".join(" ".join(proc.cmdline()).split())[:100]  # one line, whatever the argv holds
                return f"pid {conn.pid} ({proc.username()}: {command})"
            except psutil.Error:
                return f"pid {conn.pid}"
    return _socket_owner(port)


def _socket_owner(port: int) -> str | None:
    import pwd

    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = [line.split() for line in fh.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if len(row) > 7 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                try:
                    return f"a process of user {pwd.getpwuid(int(row[7])).pw_name}"
                except KeyError:
                    return f"a process of uid {row[7]}"
    return None


def busy_rendezvous(host: str, port: int) -> str:
    """``; port P ... is held by ...`` when the rendezvous port on this machine is another process's
    (said after a rendezvous that could not connect: torch only says the store failed), else ``""``."""
    try:
        if not (is_local(host) or hosts_c10d_store(host) is None) or not port_in_use(host, port):
            return ""
    except OSError:
        return ""
    holder = port_holder(port)
    if holder is not None and holder.startswith(f"pid {os.getpid()} "):
        return ""
    return (f"; port {port} of the rendezvous endpoint {host}:{port} is held by another program"
            f"{f' ({holder})' if holder else ''}: give --rdzv-endpoint (or --master-port) a free port")
