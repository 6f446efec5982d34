"""How ``prepare()`` spreads a model over the ranks: DDP (a replica per rank) or FSDP
(parameters, gradients and optimizer state sharded), each with its mixed precision.

The options travel as one frozen :class:`PrepareOptions`, validated once, so that a new
option (gradient compression, bucket sizes) is a field here and a use in :func:`wrap_ddp`
or :func:`wrap_fsdp` -- not a keyword threaded through every function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError
from . import comm
from . import precision as precision_mod
from .context import Context
from .device import ddp_device_ids
from .state import PreparedModel

STRATEGIES = ("ddp", "fsdp")
# Without repeated blocks, FSDP shards each child holding at least this share of the
# parameters on its own: fewer, larger all-gathers than one per layer, and the peak is
# still about one child's worth of full parameters rather than the whole model's.
_CHILD_SHARE = 0.1
_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)

Blocks = Iterable[type] | Callable[[torch.nn.Module], bool] | None


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """The keyword arguments of ``disttrain.prepare()``, checked once."""

    strategy: str = "ddp"
    mixed_precision: str | None = None
    # fsdp: the modules sharded one by one (classes, or a predicate on a module); None:
    # the model's repeated blocks (see default_blocks()).
    blocks: Any = None
    # DDP's gradient communication (runtime.comm); None: `disttrain run --grad-compression`
    # / `--bucket-mb` (DISTTRAIN_GRAD_COMPRESSION / DISTTRAIN_BUCKET_MB), else plain fp32.
    grad_compression: str | None = None
    bucket_mb: float | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UsageError(
                f"prepare(strategy={self.strategy!r}): unknown strategy; use 'ddp' (a full "
                "replica per rank) or 'fsdp' (parameters, gradients and optimizer state "
                "sharded over the ranks)")
        if self.blocks is not None and self.strategy != "fsdp":
            raise UsageError("prepare(blocks=...) chooses FSDP's units: pass it with "
                             "strategy='fsdp', or drop it")
        if self.comm_settings.compression != "none" and self.strategy != "ddp":
            raise UsageError(f"grad_compression={self.comm_settings.compression!r} is a DDP communication "
                             f"hook; strategy={self.strategy!r} does not run it: use strategy='ddp' "
                             "or leave the compression unset")

    @property
    def comm_settings(self) -> comm.CommSettings:
        """The communication settings, validated (bad names and sizes raise here)."""
        return comm.CommSettings.resolve(self.grad_compression, self.bucket_mb)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> PrepareOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UsageError(f"prepare(): unknown option {unknown[0]!r}; the options are "
                             f"{', '.join(sorted(known))}")
        return cls(**kwargs)


def wrap_model(model: torch.nn.Module, ctx: Context, options: PrepareOptions,
               optimizer: Any = None) -> torch.nn.Module:
    """``model`` on its device, wrapped for ``options.strategy``; recorded on the runtime."""
    precision = precision_mod.resolve(options.mixed_precision, ctx.device)
    if options.strategy == "fsdp":
        wrapped = wrap_fsdp(model, ctx, precision, options.blocks, optimizer)
    else:
        model = model.to(ctx.device)
        _autocast(model, precision)
        wrapped = wrap_ddp(model, ctx, options) if ctx.distributed else model
    ctx.runtime.models[wrapped] = PreparedModel(strategy=options.strategy, precision=precision)
    return wrapped


def wrap_ddp(model: torch.nn.Module, ctx: Context, options: PrepareOptions) -> DistributedDataParallel:
    """The one place a model becomes ``DistributedDataParallel``, with its communication
    hook and bucket size (:mod:`.comm`)."""
    settings = options.comm_settings
    ddp = DistributedDataParallel(model, device_ids=ddp_device_ids(ctx.device),
                                  **settings.ddp_kwargs(ctx.backend))
    comm.attach(ddp, settings, backend=ctx.backend)
    return ddp


def wrap_fsdp(model: torch.nn.Module, ctx: Context, precision: precision_mod.Precision,
              blocks: Blocks, optimizer: Any) -> torch.nn.Module:
    """``model`` sharded with FSDP2's ``fully_shard``: each block, then the root.

    ``fully_shard`` replaces every parameter by a sharded ``DTensor``; an optimizer built
    before (the usual order) still holds the old ones, so it is pointed at the new ones by
    name. A world of one has nothing to shard: the model runs as it is, under the same
    precision, and checkpoints the same way, so runs move between 1 and N ranks.
    """
    model = model.to(ctx.device)
    if not ctx.distributed:
        _autocast(model, precision)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = {id(p): name for name, p in model.named_parameters()}
    _check_fresh(optimizer)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in select_blocks(model, blocks):
        fully_shard(block, mesh=mesh, mp_policy=precision.fsdp_policy(root=False))
    fully_shard(model, mesh=mesh, mp_policy=precision.fsdp_policy(root=True))
    if optimizer is not None:
        _rebind(optimizer, names, dict(model.named_parameters()))
    return model


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


def _autocast(model: torch.nn.Module, precision: precision_mod.Precision) -> None:
    # On the instance, so that the user's module (inside DDP, or unwrapped for
    # evaluation) runs the same way, and state_dict() is untouched.
    if precision.dtype is None or hasattr(model.forward, "__disttrain_precision__"):
        return
    model.forward = precision_mod.autocast_forward(model.forward, precision)


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
