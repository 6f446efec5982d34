"""Small socket facts the launcher needs before it starts anything."""

from __future__ import annotations

import errno
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails because something already listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
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
