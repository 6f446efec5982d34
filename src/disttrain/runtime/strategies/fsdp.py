"""FSDP: parameters, gradients and optimizer state sharded over the ranks (FSDP2's
``fully_shard``), checkpointed shard by shard through ``torch.distributed.checkpoint``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ... import torchcompat
from ...errors import UsageError
from .. import precision as precision_mod
from ..context import Context
from . import dcp
from .base import Strategy, autocast

# Without repeated blocks, FSDP shards each child holding at least this share of the
# parameters on its own: fewer, larger all-gathers than one per layer, and the peak is
# still about one child's worth of full parameters rather than the whole model's.
_CHILD_SHARE = 0.1
_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)

Blocks = Iterable[type] | Callable[[torch.nn.Module], bool] | None


class FSDPStrategy(Strategy):
    """``fully_shard`` on each block (``blocks``: module classes or a predicate; None: the
    model's repeated blocks), then on the root.

    A world of one has nothing to shard: the model runs as it is, under the same
    precision, and checkpoints the same way (shard files), so runs move between 1 and N
    ranks.
    """

    checkpoint_format: ClassVar[str] = "fsdp"

    def __init__(self, ctx: Context, precision: precision_mod.Precision, blocks: Blocks = None) -> None:
        super().__init__(ctx, precision)
        self.blocks = blocks

    @property
    def collective_forward(self) -> bool:
        return self.ctx.distributed

    def wrap(self, model: torch.nn.Module, optimizer: Any = None) -> torch.nn.Module:
        """``fully_shard`` replaces every parameter by a sharded ``DTensor``; an optimizer
        built before (the usual order) still holds the old ones, so it is pointed at the
        new ones by name."""
        model = model.to(self.ctx.device)
        if not self.ctx.distributed:
            autocast(model, self.precision)
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torchcompat.require_fsdp(self.ctx.device.type)
        names = {id(p): name for name, p in model.named_parameters()}
        _check_fresh(optimizer)
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        for block in select_blocks(model, self.blocks):
            fully_shard(block, mesh=mesh, mp_policy=self.precision.fsdp_policy(root=False))
        fully_shard(model, mesh=mesh, mp_policy=self.precision.fsdp_policy(root=True))
        if optimizer is not None:
            _rebind(optimizer, names, dict(model.named_parameters()))
        return model

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Every forward gathers the shards from all ranks: evaluation runs the sharded model.
        return model if self.ctx.distributed else self.unwrap(model)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        if callable(getattr(model, "set_requires_gradient_sync", None)):
            return _gradient_sync_off(model)
        return contextlib.nullcontext()  # a world of one: nothing to sync

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Each rank holds a shard of each gradient: the norm of the local shards would
        differ per rank and clip each shard by a different factor. torch's
        ``clip_grad_norm_`` computes on the gradients' ``DTensor`` form, whose norm is
        reduced over the ranks; the result is made a plain tensor here."""
        norm = super().clip_grad_norm(model, max_norm)
        full = getattr(norm, "full_tensor", None)
        return full() if callable(full) else norm

    def check_optimizer(self, model: torch.nn.Module, optimizer: Any) -> None:
        """FSDP replaced the parameters: an optimizer still holding the old ones would step
        tensors the model no longer uses -- training that silently does nothing."""
        current = {id(p) for p in model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in current for p in held):
            raise UsageError(
                "accumulate(): the optimizer steps parameters the model no longer has; with "
                "strategy='fsdp' pass the optimizer to prepare() (it is re-pointed at the shards) "
                "or build it after prepare()")

    def shard_objects(self, objects: dict[str, Any]) -> dict[str, Any]:
        """Every model and optimizer saved with an FSDP model: an optimizer's state is
        keyed by its model's parameter names, so both reshard together."""
        return {name: obj for name, obj in objects.items()
                if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))}

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return dcp.full_model_state(model)

    def write_shards(self, objects: dict[str, Any], directory: Any) -> None:
        dcp.write(objects, directory)

    def write_shards_async(self, objects: dict[str, Any], directory: Any, group: Any) -> Any:
        return dcp.write_async(objects, directory, group)

    def read_shards(self, objects: dict[str, Any], directory: Any) -> None:
        dcp.read(objects, directory)


def select_blocks(model: torch.nn.Module, blocks: Blocks) -> list[torch.nn.Module]:
    """The submodules FSDP shards as units, outermost first, per ``blocks``."""
    if blocks is None:
        return default_blocks(model)
    if callable(blocks) and not isinstance(blocks, type):
        chosen = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        classes = tuple(blocks) if not isinstance(blocks, type) else (blocks,)
        if not all(isinstance(c, type) for c in classes):
            raise UsageError("prepare(blocks=...): give module classes (e.g. [Block]) or a "
                             "function module -> bool")
        chosen = [m for m in model.modules() if m is not model and isinstance(m, classes)]
    return _outermost(chosen)


def default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: instances of the outermost module class that occurs
    more than once with parameters (a transformer's layers, a ResNet's BasicBlocks); for
    a model without any, its children holding at least a tenth of the parameters."""
    counts: dict[type, list[torch.nn.Module]] = {}
    for module in model.modules():
        if module is model or isinstance(module, _CONTAINERS) or not _size(module):
            continue
        counts.setdefault(type(module), []).append(module)
    repeated = {cls: mods for cls, mods in counts.items() if len(mods) > 1}
    inside = _descendants_of([m for mods in repeated.values() for m in mods])
    outer = [cls for cls, mods in repeated.items() if not any(id(m) in inside for m in mods)]
    if outer:
        return [m for cls in outer for m in repeated[cls]]
    total = _size(model)
    return [c for c in model.children() if total and _size(c) >= _CHILD_SHARE * total]


def _size(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _descendants_of(modules: list[torch.nn.Module]) -> set[int]:
    return {id(d) for m in modules for d in m.modules() if d is not m}


def _outermost(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    inside = _descendants_of(modules)
    return [m for m in modules if id(m) not in inside]


def _check_fresh(optimizer: Any) -> None:
    if optimizer is not None and getattr(optimizer, "state", None):
        raise UsageError(
            "prepare(strategy='fsdp'): the optimizer has already stepped; FSDP replaces the "
            "parameters, so build the optimizer (or load its checkpoint) after prepare(), or "
            "pass it to prepare() before its first step")


def _rebind(optimizer: Any, names: dict[int, str], params: dict[str, torch.nn.Parameter]) -> None:
    """Point ``optimizer``'s groups at the sharded parameters with the same names."""
    for group in optimizer.param_groups:
        rebound = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise UsageError(
                    "prepare(strategy='fsdp'): the optimizer holds a parameter that is not "
                    "the model's; FSDP can only shard the model it was given")
            rebound.append(params[name])
        group["params"] = rebound


@contextlib.contextmanager
def _gradient_sync_off(model: Any):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
