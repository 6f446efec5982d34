"""The nodes a round of an elastic job that disttrain placed waits for: every node started with the
job, for its first round; its members and the nodes waiting to join, for a round that grows.

torch's c10d rendezvous completes a round ``last_call_timeout`` (1 s here: the regroups' pace)
after its minimum of nodes joined, and a node waiting for a round looks at it once a second. Under
load the nodes' agents come seconds apart (ssh, Python, torch, each at a share of a core), and each
late one then restarts every worker for a round with it: five rounds before the first step were
seen at a load of 12. So a node first says it came, on the launcher's store, and waits for the
others (:func:`gather_at_start`). Even gathered they join torch's rendezvous a moment apart, and a
process starved for over a second (CI, at a load past 10) still missed the first round; so may a
member or a newcomer miss the round that grows (the members that left the round before first and
the newcomer each look once a second). So such a round's settings are those of the nodes it waits
for (:func:`expecting`): it is complete once all of them joined, or :data:`LAST_CALL_S` after its
minimum did (one lost in between).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from ..workerenv import ROUND_COUNTER

START_GATHER_S = 60  # the job's first round waits this long at most for every node started with the job
LAST_CALL_S = 10  # a round that waits for known nodes: this long after its minimum joined, for the rest
ARRIVED_KEY = "disttrain/arrived"  # nodes that came to the job's first rendezvous


def gather_at_start(endpoint: str, nodes: int, limit_s: float = START_GATHER_S, *,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Before its first rendezvous, a node says it came, on the launcher's store at ``endpoint``, and
    waits until the ``nodes`` started with the job all did, or a round already formed (this node joins
    a running job: 0), or ``limit_s`` passed (a node lost at the start). How many had come."""
    from torch.distributed import TCPStore

    host, port = endpoint.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(limit_s, 1)))
    came = store.add(ARRIVED_KEY, 1)
    end = clock() + limit_s
    while store.add(ROUND_COUNTER, 0) == 0:
        if came >= nodes or clock() >= end:
            return came
        sleep(0.2)
        came = store.add(ARRIVED_KEY, 0)
    return 0


@contextlib.contextmanager
def expecting(handler: Any, nodes: int | None) -> Iterator[None]:
    """Within the block, a round of torch's dynamic rendezvous ``handler`` waits for ``nodes`` (None:
    as many as come, up to its maximum: a node joining a running job, which knows no count): it is
    complete once they all joined, or :data:`LAST_CALL_S` (its own last call, if longer) after its
    minimum did. Its own settings again after; with fewer ``nodes`` than its minimum (0: torch's own
    round), or a handler without those settings (another backend), it is left as it is.

    torch reads the settings at each step of the join, each node its own: the deadline is set by the
    node that brings the minimum, the completion at the maximum by whichever node sees it; so every
    node of such a round sets them."""
    settings = getattr(handler, "_settings", None)
    timeout = getattr(settings, "timeout", None)
    if not hasattr(timeout, "_last_call") or nodes is not None and nodes < settings.min_nodes:
        yield
        return
    kept = settings.max_nodes, timeout._last_call
    # a frozen dataclass, shared by the handler's parts
    object.__setattr__(settings, "max_nodes", min(nodes or settings.max_nodes, settings.max_nodes))
    timeout._last_call = max(kept[1], timedelta(seconds=LAST_CALL_S))  # a longer one of --rdzv-conf stays
    try:
        yield
    finally:
        object.__setattr__(settings, "max_nodes", kept[0])
        timeout._last_call = kept[1]
