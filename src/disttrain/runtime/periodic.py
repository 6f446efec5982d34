"""Synchronising every H optimizer steps instead of every step: local SGD and DiLoCo.

``prepare(..., comm="localsgd:H")`` / ``"diloco:H"`` (or ``disttrain run --grad-compression``)
end here. Between synchronisations each rank trains alone on its own batches; DDP still wraps
the model (it broadcast rank 0's weights at the start, and Join and ``no_sync`` keep working)
but its gradient hook is torch's no-op one. Both modes keep an *anchor* (the replicas' common
weights) and send each rank's *pseudo-gradient*: the weights it started the period with minus
the weights it has now. Their average updates the anchor through an outer SGD:

- ``diloco`` -- DiLoCo (Douillard et al. 2023): Nesterov momentum :data:`OUTER_MOMENTUM`,
  learning rate :data:`OUTER_LR`. It streams (Streaming DiLoCo, Douillard et al. 2025): the
  flattened parameters are cut into :data:`FRAGMENTS` equal ranges, each synchronised every H
  steps, their turns staggered H/F steps apart, so the link carries a fragment every few steps
  instead of the whole model at the period's end.
- ``localsgd`` -- the same with one fragment, learning rate 1 and no momentum: the anchor
  becomes the ranks' average weights, which is local SGD.

Nothing waits on the wire (Overlap Local-SGD, Wang et al. 2020): a fragment's all-reduce is
started when its period ends and applied when its next period ends, the rank going on
meanwhile from the anchor plus its own progress in flight. The pseudo-gradient travels in
:data:`WIRE_DTYPE` (half fp32's bytes; the rounding falls on one period's progress, never on the
weights). So a link that moves the model's weights in bfloat16 within H steps of compute costs
nothing; the price is a one-period-stale update, which ``disttrain bench --comm`` measures.

At the end of each training epoch of a loader from ``prepare()`` both modes synchronise
fully (the period restarts), so that evaluation and epoch-end checkpoints see one model on
every rank. Between synchronisations the ranks' weights and inner optimizers differ: what
:func:`disttrain.resume` needs to continue bit-for-bit is each rank's own weights and inner
optimizer state (in its rank file: one more copy of the weights and optimizer per rank in
every checkpoint) plus the shared state (the anchor, the outer momentum, the averages in
flight, the step within the period; in the checkpoint's main file). Resumed by another
number of ranks (an elastic regroup) the period restarts from the checkpointed anchor: the
averages in flight are applied to it, every rank starts from the result with rank 0's inner
optimizer state, and the progress of the period that was in flight is lost (at most H steps).

Memory beyond plain DDP, per rank: the anchor and the start of the period (two copies of the
weights), the pseudo-gradients in flight (half a copy, bfloat16) and, for ``diloco``, the outer
momentum (a third copy).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

from ..errors import UsageError

__all__ = ["FRAGMENTS", "OUTER_LR", "OUTER_MOMENTUM", "WIRE_DTYPE", "attach", "epoch_end", "fragment_plan",
           "rank_state", "restore", "shared_state", "state_bytes"]

# DiLoCo's outer SGD, as the paper tuned it (Nesterov momentum 0.9, learning rate 0.7).
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
# Streaming DiLoCo's fragments (the paper's smallest models use a few; more only add messages).
FRAGMENTS = 4
# The pseudo-gradients' type on the wire: fp32's range, half its bytes.
WIRE_DTYPE = torch.bfloat16
# Where resume() keeps the state: the shared part in the checkpoint's main file, each
# rank's own in its rank file.
SHARED_KEY = "periodic_sync"
RANK_KEY = "periodic"


def fragment_plan(total: int, fragments: int, period: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The flattened parameters' ``total`` elements cut into at most ``fragments`` ranges of equal
    size (a range may split a tensor), and the step within the period at which each is
    synchronised: ``period * (f + 1) // F`` modulo ``period``, the last at the period's end."""
    count = max(1, min(fragments, period, total))
    bounds = [total * f // count for f in range(count + 1)]
    return list(zip(bounds, bounds[1:])), [period * (f + 1) // count % period for f in range(count)]


class Synchronizer:
    """One prepared model's periodic synchronisation, run after each step of ``optimizer``: the
    anchor, the outer SGD and the fragments' all-reduces in flight (see the module). The anchor,
    the start of the period and the momentum are flat, so that a fragment may split a tensor."""

    def __init__(self, ddp: Any, optimizer: Any, mode: str, period: int, *, outer_lr: float,
                 outer_momentum: float, fragments: int) -> None:
        self.mode = mode
        self._ddp = weakref.ref(ddp)  # the registry is weak on the model: hold no strong reference back
        self.optimizer = optimizer
        self.period = period
        self.lr, self.momentum = outer_lr, outer_momentum
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.group = dist.group.WORLD
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)  # inner steps send nothing
        self._offsets = [0]
        for param in self.params:
            self._offsets.append(self._offsets[-1] + param.numel())
        self.anchor = self._read(0, self.total)  # the replicas' common weights (DDP broadcast rank 0's)
        self.start = self.anchor.clone()  # this rank's weights when each fragment's period began
        self.velocity: torch.Tensor | None = None  # the outer momentum, from the first outer step
        self.fragments, self.turns = fragment_plan(self.total, fragments, period)
        self.step = 0  # inner steps since the period began, 0..period-1
        self._flight: list[tuple[Any, torch.Tensor] | None] = [None] * len(self.fragments)  # all-reduce, buffer
        self._received: list[torch.Tensor | None] = [None] * len(self.fragments)  # arrived, not applied
        self._hook = optimizer.register_step_post_hook(self._after_step)

    @property
    def total(self) -> int:
        return self._offsets[-1]

    @property
    def training(self) -> bool:
        ddp = self._ddp()
        return ddp is not None and ddp.training

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step = (self.step + 1) % self.period
        due = [f for f, turn in enumerate(self.turns) if turn == self.step]
        if not due:
            return
        global _waited
        began = time.perf_counter()
        for f in due:
            lo, hi = self.fragments[f]
            own = self.start[lo:hi] - self._read(lo, hi)
            arrived = self._arrived(f)
            sent = own.to(WIRE_DTYPE, copy=True)
            self._flight[f] = (dist.all_reduce(sent, group=self.group, async_op=True), sent)
            if arrived is not None:
                self._outer_step(lo, hi, arrived)
            self._rebase(lo, hi, own)
        _waited += time.perf_counter() - began

    def flush(self) -> None:
        """Synchronise fully now; the next period starts here."""
        for f, (lo, hi) in enumerate(self.fragments):
            arrived = self._arrived(f)
            if arrived is not None:
                self._outer_step(lo, hi, arrived)
        sent = (self.start - self._read(0, self.total)).to(WIRE_DTYPE)
        dist.all_reduce(sent, group=self.group)
        self._outer_step(0, self.total, self._average(sent))
        self._rebase(0, self.total, None)
        self.step = 0

    def _read(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of the flattened parameters, a copy."""
        with torch.no_grad():
            return torch.cat([param.detach().reshape(-1)[max(lo, at) - at:min(hi, end) - at]
                              for param, at, end in zip(self.params, self._offsets, self._offsets[1:])
                              if at < hi and end > lo])

    def _write(self, lo: int, hi: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            for param, at, end in zip(self.params, self._offsets, self._offsets[1:]):
                if at < hi and end > lo:
                    # a channels-last weight has no flat view: its elements in logical order, copied back
                    flat = param.view(-1) if param.is_contiguous() else param.detach().reshape(-1).clone()
                    flat[max(lo, at) - at:min(hi, end) - at] = values[max(lo, at) - lo:min(hi, end) - lo]
                    if not param.is_contiguous():
                        param.copy_(flat.view(param.shape))

    def _average(self, summed: torch.Tensor) -> torch.Tensor:
        return summed.to(self.anchor.dtype).div_(dist.get_world_size(self.group))

    def _arrived(self, f: int) -> torch.Tensor | None:
        """The average of fragment ``f``'s last pseudo-gradients (waiting for it), or None."""
        flight, self._flight[f] = self._flight[f], None
        if flight is not None:
            flight[0].wait()
            self._received[f] = self._average(flight[1])
        arrived, self._received[f] = self._received[f], None
        return arrived

    def _outer_step(self, lo: int, hi: int, averaged: torch.Tensor) -> None:
        """SGD on the anchor's ``lo:hi`` with the averaged pseudo-gradient (Nesterov momentum, as
        torch.optim.SGD computes it; written out because a fragment may split a tensor)."""
        step = averaged
        if self.momentum:
            if self.velocity is None:
                self.velocity = torch.zeros_like(self.anchor)
            velocity = self.velocity[lo:hi]
            velocity.mul_(self.momentum).add_(averaged)
            step = averaged + self.momentum * velocity
        self.anchor[lo:hi].sub_(step, alpha=self.lr)

    def _rebase(self, lo: int, hi: int, own: torch.Tensor | None) -> None:
        """The range's weights become the anchor plus this rank's own progress still in flight."""
        values = self.anchor[lo:hi] if own is None else self.anchor[lo:hi] - own
        self._write(lo, hi, values)
        self.start[lo:hi] = values

    def shared_state(self) -> dict[str, Any]:
        # a checkpoint waits for the all-reduces in flight
        self._received = [self._arrived(f) for f in range(len(self.fragments))]
        received = None if all(r is None for r in self._received) else [
            None if r is None else r.clone() for r in self._received]
        return {"mode": self.mode, "period": self.period, "fragments": len(self.fragments), "step": self.step,
                "anchor": self.anchor.clone(), "velocity": None if self.velocity is None else self.velocity.clone(),
                "received": received}

    def rank_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "params": _clones(self.params), "optimizer": self.optimizer.state_dict(),
                "start": self.start.clone()}

    def restore(self, shared: Mapping[str, Any] | None, own: Mapping[str, Any] | None) -> None:
        if shared is None or shared.get("mode") != self.mode or not isinstance(shared.get("anchor"), torch.Tensor):
            # A checkpoint of another mode (or of disttrain 0.6's layout): its weights, everyone's,
            # are the anchor.
            self.anchor = self._read(0, self.total)
            self.start = self.anchor.clone()
            self.velocity = None
            return
        device = self.anchor.device
        self.anchor = shared["anchor"].to(device).clone()
        velocity = shared.get("velocity")
        self.velocity = None if velocity is None else velocity.to(device).clone()
        saved = int(shared.get("fragments", 1))
        received = [None if r is None else r.to(device).clone() for r in (shared.get("received") or [None] * saved)]
        self._flight = [None] * len(self.fragments)
        if (own is not None and own.get("mode") == self.mode and shared.get("period") == self.period
                and saved == len(self.fragments)):
            self.step = int(shared["step"])
            self._received = received
            _copy_into(self.params, own["params"])
            self.optimizer.load_state_dict(own["optimizer"])
            self.start = own["start"].to(device).clone()
            return
        # Regrouped (or another H): the averages in flight land on the anchor, the period
        # restarts from there on every rank.
        ranges, _ = fragment_plan(self.total, saved, int(shared["period"]))
        for (lo, hi), arrived in zip(ranges, received):
            if arrived is not None:
                self._outer_step(lo, hi, arrived)
        self._received = [None] * len(self.fragments)
        self._rebase(0, self.total, None)
        self.step = 0

    def state_bytes(self) -> int:
        """Bytes of the tensors this mode keeps beside plain DDP's, now."""
        held = [self.anchor, self.start, *([self.velocity] if self.velocity is not None else [])]
        held += [f[1] for f in self._flight if f is not None] + [r for r in self._received if r is not None]
        return sum(t.numel() * t.element_size() for t in held)


# Seconds the synchronisations took since the step timer last asked (the bench's timeline).
_waited = 0.0


def take_waited() -> float:
    global _waited
    waited, _waited = _waited, 0.0
    return waited


# DDP models with a periodic synchronisation, in the order prepared.
_synchronizers: weakref.WeakKeyDictionary[Any, Synchronizer] = weakref.WeakKeyDictionary()


def attach(ddp: Any, optimizer: Any, mode: str, period: int) -> Synchronizer:
    """Make ``ddp`` synchronise every ``period`` steps of ``optimizer`` (``mode``: localsgd, diloco)."""
    if optimizer is None or not callable(getattr(optimizer, "register_step_post_hook", None)):
        raise UsageError(
            f"comm={mode!r} synchronises after every {period}th optimizer step: pass the "
            "torch.optim optimizer to prepare(model, optimizer, ...)")
    sync = (Synchronizer(ddp, optimizer, mode, period, outer_lr=1.0, outer_momentum=0.0, fragments=1)
            if mode == "localsgd" else
            Synchronizer(ddp, optimizer, mode, period, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                         fragments=FRAGMENTS))
    _synchronizers[ddp] = sync
    return sync


def active() -> list[Synchronizer]:
    return list(_synchronizers.values())


def epoch_end() -> None:
    """A training loader from ``prepare()`` ran out: every model in training synchronises."""
    for sync in active():
        if sync.training:
            sync.flush()


def shared_state() -> dict[str, Any]:
    """What every rank shares, for the checkpoint's main file (nothing without these modes)."""
    states = [sync.shared_state() for sync in active()]
    return {SHARED_KEY: states} if states else {}


def rank_state() -> dict[str, Any]:
    """This rank's own weights and inner optimizer state, for its rank file."""
    states = [sync.rank_state() for sync in active()]
    return {RANK_KEY: states} if states else {}


def restore(shared: Any, own: Mapping[str, Any] | None) -> None:
    """Put back :func:`shared_state` / :func:`rank_state` (``own`` None: this rank was not in the
    job that saved, or the number of ranks changed: the period restarts from the anchor)."""
    shared_states = shared if isinstance(shared, list) else []
    own_states = (own or {}).get(RANK_KEY) or []
    for k, sync in enumerate(active()):
        sync.restore(shared_states[k] if k < len(shared_states) else None,
                     own_states[k] if k < len(own_states) else None)


def state_bytes() -> int:
    return sum(sync.state_bytes() for sync in active())


def _clones(tensors: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _copy_into(targets: list[torch.Tensor], values: Any) -> None:
    with torch.no_grad():
        for target, value in zip(targets, values, strict=True):
            target.copy_(value)

