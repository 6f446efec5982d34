"""Reading the newest whole checkpoint, the same way for every strategy.

Every rank looks at the same candidates, newest first. For each, every rank checks its
share against the marker's digests -- the files it reads itself (rank 0's file, its own
rank file) and every ``world_size``-th shard file -- and the ranks agree: one rank's
problem makes all of them skip the checkpoint, with one warning naming the file and the
reason, for the one before. A file that ``weights_only`` refuses is not damage but a
decision for the user: every rank stops on it. No whole checkpoint left: one error.
"""

from __future__ import annotations

import pickle
import re
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint_layout import MARKER, SHARDED_DIR, STATE_FILE, CheckpointLayout
from ..checkpoint_url import RemoteLayout
from ..errors import DisttrainError, UsageError
from .context import Context
from .strategies import Strategy
from .torch_errors import first_line
from .warn import warn


class Refused(Exception):
    """A file that ``weights_only=True`` refuses to unpickle: stop, do not fall back."""


class Damaged(Exception):
    """A file of the checkpoint cannot be used; the message names it and says why."""


def load(layout: CheckpointLayout | RemoteLayout, objects: dict[str, Any], strategy: Strategy, ctx: Context, *,
         location: Any, weights_only: bool) -> dict[str, Any] | None:
    """Restore ``objects`` from the newest whole checkpoint in ``layout``; what it holds, or
    None when there is none. A collective."""
    shards = strategy.shard_objects(objects)
    steps = _agreed_steps(ctx, layout)
    for step in steps:
        path = layout.step_dir(step)
        state, problem, refusal = None, None, None
        try:
            state = _examine(layout, path, ctx, strategy, location, weights_only)
        except Damaged as err:
            problem = str(err)
        except Refused as err:
            refusal = str(err)
        problem, refusal = _worst(ctx, problem, refusal)
        if refusal is not None:
            raise DisttrainError(refusal)
        if problem is not None:
            if ctx.is_main:
                warn(f"disttrain: skipping checkpoint {path}: {problem}; trying the one before")
            continue
        assert state is not None
        for name, obj in objects.items():
            if name not in shards:
                _restore(name, obj, state, path, strategy)
        if shards:
            strategy.read_shards(shards, path / SHARDED_DIR)
        return state
    if steps:
        raise DisttrainError(
            f"no whole checkpoint left in {layout.root}: all {len(steps)} are damaged (the warnings "
            "above name the files); move them out of the folder to start afresh")
    return None


def _agreed_steps(ctx: Context, layout: CheckpointLayout | RemoteLayout) -> list[int]:
    """Rank 0's complete checkpoints, newest first; refused when some ranks see none while
    others see some (the folder is not shared)."""
    try:
        mine = [step for step, _ in layout.complete()]
    except OSError as err:
        raise DisttrainError(
            f"cannot read checkpoint directory {layout.root}: {err.strerror or err}") from err
    everyone = [mine]
    if ctx.distributed:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
    if any(everyone) and not all(everyone):
        newest = max(step for steps in everyone for step in steps)
        raise DisttrainError(
            f"some ranks find no checkpoint in {layout.root} while others find step {newest}: "
            "the checkpoint directory must be on a filesystem every node shares")
    return list(reversed(everyone[0]))


def _worst(ctx: Context, problem: str | None, refusal: str | None) -> tuple[str | None, str | None]:
    """The first rank's refusal, else the first rank's problem: the same on every rank."""
    if not ctx.distributed:
        return problem, refusal
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, (problem, refusal))
    refusals = [r for _, r in everyone if r is not None]
    problems = [p for p, _ in everyone if p is not None]
    return (problems[0] if problems else None), (refusals[0] if refusals else None)


