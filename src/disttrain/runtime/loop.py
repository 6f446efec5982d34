"""The epoch loop: keeps every rank's shuffling in step."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader

from ..errors import UsageError
from .context import context, current_runtime


def track(loader: DataLoader) -> DataLoader:
    """Have :func:`epochs` call ``set_epoch`` on ``loader``'s sampler; returns ``loader``.

    :func:`~disttrain.prepare` does this for the loaders it returns; call it yourself for
    a loader you sharded with your own ``DistributedSampler``.
    """
    context().runtime.loaders.add(loader)
    return loader


def tracked() -> list[DataLoader]:
    """The loaders :func:`epochs` reshuffles (those of the current context)."""
    runtime = current_runtime()
    return list(runtime.loaders) if runtime is not None else []


def set_epoch(epoch: int) -> None:
    """Tell the sampler (and batch sampler) of every tracked loader which epoch starts."""
    for loader in tracked():
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
        runtime = current_runtime()
        state = runtime.training if runtime is not None else None
        if state is not None:  # the TrainingState of disttrain.resume()
            yield from state.epochs(n)
            return
        start = 0
    if start < 0:
        raise UsageError(f"epochs(start={start}): start cannot be negative")
    for epoch in range(start, n):
        set_epoch(epoch)
        yield epoch
