"""Writing one checkpoint, the same way for every strategy: rank 0 writes its file (and
the ranks' own values) into a temporary directory, every rank writes its shards there when
the strategy shards, every file's digest reaches rank 0, and rank 0 writes the marker last
and renames (:mod:`disttrain.checkpoint_layout`).

Every failure ends the same way on every rank: one :class:`DisttrainError` whose message
is one line (torch's multi-line errors are cut to their telling line), and the temporary
directory gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint_layout import (
    SHARDED_DIR,
    STATE_FILE,
    CheckpointLayout,
    FileDigest,
    begin,
    discard,
    files_under,
    prune,
    publish,
    sync_and_digest,
    sync_dir,
    write_durably,
)
from ..errors import DisttrainError
from .context import Context
from .strategies import Strategy
from .torch_errors import FAILURES, first_line, os_error


def save(layout: CheckpointLayout, step: int, keep_last: int | None, plain: dict[str, Any],
         shards: dict[str, Any], rank_states: list[dict] | None, strategy: Strategy, ctx: Context, *,
         asynchronous: bool) -> Path | None:
    """Write the checkpoint of ``step``: ``plain`` into rank 0's file, ``shards`` through the
    strategy; returns its path on rank 0 (None elsewhere). A collective."""
    meta = {"world_size": ctx.world_size, "time": time.time(), "torch": torch.__version__,
            "strategy": strategy.checkpoint_format, "sharded": sorted(shards)}
    temp, digests, failure = None, {}, None
    if ctx.is_main:
        try:
            temp = begin(layout, step)
            payload = {"step": step, **{name: strategy.state_dict(v) for name, v in plain.items()}}
            digests = _write_plain(layout, temp, payload, rank_states)
        except Exception as err:  # told to every rank below, then raised everywhere
            discard(temp)
            temp, failure = None, err
    # The broadcast is also the barrier: no rank goes on before rank 0's part is written.
    told = from_main(ctx, (None if temp is None else str(temp), describe(layout.root, failure)))
    if told[1] is not None:
        fail(ctx, layout.root, told[1], failure)
    temp = Path(told[0])

    def finish(shard_digests: dict[str, FileDigest]) -> Path | None:
        if not ctx.is_main:
            return None
        final = publish(layout, step, temp, {**digests, **shard_digests}, meta)
        prune(layout, keep_last)
        return final

    if not shards:
        return _finish_on_main(ctx, layout.root, lambda: finish({}), temp)
    target = temp / SHARDED_DIR
    if asynchronous:
        group = async_group(ctx)
        future = strategy.write_shards_async(shards, target, group)
        ctx.runtime.pending_save = PendingSave(
            ctx, future, lambda written: gather_shard_digests(ctx, target, written, group), finish,
            abandon=lambda: discard(temp), describe=lambda err: describe(layout.root, err))
        return layout.step_dir(step) if ctx.is_main else None
    written = None
    try:
        strategy.write_shards(shards, target)  # raises on every rank when any rank failed
    except FAILURES as err:
        written = err
    shard_digests = gather_shard_digests(ctx, target, written, group=None)
    if written is not None:  # every rank knows: DCP raised everywhere
        if ctx.is_main:
            discard(temp)
        raise DisttrainError(describe(layout.root, written)) from written

    def finish_shards() -> Path | None:
        if isinstance(shard_digests, str):
            raise DisttrainError(shard_digests)
        return finish(shard_digests)

    return _finish_on_main(ctx, layout.root, finish_shards, temp)


def _write_plain(layout: CheckpointLayout, directory: Path, payload: dict,
                 rank_states: list[dict] | None) -> dict[str, FileDigest]:
    digests = {STATE_FILE: write_durably(directory / STATE_FILE, lambda f: torch.save(payload, f))}
    for rank, values in enumerate(rank_states or ()):
        name = layout.rank_file(rank)
        digests[name] = write_durably(directory / name, lambda f, v=values: torch.save(v, f))
    return digests


def _finish_on_main(ctx: Context, root: Path, finish: Any, temp: Path) -> Path | None:
    """Rank 0 publishes (``finish()``: marker, rename, prune); every rank learns how it went."""
    path, failure = None, None
    if ctx.is_main:
        try:
            path = finish()
        except Exception as err:
            discard(temp)
            failure = err
    error = from_main(ctx, describe(root, failure))
    if error is not None:
        fail(ctx, root, error, failure)
    return path


def describe(root: Path, failure: BaseException | None) -> str | None:
    """The one line that says why writing a checkpoint in ``root`` failed (None: it did not)."""
    if failure is None:
        return None
    if isinstance(failure, DisttrainError):
        return str(failure)
    # torch.save turns a full disk into "RuntimeError ... unexpected pos", DCP into a
    # CheckpointException of every rank's traceback: the OSError behind is what to tell.
    error = os_error(failure)
    if error is None:
        return f"cannot write a checkpoint in {root}: {type(failure).__name__}: {first_line(failure)}"
    if root.exists() and not root.is_dir():
        return f"cannot write checkpoint directory {root}: it is a file"
    where = f" ({error.filename})" if error.filename and Path(error.filename) != root else ""
    return f"cannot write checkpoint directory {root}{where}: {error.strerror or first_line(error)}"


def fail(ctx: Context, root: Path, error: str, failure: BaseException | None) -> None:
    """Raise rank 0's failure on every rank: as it is on rank 0 when it is not about the
    files (a ``state_dict()`` that raised: its traceback helps), as one line elsewhere."""
    if failure is not None and os_error(failure) is None:
        raise failure
    if ctx.is_main:
        raise DisttrainError(error) from failure
    raise DisttrainError(f"rank 0 failed to save a checkpoint: {error}")


def from_main(ctx: Context, value: Any) -> Any:
    """Rank 0's ``value`` (any picklable value) on every rank; also a barrier."""
    if not ctx.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- the shards' digests ----------------------------------------------------------------

