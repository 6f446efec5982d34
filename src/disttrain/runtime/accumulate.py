"""Gradient accumulation and clipping: several micro-batches summed into one optimizer step.

::

    step = disttrain.accumulate(model, optimizer, 4, clip_grad_norm=1.0)
    for x, y in state.steps(train_dl):
        with step:                              # no gradient sync on 3 of every 4 batches
            loss = F.cross_entropy(model(x), y)
            step.backward(loss)                 # loss / 4 (and scaled under fp16)
        if step.stepped:                        # the optimizer stepped at the 4th
            scheduler.step()

Gradients are averaged over the ranks once per optimizer step, not once per micro-batch:
DDP's ``no_sync()`` and FSDP's ``set_requires_gradient_sync(False)`` keep the accumulating
backward passes local. Under ``mixed_precision="fp16"`` the accumulator owns the
``GradScaler`` (saved with it: pass it to :func:`disttrain.resume` as ``accumulator=``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from ..errors import UsageError
from . import strategies
from .context import context, current


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``model`` to a total norm of ``max_norm``; returns the norm
    before clipping, the same on every rank (with FSDP, the norm of the whole gradient,
    not of this rank's shards: see the strategy's ``clip_grad_norm``)."""
    ctx = current()
    if ctx is None:  # nothing prepared yet: clipping needs no process group
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return full() if callable(full) else norm
    return strategies.of(model, ctx).clip_grad_norm(model, max_norm)


class Accumulator:
    """One optimizer step every ``steps`` micro-batches; see the module's documentation."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1,
                 *, clip_grad_norm: float | None = None) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise UsageError(f"accumulate(steps={steps!r}): micro-batches per optimizer step, "
                             "an integer >= 1")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise UsageError(f"accumulate(clip_grad_norm={clip_grad_norm!r}): a positive norm, "
                             "or None not to clip")
        self.strategy = strategies.of(model, context())
        self.strategy.check_optimizer(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.steps = steps
        self.clip_grad_norm = clip_grad_norm
        self.scaler = self.strategy.precision.scaler()
        self.micro = 0  # micro-batches since the last optimizer step
        self.stepped = False  # whether leaving the last block stepped the optimizer
        self.grad_norm: torch.Tensor | None = None  # before clipping, at the last step
        self._sync: contextlib.AbstractContextManager | None = None

    @property
    def syncing(self) -> bool:
        """Whether the micro-batch in the block is the last before the optimizer step."""
        return (self.micro + 1) % self.steps == 0

    def __enter__(self) -> Accumulator:
        self.stepped = False
        self._sync = self.strategy.no_sync(self.model) if not self.syncing else contextlib.nullcontext()
        self._sync.__enter__()
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        assert self._sync is not None
        self._sync.__exit__(kind, value, tb)
        self._sync = None
        if kind is not None:
            return
        self.micro += 1
        if self.micro % self.steps == 0:
            self._step()
            self.micro = 0

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for one micro-batch: divided by ``steps`` so that the summed
        gradients are the mean over the whole batch, and scaled under fp16."""
        loss = loss / self.steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def _step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        if self.clip_grad_norm is not None:
            self.grad_norm = self.strategy.clip_grad_norm(self.model, self.clip_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when a gradient overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.stepped = True

    def state_dict(self) -> dict[str, Any]:
        if self.micro:
            warnings.warn(
                f"checkpoint saved after {self.micro} of {self.steps} accumulated micro-batches: "
                "their gradients are not saved, so a run resumed from it differs; checkpoint "
                f"every multiple of {self.steps} steps", stacklevel=2)
        return {"micro": self.micro,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro = 0  # the accumulated gradients were not saved
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def accumulate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1, *,
               clip_grad_norm: float | None = None) -> Accumulator:
    """An :class:`Accumulator`: ``with`` it around each micro-batch's forward and backward."""
    return Accumulator(model, optimizer, steps, clip_grad_norm=clip_grad_norm)
