"""Checkpoints that a crash cannot corrupt and that every rank can resume from.

``disttrain.checkpoint.save(dir, step=..., model=model, optimizer=opt, epoch=e)`` on every
rank (rank 0 writes), then at start-up ``disttrain.checkpoint.load_latest(dir,
model=model, optimizer=opt)``. The layout is described in :mod:`.checkpoint_layout`.
"""

from __future__ import annotations

import pickle
import re
import threading
import time
import warnings
from collections import OrderedDict
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DisttrainError, UsageError
from . import sharded
from .checkpoint_layout import (
    MARKER,
    SHARDED_DIR,
    STATE_FILE,
    CheckpointLayout,
    begin,
    commit,
    discard,
    listed_files,
    prune,
    publish,
    read_marker,
    write_durably,
)
from .context import Context, context
from .data import unwrap

__all__ = ["save", "load_latest", "latest", "export", "wait", "CheckpointLayout"]

# What torch.load(weights_only=True) accepts back, so save() can refuse the rest up front.
# Exact types: a subclass (an IntEnum, a named tuple) is pickled by class name and refused.
_PLAIN_LEAVES = {type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Parameter,
                 torch.Size, torch.dtype, torch.device}
_PLAIN_CONTAINERS = {dict, OrderedDict, list, tuple}


def save(directory: str | PathLike[str], *, step: int, keep_last: int | None = 3,
         rank_state: dict[str, Any] | None = None, asynchronous: bool = False,
         **state: Any) -> Path | None:
    """Save ``state`` as the checkpoint for ``step``; call it on every rank.

    Objects with ``state_dict()`` (model -- DDP or compiled --, optimizer, scheduler) are
    saved through it; plain values (numbers, strings, tensors, and dicts/lists/tuples of
    them) as they are. Rank 0 writes into a temporary directory and renames it to
    ``step_<8 digits>`` only when complete, then keeps the newest ``keep_last`` (None keeps
    all). The other ranks wait, so anyone may load right after. Returns the checkpoint's
    path on rank 0, None on the others.

    ``rank_state`` holds what differs between ranks (their RNG states): plain values,
    passed by every rank or by none. Rank 0 gathers them and writes one file per rank
    into the same directory, so they are committed with the rest or not at all.

    A model prepared with ``strategy="fsdp"`` (and the optimizers saved with it) is saved
    through ``torch.distributed.checkpoint``: every rank writes its own shard, and a
    checkpoint resumes on any number of ranks. ``asynchronous=True`` (sharded models only)
    returns once the state is copied, and the files are written while training goes on;
    the checkpoint counts (gets its marker) when all are written. The next save, and the
    end of the process, wait for it; so does :func:`wait`.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"checkpoint.save(step={step!r}): step must be an integer >= 0")
    if keep_last is not None and keep_last < 1:
        raise UsageError(
            f"checkpoint.save(keep_last={keep_last}): keep at least 1, or None for all")
    ctx = context()
    layout = CheckpointLayout(Path(directory))
    for name, value in state.items():  # on every rank, so that all raise alike
        _check_saveable(name, value)
    if rank_state is not None:
        _check_saveable("rank_state", rank_state, plain_only=True)
    rank_states = _gather(ctx, rank_state)
    wait()  # an asynchronous checkpoint still being written comes first
    by_shard = sharded.split(state, ctx.runtime)
    if by_shard:
        return _save_sharded(layout, step, keep_last, state, by_shard, rank_states, ctx,
                             asynchronous=asynchronous)
    if asynchronous:
        raise UsageError("checkpoint.save(asynchronous=True) writes sharded models only "
                         "(prepare(..., strategy='fsdp')); drop it for this model")
    path, error, failure = None, None, None
    if ctx.is_main:
        try:
            payload = {"step": step, **{name: _saveable(v) for name, v in state.items()}}
            path = _write(layout, step, payload, rank_states, ctx)
            prune(layout, keep_last)
        except Exception as err:  # re-raised below, once the other ranks know
            # torch.save turns a full disk into "RuntimeError ... unexpected pos": the OSError
            # behind it (ENOSPC) is what the user needs to hear about.
            os_error = _os_error(err)
            if os_error is not None:
                error, failure = _write_error(layout.root, os_error), os_error
            else:
                error, failure = f"{type(err).__name__}: {err}", err
    # The broadcast is also the barrier: no rank returns before the checkpoint exists.
    error = _from_main(ctx, error)
    if isinstance(failure, OSError):
        raise DisttrainError(error) from failure
    if failure is not None:
        raise failure
    if error is not None:
        raise DisttrainError(f"rank 0 failed to save a checkpoint in {layout.root}: {error}")
    return path


def load_latest(directory: str | PathLike[str], *, map_location: Any = None,
                weights_only: bool = True, **objects: Any) -> dict[str, Any] | None:
    """Restore ``objects`` from the newest complete checkpoint; None when there is none.

    Each object passed (``model=model, optimizer=opt``...) gets ``load_state_dict`` with
    what was saved under its name; the return value is everything saved (``step``, the
    plain values, the state dicts) and, when the checkpoint was saved with them,
    ``rank_state``: this rank's own values (None for a rank the saving job did not have).
    Call it on every rank: every rank reads the files, and all agree on the step. A newest checkpoint that fails to load (truncated, corrupt) is
    skipped with a warning for the one before it. ``map_location=None`` loads onto the
    CPU -- ``load_state_dict`` copies onto each object's own device -- so that ranks do not
    all allocate on the GPU rank 0 saved from. ``weights_only=False`` unpickles arbitrary
    objects: only for checkpoints you trust.
    """
    ctx = context()
    layout = CheckpointLayout(Path(directory))
    location = "cpu" if map_location is None else map_location
    wait()  # a checkpoint this process is still writing must not be half-read
    by_shard = sharded.split(objects, ctx.runtime)
    candidates = _complete(layout)
    step, state = _load_newest(candidates, ctx.rank, location, weights_only)
    agreed = _agree_on_step(ctx, -1 if step is None else step, layout.root)
    if agreed is None:
        return None
    if agreed != step:
        warnings.warn(f"rank {ctx.rank}: loading step {agreed}, the newest every rank could read",
                      stacklevel=2)
        path = dict((s, p) for s, p in candidates).get(agreed)
        state = _load(path, ctx.rank, location, weights_only) if path else None
        if state is None:
            raise DisttrainError(
                f"rank {ctx.rank} cannot read checkpoint step {agreed} in {layout.root}")
    path = layout.step_dir(agreed)
    _check_strategy(path, "fsdp" if by_shard else "ddp")
    for name, obj in objects.items():
        if name not in by_shard:
            _restore(name, obj, state, path)
    if by_shard:
        sharded.read(by_shard, path / SHARDED_DIR)
    return state


def _check_strategy(path: Path, expected: str) -> None:
    """A sharded checkpoint holds no model in ``state.pt``, an unsharded one no shards:
    loading across strategies would fail deep in torch, so say it plainly."""
    try:
        written = read_marker(path).get("strategy", "ddp")
    except (OSError, ValueError) as err:
        raise DisttrainError(f"cannot read checkpoint {path}/{MARKER}: {err}") from err
    if written != expected:
        raise UsageError(
            f"checkpoint {path} was written with strategy={written!r} but this run prepares "
            f"the model with strategy={expected!r}: pass strategy={written!r} to prepare() "
            "to resume it, or use a new checkpoint directory")


def holds_sharded(objects: dict[str, Any]) -> bool:
    """Whether saving ``objects`` writes a sharded checkpoint (an FSDP model among them)."""
    return bool(sharded.split(objects, context().runtime))


def latest(directory: str | PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory, or None; loads nothing, not a collective."""
    complete = _complete(CheckpointLayout(Path(directory)))
    return complete[-1][1] if complete else None


