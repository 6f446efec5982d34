"""Is the network the limit? A step split into compute and communication, and whether
gradient compression is worth turning on.

``disttrain bench --comm`` times each multi-process count, through the same step timer, as
asked, with each compression, and its compute reference: the same count with DDP exchanging
no gradients at all (torch's no-op communication hook: the same steps, the same ranks sharing
the same cores, no wire), with denormal floats flushed to zero, the better of OpenMP's two ways
of waiting. From them:

- compute time per step = the reference's step; communication = what the synchronous step
  adds to it (what the all-reduce adds after overlapping with the backward pass);
- the bus bandwidth that communication time implies for the gradient size, against the
  ring all-reduce's bound 2(N-1)/N * S / B when the link rate B is given;
- a recommendation: the fastest compression if it beats plain DDP by more than
  :data:`WORTH`, else none (a compute-bound job gains nothing and pays accuracy).

The reference must bound every run, and once did not: on two namespace "hosts" sharing 2
cores it measured 273 samples/s against PowerSGD's 1,174 and plain DDP's 114. Two causes,
each measured here: OpenMP threads busy-wait between parallel regions, and each host gave each
rank 2 threads, so with all ranks computing at once 4 threads spun for 2 cores (passive
waiting: 132 -> 859 samples/s); and the exact gradients of a model near convergence drive the
arithmetic into denormal floats, the CPU's slow path, which fp16's rounding and PowerSGD's
approximation never take (flushed: 859 -> 2,012, above PowerSGD's 1,886). Should a run still
beat the reference (noise), the split is not given rather than given wrong.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..runtime.comm import POWERSGD_START
from ..workerenv import BENCH_FLUSH_DENORMAL, BENCH_NO_SYNC
from . import runner

# A compression must beat plain all-reduce by this factor to be recommended: below it the
# gain is within the noise of a shared machine and not worth the rounding of the gradients.
WORTH = 1.05
# Communication at or above this share of a step makes the job communication-bound.
COMM_BOUND = 0.2
# A run at most this much faster than the compute reference ran at the same speed, measured twice:
# a compute-bound job's plain DDP is within noise of the reference. Faster still: the reference was
# no upper bound (noise), and no split is made from it.
REFERENCE_NOISE = 0.05


@dataclass(frozen=True)
class Choice:
    name: str  # "none" or a compression
    speedup: float  # its samples/s over plain DDP's
    reason: str


def recommend_compression(plain: float, compressed: dict[str, float]) -> Choice:
    """The compression to use given samples/s measured with plain DDP and with each one."""
    if not compressed:
        return Choice("none", 1.0, "no compression was measured")
    best = max(compressed, key=lambda name: compressed[name])
    speedup = compressed[best] / plain
    if speedup >= WORTH:
        return Choice(best, speedup, f"--grad-compression {best}: {speedup:.2f}x the samples/s "
                      "of plain DDP here")
    return Choice("none", 1.0, f"compression is not worth it here: the best ({best}) reached "
                  f"{speedup:.2f}x the samples/s of plain DDP (worth it from {WORTH:.2f}x)")


@dataclass(frozen=True)
class Split:
    """One process count's step, split."""

    step_s: float  # with gradient sync
    compute_s: float  # without (no-op hook)
    gradient_bytes: int | None
    world_size: int

    @property
    def comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def bound(self) -> str:
        return "communication" if self.comm_fraction >= COMM_BOUND else "compute"

    def bus_gbit(self) -> float | None:
        """Bus bandwidth the exposed communication time implies: 2(N-1)/N * S / t, in Gbit/s
        (a lower bound on the link's: overlap with the backward pass hides some of it)."""
        if not self.gradient_bytes or self.comm_s <= 0 or self.world_size < 2:
            return None
        return ring_bytes(self.gradient_bytes, self.world_size) * 8 / self.comm_s / 1e9


