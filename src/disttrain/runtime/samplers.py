"""Samplers that split a dataset between ranks."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler, Sampler


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


def rest_of_epoch(sampler: Sampler, consumed: int, *, rank: int, world_size: int) -> list[int] | None:
    """``rank``'s indices for the rest of the epoch, once the ranks together have consumed
    the first ``consumed`` positions of the epoch's global order -- whatever number of
    ranks consumed them. None for a sampler whose global order is not known here.

    The rest of the order is dealt out as the sampler deals a whole epoch (position ``p``
    to rank ``p % world_size``), padded like ``DistributedSampler`` with the epoch's first
    samples so that every rank gets as many: a sample consumed before is trained again
    only as that padding. With the world that consumed them, these are exactly the
    sampler's own indices from the same point on. The ranks then consume the global order
    contiguously, so ``consumed`` stays a position in it at any later step.
    """
    if type(sampler) is DistributedSampler and not sampler.drop_last:
        whole = DistributedSampler(sampler.dataset, num_replicas=1, rank=0,
                                   shuffle=sampler.shuffle, seed=sampler.seed)
        whole.set_epoch(sampler.epoch)
        order = list(whole)
        rest = order[consumed:]
        padding = -len(rest) % world_size
        if rest and padding:
            rest += (order * (padding // len(order) + 1))[:padding]
        return rest[rank::world_size]
    if type(sampler) is EvalShardSampler:  # unpadded: ranks may differ by one
        return list(range(consumed + rank, sampler.length, world_size))
    return None
