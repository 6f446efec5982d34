"""``disttrain.log``: a script's metrics for the tracker that ``disttrain run --track`` writes to.

The workers hold no tracker client: :func:`log` prints a track line (:mod:`disttrain.trackline`)
that reaches the launcher like any output, and the launcher's one writer sends it to MLflow,
Trackio or W&B. Without ``--track`` nothing is printed and nothing is reduced, on every rank
alike (they all see the same ``DISTTRAIN_TRACK``), so a script may call it always.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Number

import torch

from .. import trackline
from ..errors import UsageError
from ..workerenv import WorkerEnv

_mode: str | None | bool = False  # False: not read yet


def mode() -> str | None:
    """``"reduced"``, ``"ranks"`` or None (no tracker listens); read once per process."""
    global _mode
    if _mode is False:
        _mode = WorkerEnv.from_environ().track
    return _mode  # type: ignore[return-value]


def log(values: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
    """Send ``values`` at ``step`` to the run's tracker: their mean over ranks (a collective:
    every rank calls it, at the same point), and each rank's own with ``--track-ranks``.

    Costs nothing without ``--track``. Call it every N steps rather than every step when a
    step is short: each call is one small all-reduce and one line of output.
    """
    how = mode()
    if how is None:
        return
    names = list(values)
    numbers = []
    for name in names:
        value = values[name]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise UsageError(f"disttrain.log: {name!r} has {value.numel()} elements; log one number per name")
            value = value.detach().item()
        elif not isinstance(value, Number) or isinstance(value, complex):
            raise UsageError(f"disttrain.log: {name!r} is a {type(value).__name__}, not a number")
        numbers.append(float(value))
    from .context import context
    from .metrics import reduce_mean

    ctx = context()
    if how == "ranks":  # before the collective: when each rank got here is what shows a straggler
        _print(trackline.encode("metrics", rank=ctx.rank, step=step, values=dict(zip(names, numbers)),
                                reduced=False))
    mean = reduce_mean(torch.tensor(numbers, dtype=torch.float64)).tolist() if numbers else []
    if ctx.rank == 0:
        _print(trackline.encode("metrics", rank=0, step=step, values=dict(zip(names, mean)), reduced=True))


def record(kind: str, **fields) -> None:
    """A record of the runtime's own (a checkpoint's stall, the Trainer's epoch), from rank 0
    only and with values already the same on every rank: no collective."""
    if mode() is None:
        return
    from .context import current_rank

    if current_rank() == 0:
        _print(trackline.encode(kind, rank=0, **fields))


def _print(line: str) -> None:
    print(line, flush=True)


def _reset() -> None:
    """Read DISTTRAIN_TRACK again (tests)."""
    global _mode
    _mode = False
