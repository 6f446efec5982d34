"""Which agent's failure the launcher reports: the first in time on the workers, not the first heard of.

Under load the launcher may hear of a consequence first: rank 1 exits 5, rank 0 aborts (134)
when it loses its peer, and rank 0's agent happens to exit before rank 1's. Each failed agent
says when its root cause happened, on its worker's clock (:class:`~disttrain.wire.RankFailed`,
timed by the rank's own last write), and whether that rank only lost a peer; once every agent
has stopped, the launcher reports the earliest failure that did not merely lose its peer.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..wire import RankFailed


def first_in_time(heard_first: int, heard_code: int, failed: Mapping[int, RankFailed]) -> tuple[int, int]:
    """``(agent index, exit code)`` of the root cause: among the agents that said when their rank
    failed, one that did not lose its peer before one that did, then the earliest; the agent heard
    of first where none said (an agent killed before it could)."""
    if not failed:
        return heard_first, heard_code
    index = min(failed, key=lambda i: (failed[i].lost_peer, failed[i].at, i))
    return index, failed[index].exit_code