def _complete(layout: CheckpointLayout) -> list[tuple[int, Path]]:
    try:
        return layout.complete()
    except OSError as err:
        raise DisttrainError(
            f"cannot read checkpoint directory {layout.root}: {err.strerror or err}") from err


def _saveable(value: Any) -> Any:
    target = unwrap(value)
    return target.state_dict() if callable(getattr(target, "state_dict", None)) else value


def _check_saveable(name: str, value: Any, *, plain_only: bool = False) -> None:
    if not plain_only and callable(getattr(unwrap(value), "state_dict", None)):
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


def _write(layout: CheckpointLayout, step: int, payload: dict, rank_states: list[dict] | None,
           ctx: Context) -> Path:
    def write_files(directory: Path) -> list[str]:
        return _write_plain(layout, directory, payload, rank_states)

    return commit(layout, step, write_files, _meta(ctx, "ddp", []))


def _meta(ctx: Context, strategy: str, sharded_names: list[str]) -> dict:
    return {"world_size": ctx.world_size, "time": time.time(), "torch": torch.__version__,
            "strategy": strategy, "sharded": sharded_names}


def _write_plain(layout: CheckpointLayout, directory: Path, payload: dict,
                 rank_states: list[dict] | None) -> list[str]:
    write_durably(directory / STATE_FILE, lambda f: torch.save(payload, f))
    files = [STATE_FILE]
    for rank, values in enumerate(rank_states or ()):
        name = layout.rank_file(rank)
        write_durably(directory / name, lambda f, v=values: torch.save(v, f))
        files.append(name)
    return files


