"""The strategies ``prepare(strategy=...)`` chooses from, and the one place that chooses.

- :class:`~.base.Strategy`: a model on one process (a world of one, or a model the script
  did not prepare);
- :class:`~.ddp.DDPStrategy`: ``"ddp"`` on more than one process;
- :class:`~.fsdp.FSDPStrategy`: ``"fsdp"``, on any number of processes.

``prepare()`` records the chosen object with the model it returns (``Runtime.models``);
:func:`of` finds it again for the accumulator, the checkpoints and the Trainer.
The options travel as one frozen :class:`PrepareOptions`, validated once, so that a new
option is a field here and a use in one strategy -- not a keyword threaded through every
function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ...errors import UsageError
from .. import comm
from .. import precision as precision_mod
from ..context import Context
from .base import Strategy, unwrap
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy

__all__ = ["STRATEGIES", "DDPStrategy", "FSDPStrategy", "PrepareOptions", "Strategy", "for_checkpoint",
           "choose", "of", "unwrap"]

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """The keyword arguments of ``disttrain.prepare()``, checked once (reading nothing but
    themselves: the launcher's defaults are the context's, applied by :func:`choose`)."""

    strategy: str = "ddp"
    mixed_precision: str | None = None
    # fsdp: the modules sharded one by one (classes, or a predicate on a module); None:
    # the model's repeated blocks (see fsdp.default_blocks()).
    blocks: Any = None
    # DDP's gradient communication (runtime.comm); None: `disttrain run --grad-compression`
    # / `--bucket-mb` (DISTTRAIN_GRAD_COMPRESSION / DISTTRAIN_BUCKET_MB), else plain fp32.
    grad_compression: str | None = None
    bucket_mb: float | None = None
    # The same choice under its general name, which also takes the modes that are no
    # compression (localsgd:H, diloco:H; runtime.periodic); give one of the two.
    comm: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UsageError(
                f"prepare(strategy={self.strategy!r}): unknown strategy; use 'ddp' (a full "
                "replica per rank) or 'fsdp' (parameters, gradients and optimizer state "
                "sharded over the ranks)")
        if self.blocks is not None and self.strategy != "fsdp":
            raise UsageError("prepare(blocks=...) chooses FSDP's units: pass it with "
                             "strategy='fsdp', or drop it")
        if self.comm is not None and self.grad_compression is not None:
            raise UsageError(f"prepare(comm={self.comm!r}, grad_compression={self.grad_compression!r}): "
                             "both name how DDP communicates; give one (comm)")
        compression, _ = comm.parse_compression(self.mode)
        comm.parse_bucket_mb(self.bucket_mb)
        _check_compression(compression, self.strategy)

    @property
    def mode(self) -> str | None:
        """``comm`` or ``grad_compression``, whichever was given."""
        return self.comm if self.comm is not None else self.grad_compression

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> PrepareOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UsageError(f"prepare(): unknown option {unknown[0]!r}; the options are "
                             f"{', '.join(sorted(known))}")
        return cls(**kwargs)


def _check_compression(compression: str, strategy: str) -> None:
    if compression != "none" and strategy != "ddp":
        raise UsageError(f"grad_compression={compression!r} is a DDP communication hook; "
                         f"strategy={strategy!r} does not run it: use strategy='ddp' or leave "
                         "the compression unset")


def choose(options: PrepareOptions, ctx: Context) -> Strategy:
    """The strategy ``options`` ask for on this context: the one choice of the runtime."""
    precision = precision_mod.resolve(options.mixed_precision, ctx.device)
    settings = comm.CommSettings.resolve(options.mode, options.bucket_mb, env=ctx.env)
    _check_compression(settings.compression, options.strategy)  # the launcher's default too
    if options.strategy == "fsdp":
        return FSDPStrategy(ctx, precision, options.blocks)
    if ctx.distributed:
        return DDPStrategy(ctx, precision, settings)
    return Strategy(ctx, precision)


def of(model: Any, ctx: Context) -> Strategy:
    """The strategy ``model`` was prepared with; for a model ``prepare()`` did not return,
    the one its own wrapping implies (DDP the script set up itself, or none)."""
    prepared = ctx.runtime.prepared(model)
    if prepared is not None:
        return prepared
    full = precision_mod.resolve(None, ctx.device)
    if isinstance(model, DistributedDataParallel):
        return DDPStrategy(ctx, full, None)
    return Strategy(ctx, full)


def for_checkpoint(objects: Mapping[str, Any], ctx: Context) -> Strategy:
    """The strategy that writes and reads a checkpoint of ``objects``: a sharded model's,
    when one is among them (the optimizers saved with it are sharded too), else the plain
    one whose checkpoint is rank 0's file."""
    strategies = [ctx.runtime.prepared(obj) for obj in objects.values()]
    sharded = [s for s in strategies if s is not None and s.sharded]
    if sharded:
        return sharded[0]
    return Strategy(ctx, precision_mod.resolve(None, ctx.device))