def _examine(layout: CheckpointLayout | RemoteLayout, path: Any, ctx: Context, strategy: Strategy,
             location: Any, weights_only: bool) -> dict:
    """What this rank loads from ``path`` (a step of ``layout``, whose reads it uses), once its
    share of the files matches the digests.

    Raises :class:`Damaged` or :class:`Refused`; :class:`UsageError` for a checkpoint of
    another strategy (every rank reads the same marker, so all raise alike).
    """
    try:
        meta = layout.marker(path)
    except FileNotFoundError as err:
        raise Damaged(f"{MARKER} is missing on rank {ctx.rank} (the checkpoint directory must be "
                      "on a filesystem every node shares)") from err
    except (OSError, ValueError) as err:
        raise Damaged(f"{MARKER} is unreadable: {err}") from err
    _check_strategy(path, meta, strategy.checkpoint_format)
    digests = meta.get("digests")  # None: written before checkpoints had digests
    rank_files = [name for name in meta.get("files", []) if name.startswith("rank_")]
    own = CheckpointLayout.rank_file(ctx.rank)
    mine = [STATE_FILE, *([own] if own in rank_files else [])]
    checks = []
    if digests is not None:
        shard_files = sorted(name for name in digests if name.startswith(f"{SHARDED_DIR}/"))
        checks = [*mine, *shard_files[ctx.rank::ctx.world_size]]
    if not weights_only:  # the files must be whole before anything trusted is unpickled
        for name in checks:
            _check(layout, path, name, digests)
        checks = []
    # weights_only loading runs no code, whatever the bytes: it goes on while the digests
    # are checked, and their verdict decides after -- except that a file holding code is
    # refused whatever its digest says (not skipped: the user must decide).
    checking = _Checking(layout, path, checks, digests)
    try:
        state = _load_file(layout, path, STATE_FILE, location, weights_only)
        values = _load_file(layout, path, own, location, weights_only) if own in rank_files else None
    except Damaged as err:
        raise Damaged(checking.problem() or str(err)) from err
    finally:
        problem = checking.problem()
    if problem is not None:
        raise Damaged(problem)
    if not isinstance(state, dict) or "step" not in state:
        raise Damaged(f"{STATE_FILE} is not a disttrain state")
    if own in rank_files:
        if not isinstance(values, dict):
            raise Damaged(f"{own} is not a dict")
        state["rank_state"] = values
    elif rank_files:  # saved by a job without this rank
        state["rank_state"] = None
    return state


class _Checking:
    """This rank's files checked against their digests on a thread of its own (hashlib lets
    go of the GIL), while the main thread loads."""

    def __init__(self, layout: Any, path: Any, names: list[str], digests: dict | None) -> None:
        self._problems: list[str | None] = []
        self._thread = threading.Thread(target=self._run, args=(layout, path, names, digests or {}), daemon=True,
                                        name="disttrain-digest-check")
        self._thread.start()

    def _run(self, layout: Any, path: Any, names: list[str], digests: dict) -> None:
        try:
            for name in names:
                _check(layout, path, name, digests)
        except Damaged as err:
            self._problems.append(str(err))
        else:
            self._problems.append(None)

    def problem(self) -> str | None:
        """The first file that does not match, and why; None when all do."""
        self._thread.join()
        return self._problems[0]


def _check(layout: Any, path: Any, name: str, digests: dict) -> None:
    expected = digests.get(name)
    problem = f"its marker lists no digest for {name}" if expected is None else layout.check(path, name, expected)
    if problem is not None:
        raise Damaged(problem)


def _load_file(layout: Any, path: Any, name: str, location: Any, weights_only: bool) -> Any:
    """What ``path/name`` holds; :class:`Damaged` when it cannot be read."""
    try:
        return torch.load(layout.source(path, name), map_location=location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        message = str(err)
        # A pickle runs code only through a global it imports: naming one is a refusal, not
        # damage (torch words it "Unsupported global: GLOBAL x" or "... GLOBAL x whose module
        # y is blocked"). Falling back to an older checkpoint would quietly hide that this one
        # holds code to run, hostile or not; the user must decide.
        wanted = re.search(r"GLOBAL ([\w.]+)", message) if weights_only else None
        if wanted:
            raise Refused(
                f"checkpoint {path / name} refused: it tries to load {wanted[1]}, which weights_only=True "
                f"blocks (nothing was run); to resume from an older one, move {path.name} out of "
                f"{path.parent}; if you trust it, pass weights_only=False") from None
        raise Damaged(f"{name} is damaged: {message.splitlines()[0] if message else 'unpickling failed'}") from err
    except (OSError, EOFError, RuntimeError) as err:
        raise Damaged(f"{name} is unreadable: {first_line(err)}") from err


def _check_strategy(path: Path, meta: dict, expected: str) -> None:
    """A sharded checkpoint holds no model in ``state.pt``, an unsharded one no shards:
    loading across strategies would fail deep in torch, so say it plainly."""
    written = meta.get("strategy", "ddp")
    if written != expected:
        raise UsageError(
            f"checkpoint {path} was written with strategy={written!r} but this run prepares "
            f"the model with strategy={expected!r}: pass strategy={written!r} to prepare() "
            "to resume it, or use a new checkpoint directory")


def _restore(name: str, obj: Any, state: dict, path: Path, strategy: Strategy) -> None:
    target = strategy.unwrap(obj)
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
            f"{type(target).__name__} ({first_line(err)}): resume from this "
            "model's own checkpoint directory, or start a new one") from err