def _save_sharded(layout: CheckpointLayout, step: int, keep_last: int | None,
                  state: dict[str, Any], by_shard: dict[str, Any],
                  rank_states: list[dict] | None, ctx: Context, *,
                  asynchronous: bool) -> Path | None:
    """Every rank writes its shards into rank 0's temporary directory; rank 0 adds the
    plain values, then the marker, then renames -- after every rank's write succeeded."""
    temp, error = None, None
    if ctx.is_main:
        try:
            temp = begin(layout, step)
            plain = {name: v for name, v in state.items() if name not in by_shard}
            payload = {"step": step, **{name: _saveable(v) for name, v in plain.items()}}
            files = _write_plain(layout, temp, payload, rank_states)
        except OSError as err:
            error = _write_error(layout.root, err)
            if temp is not None:
                discard(temp)
    box = _from_main(ctx, (None if temp is None else str(temp), error))
    if box[1] is not None:
        raise DisttrainError(box[1])
    target = Path(box[0]) / SHARDED_DIR
    meta = _meta(ctx, "fsdp", sorted(by_shard))

    def finish() -> Path | None:
        if not ctx.is_main:
            return None
        final = publish(layout, step, Path(box[0]), [*files, SHARDED_DIR], meta)
        prune(layout, keep_last)
        return final

    if asynchronous:
        group = _async_group(ctx)
        future = sharded.write_async(by_shard, target, group)
        ctx.runtime.pending_save = _PendingSave(future, finish, Path(box[0]), ctx.is_main)
        return layout.step_dir(step) if ctx.is_main else None
    failure = None
    try:
        sharded.write(by_shard, target)  # raises on every rank when any rank failed
    except sharded.FAILURES as err:
        failure = err
    path, error = None, None
    if ctx.is_main and failure is not None:
        discard(Path(box[0]))
        error = f"cannot write a checkpoint in {layout.root}: {sharded.first_line(failure)}"
    elif ctx.is_main:
        try:
            path = finish()
        except OSError as err:
            error = _write_error(layout.root, err)
    error = _from_main(ctx, error)
    if error is not None:
        raise DisttrainError(error) from failure
    return path


class _PendingSave:
    """An asynchronous sharded checkpoint: DCP's future, and rank 0's commit after it."""

    def __init__(self, future: Any, finish: Any, temp: Path, is_main: bool) -> None:
        self._future = future
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._temp = temp
        # Rank 0 commits as soon as the files are written, not at the next save: a run
        # killed in between keeps this checkpoint.
        if is_main:
            threading.Thread(target=self._commit, args=(finish,), daemon=True,
                             name="disttrain-checkpoint-commit").start()
        else:
            self._done.set()

    def _commit(self, finish: Any) -> None:
        try:
            self._future.result()
            finish()
        except BaseException as err:
            self._error = err
            discard(self._temp)
        finally:
            self._done.set()

    def wait(self) -> None:
        self._future.result()
        self._done.wait()
        if self._error is not None:
            raise DisttrainError(f"the asynchronous checkpoint in {self._temp.parent} was not "
                                 f"written: {self._error}") from self._error


def wait() -> None:
    """Wait until an asynchronous checkpoint is written and committed (if one is)."""
    runtime = context().runtime
    pending, runtime.pending_save = runtime.pending_save, None
    if pending is not None:
        pending.wait()


def _async_group(ctx: Context) -> Any:
    """A gloo group of its own for the background writes' collectives, so that they never
    interleave with the training's on the default group."""
    if not ctx.distributed:
        return None
    if ctx.runtime.async_group is None:
        ctx.runtime.async_group = dist.new_group(backend="gloo")
    return ctx.runtime.async_group


def export(path: str | PathLike[str], model: Any) -> Path | None:
    """Write ``model``'s whole state dict to the single file ``path`` (for inference);
    call it on every rank: a sharded model is gathered, rank 0 writes. Returns ``path`` on
    rank 0. The file is written under a temporary name and renamed, so a crash leaves no
    half-written file; ``torch.load(path, weights_only=True)`` reads it back."""
    ctx = context()
    target = Path(path)
    prepared = ctx.runtime.prepared(model)
    if prepared is not None and prepared.strategy == "fsdp":
        full = sharded.full_model_state(model)
    else:
        full = unwrap(model).state_dict() if ctx.is_main else {}
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
    error = _from_main(ctx, error)
    if error is not None:
        raise DisttrainError(error)
    return target if ctx.is_main else None


