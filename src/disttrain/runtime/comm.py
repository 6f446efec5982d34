"""Gradient communication: what DDP sends over the network, and in how many pieces.

``disttrain.prepare(..., grad_compression=..., bucket_mb=...)`` ends here. Compression uses
the communication hooks torch ships (``torch.distributed.algorithms.ddp_comm_hooks``); no
collective is written here. What each option trades:

- ``None`` / ``"none"``: fp32 all-reduce, exact; 4 bytes per gradient element on the wire.
- ``"fp16"``: gradients cast to float16 for the all-reduce (half the bytes). 10 bits of
  mantissa: the sum of the ranks' gradients is rounded, and values below ~6e-8 vanish.
- ``"bf16"``: the same with bfloat16: half the bytes, fp32's range, 7 bits of mantissa.
- ``"powersgd"`` (``"powersgd:R"``): each gradient matrix sent as a rank-R product
  (default R=2), with error feedback (what the approximation missed is added to the next
  step's gradient, so nothing is lost for good, only delayed). Sends a few percent of the
  bytes, at the price of some compute per step and a biased gradient; the first
  :data:`POWERSGD_START` steps are plain all-reduce, as torch recommends. Its state (each
  rank's error feedback, the warm-started factors, its random generator) is saved with each
  rank's own values by :func:`disttrain.resume`, so a resumed run stays bit-exact.

``bucket_mb`` is DDP's ``bucket_cap_mb`` (25 by default): smaller buckets start sending
earlier in the backward pass (more overlap with compute), larger ones send fewer messages.

The launcher's ``--grad-compression`` / ``--bucket-mb`` reach the workers as
``DISTTRAIN_GRAD_COMPRESSION`` / ``DISTTRAIN_BUCKET_MB`` (:mod:`disttrain.workerenv`); an
argument given to ``prepare`` wins.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import bounds
from ..errors import UsageError
from ..workerenv import WorkerEnv

if TYPE_CHECKING:  # torch is imported where it is used: the launcher validates with this module
    import torch

__all__ = ["COMPRESSIONS", "CommSettings", "PowerSGDCheckpoint", "attach", "gradient_bytes",
           "parse_compression", "rank_state", "restore_rank_state"]

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# Modes that synchronise every H steps instead of every step (runtime.periodic).
PERIODIC = ("localsgd", "diloco")
MODES = (*COMPRESSIONS, *PERIODIC)
# Steps between synchronisations when "localsgd"/"diloco" names none (periodic.DEFAULT_PERIOD).
DEFAULT_PERIOD = 16
# Backends whose collectives return futures, which every hook needs (MPI's do not).
HOOK_DIST_BACKENDS = ("gloo", "nccl")
POWERSGD_RANK = 2
# bucket_cap_mb that holds any model in one bucket (PowerSGD on gloo, see ddp_kwargs).
ONE_BUCKET_MB = 1 << 20
# Plain all-reduce for the first steps: DDP rebuilds its buckets after step 1 (PowerSGD's
# per-bucket memory must start after that), and torch advises a vanilla warm-up for accuracy.
POWERSGD_START = 10
# Where resume() keeps PowerSGD's state among each rank's own checkpoint values.
RANK_STATE_KEY = "powersgd"


def parse_compression(raw: str | None) -> tuple[str, int]:
    """``"powersgd:4"`` -> ``("powersgd", 4)``; ``"diloco:32"`` -> ``("diloco", 32)`` (H, the
    steps between synchronisations); ``None``/``""`` -> ``("none", 0)``.

    Raises :class:`UsageError` naming the choices for anything else.
    """
    if raw is None or raw == "":
        return "none", 0
    name, sep, number = str(raw).strip().lower().partition(":")
    if name not in MODES or (sep and name not in ("powersgd", *PERIODIC)):
        raise UsageError(
            f"unknown gradient compression {raw!r}: choose one of {', '.join(MODES)} "
            "(powersgd:R for a rank-R approximation, localsgd:H or diloco:H to synchronise every H steps)")
    if name not in ("powersgd", *PERIODIC):
        return name, 0
    if not sep:
        return name, POWERSGD_RANK if name == "powersgd" else DEFAULT_PERIOD
    if not number.isdigit() or int(number) < 1:
        what = "the PowerSGD rank" if name == "powersgd" else "the steps between synchronisations"
        raise UsageError(f"gradient compression {raw!r}: {what} after ':' must be a "
                         f"positive integer, e.g. {name}:{2 if name == 'powersgd' else DEFAULT_PERIOD}")
    what = "the PowerSGD rank" if name == "powersgd" else "the steps between synchronisations"
    return name, bounds.within(f"gradient compression {name}: {what} after ':'", int(number), 1,
                               1024 if name == "powersgd" else bounds.MAX_STEPS)


def check_launch_settings(grad_compression: str | None, bucket_mb: Any, *, dist_backend: str | None,
                          framework: str = "pytorch") -> None:
    """``disttrain run --grad-compression/--bucket-mb``, refused before anything starts when they
    cannot work (the launch spec carries them into the worker-env contract)."""
    name, _ = parse_compression(grad_compression)
    bucket = parse_bucket_mb(bucket_mb, flag="--bucket-mb")
    if name == "none" and bucket is None:
        return
    flag = "--grad-compression" if name != "none" else "--bucket-mb"
    if framework != "pytorch":
        raise UsageError(f"{flag} sets how PyTorch's DDP sends gradients; it does nothing with "
                         f"--framework {framework}: remove it")
    if name != "none" and dist_backend is not None and dist_backend not in HOOK_DIST_BACKENDS:
        raise UsageError(f"--grad-compression {grad_compression} cannot run on --dist-backend "
                         f"{dist_backend} (its collectives return no futures, which DDP's "
                         f"compression hooks need): use {' or '.join(HOOK_DIST_BACKENDS)}")
    if name == "powersgd":
        _check_single_bucket(bucket, dist_backend, flag="--bucket-mb")


def _check_single_bucket(bucket_mb: float | None, dist_backend: str | None, flag: str = "bucket_mb") -> None:
    if bucket_mb is not None and dist_backend == "gloo":
        raise UsageError(f"{flag} {bucket_mb:g} with powersgd on gloo: gloo needs PowerSGD's "
                         "gradients in one bucket (several make the ranks' collectives "
                         f"disagree); leave {flag} unset and disttrain uses one")


def parse_bucket_mb(raw: Any, *, flag: str = "bucket_mb") -> float | None:
    """A positive number of megabytes, or None (DDP's default)."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(raw, bool) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag} {raw!r}: the gradient bucket size must be a positive number "
                         "of megabytes, e.g. 25 (DDP's default)")
    return bounds.within(flag, value, 0, bounds.MAX_MB, unit="MB")


