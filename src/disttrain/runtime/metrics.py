"""Numbers reduced across ranks, and output that appears once rather than once per rank.

The rule of every reduction here (``reduce_*``, ``MeanMeter.avg``, ``barrier``): it is a
collective, so every rank calls it, at the same point. Called where only some ranks go
(``if ctx.is_main: print(meter.avg)``), the others would never join it and the job would
hang. So a call is refused at once, in one line, when its source shows it inside a rank
test (:mod:`.rankonly`); and before ``MeanMeter.avg`` and ``barrier()`` join the collective,
each rank checks in with the others through the job's store, so that one the source does
not give away fails with the same line after the process group's timeout instead of
meeting another collective. (``reduce_*``, often called every step, get the source check
only: the store's round trips would cost each call about a millisecond here.)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from numbers import Number
from typing import TypeVar

import torch
import torch.distributed as dist

from ..errors import DisttrainError, UsageError
from .context import Context, context, current_rank
from .device import ddp_device_ids
from .rankonly import caller_outside_disttrain, rank_condition

Value = TypeVar("Value", torch.Tensor, int, float)

RULE = ("it is a collective: every rank must call it at the same point (read it before "
        "`if ctx.is_main:`, and use the value inside; MeanMeter.local_avg is this rank's own, "
        "without a collective)")

_gates = itertools.count()
_SPIN_POLLS = 20


def every_rank(ctx: Context, what: str, *, check_source: bool = True, check_in: bool = True) -> None:
    """Refuse ``what`` when its source shows that only some ranks call it; then (``check_in``)
    wait until every rank has called it, bounded by the process group's timeout, so that
    it never meets another collective on the ranks that did not."""
    if not ctx.distributed:
        return
    guard = rank_condition(caller_outside_disttrain()) if check_source else None
    if guard is not None:
        filename, line, test = guard
        raise UsageError(f"{what} at {filename}:{line} runs only where `{test}` holds, but {RULE}")
    store = _store() if check_in else None
    if store is None:
        return
    # Numbered and named, so that a lone call never pairs with another rank's different one.
    key = f"disttrain/collective/{next(_gates)}/{what}"
    timeout = ctx.runtime.pg_timeout_s
    deadline, polls = time.monotonic() + timeout, 0
    try:
        # Polled, not store.wait(): a wait blocks in C++ where Ctrl-C cannot reach it. The
        # first polls come at once (ranks in step arrive within a round trip or two).
        arrived = store.add(key, 1)
        while arrived < ctx.world_size:
            if time.monotonic() > deadline:
                raise UsageError(f"{what} on rank {ctx.rank}: the other ranks did not call it within "
                                 f"{timeout:.0f} s; {RULE}")
            polls += 1
            if polls > _SPIN_POLLS:
                time.sleep(min(0.02, 0.0001 * 2 ** (polls - _SPIN_POLLS)))
            arrived = store.add(key, 0)
    except dist.DistError as err:  # the store is gone: the job is ending
        raise DisttrainError(f"{what} on rank {ctx.rank}: lost the job's store while waiting for the "
                             "other ranks (another rank ended)") from err


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a group set up without a store
        return None


def _reduce(value: Value, op: dist.ReduceOp, *, mean: bool = False, what: str = "reduce",
            check_in: bool = False) -> Value:
    ctx = context()
    # reduce_* run every step in many loops: the source check only (a dictionary lookup per
    # frame once a call site is known); the store check's round trips are for the reads
    # made once an epoch (MeanMeter.avg) and barrier().
    every_rank(ctx, what, check_in=check_in)
    is_tensor = isinstance(value, torch.Tensor)
    if is_tensor:
        # A detached copy on the context's device: all_reduce works in place and must not
        # touch the caller's tensor or its autograd graph, and NCCL only reduces GPU memory.
        work = value.detach().to(ctx.device, copy=True)
    elif isinstance(value, Number) and not isinstance(value, complex):
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        work = torch.tensor(value, dtype=dtype, device=ctx.device)
    else:
        raise TypeError(f"can only reduce a tensor or a number, not {type(value).__name__}")
    if mean and not (work.is_floating_point() or work.is_complex()):
        work = work.to(torch.get_default_dtype() if is_tensor else torch.float64)
    if ctx.distributed:
        dist.all_reduce(work, op=op)
        if mean:
            work /= ctx.world_size
    return work.to(value.device) if is_tensor else work.item()


def reduce_sum(value: Value) -> Value:
    """The sum of ``value`` over all ranks (a tensor or a number, returned as the same).

    A collective: every rank must call it. Tensors come back detached, on their device.
    """
    return _reduce(value, dist.ReduceOp.SUM, what="reduce_sum()")


def reduce_mean(value: Value) -> Value:
    """The mean of ``value`` over ranks, each rank weighing the same.

    For a mean over samples when ranks hold different numbers of them, use
    :class:`MeanMeter`. Integers come back as floats.
    """
    return _reduce(value, dist.ReduceOp.SUM, mean=True, what="reduce_mean()")


def reduce_max(value: Value) -> Value:
    """The largest ``value`` over all ranks (e.g. the slowest rank's step time)."""
    return _reduce(value, dist.ReduceOp.MAX, what="reduce_max()")


class MeanMeter:
    """A running mean over samples, local as it goes and global when read with ``.avg``.

    ``update(batch_mean, n=batch_size)`` per batch; ``.sum`` and ``.count`` are this rank's,
    ``.local_avg`` their mean. ``.avg`` is global sum / global count, so ranks with more
    samples weigh more, as they should (a mean of per-rank means would not). Reading
    ``.avg`` is a collective: read it on every rank (``loss = meter.avg``), then use the
    value where you like; read inside ``if ctx.is_main:`` it is refused at once.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def update(self, value: torch.Tensor | float, n: int = 1) -> None:
        """Add ``n`` samples whose mean is ``value``."""
        if isinstance(value, torch.Tensor):
            value = value.detach().item()
        self.sum += float(value) * n
        self.count += n

    @property
    def local_avg(self) -> float:
        """This rank's mean; NaN before any update."""
        return self.sum / self.count if self.count else math.nan

    @property
    def avg(self) -> float:
        """The mean over every rank's samples; NaN if there are none. A collective."""
        totals = _reduce(torch.tensor([self.sum, float(self.count)], dtype=torch.float64),
                         dist.ReduceOp.SUM, what="MeanMeter.avg", check_in=True)
        total, count = totals.tolist()
        return total / count if count else math.nan

    def __repr__(self) -> str:
        return f"MeanMeter(sum={self.sum!r}, count={self.count!r})"


AverageMeter = MeanMeter  # the name the ImageNet example made familiar


def topk_correct(
    output: torch.Tensor, target: torch.Tensor, topk: Sequence[int] = (1,)
) -> list[int]:
    """For each k in ``topk``, how many rows of ``output`` have ``target`` in their top k.

    Counts, not fractions, so that they can be summed over batches and ranks exactly.
    """
    if output.dim() != 2:
        raise ValueError(f"output must be (batch, classes), got shape {tuple(output.shape)}")
    classes = output.size(1)
    if not topk or min(topk) < 1 or max(topk) > classes:
        raise ValueError(f"topk={tuple(topk)}: each k must be between 1 and {classes} (classes)")
    with torch.no_grad():
        _, predicted = output.topk(max(topk), dim=1)
        hits = predicted.eq(target.reshape(-1, 1))
        return [int(hits[:, :k].any(dim=1).sum()) for k in topk]


def accuracy(
    output: torch.Tensor, target: torch.Tensor, topk: Sequence[int] = (1,)
) -> list[float]:
    """This rank's top-k accuracies for one batch, as fractions in [0, 1] (NaN if empty).

    For an accuracy over a whole evaluation set across ranks, sum :func:`topk_correct`
    and the sample counts with :func:`reduce_sum` (or feed a :class:`MeanMeter`).
    """
    total = target.numel()
    return [c / total if total else math.nan for c in topk_correct(output, target, topk)]


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only, flushed so that launcher logs interleave in order."""
    if current_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def barrier() -> None:
    """Wait until every rank gets here; nothing to wait for in a world of one."""
    ctx = context()
    # Not judged by its source: rank 0 working while the others wait at one barrier, then
    # joining them at another, is a barrier's classic use.
    every_rank(ctx, "barrier()", check_source=False)
    if ctx.distributed:
        if ctx.dist_backend == "nccl":
            dist.barrier(device_ids=ddp_device_ids(ctx.device))
        else:
            dist.barrier()
