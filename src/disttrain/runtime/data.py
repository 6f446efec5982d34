"""prepare(): the model onto its device (DDP when distributed), the loaders sharded."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from ..errors import UsageError
from . import heartbeat, loop, preemption, steptimer, strategies
from .context import Context, context, current_runtime
from .device import batch_target, move_to, non_blocking_for, pin_memory_for
from .samplers import EvalShardSampler
from .strategies import PrepareOptions

# DistributedSampler's own default, used when the loader carries no generator.
DEFAULT_SEED = 0


def prepare(model: torch.nn.Module | None, optimizer: Any, *dataloaders: DataLoader,
            **options: Any) -> tuple:
    """``(model, optimizer, *loaders)`` ready for this process, in the order given.

    The model moves to the context's device and, with more than one process, is spread
    over the ranks by ``strategy``: ``"ddp"`` (the default) wraps it in
    ``DistributedDataParallel``; ``"fsdp"`` shards its parameters, gradients and optimizer
    state with FSDP2's ``fully_shard``, block by block (``blocks=``: the module classes, or
    a predicate, to shard as units; default: the model's repeated blocks).
    ``mixed_precision``: None (float32), ``"bf16"`` (CPU or GPU) or ``"fp16"`` (GPU; step
    through :func:`disttrain.accumulate`, which scales the loss). The forward then runs in
    the low dtype and returns float32 outputs. The optimizer passes through (parameters
    keep their identity when moved, so it may be built before or after; with ``"fsdp"``
    an optimizer built before must be passed here, to be pointed at the sharded
    parameters). Each loader is rebuilt with
    a sampler that gives this rank its share: a shuffling loader (training) gets a
    ``DistributedSampler`` padded so all ranks run the same number of steps, a sequential
    one (evaluation) an :class:`EvalShardSampler` that sees each sample exactly once.
    The shuffle seed, which must be the same on every rank, is that of the loader's
    ``generator`` when it has one (``generator=torch.Generator().manual_seed(s)``), else 0.
    On a GPU the returned loaders pin memory and yield batches already on the device.
    ``comm`` (``"fp16"``, ``"bf16"``, ``"powersgd"``, or ``"localsgd:H"`` / ``"diloco:H"`` to
    synchronise every H optimizer steps; the older name ``grad_compression`` takes the same)
    and ``bucket_mb`` set how DDP communicates (:mod:`.comm`, :mod:`.periodic`; default:
    ``disttrain run --grad-compression``).
    """
    settings = PrepareOptions.from_kwargs(options)
    ctx = context()
    prepared = _prepare_model(model, ctx, settings, optimizer) if model is not None else None
    loaders = tuple(_prepare_loader(dl, ctx, position=i) for i, dl in enumerate(dataloaders))
    return (prepared, optimizer, *loaders)


def _prepare_model(model: torch.nn.Module, ctx: Context, options: PrepareOptions,
                   optimizer: Any) -> torch.nn.Module:
    if isinstance(model, DistributedDataParallel) or ctx.runtime.prepared(model) is not None:
        return model  # prepared already
    strategy = strategies.choose(options, ctx)
    wrapped = strategy.wrap(model, optimizer)
    ctx.runtime.models[wrapped] = strategy
    return wrapped


class PreparedLoader(DataLoader):
    """A DataLoader whose batches arrive on ``target`` (None: as the workers made them).

    A subclass rather than a wrapper so that ``isinstance(x, DataLoader)``, ``len()``,
    ``.sampler``, ``.dataset`` and ``.batch_size`` all behave as users expect.
    """

    def __init__(self, *args: Any, target: torch.device | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target = target

    def __iter__(self):
        batches = super().__iter__()  # here, not in the generator: it draws from the RNG now
        # An unpadded shard (shuffle=False) may give this rank one batch fewer than another;
        # training DDP on it, the rank with the extra batch would wait forever in backward.
        # Under torch's Join, ranks that ran out shadow the others' collectives instead.
        uneven = isinstance(self.sampler, EvalShardSampler)
        joined = _training_ddp_models() if uneven else []
        return steptimer.timed(self._steps(batches, self.target, joined, training=not uneven), self)

    @staticmethod
    def _steps(batches, target: torch.device | None, joined: list[DistributedDataParallel], *,
               training: bool):
        non_blocking = target is not None and non_blocking_for(target)
        with Join(joined) if joined else contextlib.nullcontext():
            for batch in batches:
                heartbeat.beat()  # each batch is progress, for the launcher's hang watchdog
                yield batch if target is None else move_to(batch, target, non_blocking=non_blocking)
        if training:  # a training epoch ended: local SGD / DiLoCo replicas become one model again
            periodic_epoch_end()


def periodic_epoch_end() -> None:
    from . import periodic  # torch's averaging pieces only where a mode uses them

    if periodic.active():
        periodic.epoch_end()


def _training_ddp_models() -> list[DistributedDataParallel]:
    # Join only knows DDP; an FSDP model must not see uneven batches (documented).
    runtime = current_runtime()
    models = list(runtime.models.items()) if runtime is not None else []
    return [m for m, strategy in models if strategy.joins_uneven_batches and m.training]


def shard_sampler(loader: DataLoader, *, rank: int, world_size: int, position: int = 0) -> Sampler:
    """The sampler that gives ``rank`` its share of ``loader``'s data.

    Decided from how the loader was built: ``shuffle=True`` (a RandomSampler) marks
    training data, the default SequentialSampler evaluation data. Anything else is
    refused, because silently replacing a custom sampler would change what is trained on.
    """
    where = f"prepare(): data loader #{position}"
    if isinstance(loader.dataset, IterableDataset):
        raise UsageError(
            f"{where} has an IterableDataset, which cannot be sharded by index: split the "
            "stream by rank yourself (disttrain.context().rank / .world_size) and do not "
            "pass this loader to prepare()"
        )
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise UsageError(
            f"{where} has a custom batch_sampler ({type(loader.batch_sampler).__name__}): "
            "make it yield only this rank's batches (disttrain.context().rank / "
            ".world_size) and do not pass this loader to prepare()"
        )
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            raise UsageError(
                f"{where} samples with replacement or a fixed num_samples, which "
                "DistributedSampler cannot reproduce: use DataLoader(shuffle=True), or "
                "shard it yourself and do not pass it to prepare()"
            )
        generator = sampler.generator or loader.generator
        seed = generator.initial_seed() if generator is not None else DEFAULT_SEED
        return DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
        )
    if type(sampler) is SequentialSampler:
        return EvalShardSampler(len(loader.dataset), num_replicas=world_size, rank=rank)
    raise UsageError(
        f"{where} has a custom sampler ({type(sampler).__name__}): prepare() only shards "
        "loaders built with shuffle=True (training) or shuffle=False (evaluation); wrap "
        "your sampler so that it yields only this rank's indices and do not pass this "
        "loader to prepare()"
    )


def _prepare_loader(loader: DataLoader, ctx: Context, *, position: int) -> PreparedLoader:
    if not isinstance(loader, DataLoader):
        raise UsageError(
            f"prepare(): argument #{position + 3} is a {type(loader).__name__}, "
            "expected a torch DataLoader"
        )
    if type(loader) not in (DataLoader, PreparedLoader):
        raise UsageError(
            f"prepare(): data loader #{position} is a {type(loader).__name__}, which "
            "prepare() cannot rebuild: give it a DistributedSampler yourself and call "
            "disttrain.runtime.loop.track(loader) so that epochs() reshuffles it"
        )
    if isinstance(loader, PreparedLoader):
        return loader  # prepared already: re-sharding a shard would drop data
    sampler = shard_sampler(loader, rank=ctx.rank, world_size=ctx.world_size, position=position)
    prepared = _rebuilt(loader, sampler, pin_memory=pin_memory_for(ctx.device),
                        target=batch_target(ctx.device))
    return loop.track(prepared)


def with_sampler(loader: DataLoader, sampler: Any) -> DataLoader:
    """A loader like ``loader`` (same batches, workers, device) drawing from ``sampler``.

    Resuming an epoch part-way uses it with the indices still to come, so that the batches
    already trained on are never read again.
    """
    return _rebuilt(loader, sampler, pin_memory=loader.pin_memory,
                    target=getattr(loader, "target", None))


def _rebuilt(loader: DataLoader, sampler: Any, *, pin_memory: bool,
             target: torch.device | None) -> PreparedLoader:
    # in_order exists from torch 2.6 on; pass it only where the loader has it.
    extra = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}
    return PreparedLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=preemption.worker_init(loader.worker_init_fn),
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        target=target,
        **extra,
    )
