"""Samplers that split a dataset between ranks."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


class EvalShardSampler(Sampler[int]):
    """Every ``num_replicas``-th index starting at ``rank``: each sample on exactly one rank.

    Unlike ``DistributedSampler`` nothing is padded, so metrics summed over ranks count
    each sample once (101 samples on 2 ranks: 51 + 50, not 51 + 51). Ranks may therefore
    see one batch more or less than each other, so an evaluation loop must not run a
    collective per batch: reduce once, after the loop, and evaluate the unwrapped model
    (``model.module``), because a DDP forward may broadcast buffers.
    """

    def __init__(self, length: int, *, num_replicas: int, rank: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))
