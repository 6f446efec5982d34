"""The default process group's own TCP connections, and cutting them; the store it met on.

A collective blocked on a peer that lost power waits out the group's timeout: no reset ever comes,
and gloo's ``abort()`` does not end a collective already waiting. Shutting the group's sockets down
does, at once, on every rank that does it. Which sockets are the group's is learnt when it is made
(:func:`tracking`): those it opened.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

_group_fds: set[int] = set()
_forming: set[int] | None = None  # while a group forms: the sockets open before it began
store = None  # the (prefixed) store the runtime made the group on, when it made it on one


def _sockets() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except (OSError, ValueError):
            continue
    return found


@contextlib.contextmanager
def tracking():
    """Around the making of the default process group: the sockets it opened are its connections."""
    global _group_fds, _forming
    if not sys.platform.startswith("linux"):
        yield
        return
    _group_fds = set()  # the old group's were cut when it was left; the new one may reuse their numbers
    before = _forming = _sockets()
    try:
        yield
    finally:
        _forming = None
        _group_fds = _sockets() - before


def cut() -> None:
    """Shut the group's TCP connections down: every collective on them fails now, none waits for a
    peer that lost power. Listening sockets are left (gloo aborts the process when its listener
    fails). A group still forming loses the connections it made so far, its store's among them:
    a wait for a member lost meanwhile fails now (any other thread's socket opened meanwhile too)."""
    fds = set(_group_fds)
    forming = _forming
    if forming is not None:
        fds |= _sockets() - forming
    for fd in sorted(fds):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()


def known() -> bool:
    """Whether the current group's connections are known (the runtime made it)."""
    return bool(_group_fds)
