"""disttrain: data-parallel training from one command.

The in-script runtime is exported lazily so that ``import disttrain`` in the launcher
does not pay for importing torch before it needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

_EXPORTS = {
    "init": "runtime.context",
    "context": "runtime.context",
    "shutdown": "runtime.context",
    "Context": "runtime.context",
    "prepare": "runtime.data",
    "unwrap": "runtime.strategies",
    "epochs": "runtime.loop",
    "resume": "runtime.resume",
    "TrainingState": "runtime.resume",
    "reduce_sum": "runtime.metrics",
    "reduce_mean": "runtime.metrics",
    "reduce_max": "runtime.metrics",
    "MeanMeter": "runtime.metrics",
    "AverageMeter": "runtime.metrics",
    "topk_correct": "runtime.metrics",
    "accuracy": "runtime.metrics",
    "print0": "runtime.metrics",
    "barrier": "runtime.metrics",
    "log": "runtime.track",
    "checkpoint": "runtime.checkpoint",
    "accumulate": "runtime.accumulate",
    "Accumulator": "runtime.accumulate",
    "clip_grad_norm_": "runtime.accumulate",
    "Trainer": "trainer",
    "elastic": "runtime.regroup",
    "Job": "jobs",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'disttrain' has no attribute {name!r}")
    mod = importlib.import_module(f".{module}", __name__)
    value = mod if name == "checkpoint" else getattr(mod, name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover
    from .jobs import Job
    from .runtime import checkpoint
    from .runtime.accumulate import Accumulator, accumulate, clip_grad_norm_
    from .runtime.context import Context, context, init, shutdown
    from .runtime.data import prepare
    from .runtime.loop import epochs
    from .runtime.metrics import (
        AverageMeter,
        MeanMeter,
        accuracy,
        barrier,
        print0,
        reduce_max,
        reduce_mean,
        reduce_sum,
        topk_correct,
    )
    from .runtime.regroup import elastic
    from .runtime.resume import TrainingState, resume
    from .runtime.strategies import unwrap
    from .runtime.track import log
    from .trainer import Trainer
