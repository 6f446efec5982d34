"""Staging a checkpoint's state in host memory without stalling training: buffers kept from one save
to the next, copies queued on a side stream.

The first GPU run measured 1.2 s blocked per asynchronous save of 1.6 GB of CUDA state, with a step
of 8 ms and a pinned copy of about 30 ms: the staging memory was allocated anew at every save
(DCP's ``FileSystemWriter`` stages without caching; pinning 1.6 GB costs about a second). Here:

- :class:`HostBuffers` keeps one host buffer per leaf of the state, sized at the first save and
  grown only when that leaf grows; its allocator is injected (pinned memory on a GPU, plain in the
  tests). A save leases the whole set: a second save's staging waits until the first one's bytes
  were serialised, so two saves never stage into the same memory.
- :func:`stage` queues every device-to-host copy on a side stream that first waits for the
  training's stream (the copies see the state as the step left it), records one event, and makes
  the training's stream wait for that event on the GPU -- not the host: the next optimizer step
  cannot overwrite a tensor before it is copied, yet the host returns to training at once. Whoever
  reads the host copies waits for the event first (:meth:`Staged.wait`).
- For sharded models (DCP's ``async_save``), :func:`dcp_stager` is torch's own ``DefaultStager``
  with pinned memory, kept for the process (its storages are cached between saves), and shielded
  from the ``close()`` torch versions differ about calling on a caller's stager.

Which of these runs is chosen by :func:`staging_for` from what the process has (CUDA, the torch
API), so that a CPU run keeps the plain path; the choice is a pure function, unit-tested.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

Allocator = Callable[[int], torch.Tensor]  # bytes -> a 1-D uint8 host tensor of that many bytes


def pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)


# -- the choice -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Staging:
    """How this process stages: ``host`` for rank 0's file (``"pinned-kept"``: :class:`HostBuffers`
    and a side stream; ``"as-is"``: CPU tensors are already on the host), ``dcp`` for shards
    (``"pinned-kept"``: a kept ``DefaultStager``; ``"writer"``: DCP's storage writer stages, as before)."""

    host: str
    dcp: str


def staging_for(*, cuda: bool, has_default_stager: bool, async_save_takes_stager: bool) -> Staging:
    """The staging a process uses: pinned and kept wherever there is CUDA state to copy; the plain
    path on CPU, where there is no device copy to hide and pinning would only cost memory."""
    if not cuda:
        return Staging(host="as-is", dcp="writer")
    kept_dcp = has_default_stager and async_save_takes_stager
    return Staging(host="pinned-kept", dcp="pinned-kept" if kept_dcp else "writer")


def this_process() -> Staging:
    """:func:`staging_for` with what this process has (torch's API checked once, here)."""
    import inspect

    import torch.distributed.checkpoint as dcp

    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401  (torch >= 2.9)
        has_default = True
    except ImportError:
        has_default = False
    takes = "async_stager" in inspect.signature(dcp.async_save).parameters
    return staging_for(cuda=torch.cuda.is_available(), has_default_stager=has_default, async_save_takes_stager=takes)


# -- buffers kept between saves ---------------------------------------------------------------------

class HostBuffers:
    """One host buffer per leaf of the staged state, kept between saves and grown only when a leaf
    outgrows its buffer; leased by one save at a time. ``clock`` times the wait for a lease."""

    def __init__(self, allocate: Allocator = pinned_bytes, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._allocate = allocate
        self._clock = clock
        self._buffers: dict[int, torch.Tensor] = {}
        self._leased = False
        self._free = threading.Condition()
        self.allocations = 0  # how many buffers were ever allocated (the first save's, then growth)
        self.allocated_bytes = 0
        self.last_wait_s = 0.0  # how long the last lease waited for the save before it

    def lease(self) -> None:
        """Take the buffers for one save, waiting until the save before released them."""
        start = self._clock()
        with self._free:
            while self._leased:
                self._free.wait()
            self._leased = True
        self.last_wait_s = self._clock() - start

    def release(self) -> None:
        with self._free:
            self._leased = False
            self._free.notify_all()

    def view(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped as ``like``, in the buffer of ``slot`` (grown if too small)."""
        if not self._leased:
            raise RuntimeError("HostBuffers.view() outside a lease: two saves would share the buffers")
        nbytes = like.numel() * like.element_size()
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._allocate(nbytes)
            self._buffers[slot] = buffer
            self.allocations += 1
            self.allocated_bytes += nbytes
        return buffer[:nbytes].view(like.dtype).view(like.shape)


# -- copies on a side stream ----------------------------------------------------------------------

class Copier(Protocol):
    """Queues device-to-host copies; ``finish()`` returns what :meth:`Staged.wait` waits on."""

    def copy(self, host: torch.Tensor, device: torch.Tensor) -> None: ...

    def finish(self) -> Any: ...


class CudaSideStream:
    """The copies on a stream of their own, kept for the process: it waits for the training's
    stream first; at the end the training's stream waits for it on the GPU (the host does not)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self._started = False

    def copy(self, host: torch.Tensor, device: torch.Tensor) -> None:
        if not self._started:
            self.stream.wait_stream(torch.cuda.current_stream())
            self._started = True
        with torch.cuda.stream(self.stream):
            host.copy_(device, non_blocking=True)
        device.record_stream(self.stream)  # its memory is not reused before the copy ran

    def finish(self) -> Any:
        self._started = False
        done = self.stream.record_event()
        torch.cuda.current_stream().wait_event(done)  # the next step's writes come after the copies
        return done


class Staged:
    """A staged state: ``value`` holds host tensors, readable once :meth:`wait` returned; the
    buffers go back with :meth:`release` (after the bytes were serialised)."""

    def __init__(self, value: Any, done: Any, buffers: HostBuffers | None) -> None:
        self.value = value
        self._done = done
        self._buffers = buffers

    def wait(self) -> Any:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self.value

    def release(self) -> None:
        buffers, self._buffers = self._buffers, None
        if buffers is not None:
            buffers.release()


def stage(value: Any, buffers: HostBuffers, copier: Copier, *, copy_host: bool = False,
          on_device: Callable[[Any], bool] = lambda t: t.is_cuda) -> Staged:
    """``value`` with each device tensor replaced by a host copy in ``buffers`` (leased here until
    :meth:`Staged.release`), every copy queued through ``copier``. Other leaves are kept as they are,
    except host tensors with ``copy_host`` (the value is serialised later, after training changed
    them in place: an optimizer's step count, a CPU buffer), which are cloned now."""
    leaves, spec = tree_flatten(value)
    buffers.lease()
    try:
        staged, copied = [], False
        for slot, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and on_device(leaf):
                host = buffers.view(slot, leaf)
                copier.copy(host, leaf.detach())
                staged.append(host)
                copied = True
            elif copy_host and isinstance(leaf, torch.Tensor):
                staged.append(leaf.detach().clone())
            else:
                staged.append(leaf)
        done = copier.finish() if copied else None
    except BaseException:
        buffers.release()
        raise
    return Staged(tree_unflatten(staged, spec), done, buffers)


# -- torch DCP's stager, kept ---------------------------------------------------------------------

class KeptStager:
    """torch's ``DefaultStager`` held for the process, its staging storages serving every save.

    Two closes are ignored until :meth:`dispose`: ``close()`` from ``async_save`` (which some torch
    versions call on a caller's stager after each save), and, in torch 2.11, the stager's own close
    of its inner ``StateDictStager`` at the end of every stage. That one empties the storage cache
    (every save allocates and pins its buffers anew: 1.1 s blocked per save of 1.6 GB on the first
    H200) and the copy dispatch table (the next save of FSDP state: ``KeyError: <class 'type'>``)."""

    def __init__(self, stager: Any) -> None:
        self._stager = stager
        self.closes_ignored = 0  # how often torch asked to close it (bench/gpu_probe.py reports it)
        self._inner = getattr(stager, "_state_dict_stager", None)
        if self._inner is not None:
            self._inner.close = self.close  # on the instance: the class's own close stays for dispose

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stager, name)

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        return self._stager.stage(state_dict, **kwargs)

    def synchronize_staging(self) -> None:
        self._stager.synchronize_staging()

    def close(self) -> None:
        """Kept: the staging storages serve the next save."""
        self.closes_ignored += 1

    def dispose(self) -> None:
        if self._inner is not None:
            del self._inner.close
        self._stager.close()


def dcp_stager(pinned: bool) -> KeptStager:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return KeptStager(DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                   use_async_staging=pinned, use_non_blocking_copy=pinned)))


_KEPT_DCP: list[KeptStager | None] = []


def kept_dcp_stager() -> KeptStager | None:
    """The process's DCP stager when :func:`this_process` stages shards pinned and kept, else None.
    Made on first use, on the main thread (torch makes its staging stream there)."""
    if not _KEPT_DCP:
        _KEPT_DCP.append(dcp_stager(pinned=True) if this_process().dcp == "pinned-kept" else None)
    return _KEPT_DCP[0]
