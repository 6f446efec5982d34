"""The random number generators a training step draws from, as plain values.

A resumed run is bit-for-bit the run that never stopped only if every generator carries on
from where it was: dropout draws from torch's CPU (or CUDA) generator, augmentations often
from python's ``random`` or numpy's global generator, and a DataLoader draws its workers'
seeds from its own ``generator``. Each rank's differ, so each rank's are saved. The values
are lists, numbers and tensors, so that ``torch.load(weights_only=True)`` reads them back.

numpy's ``Generator`` objects (``np.random.default_rng()``) are the caller's own and not
captured here: keep them in a checkpointed object, or draw from torch's generator.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def capture(generators: Sequence[torch.Generator | None] = ()) -> dict[str, Any]:
    """This process's generator states, plus those of ``generators`` (None stays None)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian],
        "torch": torch.get_rng_state(),
        # Only this process's device: asking for all of them would create a CUDA context
        # on every GPU of the node in every rank.
        "cuda": torch.cuda.get_rng_state() if _cuda_in_use() else None,
        "generators": [None if g is None else g.get_state() for g in generators],
    }


def restore(state: dict[str, Any], generators: Sequence[torch.Generator | None] = ()) -> None:
    """Put back what :func:`capture` returned, ``generators`` in the same order."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for generator, saved in zip(generators, state.get("generators", ())):
        if generator is not None and saved is not None:
            generator.set_state(saved)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()
