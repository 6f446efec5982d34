"""Writing one checkpoint to a store (:mod:`disttrain.checkpoint_url`), in the steps of
:mod:`.checkpoint_write`: rank 0 serialises its file and the ranks' own values in memory (the
staging copy: once it is taken, training may change the state), every rank writes its shards
with DCP's fsspec storage when the strategy shards, every object is read back from the store
and checked -- rank 0's against the digests of the bytes it sent, each rank's shards against
the extents DCP's ``.metadata`` records -- and only then rank 0 writes the marker and prunes.

Asynchronous saves (any model, here: uploading is the slow part) return after the staging copy;
the uploads, the read-back and the marker run on a thread (:class:`.checkpoint_write.PendingSave`).
Every failure ends as in :mod:`.checkpoint_write`: one line on every rank, the step's objects gone.
"""

from __future__ import annotations

import io
import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..checkpoint_layout import SHARDED_DIR, STATE_FILE, FileDigest
from ..checkpoint_url import RemoteLayout, RemotePath
from ..errors import DisttrainError
from .checkpoint_stage import CudaSideStream, HostBuffers, Staged, stage, this_process
from .checkpoint_write import PendingSave, async_group, fail, from_main, gather_shard_digests
from .context import Context
from .strategies import Strategy
from .strategies.dcp import extents
from .torch_errors import FAILURES, first_line, os_error


def save(layout: RemoteLayout, step: int, keep_last: int | None, plain: dict[str, Any],
         shards: dict[str, Any], rank_states: list[dict] | None, strategy: Strategy, ctx: Context, *,
         asynchronous: bool) -> str | None:
    """Write the checkpoint of ``step`` to the store; its URL on rank 0 (None elsewhere). A collective."""
    meta = {"world_size": ctx.world_size, "time": time.time(), "torch": torch.__version__,
            "strategy": strategy.checkpoint_format, "sharded": sorted(shards)}
    blobs: dict[str, bytes] = {}
    deferred: Staged | None = None  # rank 0's state, staged on the GPU's side stream: serialised on the thread
    failure = None
    if ctx.is_main:
        try:
            payload = {"step": step, **{name: strategy.state_dict(v) for name, v in plain.items()}}
            buffers = kept_buffers(ctx)
            if asynchronous and buffers is not None:
                deferred = stage(payload, buffers, side_stream(), copy_host=True)
                blobs = _serialise(layout, None, rank_states, ctx)
            else:
                blobs = _serialise(layout, payload, rank_states, ctx)
            layout.begin(step)  # a step saved again, or an upload cut short: marker first
        except Exception as err:
            if deferred is not None:
                deferred.release()
            failure = err
    error = from_main(ctx, describe(layout, failure))  # also the barrier before the shards
    if error is not None:
        fail(ctx, layout.root, error, failure)
    folder = layout.step_dir(step)
    target = folder / SHARDED_DIR

    def gather(written: BaseException | None, group: Any) -> dict[str, FileDigest] | str:
        if not shards:
            return {}
        return gather_shard_digests(ctx, target, written, group, list_files=layout.files_under,
                                    digest=layout.digest, settle=_check_extents)

    def finish(shard_digests: dict[str, FileDigest]) -> str | None:
        if not ctx.is_main:
            return None
        if deferred is not None:
            blobs[STATE_FILE] = serialise_staged(deferred)
        digests = {name: layout.put(folder, name, data) for name, data in blobs.items()}
        layout.publish(step, {**digests, **shard_digests}, meta)
        layout.prune(keep_last)
        return str(folder)

    if asynchronous:
        group = async_group(ctx)
        future = strategy.write_shards_async(shards, target, group) if shards else None
        ctx.runtime.pending_save = PendingSave(
            ctx, future, lambda written: gather(written, group), finish,
            abandon=lambda: abandon(deferred, layout, folder), describe=lambda err: describe(layout, err))
        return str(folder) if ctx.is_main else None
    written = None
    if shards:
        try:
            strategy.write_shards(shards, target)  # raises on every rank when any rank failed
        except FAILURES as err:
            written = err
    shard_digests = gather(written, None)
    if written is not None:
        if ctx.is_main:
            discard(layout, folder)
        raise DisttrainError(describe(layout, written)) from written
    path, failure = None, None
    if ctx.is_main:
        try:
            if isinstance(shard_digests, str):
                raise DisttrainError(shard_digests)
            path = finish(shard_digests)
        except Exception as err:
            discard(layout, folder)
            failure = err
    error = from_main(ctx, describe(layout, failure))
    if error is not None:
        fail(ctx, layout.root, error, failure)
    return path