def ring_bytes(gradient_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``gradient_bytes``."""
    return 2 * (world_size - 1) / world_size * gradient_bytes


def ring_bound_s(gradient_bytes: int, world_size: int, link_gbit: float) -> float:
    """The ring all-reduce's lower bound on time over a ``link_gbit`` link."""
    return ring_bytes(gradient_bytes, world_size) * 8 / (link_gbit * 1e9)


def step_seconds(samples_per_s: float, global_batch: int) -> float:
    return global_batch / samples_per_s


# --------------------------------------------------------------------------- the measuring

# Compressions tried by `disttrain bench --comm` (bf16 moves the same bytes as fp16).
TRIED = ("fp16", "powersgd")


@dataclass(frozen=True)
class CommResult:
    """One process count, measured with sync, with each compression, and its compute reference."""

    nproc: int
    world_size: int
    global_batch: int
    plain: float | None  # samples/s
    compute_only: float | None  # the reference: no gradient sync, denormals flushed (an upper bound)
    compressed: dict[str, float]
    gradient_bytes: int | None
    link_gbit: float | None
    errors: tuple[str, ...] = ()

    @property
    def beaten_by(self) -> tuple[str, float] | None:
        """A run clearly faster than the reference (by more than :data:`REFERENCE_NOISE`), which
        then is no upper bound (noise): name, rate."""
        if not self.compute_only:
            return None
        rates = {"plain DDP": self.plain or 0.0, **self.compressed}
        name = max(rates, key=lambda k: rates[k])
        return (name, rates[name]) if rates[name] > self.compute_only * (1 + REFERENCE_NOISE) else None

    @property
    def split(self) -> Split | None:
        if not self.plain or not self.compute_only or self.beaten_by:
            return None
        return Split(step_s=step_seconds(self.plain, self.global_batch),
                     compute_s=step_seconds(self.compute_only, self.global_batch),
                     gradient_bytes=self.gradient_bytes, world_size=self.world_size)

    @property
    def choice(self) -> Choice | None:
        return recommend_compression(self.plain, self.compressed) if self.plain else None

    def to_json(self) -> dict:
        split, choice = self.split, self.choice
        bound = (ring_bound_s(self.gradient_bytes, self.world_size, self.link_gbit)
                 if self.gradient_bytes and self.link_gbit else None)
        beaten = self.beaten_by
        return {
            "nproc": self.nproc, "world_size": self.world_size,
            "samples_per_s": {"plain": self.plain, "compute_reference": self.compute_only, **self.compressed},
            "reference": "no gradient sync, denormals flushed, the better OpenMP wait (an upper bound)",
            "reference_beaten_by": {"run": beaten[0], "samples_per_s": beaten[1]} if beaten else None,
            "gradient_bytes": self.gradient_bytes,
            "step_s": split.step_s if split else None,
            "compute_s": split.compute_s if split else None,
            "comm_s": split.comm_s if split else None,
            "comm_fraction": split.comm_fraction if split else None,
            "bound": split.bound if split else None,
            "bus_gbit_per_s": split.bus_gbit() if split else None,
            "link_gbit_per_s": self.link_gbit,
            "ring_bound_s": bound,
            "speedup": {name: rate / self.plain for name, rate in self.compressed.items()} if self.plain else {},
            "recommended": choice.name if choice else None,
            "recommendation": choice.reason if choice else None,
            "errors": list(self.errors),
        }

    def lines(self) -> list[str]:
        split, choice = self.split, self.choice
        head = f"communication, {self.world_size} processes:"
        beaten = self.beaten_by
        if beaten:
            out = [f"{head} no split: {beaten[0]} ran at {beaten[1]:,.0f} samples/s, above the compute "
                   f"reference's {self.compute_only:,.0f} (no gradient sync), which should bound every run: the "
                   "machine's noise; run it again on a quiet machine"]
        elif split is None:
            return [f"{head} not measured ({'; '.join(self.errors) or 'no throughput'})"]
        else:
            out = [f"{head} step {split.step_s * 1e3:,.0f} ms = compute {split.compute_s * 1e3:,.0f} ms "
                   f"+ communication {split.comm_s * 1e3:,.0f} ms ({split.comm_fraction:.0%}): {split.bound}-bound"]
        if self.gradient_bytes and split:
            detail = f"  gradients {self.gradient_bytes / 1e6:,.1f} MB per step"
            bus = split.bus_gbit()
            if bus:
                detail += f"; the exposed communication moves them at {bus:.2f} Gbit/s (bus bandwidth)"
            if self.link_gbit:
                bound = ring_bound_s(self.gradient_bytes, self.world_size, self.link_gbit)
                detail += (f"; the ring all-reduce needs at least {bound * 1e3:,.0f} ms at "
                           f"{self.link_gbit:g} Gbit/s")
            out.append(detail)
        if self.compressed and self.plain:
            out.append("  " + ", ".join(f"{name}: {rate / self.plain:.2f}x" for name, rate
                                        in self.compressed.items()) + " the samples/s of plain DDP")
        if choice:
            out.append(f"  recommended: {choice.reason}" if choice.name != "none" else f"  {choice.reason}")
        return out


def measure(spec, *, link_gbit: float | None = None, tried: tuple[str, ...] = TRIED,
            plain: dict[int, float] | None = None) -> list[CommResult]:
    """Each count of ``spec`` (a :class:`~.bench.BenchSpec`) with two or more processes:
    plain, each compression in ``tried``, and the compute reference (see the module), one
    ``disttrain run`` after the other, ``spec.repeat`` rounds with the order rotated, the best
    run of each kept. ``plain``: samples/s per count already measured (the bench's own runs),
    not measured again."""
    no_sync = {BENCH_NO_SYNC: "1", BENCH_FLUSH_DENORMAL: "1"}
    # OpenMP threads busy-wait between parallel regions: fastest on free cores, far slower when
    # other threads hold them; the reference takes the better of both ways of waiting.
    references = {"reference": no_sync, "reference, passive wait": {**no_sync, "OMP_WAIT_POLICY": "PASSIVE"}}
    hosts = max(1, len(spec.hosts))
    results = []
    for n in spec.counts:
        world = n * hosts
        if world < 2:
            continue
        known = (plain or {}).get(n)
        variants = [*([] if known else ["plain"]), *references, *tried]
        rates: dict[str, float] = {"plain": known} if known else {}
        errors: dict[str, str] = {}
        grad_bytes = None
        for k in range(spec.repeat):
            shift = k % len(variants)
            for name in variants[shift:] + variants[:shift]:
                print(f"disttrain bench: {world} processes, {name}"
                      f"{f' (run {k + 1} of {spec.repeat})' if spec.repeat > 1 else ''} ...", file=sys.stderr, flush=True)
                # PowerSGD sends plain all-reduces for its first steps: time it after them (and the
                # reference as late: a model's steps can get cheaper as it trains).
                late = name == "powersgd" or (name in references and "powersgd" in tried)
                warmup = max(spec.warmup, POWERSGD_START + 1) if late else spec.warmup
                fields = ({"env": references[name]} if name in references else
                          {} if name == "plain" else {"grad_compression": name})
                count_run = runner.run_count(spec.command(), spec.count(n, warmup=warmup, **fields),
                                             timeout_s=spec.timeout_s)
                parsed = runner.parse_output(count_run.stdout) if count_run.returncode == 0 else None
                rate = parsed[1].get("samples_per_s") if parsed else None
                if not rate:
                    errors[name] = f"{name}: exit {count_run.returncode}, no measurement"
                    continue
                grad_bytes = grad_bytes or parsed[1].get("gradient_bytes")
                name = "reference" if name in references else name
                rates[name] = max(rate, rates.get(name, 0.0))
        results.append(CommResult(
            nproc=n, world_size=world, global_batch=spec.global_batch, plain=rates.get("plain"),
            compute_only=rates.get("reference"), compressed={k: rates[k] for k in tried if k in rates},
            gradient_bytes=grad_bytes, link_gbit=link_gbit,
            errors=tuple(e for name, e in errors.items() if name.split(",")[0] not in rates)))
    return results
