"""What changes when the training device is a GPU: pure decisions plus the batch copy.

Each decision takes the device as an argument, so the CUDA path is exercised by unit tests
on machines without a GPU (a ``torch.device("cuda:1")`` can be built anywhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def pin_memory_for(device: torch.device) -> bool:
    """Whether a loader feeding ``device`` should pin its batches.

    Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously;
    on CPU it only costs memory, and torch warns about it without an accelerator.
    """
    return is_cuda(device)


def non_blocking_for(device: torch.device) -> bool:
    """Whether batch copies to ``device`` may be asynchronous.

    Safe for CUDA because kernels that read the batch are queued on the same stream as the
    copy; only meaningful together with pinned memory (:func:`pin_memory_for`).
    """
    return is_cuda(device)


def batch_target(device: torch.device) -> torch.device | None:
    """Where a prepared loader moves its batches, or None to hand them over untouched.

    On CPU the batches already live where the model does; copying would only cost time.
    """
    device = torch.device(device)
    return device if device.type == "cuda" else None


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """``device_ids`` for DistributedDataParallel: the one GPU of this process, or None.

    DDP requires None for CPU modules; for a single-GPU module naming the device makes
    DDP place its buckets and the forward's inputs on it.
    """
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        return None
    return [device.index]


def move_to(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists, dicts) moved to ``device``.

    Other leaves (strings, numbers, None) are passed through; containers keep their type,
    named tuples included.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: move_to(v, device, non_blocking=non_blocking) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:  # a Mapping whose constructor takes something else
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(move_to(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device, non_blocking=non_blocking) for v in batch)
    return batch
