"""Synchronising every H optimizer steps instead of every step: local SGD and DiLoCo.

``prepare(..., comm="localsgd:H")`` / ``"diloco:H"`` (or ``disttrain run --grad-compression``)
end here. Between synchronisations each rank trains alone on its own batches; DDP still wraps
the model (it broadcast rank 0's weights at the start, and Join and ``no_sync`` keep working)
but its gradient hook sends nothing. What each mode sends, once per H steps:

- ``localsgd`` -- torch's post-local SGD pieces: the ``post_localSGD`` communication hook
  (local from the first step, no intra-node all-reduce) and a ``PeriodicModelAverager`` run
  after each optimizer step, which all-reduces the weights every H steps. The all-reduce
  blocks the step that ends the period: nothing is overlapped.
- ``diloco`` -- an outer optimizer over the averaged progress (DiLoCo, Douillard et al. 2023):
  at the end of a period each rank's pseudo-gradient is the weights it started the period
  with minus the weights it has now; their average is applied to the *anchor* (the
  replicas' common weights) by SGD with Nesterov momentum (:data:`OUTER_LR`,
  :data:`OUTER_MOMENTUM`). The all-reduce is overlapped with the next period's H inner
  steps: it is started at the end of a period and applied at the end of the next one
  (Overlap Local-SGD's one-period delay), the rank going on meanwhile from the anchor plus
  its own progress of the period in flight. So a link that moves the weights within H steps
  costs nothing; the price is a stale update, which ``disttrain bench --comm`` measures.

At the end of each training epoch of a loader from ``prepare()`` both modes synchronise
fully (the period restarts), so that evaluation and epoch-end checkpoints see one model on
every rank. Between synchronisations the ranks' weights and inner optimizers differ: what
:func:`disttrain.resume` needs to continue bit-for-bit is each rank's own weights and inner
optimizer state (in its rank file: one more copy of the weights and optimizer per rank in
every checkpoint) plus the shared state (the anchor, the outer momentum, the average in
flight, the step within the period; in the checkpoint's main file). Resumed by another
number of ranks (an elastic regroup) the period restarts from the checkpointed anchor: the
average in flight is applied to it, every rank starts from the result with rank 0's inner
optimizer state, and the progress of the period that was in flight is lost (at most H steps).

Memory beyond plain DDP, per rank: ``localsgd`` none (torch averages in place through one
flat buffer while syncing); ``diloco`` four copies of the weights (the anchor, the outer
momentum, the start of the period, the pseudo-gradient in flight).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging import utils as averaging

from ..errors import UsageError

__all__ = ["OUTER_LR", "OUTER_MOMENTUM", "attach", "epoch_end", "rank_state",
           "restore", "shared_state", "state_bytes"]

# DiLoCo's outer SGD, as the paper tuned it (Nesterov momentum 0.9, learning rate 0.7).
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
# Where resume() keeps the state: the shared part in the checkpoint's main file, each
# rank's own in its rank file.
SHARED_KEY = "periodic_sync"
RANK_KEY = "periodic"


class Synchronizer:
    """One prepared model's periodic synchronisation, run after each step of ``optimizer``."""

    mode = ""

    def __init__(self, ddp: Any, optimizer: Any, period: int) -> None:
        self._ddp = weakref.ref(ddp)  # the registry is weak on the model: hold no strong reference back
        self.optimizer = optimizer
        self.period = period
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.group = dist.group.WORLD
        self._hook = optimizer.register_step_post_hook(self._after_step)

    @property
    def training(self) -> bool:
        ddp = self._ddp()
        return ddp is not None and ddp.training

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Synchronise fully now; the next period starts here."""
        raise NotImplementedError

    @property
    def step_in_period(self) -> int:
        raise NotImplementedError

    def shared_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def rank_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "params": _clones(self.params),
                "optimizer": self.optimizer.state_dict()}

    def restore(self, shared: Mapping[str, Any] | None, own: Mapping[str, Any] | None) -> None:
        raise NotImplementedError

    def _restore_own(self, own: Mapping[str, Any]) -> None:
        _copy_into(self.params, own["params"])
        self.optimizer.load_state_dict(own["optimizer"])

    def state_bytes(self) -> int:
        """Bytes of the tensors this mode keeps beside plain DDP's, now."""
        return 0


class LocalSGD(Synchronizer):
    """torch's post-local SGD: a hook that keeps gradients local, weights averaged every H steps."""

    mode = "localsgd"

    def __init__(self, ddp: Any, optimizer: Any, period: int) -> None:
        super().__init__(ddp, optimizer, period)
        # Local from the first step: a warm-up of global all-reduces costs what the mode is
        # there to save on a slow link; the bench measures the accuracy this costs.
        state = post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                                             post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, post_local.post_localSGD_hook)
        self.averager = averagers.PeriodicModelAverager(period=period, warmup_steps=0)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.averager.average_parameters(self.params)

    def flush(self) -> None:
        averaging.average_parameters(iter(self.params), self.group)
        self.averager.step = 1  # the averager's next average: H steps from here

    @property
    def step_in_period(self) -> int:
        return (self.averager.step - 1) % self.period

    def shared_state(self) -> dict[str, Any]:
        return {"mode": self.mode, "period": self.period, "averager_step": self.averager.step}

    def restore(self, shared: Mapping[str, Any] | None, own: Mapping[str, Any] | None) -> None:
        if shared is None or shared.get("mode") != self.mode:
            return  # a checkpoint of another mode: the weights it holds are everyone's
        if own is not None and own.get("mode") == self.mode and shared.get("period") == self.period:
            self.averager.step = int(shared["averager_step"])
            self._restore_own(own)
        else:  # regrouped: every rank holds rank 0's weights, the period starts from them
            self.averager.step = 1