@dataclass(frozen=True, kw_only=True)
class CommSettings:
    """How a prepared DDP model communicates; validated on construction."""

    compression: str = "none"  # one of MODES
    powersgd_rank: int = 0
    period: int = 0  # localsgd / diloco: optimizer steps between synchronisations
    bucket_mb: float | None = None  # None: DDP's own default (25 MB)
    # disttrain bench's compute reference: every other step exchanges no gradient (torch's no-op hook)
    bench_no_sync: bool = False

    @classmethod
    def resolve(cls, grad_compression: str | None = None, bucket_mb: Any = None, *,
                env: WorkerEnv | None = None) -> CommSettings:
        """``prepare``'s arguments, else the launcher's defaults in ``env`` (the worker
        environment the context read once; None: no launcher defaults)."""
        env = env if env is not None else WorkerEnv.from_environ({})
        raw = grad_compression if grad_compression is not None else env.grad_compression
        name, number = parse_compression(raw)
        bucket = parse_bucket_mb(bucket_mb if bucket_mb is not None else env.bucket_mb)
        return cls(compression=name, powersgd_rank=number if name == "powersgd" else 0,
                   period=number if name in PERIODIC else 0, bucket_mb=bucket,
                   bench_no_sync=env.bench_no_sync)

    @property
    def label(self) -> str:
        name = (f"powersgd:{self.powersgd_rank}" if self.compression == "powersgd" else
                f"{self.compression}:{self.period}" if self.compression in PERIODIC else self.compression)
        return name + (f", {self.bucket_mb:g} MB buckets" if self.bucket_mb else "")

    def ddp_kwargs(self, dist_backend: str | None) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel`` itself."""
        if self.compression == "powersgd" and dist_backend == "gloo":
            # PowerSGD issues its second all-reduce of a bucket from the first one's callback;
            # with several buckets gloo's ranks then order their collectives differently and
            # the job fails or hangs ("Received data size doesn't match"). One bucket keeps a
            # single order; PowerSGD sends so little that overlap matters less.
            _check_single_bucket(self.bucket_mb, dist_backend)
            return {"bucket_cap_mb": ONE_BUCKET_MB}
        return {"bucket_cap_mb": self.bucket_mb} if self.bucket_mb is not None else {}


# Gradient bytes of the last model attach() saw, for the bench's step timer.
_gradient_bytes: int | None = None


def gradient_bytes_seen() -> int | None:
    """Bytes one uncompressed all-reduce of the last prepared DDP model sends; None when
    no DDP model was prepared in this process."""
    return _gradient_bytes


# DDP models with PowerSGD, and their state: what resume() checkpoints.
_powersgd: weakref.WeakKeyDictionary[Any, PowerSGDCheckpoint] = weakref.WeakKeyDictionary()


def attach(ddp: Any, settings: CommSettings, *, dist_backend: str | None, optimizer: Any = None) -> None:
    """Register ``settings``' communication hook on the DDP model ``ddp`` (and, for local SGD
    and DiLoCo, their synchronisation after each step of ``optimizer``: :mod:`.periodic`).

    Under ``disttrain bench --comm``'s compute reference, every other step's backward pass
    exchanges no gradient (torch's no-op hook) and the others all-reduce as plain DDP does, so
    that the step timer times steps with and without communication side by side in one run.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    global _gradient_bytes
    _gradient_bytes = gradient_bytes(getattr(ddp, "module", ddp))
    if settings.bench_no_sync:
        ddp.register_comm_hook({"backward": 0}, _every_other_step)
        return
    if settings.compression == "none":
        return
    if not isinstance(ddp, DistributedDataParallel):
        raise UsageError(
            f"grad_compression={settings.compression!r} needs a DistributedDataParallel model "
            f"(got {type(ddp).__name__}): use strategy DDP, or leave grad_compression unset")
    if dist_backend not in HOOK_DIST_BACKENDS:
        raise UsageError(
            f"grad_compression={settings.compression!r} cannot run on the {dist_backend!r} backend "
            f"(its collectives return no futures): use --dist-backend {' or '.join(HOOK_DIST_BACKENDS)}, "
            "or leave the compression unset")
    if settings.compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif settings.compression == "bf16":
        # torch's hook refuses to register unless CUDA with NCCL >= 2.10 is there, a limit of
        # NCCL's: gloo all-reduces bfloat16 on the CPU, so on gloo the same hook goes in
        # under another name.
        hook = default_hooks.bf16_compress_hook if dist_backend == "nccl" else _bf16_on_gloo
        ddp.register_comm_hook(None, hook)
    elif settings.compression in PERIODIC:
        from . import periodic

        periodic.attach(ddp, optimizer, settings.compression, settings.period)
    elif settings.compression == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=settings.powersgd_rank,
            start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True)
        saved = PowerSGDCheckpoint(ddp, state)
        ddp.register_comm_hook(saved, _powersgd_with_layout)
        _powersgd[ddp] = saved


