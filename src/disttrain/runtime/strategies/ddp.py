"""DDP: a full replica of the model on every rank, gradients averaged in backward."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import comm
from .. import precision as precision_mod
from ..context import Context
from ..device import ddp_device_ids
from .base import Strategy, autocast


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` with the communication hook and bucket size of
    ``settings`` (:mod:`..comm`); None for a DDP model the script wrapped itself."""

    joins_uneven_batches: ClassVar[bool] = True

    def __init__(self, ctx: Context, precision: precision_mod.Precision,
                 settings: comm.CommSettings | None) -> None:
        super().__init__(ctx, precision)
        self.settings = settings

    def wrap(self, model: torch.nn.Module, optimizer: Any = None) -> torch.nn.Module:
        """The one place a model becomes ``DistributedDataParallel``."""
        model = model.to(self.ctx.device)
        autocast(model, self.precision)
        settings = self.settings or comm.CommSettings()
        ddp = DistributedDataParallel(model, device_ids=ddp_device_ids(self.ctx.device),
                                      **settings.ddp_kwargs(self.ctx.dist_backend))
        comm.attach(ddp, settings, dist_backend=self.ctx.dist_backend, optimizer=optimizer)
        return ddp

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()
