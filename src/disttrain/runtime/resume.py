"""Resumable training: where the loop stands, saved with the model, so a restarted job
carries on as if it had never stopped.

::

    state = disttrain.resume("ckpt", every=100, model=model, optimizer=opt, scheduler=sched)
    for epoch in disttrain.epochs(10):        # from the checkpoint's epoch on
        for x, y in state.steps(train_dl):    # without the batches already trained on
            ...                               # a checkpoint every 100 steps

A checkpoint (through :mod:`.checkpoint`, so atomic and loaded with ``weights_only``)
holds the objects given to :func:`resume`, the step, the position in the epoch and, per
rank, every random generator (:mod:`.rng`). With the same world size a run killed at any
moment and resumed ends with the same bits as the run that never stopped, because

- the epoch's remaining batches come from the same permutation (the sampler's indices
  from the saved position on; the batches before it are not read again);
- each rank's generators are restored *after* the resumed epoch's iterator exists, since
  creating it draws from them, which the uninterrupted run did before the checkpoint.

SIGTERM and Ctrl-C stop the loop at the next step boundary on every rank, save, and exit
with 128 + the signal (see :mod:`.preemption`).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)

from ..checkpoint_url import is_url, location
from ..errors import DisttrainError, UsageError
from ..workerenv import CHECKPOINT_DIR, RESUMED_MARKER
from . import checkpoint, comm, loop, periodic, preemption, regroup, rng, track
from .context import Context, context, current_runtime
from .data import with_sampler
from .samplers import EvalShardSampler, rest_of_epoch
from .strategies import unwrap

__all__ = ["TrainingState", "current", "resume"]

# Names the checkpoint itself uses; objects cannot be saved under them.
_RESERVED = ("step", "progress", "rank_state", periodic.SHARED_KEY)
# Samplers whose order is a function of the epoch alone, so the rest of an epoch can be
# cut from a fresh iteration of it.
_REPEATABLE = (DistributedSampler, SequentialSampler, EvalShardSampler)


def resume(directory: str | PathLike[str] | None = None, *, every: int | None = None,
           keep_last: int | None = 3, weights_only: bool = True, asynchronous: bool = False,
           **objects: Any) -> TrainingState:
    """Load the newest complete checkpoint in ``directory`` (if any) into ``objects``;
    return the :class:`TrainingState` that continues from it. Call it on every rank.

    ``objects`` are what has a ``state_dict()``: model (DDP or not), optimizer, LR
    scheduler, ``GradScaler``...; None values are skipped (``scaler=None`` without AMP).
    ``directory`` defaults to ``$DISTTRAIN_CHECKPOINT_DIR``; without either nothing is
    saved or loaded and the state only counts. It may be an fsspec URL (``s3://bucket/run``),
    which every host reads and writes directly (see :func:`checkpoint.save`). ``every`` is the number of steps between
    checkpoints (default ``$DISTTRAIN_CHECKPOINT_EVERY``, else 0: at the end of each
    epoch); ``keep_last`` and ``weights_only`` are :func:`checkpoint.save`'s and
    :func:`checkpoint.load_latest`'s; so is ``asynchronous`` (sharded models: training goes
    on while the checkpoint is written; the save on SIGTERM is always synchronous).

    A model prepared with ``strategy="fsdp"`` is checkpointed shard by shard and resumes
    on any number of ranks; the position in the epoch is kept as samples consumed, so no
    sample of the interrupted epoch is skipped or trained twice (beyond the padding that
    makes the samples divide among the new number of ranks).
    """
    ctx = context()
    directory = directory if directory is not None else ctx.env.checkpoint_dir
    every = every if every is not None else (ctx.env.checkpoint_every or 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UsageError(f"resume(every={every!r}): steps between checkpoints, an integer >= 0 "
                         "(0: at the end of each epoch)")
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"resume(keep_last={keep_last}): keep at least 1, or None for all")
    kept = {name: obj for name, obj in objects.items() if obj is not None}
    for name, obj in kept.items():
        _check_object(name, obj)
    if asynchronous and not checkpoint.holds_sharded(kept) and not is_url(directory):
        raise UsageError("resume(asynchronous=True) writes sharded models, or checkpoints at a URL "
                         "(s3://...), in the background; prepare the model with strategy='fsdp', or "
                         "drop asynchronous")
    state = TrainingState(location(directory) if directory else None, every=every,
                          keep_last=keep_last, objects=kept, ctx=ctx)
    state.asynchronous = asynchronous
    return _begin(state, weights_only)


def counting(*, why_not_in_place: str = "", disk_between_epochs: bool = False, **objects: Any) -> TrainingState:
    """A state over ``objects`` that saves and loads nothing -- their owner checkpoints them its own
    way (the :class:`~disttrain.Trainer`) -- for the loop's position and an in-place regroup (see
    :mod:`.regroup`): after one, it holds the state from memory (``resumed_from`` set), else nothing.

    ``why_not_in_place``: why its objects cannot be carried over (they go on from the owner's
    checkpoint then); ``disk_between_epochs``: so too when the regroup comes between two epochs' steps.
    """
    ctx = context()
    state = TrainingState(None, every=0, keep_last=None, ctx=ctx,
                          objects={name: obj for name, obj in objects.items() if obj is not None})
    state.why_not_in_place, state.disk_between_epochs = why_not_in_place, disk_between_epochs
    return _begin(state, True)


def _begin(state: TrainingState, weights_only: bool) -> TrainingState:
    """Where ``state`` starts: the other ranks' (an in-place regroup), else the newest checkpoint; it
    becomes the context's, armed for a regroup."""
    ctx = state._ctx
    if ctx.runtime.training is not None:
        ctx.runtime.training.close()
    second_run, carry = regroup.carried() if ctx.distributed else (False, None)
    if second_run or (ctx.distributed and regroup.joining()):
        state._adopt(carry, weights_only)
    elif state.directory is not None:
        state._load(weights_only)
    if state.directory is not None:
        state._watch_sigterm()
    ctx.runtime.training = state
    if ctx.distributed:
        regroup.arm(state)
    return state


