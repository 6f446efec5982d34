"""Checkpoints that a crash cannot corrupt, that prove they are whole, and that every rank
can resume from.

``disttrain.checkpoint.save(dir, step=..., model=model, optimizer=opt, epoch=e)`` on every
rank (rank 0 writes), then at start-up ``disttrain.checkpoint.load_latest(dir,
model=model, optimizer=opt)``. The layout is described in :mod:`disttrain.checkpoint_layout`;
writing is :mod:`.checkpoint_write`, reading :mod:`.checkpoint_read`; what differs between
DDP and FSDP, the model's strategy (:mod:`.strategies`) says. ``dir`` may be an fsspec URL
(``s3://bucket/run``): the same layout on the store (:mod:`disttrain.checkpoint_url`), written
by :mod:`.checkpoint_write_remote` and read by the same reader.
"""

from __future__ import annotations

from collections import OrderedDict
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint_check import refuse_process_store
from ..checkpoint_layout import CheckpointLayout, write_durably
from ..checkpoint_url import RemoteLayout, is_url, open_url
from ..errors import DisttrainError, UsageError
from ..workerenv import WorkerEnv
from . import checkpoint_read, checkpoint_write, checkpoint_write_remote, strategies
from .context import Context, context, current

__all__ = ["save", "load_latest", "latest", "export", "wait", "CheckpointLayout"]

# What torch.load(weights_only=True) accepts back, so save() can refuse the rest up front.
# Exact types: a subclass (an IntEnum, a named tuple) is pickled by class name and refused.
_PLAIN_LEAVES = {type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Parameter,
                 torch.Size, torch.dtype, torch.device}
_PLAIN_CONTAINERS = {dict, OrderedDict, list, tuple}