def _os_error(err: BaseException | None) -> OSError | None:
    """``err`` itself or the OSError it was raised while handling (torch wraps them)."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _write_error(root: Path, err: OSError) -> str:
    if root.exists() and not root.is_dir():
        return f"cannot write checkpoint directory {root}: it is a file"
    where = f" ({err.filename})" if err.filename and Path(err.filename) != root else ""
    return f"cannot write checkpoint directory {root}{where}: {err.strerror or err}"


def _from_main(ctx: Context, error: Any) -> Any:
    """Rank 0's ``error`` (any picklable value) on every rank; also a barrier."""
    if not ctx.distributed:
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _load(path: Path, rank: int, location: Any, weights_only: bool) -> dict | None:
    """The state in ``path`` with ``rank``'s own values, or None (with a warning) when the
    files are damaged."""
    state = _load_file(path, STATE_FILE, location, weights_only)
    if state is None:
        return None
    if not isinstance(state, dict) or "step" not in state:
        warnings.warn(
            f"skipping checkpoint {path}: {STATE_FILE} is not a disttrain state", stacklevel=3)
        return None
    try:
        rank_files = [name for name in listed_files(path) if name.startswith("rank_")]
    except (OSError, ValueError) as err:
        warnings.warn(f"skipping checkpoint {path}: unreadable {MARKER}: {err}", stacklevel=3)
        return None
    mine = CheckpointLayout.rank_file(rank)
    if mine in rank_files:
        values = _load_file(path, mine, location, weights_only)
        if values is None:
            return None
        if not isinstance(values, dict):
            warnings.warn(f"skipping checkpoint {path}: {mine} is not a dict", stacklevel=3)
            return None
        state["rank_state"] = values
    elif rank_files:  # saved by a job without this rank
        state["rank_state"] = None
    return state


def _load_file(path: Path, name: str, location: Any, weights_only: bool) -> Any:
    """What ``path/name`` holds, or None (with a warning) when it is damaged."""
    try:
        return torch.load(path / name, map_location=location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        message = str(err)
        # A pickle runs code only through a global it imports: naming one is a refusal, not
        # damage (torch words it "Unsupported global: GLOBAL x" or "... GLOBAL x whose module
        # y is blocked"). Falling back to an older checkpoint would quietly hide that this one
        # holds code to run, hostile or not; the user must decide.
        wanted = re.search(r"GLOBAL ([\w.]+)", message) if weights_only else None
        if wanted:
            raise DisttrainError(
                f"checkpoint {path / name} refused: it tries to load {wanted[1]}, which weights_only=True blocks (nothing was "
                f"run); to resume from an older one, move {path.name} out of {path.parent}; if you trust it, "
                "pass weights_only=False"
            ) from None
        warnings.warn(
            f"skipping damaged checkpoint {path}: {message.splitlines()[0]}", stacklevel=3)
        return None
    except (OSError, EOFError, RuntimeError) as err:
        warnings.warn(f"skipping unreadable checkpoint {path}: {err}", stacklevel=4)
        return None


def _load_newest(candidates: list[tuple[int, Path]], rank: int, location: Any,
                 weights_only: bool) -> tuple[int | None, dict | None]:
    for step, path in reversed(candidates):
        state = _load(path, rank, location, weights_only)
        if state is not None:
            return step, state
    return None, None


def _agree_on_step(ctx: Context, step: int, root: Path) -> int | None:
    """The step every rank loads: the oldest of the ranks' newest readable ones."""
    if ctx.distributed:
        bounds = torch.tensor([step, -step], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        newest, oldest = int(bounds[0]), -int(bounds[1])
        if oldest < 0 <= newest:
            raise DisttrainError(
                f"some ranks find no checkpoint in {root} while others find step {newest}: "
                "the checkpoint directory must be on a filesystem every node shares"
            )
        step = oldest
    return None if step < 0 else step


def _restore(name: str, obj: Any, state: dict, path: Path) -> None:
    target = unwrap(obj)
    if not callable(getattr(target, "load_state_dict", None)):
        raise UsageError(
            f"load_latest({name}=...): a {type(obj).__name__} has no load_state_dict()")
    if name not in state:
        held = ", ".join(sorted(k for k in state if k != "step")) or "nothing else"
        raise DisttrainError(f"checkpoint {path} has no {name!r} to restore (it holds {held})")
    try:
        target.load_state_dict(state[name])
    except (RuntimeError, ValueError, KeyError) as err:
        # torch lists every missing and unexpected key over many lines: one is enough.
        raise DisttrainError(
            f"checkpoint {path} holds a {name!r} that does not fit this "
            f"{type(target).__name__} ({sharded.first_line(err)}): resume from this "
            "model's own checkpoint directory, or start a new one") from err