# The hooks carry no annotations: torch checks them, and this module's are strings.
def _bf16_on_gloo(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _powersgd_with_layout(state, bucket):
    """torch's PowerSGD hook, noting which parameters each bucket holds (see
    :class:`PowerSGDCheckpoint`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    state.check_layout(bucket)
    return powersgd.powerSGD_hook(state.state, bucket)


class PowerSGDCheckpoint:
    """PowerSGD's state as a ``state_dict`` of tensors and plain values (for ``weights_only``
    loading), and the hook's state object.

    torch keeps the error feedback and the warm-started factors P and Q as one flat tensor
    per DDP *bucket*, in the order of the bucket's parameters. That order changes: a new DDP
    (a resumed run) fills its buckets in parameter order, and after its first step rebuilds
    them in the order the gradients became ready, which is what the run that never stopped
    had all along. So whenever a bucket holds other parameters, or the same ones in another
    order, than the memory under its index was made for, the memory is cut into per-parameter
    pieces and put together again for the new layout -- the per-matrix arithmetic is the same
    either way, so the run stays bit-for-bit. A parameter without saved pieces (another
    model) gets fresh memory, with a warning.
    """

    def __init__(self, ddp: Any, state: Any) -> None:
        self.state = state
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._shapes = {name: tuple(p.shape) for name, p in ddp.module.named_parameters()}
        self._layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> its memory's parameters
        self._pieces: dict[str, tuple[Any, Any, Any]] = {}  # per parameter: error, P, Q slices
        self._pieces_iter = -1  # the step the pieces were cut at

    def check_layout(self, bucket: Any) -> None:
        """Before torch's hook sees ``bucket``: make its memory match the bucket's layout."""
        index = bucket.index()
        layout = tuple(self._names.get(id(p), "?") for p in bucket.parameters())
        s = self.state
        if self._layouts.get(index) != layout and (s.error_dict or self._pieces_iter == s.iter):
            # Cut once per step, before the first re-laid-out bucket changes anything: every
            # bucket still holds what the last step (or the checkpoint) left in it.
            if self._pieces_iter != s.iter:
                self._pieces = self._cut()
                self._pieces_iter = s.iter
            self._join(index, layout)
        self._layouts[index] = layout

    def _offsets(self, layout: tuple[str, ...]) -> tuple[dict, dict]:
        """Where each parameter lies in a bucket of this layout: (error slices, P/Q slices),
        following torch's hook (matrices worth compressing, grouped by shape in order of
        first appearance)."""
        errors, at = {}, 0
        groups: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
        for name in layout:
            shape = self._shapes[name]
            numel = math.prod(shape)
            errors[name] = (at, at + numel)
            at += numel
            n = shape[0] if shape else 1
            m = numel // n if n else 0
            rank = min(n, m, self.state.matrix_approximation_rank)
            if (n + m) * rank * self.state.min_compression_rate < n * m:
                groups.setdefault((n, m), []).append((name, n, m, rank))
        factors, p_at, q_at = {}, 0, 0
        for members in groups.values():
            for name, n, m, rank in members:
                factors[name] = ((p_at, p_at + n * rank), (q_at, q_at + m * rank))
                p_at, q_at = p_at + n * rank, q_at + m * rank
        return errors, factors

    def _cut(self) -> dict[str, tuple[Any, Any, Any]]:
        s, pieces = self.state, {}
        for index, layout in self._layouts.items():
            if index not in s.error_dict or "?" in layout:
                continue
            errors, factors = self._offsets(layout)
            for name in layout:
                lo, hi = errors[name]
                p = q = None
                if name in factors and index in s.p_memory_dict:
                    (p_lo, p_hi), (q_lo, q_hi) = factors[name]
                    p = s.p_memory_dict[index][p_lo:p_hi].clone()
                    q = s.q_memory_dict[index][q_lo:q_hi].clone()
                pieces[name] = (s.error_dict[index][lo:hi].clone(), p, q)
        return pieces

    def _join(self, index: int, layout: tuple[str, ...]) -> None:
        import torch

        s = self.state
        errors, factors = self._offsets(layout)
        missing = [name for name in layout if name not in self._pieces]
        missing += [name for name in factors if self._pieces.get(name, (None, None))[1] is None]
        for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            memory.pop(index, None)
        if missing:
            warnings.warn(
                f"disttrain: no saved PowerSGD memory for {missing[0]} (bucket {index}): its "
                "error feedback starts from zero; training is correct, but not bit-for-bit "
                "the run that was interrupted", stacklevel=3)
            return
        s.error_dict[index] = torch.cat([self._pieces[name][0] for name in layout])
        order = sorted(factors, key=lambda name: factors[name][0])
        if order:
            s.p_memory_dict[index] = torch.cat([self._pieces[name][1] for name in order])
            s.q_memory_dict[index] = torch.cat([self._pieces[name][2] for name in order])

    def state_dict(self) -> dict[str, Any]:
        import torch

        s = self.state
        kind, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "iter": s.iter,
            "matrix_approximation_rank": s.matrix_approximation_rank,
            "error": {int(k): v.detach().cpu().clone() for k, v in s.error_dict.items()},
            "p": {int(k): v.detach().cpu().clone() for k, v in s.p_memory_dict.items()},
            "q": {int(k): v.detach().cpu().clone() for k, v in s.q_memory_dict.items()},
            "rng": {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                    "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
            "layouts": {int(k): list(v) for k, v in self._layouts.items()},
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        import numpy as np
        import torch

        s = self.state
        if saved["matrix_approximation_rank"] != s.matrix_approximation_rank:
            warnings.warn(
                f"disttrain: the checkpoint's PowerSGD state is for rank "
                f"{saved['matrix_approximation_rank']}, this run uses "
                f"{s.matrix_approximation_rank}: starting PowerSGD's memory afresh", stacklevel=2)
            s.iter = saved["iter"]
            return
        device = next((p.device for p in _params(self)), torch.device("cpu"))
        s.iter = saved["iter"]
        s.error_dict = {int(k): v.to(device) for k, v in saved["error"].items()}
        s.p_memory_dict = {int(k): v.to(device) for k, v in saved["p"].items()}
        s.q_memory_dict = {int(k): v.to(device) for k, v in saved["q"].items()}
        rng = saved["rng"]
        s.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"],
                         rng["has_gauss"], rng["cached"]))
        self._layouts = {int(k): tuple(v) for k, v in saved["layouts"].items()}
        self._pieces_iter = -1


def _params(saved: PowerSGDCheckpoint):
    for ddp, state in list(_powersgd.items()):
        if state is saved:
            yield from ddp.parameters()


def rank_state() -> dict[str, Any]:
    """This rank's PowerSGD state for :func:`disttrain.resume`'s per-rank checkpoint files
    (the error feedback is each rank's own), or nothing when no model uses PowerSGD."""
    states = [saved.state_dict() for saved in list(_powersgd.values())]
    return {RANK_STATE_KEY: states} if states else {}


def restore_rank_state(saved: Mapping[str, Any] | None) -> None:
    """Put back what :func:`rank_state` saved into the PowerSGD models prepared now, in the
    order they were prepared; a checkpoint without it leaves them fresh."""
    states = (saved or {}).get(RANK_STATE_KEY) or []
    for current, state in zip(list(_powersgd.values()), states):
        current.load_state_dict(state)


def state_bytes() -> int:
    """Bytes of the tensors this process's communication modes keep beside plain DDP's: PowerSGD's
    error feedback and factors, local SGD's / DiLoCo's copies of the weights (``bench --comm``
    reports it per mode)."""
    import sys

    total = 0
    for saved in list(_powersgd.values()):
        s = saved.state
        for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            total += sum(t.numel() * t.element_size() for t in memory.values())
    periodic = sys.modules.get(f"{__package__}.periodic")  # loaded only where a mode uses it
    return total + (periodic.state_bytes() if periodic is not None else 0)


# Whether a gradient all-reduce ran since the step timer last asked (bench --comm's reference).
_synced = False


def _every_other_step(state, bucket):  # unannotated: DDP rejects a hook whose annotations are not its types
    """DDP hook: the odd backward passes all-reduce (torch's own hook), the even send nothing.
    Every rank counts the same passes, so all of them sync on the same steps."""
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks

    global _synced
    sync = state["backward"] % 2 == 1
    if bucket.is_last():
        state["backward"] += 1
    if not sync:
        return debugging_hooks.noop_hook(None, bucket)
    _synced = True
    return default_hooks.allreduce_hook(None, bucket)


def take_synced() -> bool:
    """Whether gradients were all-reduced since the last call (the step timer's paired steps)."""
    global _synced
    synced, _synced = _synced, False
    return synced


def sync_waited() -> float:
    """Seconds local SGD / DiLoCo spent synchronising since the last call (the step timer's timeline)."""
    import sys

    periodic = sys.modules.get(f"{__package__}.periodic")
    return periodic.take_waited() if periodic is not None else 0.0


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients one uncompressed all-reduce sends: every trainable parameter."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
