"""The epoch loop: keeps every rank's shuffling in step."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from torch.utils.data import DataLoader

from ..errors import UsageError

# Weak, so that a loader the script drops (and its worker processes) is freed as usual.
_tracked: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def track(loader: DataLoader) -> DataLoader:
    """Have :func:`epochs` call ``set_epoch`` on ``loader``'s sampler; returns ``loader``.

    :func:`~disttrain.prepare` does this for the loaders it returns; call it yourself for
    a loader you sharded with your own ``DistributedSampler``.
    """
    _tracked.add(loader)
    return loader


def set_epoch(epoch: int) -> None:
    """Tell the sampler (and batch sampler) of every tracked loader which epoch starts."""
    for loader in list(_tracked):
        for sampler in (loader.sampler, loader.batch_sampler):
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)


def epochs(n: int, *, start: int | None = None) -> Iterator[int]:
    """Yield ``start, start+1, ..., n-1``, reshuffling the prepared loaders for each.

    ``DistributedSampler`` shuffles with ``seed + epoch``, so every rank draws the same
    permutation and takes its own disjoint slice; without ``set_epoch`` every epoch would
    repeat the first one's order. Without ``start`` the loop follows the state
    :func:`disttrain.resume` returned, if any (from the checkpoint's epoch on), else
    starts at 0. Loaders prepared while the loop runs join from the next epoch.
    """
    if n < 0:
        raise UsageError(f"epochs(n={n}): n cannot be negative")
    if start is None:
        from .resume import current  # resume builds on this module

        state = current()
        if state is not None:
            yield from state.epochs(n)
            return
        start = 0
    if start < 0:
        raise UsageError(f"epochs(start={start}): start cannot be negative")
    for epoch in range(start, n):
        set_epoch(epoch)
        yield epoch
