"""The rendezvous store of an elastic job, held by the launcher itself.

torch's c10d rendezvous keeps its state in one TCP store, which one node hosts (``is_host``);
when that node's host is lost the store goes with it, and the survivors' agents wait on a store
that will never answer (minutes, silently). The launcher is the one machine a job cannot lose
anyway (it relays every stream and decides every regroup; if it goes, every node stops itself:
:mod:`disttrain.agent.entry`), so it holds the store: the nodes all join as clients
(``is_host`` false, :func:`disttrain.agent.elastic_config.rdzv_configs`), and losing any host --
the first included -- is one more regroup. The alternative, a new store on a surviving host named
by the launcher, would need every survivor to leave torch's rendezvous handler and build another
on an empty store: a restart of every agent, and a window where two stores disagree.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

from ..errors import DisttrainError
from ..workerenv import ROUND_COUNTER

STORE_TIMEOUT_S = 60  # the server's own wait (for clients' requests); the rendezvous sets the nodes' waits


def launcher_address(toward: str) -> str:
    """This machine's address on the route toward ``toward`` (a host of the job): the one the hosts
    reach it at. A UDP socket's connect sends nothing; it only asks the kernel for the route."""
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((toward, 9))
        except OSError as err:
            raise DisttrainError(f"no route from this machine to {toward} for the rendezvous store: "
                                 f"{err.strerror}; give --master-addr") from None
        return sock.getsockname()[0]


class LauncherStore:
    """A torch TCPStore served by this process on every address, port ``port`` (0, or ``port`` in use
    here: any free one)."""

    def __init__(self, address: str, port: int) -> None:
        from torch.distributed import TCPStore  # torch only where a store is served

        # A host of the job on this machine holds the port until it has its plan (its probe listened
        # on it for the reachability round, and keeps it for the node's own use): then any free port.
        if port and not _free(port):
            port = 0
        try:
            self._store = TCPStore(address, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=STORE_TIMEOUT_S))
        except (RuntimeError, OSError) as err:
            raise DisttrainError(f"cannot serve the rendezvous store at {address}:{port} on the launcher's "
                                 f"machine ({str(err).splitlines()[0]}); pick another --master-port") from None
        self.address, self.port = address, self._store.port

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    def close(self) -> None:
        self._store = None  # torch stops its server when the last reference goes


def round_counter(endpoint: str) -> Callable[[], int]:
    """The next job-wide round number, from the store's counter at ``endpoint`` (the one the agents'
    rounds take theirs from: disttrain.agent.elastic_agent.job_attempt); an in-place regroup's round
    has no rendezvous round to number it."""
    store = None

    def next_round() -> int:
        nonlocal store
        if store is None:
            from torch.distributed import TCPStore

            host, port = endpoint.rsplit(":", 1)
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        return store.add(ROUND_COUNTER, 1) - 1
    return next_round


def _free(port: int) -> bool:
    """Whether ``port`` can be listened on here (as torch's store does: every address, address reuse)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True
