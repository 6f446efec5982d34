"""What every strategy does, and what a model on one process does: :class:`Strategy`.

A strategy is how a prepared model is spread over the ranks. It owns everything that
differs between DDP and FSDP -- wrapping, the state dicts a checkpoint holds and how
they are written and read, turning gradient synchronisation off while accumulating, and
clipping -- so that the rest of the runtime asks the model's strategy instead of testing
a name (Lightning Fabric's ``Strategy`` divides the work the same way).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import precision as precision_mod
from ..context import Context


def unwrap(model: Any) -> Any:
    """The user's module inside DDP and ``torch.compile`` wrappers (for ``state_dict``)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch.nn.Module) and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


class Strategy:
    """A model on this process's device, as it is: a world of one, or a model the script
    did not pass to ``prepare()``. The DDP and FSDP strategies change what differs."""

    # What the checkpoint's marker records: "ddp" for a checkpoint whose models are all in
    # rank 0's file, "fsdp" for one whose models are written shard by shard.
    checkpoint_format: ClassVar[str] = "ddp"
    # DDP: ranks that ran out of an uneven evaluation shard shadow the others' collectives
    # (torch's Join); FSDP cannot, and a world of one need not.
    joins_uneven_batches: ClassVar[bool] = False

    def __init__(self, ctx: Context, precision: precision_mod.Precision) -> None:
        self.ctx = ctx
        self.precision = precision

    @property
    def sharded(self) -> bool:
        """Whether checkpoints write the models shard by shard (every rank writes)."""
        return self.checkpoint_format == "fsdp"

    @property
    def collective_forward(self) -> bool:
        """Whether every forward of the prepared model is a collective (FSDP gathers the
        shards), so that every rank must run as many as the others."""
        return False

    # -- the model -----------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, optimizer: Any = None) -> torch.nn.Module:
        """``model`` ready for training on this process."""
        model = model.to(self.ctx.device)
        autocast(model, self.precision)
        return model

    def unwrap(self, model: Any) -> Any:
        return unwrap(model)

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module evaluation runs: the user's own, whose forward is not a collective
        (a DDP forward may broadcast buffers, and shards may differ by a batch)."""
        return self.unwrap(model)

    # -- gradients -----------------------------------------------------------------------

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A block whose backward passes keep their gradients local (accumulation)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total norm of ``max_norm``; the norm before clipping,
        the same on every rank."""
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def check_optimizer(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Refuse an optimizer that cannot step ``model`` as prepared."""

    # -- checkpoints ---------------------------------------------------------------------

    def shard_objects(self, objects: dict[str, Any]) -> dict[str, Any]:
        """The objects a checkpoint writes shard by shard, every rank its own; the others
        go into rank 0's file."""
        return {}

    def state_dict(self, obj: Any) -> Any:
        """What rank 0's file holds for ``obj``: its state dict, or the value itself."""
        target = self.unwrap(obj)
        return target.state_dict() if callable(getattr(target, "state_dict", None)) else obj

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0 (empty elsewhere); on every rank, since
        it is a collective for a sharded model."""
        return self.unwrap(model).state_dict() if self.ctx.is_main else {}

    def write_shards(self, objects: dict[str, Any], directory: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} writes no shards")

    def write_shards_async(self, objects: dict[str, Any], directory: Any, group: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} writes no shards")

    def read_shards(self, objects: dict[str, Any], directory: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} reads no shards")


def autocast(model: torch.nn.Module, precision: precision_mod.Precision) -> None:
    """Run ``model``'s forward under ``precision``.

    On the instance, so that the user's module (inside DDP, or unwrapped for evaluation)
    runs the same way, and ``state_dict()`` is untouched.
    """
    if precision.dtype is None or hasattr(model.forward, "__disttrain_precision__"):
        return
    model.forward = precision_mod.autocast_forward(model.forward, precision)