def own_shard_files(directory: Any, rank: int, list_files: Callable[[Any], list[str]] = files_under) -> list[str]:
    """The files of ``directory`` this rank wrote: torch.distributed.checkpoint names a
    rank's files ``__<rank>_<n>.distcp``. Rank 0 digests whatever no rank claimed
    (``.metadata``, or every file should DCP ever name them otherwise), so a change of
    naming costs time, never a file without a digest."""
    prefix = f"__{rank}_"
    return [name for name in list_files(directory) if name.startswith(prefix)]


def gather_shard_digests(ctx: Context, directory: Any, written: BaseException | None,
                         group: Any, *, list_files: Callable[[Any], list[str]] = files_under,
                         digest: Callable[[Any], FileDigest] = sync_and_digest,
                         settle: Callable[[Any, dict[str, FileDigest]], None] = lambda d, _: sync_dir(d),
                         ) -> dict[str, FileDigest] | str:
    """Every shard file's digest on rank 0, keyed ``sharded/<name>`` (``{}`` elsewhere), or
    the one line saying why not. A collective on ``group``; each rank fsyncs and digests its
    own files (DCP wrote them without fsync), which its page cache still holds. On a store,
    ``list_files``/``digest`` read the objects back from it instead, and ``settle`` checks
    them against what DCP recorded writing."""
    mine: dict[str, FileDigest] | str = {}
    if written is None:
        try:
            mine = {name: digest(directory / name) for name in own_shard_files(directory, ctx.rank, list_files)}
        except OSError as err:
            mine = f"rank {ctx.rank} cannot read back its shard: {err.strerror or err} ({err.filename})"
    everyone: list[Any] = [mine]
    if ctx.distributed:
        everyone = [None] * ctx.world_size if ctx.is_main else None
        dist.gather_object(mine, everyone, dst=0, group=group)
    if not ctx.is_main or written is not None:
        return {}
    problems = [part for part in everyone if isinstance(part, str)]
    if problems:
        return problems[0]
    merged: dict[str, FileDigest] = {}
    for part in everyone:
        merged.update(part)
    try:
        for name in list_files(directory):
            if name not in merged:
                merged[name] = digest(directory / name)
        settle(directory, merged)
    except OSError as err:
        return f"cannot read back the shards in {directory}: {err.strerror or err}"
    return {f"{SHARDED_DIR}/{name}": digest for name, digest in merged.items()}


# -- asynchronous shards ----------------------------------------------------------------

class PendingSave:
    """A checkpoint being written in the background: DCP's future (None: nothing sharded),
    then on every rank a thread that digests the rank's own shards and sends them to rank 0
    (``gather(written)``), where ``finish(digests)`` writes the marker -- as soon as the files
    are, so that a run killed before its next save keeps this checkpoint. Its own gloo group,
    so that none of this meets the training's collectives. On failure rank 0 ``abandon()``s
    what was written; ``describe(err)`` is the one line that says why."""

    def __init__(self, ctx: Context, future: Any, gather: Callable[[BaseException | None], Any],
                 finish: Callable[[dict], Any], *, abandon: Callable[[], None],
                 describe: Callable[[BaseException], str | None]) -> None:
        self._future = future
        self._error: str | None = None
        self._thread = threading.Thread(target=self._commit, args=(ctx, gather, finish, abandon, describe),
                                        daemon=True, name="disttrain-checkpoint-commit")
        self._thread.start()

    def _commit(self, ctx: Context, gather: Any, finish: Any, abandon: Any, describe: Any) -> None:
        written = None
        try:
            if self._future is not None:
                self._future.result()
        except BaseException as err:  # DCP raises on every rank when any rank failed
            written = err
        try:
            digests = gather(written)
            if written is not None:
                self._error = describe(written)
            elif isinstance(digests, str):
                self._error = digests
            elif ctx.is_main:
                finish(digests)
        except Exception as err:
            self._error = describe(err)
        if self._error is not None and ctx.is_main:
            abandon()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise DisttrainError(f"the asynchronous checkpoint was not written: {self._error}")


def async_group(ctx: Context) -> Any:
    """A gloo group of its own for the background writes' collectives, so that they never
    interleave with the training's on the default group."""
    if not ctx.distributed:
        return None
    if ctx.runtime.async_group is None:
        ctx.runtime.async_group = dist.new_group(backend="gloo")
    return ctx.runtime.async_group
