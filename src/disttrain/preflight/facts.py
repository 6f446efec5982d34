"""Facts a node reports about itself, for planning and for ``doctor``.

Run on each host (``disttrain agent``, its probe round), sent as :class:`~disttrain.wire.ProbeFacts`. The address and
interface toward the master come from the routing table, never from the hostname (which
resolves to 127.0.0.1 on many machines).
"""

from __future__ import annotations

import ipaddress
import os
import platform
import socket
from pathlib import Path

import psutil

from ..net import port_in_use
from ..placement import usable_cpus
from ..version import __version__
from ..wire import HostFacts


def route_to(addr: str) -> tuple[str, str | None]:
    """(source address, interface) this host uses to reach ``addr``.

    A UDP ``connect`` makes the kernel pick the route without sending a packet.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((addr, 9))
        source = sock.getsockname()[0]
    for ifname, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addrs):
            return source, ifname
    return source, None


def versions() -> dict[str, str | None]:
    import torch

    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build: reported as absent
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nccl": nccl,
        "disttrain": __version__,
    }


def node_facts(*, master: str, port: int | None = None, paths: list[str] = (), cwd: str | None = None) -> HostFacts:
    """This host's facts; ``paths`` are looked up relative to ``cwd`` (the launcher's)."""
    import torch

    cwd = cwd or os.getcwd()
    source, ifname = route_to(master)
    is_master = source == master or ipaddress.ip_address(master).is_loopback
    return HostFacts(
        hostname=socket.gethostname(),
        address=source,
        ifname=ifname,
        is_master=is_master,
        cpus=usable_cpus(),
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        versions=versions(),
        paths={p: (Path(cwd) / p).exists() for p in paths},
        cwd=cwd,
        cwd_exists=Path(cwd).is_dir(),
        port_free=(not port_in_use(master, port)) if (is_master and port) else None,
    )


def local_facts(cpus: int | None = None, *, toward: str | None = None):
    """This machine as a node to plan for (``cpus``: what Slurm gave a job step, if it did);
    ``toward``: the master of a job whose nodes were started by hand, for this node's address
    and interface on the route to it (GLOO/NCCL_SOCKET_IFNAME, c10d's local address)."""
    import torch  # the agent needs it anyway; imported here only to count GPUs

    from ..plan.launch import NodeFacts

    address = ifname = None
    if toward is not None:
        address, ifname = route_to(toward)
        if ifname is not None and ipaddress.ip_address(address).is_loopback:
            ifname = None  # all on this machine: gloo finds loopback by itself
    return NodeFacts(
        name=socket.gethostname(),
        cpus=cpus or usable_cpus(),
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        socket_ifname=ifname,
        address=address,
    )