def abandon(deferred: Staged | None, layout: RemoteLayout, folder: RemotePath) -> None:
    """A failed asynchronous save: its buffers back (the next save leases them), its objects gone."""
    if deferred is not None:
        deferred.release()
    discard(layout, folder)


def discard(layout: RemoteLayout, folder: RemotePath) -> None:
    """A failed save's objects removed, when the store lets them be: one it cannot reach keeps a folder
    without its marker, which no reader takes and the next writer of the step clears."""
    try:
        layout.discard(folder)
    except OSError:
        pass


def serialise_staged(staged: Staged) -> bytes:
    """A staged state's bytes, once its copies ran; its buffers go back either way."""
    out = io.BytesIO()
    try:
        torch.save(staged.wait(), out)
    finally:
        staged.release()
    return out.getvalue()


def _serialise(layout: RemoteLayout, payload: dict | None, rank_states: list[dict] | None,
               ctx: Context) -> dict[str, bytes]:
    """Rank 0's objects as the bytes to upload: ``torch.save`` into memory is the staging copy; CUDA
    state goes through host buffers kept between saves when this process stages that way. ``payload``
    None: staged already, serialised later."""
    blobs = {} if payload is None else {STATE_FILE: to_bytes(payload, kept_buffers(ctx))}
    for rank, values in enumerate(rank_states or ()):
        blobs[layout.rank_file(rank)] = to_bytes(values)
    return blobs


def to_bytes(value: Any, buffers: HostBuffers | None = None) -> bytes:
    """``value`` as ``torch.save`` writes it; CUDA tensors staged in ``buffers`` (kept between saves,
    copied on a side stream) when given, else each copied into fresh pinned memory."""
    if buffers is None:
        out = io.BytesIO()
        torch.save(on_host(value), out)
        return out.getvalue()
    return serialise_staged(stage(value, buffers, side_stream()))


def kept_buffers(ctx: Context) -> HostBuffers | None:
    """The host buffers rank 0's file is staged in, kept for the process (None: CPU state, staged as it is)."""
    runtime = ctx.runtime
    if getattr(runtime, "staging", None) is None:
        runtime.staging = this_process()
    if runtime.staging.host != "pinned-kept":
        return None
    if getattr(runtime, "host_buffers", None) is None:
        runtime.host_buffers = HostBuffers()
    return runtime.host_buffers


_SIDE: list[CudaSideStream] = []


def side_stream() -> CudaSideStream:
    """One side stream for the process's checkpoint copies (made on first use, on the current device)."""
    if not _SIDE:
        _SIDE.append(CudaSideStream())
    return _SIDE[0]


def on_host(value: Any) -> Any:
    """``value`` with each CUDA tensor copied into pinned host memory, all copies queued before one
    synchronize: ``torch.save`` would copy storage by storage through pageable memory, and the step
    waits for this copy. Loading maps to the CPU anyway, so the file is the same; CPU tensors are
    kept as they are (the same objects)."""
    copies = []

    def stage(tensor: Any) -> Any:
        if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.layout == torch.strided):
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copies.append(host)
        return host

    staged = tree_map(stage, value)
    if copies:
        torch.cuda.synchronize()
    return staged


def _check_extents(directory: RemotePath, found: dict[str, FileDigest]) -> None:
    """Every file DCP's ``.metadata`` names is on the store and holds at least the bytes DCP
    recorded writing into it; an ``OSError`` naming the first that does not."""
    for name, needed in sorted(extents(directory).items()):
        if name not in found:
            raise OSError(f"{name} is missing from the store")
        if found[name]["bytes"] < needed:
            raise OSError(f"{name} holds {found[name]['bytes']} bytes on the store, DCP wrote {needed}")


def describe(layout: RemoteLayout, failure: BaseException | None) -> str | None:
    """The one line that says why writing a checkpoint to the store failed (None: it did not)."""
    if failure is None:
        return None
    if isinstance(failure, DisttrainError):
        return str(failure)
    inner = os_error(failure) or failure
    return f"cannot write a checkpoint to {layout.root}: {type(inner).__name__}: {first_line(inner)}"