class DiLoCo(Synchronizer):
    """Inner steps with the script's optimizer, an outer Nesterov SGD on the averaged
    pseudo-gradient, its all-reduce overlapped with the next period (see the module)."""

    mode = "diloco"

    def __init__(self, ddp: Any, optimizer: Any, period: int, *, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

        super().__init__(ddp, optimizer, period)
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)  # inner steps send nothing
        self.anchor = _clones(self.params)  # the replicas' common weights (DDP broadcast rank 0's)
        self.start = _clones(self.params)  # this rank's weights when the period began
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        self.step = 0  # inner steps of this period done
        self._work: Any = None  # the last period's all-reduce, in flight
        self._sent: torch.Tensor | None = None  # its buffer (summed in place)
        self._received: torch.Tensor | None = None  # its average, arrived, not yet applied

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        if self.step < self.period:
            return
        self.step = 0
        own = self._pseudo_gradient()
        arrived = self._arrived()
        self._sent = own.clone()
        self._work = dist.all_reduce(self._sent, group=self.group, async_op=True)
        if arrived is not None:
            self._outer_step(arrived)
        self._rebase(own)

    def flush(self) -> None:
        arrived = self._arrived()
        if arrived is not None:
            self._outer_step(arrived)
        own = self._pseudo_gradient()
        dist.all_reduce(own, group=self.group)
        self._outer_step(own.div_(dist.get_world_size(self.group)))
        self._rebase(None)
        self.step = 0

    @property
    def step_in_period(self) -> int:
        return self.step

    def _pseudo_gradient(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(self.start, self.params)])

    def _arrived(self) -> torch.Tensor | None:
        """The average of the last period's pseudo-gradients (waiting for it), or None."""
        if self._work is not None:
            self._work.wait()
            assert self._sent is not None
            self._received = self._sent.div_(dist.get_world_size(self.group))
            self._work = self._sent = None
        arrived, self._received = self._received, None
        return arrived

    def _outer_step(self, averaged: torch.Tensor) -> None:
        for anchor, piece in zip(self.anchor, _pieces(averaged, self.anchor)):
            anchor.grad = piece
        self.outer.step()
        for anchor in self.anchor:
            anchor.grad = None

    def _rebase(self, own: torch.Tensor | None) -> None:
        """The weights become the anchor plus this rank's own progress still in flight."""
        with torch.no_grad():
            pieces = _pieces(own, self.anchor) if own is not None else [None] * len(self.anchor)
            for param, start, anchor, piece in zip(self.params, self.start, self.anchor, pieces):
                param.copy_(anchor if piece is None else anchor - piece)
                start.copy_(param)

    def shared_state(self) -> dict[str, Any]:
        arrived = self._arrived()  # a checkpoint waits for the all-reduce in flight
        self._received = arrived
        return {"mode": self.mode, "period": self.period, "step": self.step, "anchor": _clones(self.anchor),
                "outer": self.outer.state_dict(), "received": None if arrived is None else arrived.clone()}

    def rank_state(self) -> dict[str, Any]:
        return {**super().rank_state(), "start": _clones(self.start)}

    def restore(self, shared: Mapping[str, Any] | None, own: Mapping[str, Any] | None) -> None:
        if shared is None or shared.get("mode") != self.mode:
            # A checkpoint of another mode: its weights, everyone's, are the anchor.
            self.anchor = _clones(self.params)
            self.start = _clones(self.params)
            self.outer = torch.optim.SGD(self.anchor, **{k: v for k, v in self.outer.defaults.items()
                                                          if k in ("lr", "momentum", "nesterov")})
            return
        _copy_into(self.anchor, shared["anchor"])
        self.outer.load_state_dict(shared["outer"])
        self._work = self._sent = None
        received = shared.get("received")
        self._received = None if received is None else received.to(self.anchor[0].device).clone()
        if own is not None and own.get("mode") == self.mode and shared.get("period") == self.period:
            self.step = int(shared["step"])
            self._restore_own(own)
            _copy_into(self.start, own["start"])
            return
        # Regrouped (or another H): the average in flight lands on the anchor, the period
        # restarts from there on every rank.
        arrived = self._arrived()
        if arrived is not None:
            self._outer_step(arrived)
        self._rebase(None)
        self.step = 0

    def state_bytes(self) -> int:
        # the anchor, the outer momentum, the start of the period, the pseudo-gradient in flight
        held = [*self.anchor, *self.start, *(s["momentum_buffer"] for s in self.outer.state.values()
                                           if s.get("momentum_buffer") is not None)]
        held += [t for t in (self._sent, self._received) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)


# DDP models with a periodic synchronisation, in the order prepared.
_synchronizers: weakref.WeakKeyDictionary[Any, Synchronizer] = weakref.WeakKeyDictionary()


def attach(ddp: Any, optimizer: Any, mode: str, period: int) -> Synchronizer:
    """Make ``ddp`` synchronise every ``period`` steps of ``optimizer`` (``mode``: localsgd, diloco)."""
    if optimizer is None or not callable(getattr(optimizer, "register_step_post_hook", None)):
        raise UsageError(
            f"comm={mode!r} synchronises after every {period}th optimizer step: pass the "
            "torch.optim optimizer to prepare(model, optimizer, ...)")
    sync = LocalSGD(ddp, optimizer, period) if mode == "localsgd" else DiLoCo(ddp, optimizer, period)
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


def _pieces(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out