def current() -> TrainingState | None:
    """The state the last :func:`resume` returned (what ``disttrain.epochs`` follows)."""
    runtime = current_runtime()
    return runtime.training if runtime is not None else None


@dataclass(frozen=True)
class _ResumePoint:
    """Where the loaded checkpoint stopped, applied when its epoch's steps begin."""

    epoch: int
    epoch_step: int
    epoch_samples: int  # of the epoch's global order (all ranks), consumed
    epoch_done: bool  # every step of the epoch ran; only the code after them remains
    world_size: int
    rank_state: dict | None


class TrainingState:
    """The step and epoch of a training loop, checkpointed so that it can resume.

    ``step``: steps finished in the whole run -- inside ``steps()``'s loop, the index of
    the step being run. ``epoch``: the current epoch. ``epoch_step``: steps of this epoch
    finished (inside the loop, the batch's index in the epoch). ``resumed_from``: the step
    the run started from, or None.
    """

    def __init__(self, directory: Path | str | None, *, every: int, keep_last: int | None,
                 objects: dict[str, Any], ctx: Context) -> None:
        self.directory = directory
        self.every = every
        self.keep_last = keep_last
        self.asynchronous = False
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0
        self.resumed_from: int | None = None
        self._objects = objects
        self._ctx = ctx
        self._epoch_samples = 0
        self._epoch_len: int | None = None
        self._loader: Any = None
        self._point: _ResumePoint | None = None
        self._saved_step: int | None = None
        self._vote: preemption.StopVote | None = None
        self._stepped = False  # an optimizer stepped since the last step's end (the step in flight did)
        self._in_steps = False  # inside steps(): the objects' state is the last step's (or the one in flight's)
        self.why_not_in_place = ""  # set by an owner whose objects cannot be carried over a regroup
        self.disk_between_epochs = False  # an owner that checkpoints between epochs: its checkpoint then
        self._hooks = [obj.register_step_post_hook(self._optimizer_stepped) for obj in objects.values()
                       if isinstance(obj, torch.optim.Optimizer)]

    # -- the loops ---------------------------------------------------------------------

    def epochs(self, n: int) -> Iterator[int]:
        """Like :func:`disttrain.epochs`, from the checkpoint's epoch on."""
        for epoch in loop.epochs(n, start=min(self.epoch, n)):
            self.epoch = epoch
            yield epoch
            if self._point is not None:  # the resumed epoch ran no steps(): nothing to skip
                self._restore_generators(self._point, loader=None)
                self._point = None
            self.epoch, self.epoch_step, self._epoch_samples = epoch + 1, 0, 0
            self._epoch_len = None

    def steps(self, loader: Iterable) -> Iterator[Any]:
        """The batches of ``loader`` left in this epoch; one optimizer step per batch.

        When the body of the loop has run for a batch, that step counts: a checkpoint is
        saved every ``every`` steps (``every=0``: after the epoch's last step), and a
        SIGTERM on any rank makes every rank save here and exit.
        """
        batches = self._begin_epoch(loader)
        self._in_steps = True
        for batch in batches:
            yield batch
            self._end_step(loader)
        self._in_steps = False
        if self.every == 0 and self.directory is not None:
            self._checkpoint()

    def save(self, *, asynchronous: bool | None = None) -> Path | None:
        """Checkpoint now, as of the last finished step; call it on every rank.

        A run resumed from it starts with the next step -- or, saved after an epoch's last
        step, with that epoch's code after its step loop. Returns the path on rank 0.
        """
        if self.directory is None:
            raise UsageError("TrainingState.save(): no checkpoint directory; pass one to "
                             f"disttrain.resume() or set {CHECKPOINT_DIR}")
        progress = self._progress()
        generator = getattr(self._loader, "generator", None)
        began = time.perf_counter()
        path = checkpoint.save(
            self.directory, step=self.step, keep_last=self.keep_last,
            asynchronous=self.asynchronous if asynchronous is None else asynchronous,
            rank_state={**rng.capture([generator]), **comm.rank_state(), **periodic.rank_state()},
            progress=progress, **periodic.shared_state(), **self._objects,
        )
        self._saved_step = self.step
        # The time the step was blocked (an async save: its staging copy), for the run's goodput.
        track.record("checkpoint", step=self.step, seconds=round(time.perf_counter() - began, 4))
        return path

    def _progress(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "epoch_step": self.epoch_step,
            "epoch_samples": self._epoch_samples,
            "epoch_done": self._epoch_len is not None and self.epoch_step >= self._epoch_len,
            "world_size": self._ctx.world_size,
        }

    def close(self) -> None:
        """Stop handling SIGTERM; :func:`resume` does it for the state it replaces."""
        if self._vote is not None:
            preemption.uninstall()
            self._vote = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._ctx.runtime.training is self:
            self._ctx.runtime.training = None

    # -- inside ------------------------------------------------------------------------

    def _load(self, weights_only: bool) -> None:
        assert self.directory is not None
        loaded = checkpoint.load_latest(self.directory, weights_only=weights_only,
                                        **self._objects)
        if loaded is None:
            return
        progress = loaded.get("progress")
        if not isinstance(progress, dict):
            raise DisttrainError(
                f"the newest checkpoint in {self.directory} (step {loaded['step']}) was not "
                "written by disttrain.resume(): it holds no training progress; give resume() "
                "a directory of its own")
        self.step = self.resumed_from = self._saved_step = loaded["step"]
        self.epoch = progress["epoch"]
        # Where the loop stands before its first step (with another number of ranks, counted
        # again when the epoch's steps begin).
        self.epoch_step, self._epoch_samples = progress["epoch_step"], progress["epoch_samples"]
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer) and self.step > 0:
                # It did step, in the run resumed: resuming at an epoch's end, a scheduler
                # stepped there would warn "lr_scheduler.step() before optimizer.step()".
                obj._opt_called = True  # torch's own flag for that warning
        # Local SGD / DiLoCo: each rank's own weights and inner optimizer, between two
        # synchronisations, and the shared anchor; another number of ranks restarts the period.
        same_world = progress["world_size"] == self._ctx.world_size
        periodic.restore(loaded.get(periodic.SHARED_KEY), loaded.get("rank_state") if same_world else None)
        self._point = _ResumePoint(
            epoch=progress["epoch"], epoch_step=progress["epoch_step"],
            epoch_samples=progress["epoch_samples"], epoch_done=progress["epoch_done"],
            world_size=progress["world_size"], rank_state=loaded.get("rank_state"),
        )
        if self._ctx.is_main:
            where = "at its end" if self._point.epoch_done else \
                f"after {self._point.epoch_step} of its steps"
            print(f"{RESUMED_MARKER}{self.step} in {self.directory} "
                  f"(epoch {self.epoch}, {where})", file=sys.stderr, flush=True)
            if self._point.world_size != self._ctx.world_size:
                warnings.warn(_world_size_warning(self._point, self._ctx.world_size),
                              stacklevel=3)

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _carry(self) -> regroup.Carry:
        """Where the loop stands, for an in-place regroup: a step whose optimizer step ran counts as
        done, even if the failure came before its end (its collectives finished on every rank)."""
        if self._stepped:
            self._count_step(self._loader)
        generator = getattr(self._loader, "generator", None)
        why_not = (self.why_not_in_place or ("a sharded model's lost shard is held nowhere else"
                   if checkpoint.holds_sharded(self._objects) else "Local SGD / DiLoCo keep state per rank"
                   if periodic.active()
                   # after an epoch's steps the script's own code ran part-way (a scheduler may have stepped)
                   else "it came between two epochs' steps" if self.step and not self._in_steps
                   and (self.directory is not None or self.disk_between_epochs) else ""))
        # No state_dict() of a sharded model: it would gather over the group just cut.
        objects = {} if why_not else {name: unwrap(obj).state_dict() for name, obj in self._objects.items()}
        carry = regroup.Carry(objects=objects, step=self.step, progress=self._progress(),
                              rank_state=rng.capture([generator]), adoptable=not why_not, why_not=why_not)
        return carry

    def _adopt(self, carry: regroup.Carry | None, weights_only: bool) -> None:
        """The second run of an in-place regroup: the state the survivors agree on, from memory
        (:func:`.regroup.adopt`); from the newest checkpoint where no rank can give it."""
        agreed, source = regroup.adopt(carry, rank=self._ctx.rank)
        if agreed is None:
            if self._ctx.is_main:
                why = carry.why_not if carry is not None and carry.why_not else "no rank holds the state"
                print(f"disttrain: regrouped in place; {why}: "
                      "loading the newest checkpoint", file=sys.stderr, flush=True)
            if self.directory is not None:
                self._load(weights_only)
            return
        for name, obj in self._objects.items():
            if name in agreed.objects:
                unwrap(obj).load_state_dict(agreed.objects[name])
        progress = agreed.progress
        self.step = self.resumed_from = agreed.step
        self.epoch, self.epoch_step, self._epoch_samples = progress["epoch"], progress["epoch_step"], \
            progress["epoch_samples"]
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer) and self.step > 0:
                obj._opt_called = True  # as _load: no "scheduler before optimizer" warning
        self._point = _ResumePoint(
            epoch=progress["epoch"], epoch_step=progress["epoch_step"], epoch_samples=progress["epoch_samples"],
            epoch_done=progress["epoch_done"], world_size=progress["world_size"],
            rank_state=agreed.rank_state or None)
        if self._ctx.is_main:
            sent = f"; sent by rank {source}" if source is not None else ""
            print(f"{RESUMED_MARKER}{self.step} in memory (regrouped in place: {progress['world_size']} -> "
                  f"{self._ctx.world_size} ranks, epoch {self.epoch}{sent})", file=sys.stderr, flush=True)

    def _watch_sigterm(self) -> None:
        if not preemption.install():
            warnings.warn("disttrain.resume() outside the main thread: SIGTERM and Ctrl-C cannot be "
                          "handled, a preempted run loses the steps since its last checkpoint",
                          stacklevel=3)
            return
        group = None
        if self._ctx.distributed and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")  # the vote stays on the CPU
        self._vote = preemption.StopVote(group, distributed=self._ctx.distributed)

    def _begin_epoch(self, loader: Iterable) -> Iterator[Any]:
        self._loader = loader
        self._epoch_len = _length(loader)
        point, self._point = self._point, None
        if point is None:
            return iter(loader)
        same_world = point.world_size == self._ctx.world_size
        batch_size = getattr(loader, "batch_size", None) or 1
        self.epoch_step = point.epoch_step if same_world \
            else point.epoch_samples // self._ctx.world_size // batch_size
        self._epoch_samples = point.epoch_samples
        if point.epoch_done:
            batches: Iterator[Any] = iter(())
            self.epoch_step = self._epoch_len if self._epoch_len is not None else self.epoch_step
        else:
            batches = self._rest_of_epoch(loader, point.epoch_samples, same_world)
        # Only now: creating the iterator drew from the generators (the loader's seed for
        # its workers), which the uninterrupted run did before the checkpoint.
        self._restore_generators(point, loader)
        return batches

    def _rest_of_epoch(self, loader: Any, consumed: int, same_world: bool) -> Iterator[Any]:
        """``loader``'s batches once the ranks together consumed the epoch's first
        ``consumed`` samples (:func:`.samplers.rest_of_epoch`)."""
        if consumed == 0:
            return iter(loader)
        indexable = (
            isinstance(loader, DataLoader)
            and not isinstance(loader.dataset, IterableDataset)
            and (loader.batch_sampler is None or type(loader.batch_sampler) is BatchSampler)
        )
        if not indexable:
            self._warn_on_main(
                f"resuming epoch {self.epoch} part-way by reading and dropping its first "
                f"{self.epoch_step} batches: a {type(loader).__name__} without an index sampler "
                "cannot start in the middle")
            batches = iter(loader)
            for _ in range(self.epoch_step):
                next(batches, None)
            return batches
        world = self._ctx.world_size
        remaining = rest_of_epoch(loader.sampler, consumed, rank=self._ctx.rank, world_size=world)
        if remaining is None:
            if not isinstance(loader.sampler, _REPEATABLE):
                self._warn_on_main(
                    f"resuming epoch {self.epoch} part-way with a {type(loader.sampler).__name__}, "
                    "which may not repeat the order it had: batches of this epoch may be seen "
                    "twice or not at all (disttrain.prepare() gives a DistributedSampler, which "
                    "does repeat it)")
            remaining = list(loader.sampler)[consumed // world:]
        rest = with_sampler(loader, remaining)
        if not same_world and self._epoch_len is not None:
            self.epoch_step = max(0, self._epoch_len - len(rest))  # reaches the epoch's length at its end
        return iter(rest)

    def _restore_generators(self, point: _ResumePoint, loader: Any) -> None:
        if point.rank_state is not None:
            rng.restore(point.rank_state, [getattr(loader, "generator", None)])
            comm.restore_rank_state(point.rank_state)  # PowerSGD's error feedback

    def _count_step(self, loader: Any) -> None:
        self.step += 1
        self.epoch_step += 1
        self._epoch_samples += (getattr(loader, "batch_size", None) or 1) * self._ctx.world_size
        self._stepped = False

    def _end_step(self, loader: Any) -> None:
        self._count_step(loader)
        regroup.check()
        if self.directory is None:
            return
        stop = self._vote() if self._vote is not None else False
        if stop or (self.every and self.step % self.every == 0):
            self._checkpoint(asynchronous=False if stop else None)
        if stop:
            if self._ctx.is_main:
                print(f"disttrain: {preemption.describe(stop)}: stopped after step {self.step}, saved in "
                      f"{self.directory}; exiting with {128 + stop}, the next run resumes there",
                      file=sys.stderr, flush=True)
            raise SystemExit(128 + stop)

    def _checkpoint(self, asynchronous: bool | None = None) -> None:
        if self._saved_step == self.step:
            return
        try:
            self.save(asynchronous=asynchronous)
        except DisttrainError as err:
            # A full disk or an unwritable directory: one line, not a traceback through
            # the user's `for` loop, which does not look like it writes anything.
            print(f"disttrain: rank {self._ctx.rank}: {err}", file=sys.stderr, flush=True)
            raise SystemExit(err.exit_code) from None

    def _warn_on_main(self, message: str) -> None:
        if self._ctx.is_main:
            warnings.warn(message, stacklevel=4)


def _check_object(name: str, obj: Any) -> None:
    if name in _RESERVED:
        raise UsageError(f"resume({name}=...): {name!r} is a name the checkpoint uses itself; "
                         "pass the object under another name")
    target = unwrap(obj)
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(target, method, None)):
            raise UsageError(
                f"resume({name}=...): a {type(obj).__name__} has no {method}(); pass models, "
                "optimizers, schedulers, scalers -- objects that save and load their state")


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _world_size_warning(point: _ResumePoint, world_size: int) -> str:
    caveats = ["the global batch changes with the number of ranks",
               "each rank's data shard and random draws (dropout, augmentation) differ"]
    if world_size > point.world_size:
        caveats.append(f"ranks {point.world_size}-{world_size - 1} have no saved random state "
                       "and keep their own seeds")
    if point.epoch_samples % world_size:
        caveats.append(f"the rest of epoch {point.epoch} is padded to divide among {world_size} ranks "
                       f"(up to {world_size - 1} of its samples trained twice, as DistributedSampler pads)")
    return (
        f"disttrain: the checkpoint was saved by {point.world_size} ranks and is resumed by "
        f"{world_size}: training continues at sample {point.epoch_samples} of epoch "
        f"{point.epoch}'s order, but cannot be bit-for-bit the run that never stopped: "
        f"{'; '.join(caveats)}. Resume with {point.world_size} ranks for an exact continuation."
    )
