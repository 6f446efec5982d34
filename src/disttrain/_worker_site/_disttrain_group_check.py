"""A script's own process group, checked against the launcher's before it is made.

Scripts written for one fixed cluster (PyTorch's AWS tutorial: ``init_method="tcp://<node0>:23456"``,
``rank=int(sys.argv[1])``, ``world_size=4``) ignore the rank and address the launcher gives
them. Under a launcher they then fail late and far from the cause: every rank binds the same
hard-coded port (``EADDRINUSE``), or waits for ranks that never come. ``sitecustomize`` wraps
``torch.distributed.init_process_group`` with :func:`install` in every worker a launcher started
(``WORLD_SIZE`` set); a call whose address, rank or world size is not the launcher's ends the rank
at once with one line naming the script's file:line and what to pass instead.

Only the standard library: this module is imported in every worker of a PyTorch job.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

WHAT_TO_DO = ("leave out init_method, rank and world_size (or pass init_method='env://'): the launcher "
              "sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE")


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:  # a name that does not resolve here: not known to differ, say nothing
        return True


def mismatches(kwargs: dict, env: dict) -> list[str]:
    """What of ``init_process_group``'s arguments disagrees with the launcher's environment."""
    found = []
    method = kwargs.get("init_method")
    if isinstance(method, str) and method.startswith("tcp://") and kwargs.get("store") is None:
        where = method[len("tcp://"):].split("?")[0].split("/")[0]
        host, _, port = where.rpartition(":")
        addr, want_port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if addr and want_port and (port != want_port or not _same_host(host.strip("[]"), addr)):
            found.append(f"init_method {method!r} is not the launcher's {addr}:{want_port}")
    for key, name in (("world_size", "WORLD_SIZE"), ("rank", "RANK")):
        value, want = kwargs.get(key), env.get(name)
        if value is not None and value != -1 and want is not None and str(value) != want:
            found.append(f"{key}={value!r} where the launcher gave {name}={want}")
    return found


def _caller() -> str:
    """The first frame outside torch and this module: the script's line."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or f"{os.sep}torch{os.sep}" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "the script"
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


def install(c10d) -> None:
    """Wrap ``c10d.init_process_group`` (``torch.distributed`` re-exports it after this runs)."""
    if not os.environ.get("WORLD_SIZE"):
        return
    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        named = dict(zip(("backend", "init_method", "timeout", "world_size", "rank"), args))
        named.update(kwargs)
        found = mismatches(named, os.environ)
        if found:
            print(f"disttrain: {_caller()}: rank {os.environ.get('RANK')}: the script makes its own process group: "
                  f"{'; '.join(found)}; {WHAT_TO_DO}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        return original(*args, **kwargs)

    c10d.init_process_group = init_process_group