def save(directory: str | PathLike[str], *, step: int, keep_last: int | None = 3,
         rank_state: dict[str, Any] | None = None, asynchronous: bool = False,
         **state: Any) -> Path | str | None:
    """Save ``state`` as the checkpoint for ``step``; call it on every rank.

    Objects with ``state_dict()`` (model -- DDP or compiled --, optimizer, scheduler) are
    saved through it; plain values (numbers, strings, tensors, and dicts/lists/tuples of
    them) as they are. Rank 0 writes into a temporary directory and renames it to
    ``step_<8 digits>`` only when complete -- its marker, written last, holds every file's
    SHA-256 -- then keeps the newest ``keep_last`` (None keeps all). The other ranks wait,
    so anyone may load right after. Returns the checkpoint's path on rank 0, None on the
    others.

    ``rank_state`` holds what differs between ranks (their RNG states): plain values,
    passed by every rank or by none. Rank 0 gathers them and writes one file per rank
    into the same directory, so they are committed with the rest or not at all.

    A model prepared with ``strategy="fsdp"`` (and the optimizers saved with it) is saved
    through ``torch.distributed.checkpoint``: every rank writes its own shard, and a
    checkpoint resumes on any number of ranks. ``asynchronous=True`` (sharded models only)
    returns once the state is copied, and the files are written while training goes on;
    the checkpoint counts (gets its marker) when all are written. The next save, and the
    end of the process, wait for it; so does :func:`wait`.

    ``directory`` may be an fsspec URL (``s3://bucket/run``, ``gs://``, ``file://``,
    ``memory://``): the same checkpoint, written to the store under its final names, each
    object read back and checked before the marker is written last (:mod:`disttrain.checkpoint_url`);
    the URL is returned. There ``asynchronous=True`` works for every model: the call returns
    once the state is copied into memory, and the upload goes on meanwhile.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"checkpoint.save(step={step!r}): step must be an integer >= 0")
    if keep_last is not None and keep_last < 1:
        raise UsageError(
            f"checkpoint.save(keep_last={keep_last}): keep at least 1, or None for all")
    ctx = context()
    strategy = strategies.for_checkpoint(state, ctx)
    for name, value in state.items():  # on every rank, so that all raise alike
        _check_saveable(name, value, strategy)
    if rank_state is not None:
        _check_saveable("rank_state", rank_state, strategy, plain_only=True)
    shards = strategy.shard_objects(state)
    layout = _layout(directory)
    remote = isinstance(layout, RemoteLayout)
    if asynchronous and not shards and not remote:
        raise UsageError("checkpoint.save(asynchronous=True) writes sharded models "
                         "(prepare(..., strategy='fsdp')) or checkpoints at a URL (s3://...); "
                         "drop it for this model and folder")
    rank_states = _gather(ctx, rank_state)
    wait()  # an asynchronous checkpoint still being written comes first
    plain = {name: value for name, value in state.items() if name not in shards}
    write = checkpoint_write_remote.save if remote else checkpoint_write.save
    return write(layout, step, keep_last, plain, shards, rank_states, strategy, ctx,  # type: ignore[arg-type]
                 asynchronous=asynchronous)


def load_latest(directory: str | PathLike[str], *, map_location: Any = None,
                weights_only: bool = True, **objects: Any) -> dict[str, Any] | None:
    """Restore ``objects`` from the newest whole checkpoint; None when there is none.

    Each object passed (``model=model, optimizer=opt``...) gets ``load_state_dict`` with
    what was saved under its name; the return value is everything saved (``step``, the
    plain values, the state dicts) and, when the checkpoint was saved with them,
    ``rank_state``: this rank's own values (None for a rank the saving job did not have).
    Call it on every rank: the ranks check the files against the digests in the marker
    and agree on the checkpoint. A damaged or incomplete newest checkpoint (a file changed,
    cut short or missing) is skipped with a warning naming the file, for the one before;
    when none is whole, :class:`DisttrainError`. ``map_location=None`` loads onto the CPU
    -- ``load_state_dict`` copies onto each object's own device -- so that ranks do not
    all allocate on the GPU rank 0 saved from. ``weights_only=False`` unpickles arbitrary
    objects: only for checkpoints you trust.
    """
    ctx = context()
    wait()  # a checkpoint this process is still writing must not be half-read
    strategy = strategies.for_checkpoint(objects, ctx)
    location = "cpu" if map_location is None else map_location
    return checkpoint_read.load(_layout(directory), objects, strategy, ctx,
                                location=location, weights_only=weights_only)


def holds_sharded(objects: dict[str, Any]) -> bool:
    """Whether saving ``objects`` writes a sharded checkpoint (an FSDP model among them)."""
    return bool(strategies.for_checkpoint(objects, context()).shard_objects(objects))


def latest(directory: str | PathLike[str]) -> Path | str | None:
    """The newest complete checkpoint directory (its URL on a store), or None; loads
    nothing, checks no digest, not a collective."""
    layout = _layout(directory)
    try:
        complete = layout.complete()
    except OSError as err:
        raise DisttrainError(
            f"cannot read checkpoint directory {layout.root}: {err.strerror or err}") from err
    if not complete:
        return None
    return str(complete[-1][1]) if isinstance(layout, RemoteLayout) else complete[-1][1]


def _layout(directory: str | PathLike[str]) -> CheckpointLayout | RemoteLayout:
    """A local folder keeps its own layout (rename-committed); a URL, the store's, retried through
    an outage for ``--checkpoint-retry-s`` (the launcher's ``DISTTRAIN_CHECKPOINT_RETRY_S``)."""
    if not is_url(directory):
        return CheckpointLayout(Path(directory))
    ctx = current()
    if ctx is not None and ctx.world_size > 1:  # one process's memory holds nothing the others can read
        refuse_process_store(str(directory), "checkpoint folder")
    env = ctx.env if ctx is not None else WorkerEnv.from_environ()
    return RemoteLayout.at(str(directory), retry_s=env.checkpoint_retry_s)


def wait() -> None:
    """Wait until an asynchronous checkpoint is written and committed (if one is)."""
    runtime = context().runtime
    pending, runtime.pending_save = runtime.pending_save, None
    if pending is not None:
        pending.wait()


def export(path: str | PathLike[str], model: Any) -> Path | str | None:
    """Write ``model``'s whole state dict to the single file ``path`` (for inference);
    call it on every rank: a sharded model is gathered, rank 0 writes. Returns ``path`` on
    rank 0. The file is written under a temporary name and renamed, so a crash leaves no
    half-written file; ``torch.load(path, weights_only=True)`` reads it back. A URL is
    uploaded whole in one put and read back (an object store shows no half-written object)."""
    ctx = context()
    full = strategies.of(model, ctx).full_model_state(model)
    if is_url(path):
        return _export_remote(str(path), full, ctx)
    target = Path(path)
    error = None
    if ctx.is_main:
        temp = target.with_name(f".{target.name}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_durably(temp, lambda f: torch.save(full, f))
            temp.replace(target)
        except OSError as err:
            temp.unlink(missing_ok=True)
            error = f"cannot write {target}: {err.strerror or err}"
    if ctx.distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise DisttrainError(error)
    return target if ctx.is_main else None


def _export_remote(url: str, full: dict, ctx: Context) -> str | None:
    error = None
    if ctx.is_main:
        target = open_url(url)
        layout = RemoteLayout(target.parent)
        try:
            layout.put(target.parent, target.name, checkpoint_write_remote.to_bytes(full))
        except Exception as err:
            error = f"cannot write {url}: {type(err).__name__}: {err}"
    error = checkpoint_write.from_main(ctx, error)
    if error is not None:
        raise DisttrainError(error)
    return url if ctx.is_main else None


def _check_saveable(name: str, value: Any, strategy: strategies.Strategy, *,
                    plain_only: bool = False) -> None:
    if not plain_only and callable(getattr(strategy.unwrap(value), "state_dict", None)):
        return
    bad = _first_unplain(value)
    if bad is not None:
        raise UsageError(
            f"checkpoint value {name!r} holds a {type(bad).__name__}, which "
            "torch.load(weights_only=True) would refuse: save numbers, strings, tensors and "
            "dicts/lists/tuples of them, or an object with state_dict() "
            "(for argparse arguments: vars(args))"
        )


def _first_unplain(value: Any) -> Any | None:
    if type(value) in _PLAIN_LEAVES:
        return None
    if type(value) not in _PLAIN_CONTAINERS:
        return value
    children = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
    for child in children:
        bad = _first_unplain(child)
        if bad is not None:
            return bad
    return None


def _gather(ctx: Context, rank_state: dict | None) -> list[dict] | None:
    """Every rank's ``rank_state`` on rank 0 (None elsewhere, and when none was given)."""
    if rank_state is None:
        return None
    if not ctx.distributed:
        return [rank_state]
    gathered: list | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(rank_state, gathered, dst=0)
    return gathered
