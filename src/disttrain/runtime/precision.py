"""Mixed precision: which dtype the forward computes in, and whether gradients need scaling.

``bf16`` has float32's exponent range, so gradients need no scaling and it runs on CPUs
as well as GPUs. ``fp16`` underflows small gradients unless the loss is scaled first
(``torch.amp.GradScaler``), and torch's CPU kernels for it are slow or missing, so it is
accepted on CUDA only. Every decision is a pure function of the name and the device, so
the CUDA choices are unit-tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UsageError

# The names prepare(mixed_precision=...) accepts; None and "no" mean full precision.
PRECISIONS = ("no", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The mixed-precision policy of one prepared model."""

    name: str  # one of PRECISIONS
    device_type: str  # "cpu" or "cuda"

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the forward computes in; None for full precision."""
        return _DTYPES.get(self.name)

    @property
    def needs_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16's do not."""
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast region of a forward under this policy (a no-op at full precision)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def fsdp_policy(self, *, root: bool) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``: parameters gathered in the low dtype, gradients
        reduced in float32 (summing many ranks' bf16 gradients loses digits). The root
        hands its outputs back in float32, so that the loss the script computes is not in
        bf16; the blocks inside keep theirs in the low dtype for the next layer."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32 if root else None)

    def scaler(self) -> torch.amp.GradScaler | None:
        """A fresh gradient scaler when this policy needs one, else None."""
        return torch.amp.GradScaler(self.device_type) if self.needs_scaler else None


def resolve(name: str | None, device: torch.device) -> Precision:
    """The policy for ``prepare(mixed_precision=name)`` on ``device``; refuses what cannot run."""
    chosen = "no" if name is None else name
    if chosen not in PRECISIONS:
        raise UsageError(
            f"prepare(mixed_precision={name!r}): unknown precision; use None (full float32), "
            "'bf16' (CPU or GPU) or 'fp16' (GPU only)")
    device = torch.device(device)
    if chosen == "fp16" and device.type != "cuda":
        raise UsageError(
            f"prepare(mixed_precision='fp16') on {device.type}: fp16 training needs a CUDA GPU; "
            "use mixed_precision='bf16' on CPU")
    return Precision(name=chosen, device_type=device.type)


def autocast_forward(forward: Callable, precision: Precision) -> Callable:
    """``forward`` run under ``precision``'s autocast, its floating outputs back in float32.

    The outputs go back to float32 so that a loss computed outside the model (as most
    scripts do) is not computed in the low dtype -- autocast covers only the forward.
    """

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with precision.autocast():
            out = forward(*args, **kwargs)
        return to_float32(out)

    run.__disttrain_precision__ = precision  # marks the forward as wrapped once already
    return run


def to_float32(value: Any) -> Any:
    """``value`` with each low-precision floating tensor in it cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    if isinstance(value, dict):
        return type(value)((k, to_float32(v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_float32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_float32(v) for v in value)
    return value
