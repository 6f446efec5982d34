"""Is the network the limit? A step split into compute and communication, and whether
gradient compression is worth turning on.

``disttrain bench --comm`` times each multi-process count, through the same step timer, as
asked, with each compression, and its compute reference: the same count with DDP exchanging
no gradients every other step (torch's no-op communication hook: the same steps, the same ranks
sharing the same cores, no wire) and all-reducing on the others, with denormal floats flushed to
zero, the better of OpenMP's two ways of waiting. From it:

- compute time per step = the reference's steps without sync; communication = what the synced
  step right after each adds to it (what the all-reduce adds after overlapping with the backward
  pass), medians over :data:`PAIRS` pairs or more. Both come from one run, a moment apart: two runs
  minutes apart on a busy machine once differed by 40 % for an arithmetic-bound job, which a split
  between runs read as communication;
- the bus bandwidth that communication time implies for the gradient size, against the
  ring all-reduce's bound 2(N-1)/N * S / B when the link rate B is given;
- each mode's convergence: every run but the references goes on to the end of the script
  (the step timer reports, then lets it finish), so the same run gives the throughput and
  the script's final training loss and validation accuracy (its last JSON line's
  ``train_loss`` / ``val_accuracy``, as ``examples/mnist_convnet.py`` prints) after the
  number of samples its own arguments set -- the same for every mode;
- a recommendation (:func:`recommend_mode`): the fastest mode whose validation accuracy is
  within :data:`TOLERANCE` of plain DDP's after the same samples, if it beats plain DDP by
  more than :data:`WORTH`, else plain DDP (a compute-bound job gains nothing and pays
  accuracy). A mode that is only fast is never recommended: without a measured accuracy
  (the script printed none) the answer is plain DDP.

The reference must bound every run, and once did not: on two namespace "hosts" sharing 2
cores it measured 273 samples/s against PowerSGD's 1,174 and plain DDP's 114. Two causes,
each measured here: OpenMP threads busy-wait between parallel regions, and each host gave each
rank 2 threads, so with all ranks computing at once 4 threads spun for 2 cores (passive
waiting: 132 -> 859 samples/s); and the exact gradients of a model near convergence drive the
arithmetic into denormal floats, the CPU's slow path, which fp16's rounding and PowerSGD's
approximation never take (flushed: 859 -> 2,012, above PowerSGD's 1,886). Should a run still
beat the reference's rate (noise between runs), its speed-up is flagged and never the reason
to choose it; the split, made within the reference run, stands.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from ..runtime.comm import DEFAULT_PERIOD, POWERSGD_START
from ..workerenv import BENCH_EXIT, BENCH_FLUSH_DENORMAL, BENCH_NO_SYNC
from . import runner

# A compression must beat plain all-reduce by this factor to be recommended: below it the
# gain is within the noise of a shared machine and not worth the rounding of the gradients.
WORTH = 1.05
# Communication at or above this share of a step makes the job communication-bound.
COMM_BOUND = 0.2
# A run at most this much faster than the compute reference ran at the same speed, measured twice:
# a compute-bound job's plain DDP is within noise of the reference. Faster still: the reference was
# no upper bound (noise between runs): measured again, and never a reason to choose that mode.
REFERENCE_NOISE = 0.05
# The reference times at least this many steps without sync, each beside a synced one.
PAIRS = 8


# A mode's validation accuracy may be this far below plain DDP's (absolute: 0.01 = 1 point)
# after the same samples, and still be recommended.
TOLERANCE = 0.01


@dataclass(frozen=True)
class Choice:
    name: str  # "none" or a compression
    speedup: float  # its samples/s over plain DDP's
    reason: str


@dataclass(frozen=True)
class Convergence:
    """Where one run's training got to after the script's samples."""

    train_loss: float | None = None
    val_accuracy: float | None = None


def recommend_mode(plain: float, rates: dict[str, float], convergence: dict[str, Convergence], *,
                   tolerance: float = TOLERANCE) -> Choice:
    """The mode to use given samples/s measured with plain DDP and each mode, and each run's
    convergence (``convergence["none"]``: plain DDP's): the fastest whose validation accuracy is
    within ``tolerance`` of plain DDP's, when it is :data:`WORTH` faster; else plain DDP."""
    if not rates:
        return Choice("none", 1.0, "no other mode was measured")
    fastest = max(rates, key=lambda name: rates[name])
    reference = convergence.get("none", Convergence()).val_accuracy
    if reference is None or not math.isfinite(reference):
        return Choice("none", 1.0, f"plain DDP: no validation accuracy was measured (the script's last JSON "
                      f"line has no val_accuracy), and a mode is never chosen for speed alone (the fastest, "
                      f"{fastest}, ran at {rates[fastest] / plain:.2f}x)")
    accurate, rejected = {}, []
    for name, rate in rates.items():
        accuracy = convergence.get(name, Convergence()).val_accuracy
        if accuracy is not None and math.isfinite(accuracy) and accuracy >= reference - tolerance - 1e-12:
            accurate[name] = rate
        elif rate >= plain * WORTH:
            got = "no accuracy" if accuracy is None else f"{accuracy:.4f}"
            rejected.append(f"{name} ran at {rate / plain:.2f}x but reached {got} against plain DDP's {reference:.4f}")
    why_not = f" ({'; '.join(rejected)}: more than {tolerance * 100:g} point below)" if rejected else ""
    if not accurate:
        return Choice("none", 1.0, f"plain DDP: no mode kept its validation accuracy{why_not}")
    best = max(accurate, key=lambda name: accurate[name])
    speedup = accurate[best] / plain
    if speedup >= WORTH:
        return Choice(best, speedup, f"--grad-compression {best}: {speedup:.2f}x the samples/s of plain DDP "
                      f"here, validation accuracy within {tolerance * 100:g} point of it{why_not}")
    return Choice("none", 1.0, f"plain DDP: the fastest mode that keeps its accuracy ({best}) reached "
                  f"{speedup:.2f}x its samples/s (worth it from {WORTH:.2f}x){why_not}")


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

# Modes tried by `disttrain bench --comm` beside plain DDP (bf16 moves the same bytes as fp16).
TRIED = ("fp16", "powersgd", f"localsgd:{DEFAULT_PERIOD}", f"diloco:{DEFAULT_PERIOD}")


@dataclass(frozen=True)
class CommResult:
    """One process count, measured with sync, with each mode, and its compute reference."""

    nproc: int
    world_size: int
    global_batch: int
    plain: float | None  # samples/s
    compute_only: float | None  # the reference: no gradient sync, denormals flushed (an upper bound)
    compressed: dict[str, float]  # samples/s of every other mode (compressions, localsgd, diloco)
    gradient_bytes: int | None
    link_gbit: float | None
    errors: tuple[str, ...] = ()
    # each run's end of training ("none": plain DDP's); empty: the bench did not run to the end
    convergence: dict[str, Convergence] = field(default_factory=dict)
    # bytes of the state a mode keeps beside plain DDP's, per rank (measured in the worker)
    state_bytes: dict[str, int] = field(default_factory=dict)
    # share of a localsgd/diloco run's timed steps that rank 0 spent waiting on a synchronisation
    sync_wait: dict[str, float] = field(default_factory=dict)
    # the reference run's steps with and without sync side by side: {"compute_ms", "comm_ms", "pairs"}
    paired: dict[str, float] | None = None

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
        if not self.paired:
            return None
        compute_s = self.paired["compute_ms"] / 1e3
        return Split(step_s=compute_s + self.paired["comm_ms"] / 1e3, compute_s=compute_s,
                     gradient_bytes=self.gradient_bytes, world_size=self.world_size)

    @property
    def choice(self) -> Choice | None:
        if not self.plain:
            return None
        # A rate above the reference's is noise, no reason to choose a mode: it counts as the reference's.
        ceiling = self.compute_only or math.inf
        choice = recommend_mode(self.plain, {name: min(rate, ceiling) for name, rate in self.compressed.items()},
                                self.convergence)
        beaten = self.beaten_by
        if beaten and choice.name != "none":  # said, not hidden: the accuracy rule still holds
            choice = Choice(choice.name, choice.speedup, f"{choice.reason}; but {beaten[0]} beat the compute "
                            "reference, so these speeds are partly this machine's noise: run it again on a quiet one")
        return choice

    def modes(self) -> dict[str, dict]:
        """Every mode's throughput and convergence side by side ("none": plain DDP)."""
        out = {}
        for name, rate in {"none": self.plain, **self.compressed}.items():
            end = self.convergence.get(name, Convergence())
            out[name] = {
                "samples_per_s": rate,
                "of_compute_only": rate / self.compute_only if rate and self.compute_only else None,
                "speedup": rate / self.plain if rate and self.plain else None,
                "step_ms": step_seconds(rate, self.global_batch) * 1e3 if rate else None,
                "train_loss": end.train_loss, "val_accuracy": end.val_accuracy,
                "state_bytes": self.state_bytes.get(name),
                "sync_wait_share": self.sync_wait.get(name),
            }
        return out

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
            "paired_steps": self.paired.get("pairs") if self.paired else None,
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
            "modes": self.modes(),
            "accuracy_tolerance": TOLERANCE,
            "recommended": choice.name if choice else None,
            "recommended_of_compute_only": self.modes().get(choice.name, {}).get("of_compute_only") if choice else None,
            "recommendation": choice.reason if choice else None,
            "errors": list(self.errors),
        }

    def lines(self) -> list[str]:
        split, choice = self.split, self.choice
        head = f"communication, {self.world_size} processes:"
        beaten = self.beaten_by
        if split is None and not self.plain:
            return [f"{head} not measured ({'; '.join(self.errors) or 'no throughput'})"]
        out = [f"{head} step {split.step_s * 1e3:,.0f} ms = compute {split.compute_s * 1e3:,.0f} ms "
               f"+ communication {split.comm_s * 1e3:,.0f} ms ({split.comm_fraction:.0%}): {split.bound}-bound"
               if split else f"{head} no split: the compute reference timed no step beside a synced one "
               f"({'; '.join(self.errors) or 'its loader was not timed'})"]
        if beaten:
            out.append(f"  {beaten[0]} ran at {beaten[1]:,.0f} samples/s, above the compute reference's "
                       f"{self.compute_only:,.0f} (no gradient sync), which should bound every run: the machine's "
                       "noise between runs; its speed-ups are not to be trusted, run it again on a quiet machine")
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
        if self.convergence:
            out.append("  validation accuracy after the same samples: " + ", ".join(
                f"{'plain' if name == 'none' else name} {end.val_accuracy:.4f}" for name, end
                in self.convergence.items() if end.val_accuracy is not None))
        if choice:
            out.append(f"  recommended: {choice.reason}" if choice.name != "none" else f"  {choice.reason}")
        return out


def period_steps(name: str, steps: int) -> int:
    """Timed steps for ``name``: whole periods of a localsgd/diloco mode (at least two), so that
    its rate counts each synchronisation as often as it happens."""
    mode, _, number = name.partition(":")
    if mode not in ("localsgd", "diloco"):
        return steps
    period = int(number) if number else DEFAULT_PERIOD
    return max(2, -(-steps // period)) * period


def measure(spec, *, link_gbit: float | None = None, tried: tuple[str, ...] = TRIED,
            plain: dict[int, float] | None = None) -> list[CommResult]:
    """Each count of ``spec`` (a :class:`~.bench.BenchSpec`) with two or more processes:
    plain, each mode in ``tried``, and the compute reference (see the module), one
    ``disttrain run`` after the other, ``spec.repeat`` rounds with the order rotated, the best
    run of each kept (with that run's convergence). A run faster than the reference (beyond
    :data:`REFERENCE_NOISE`) is measured once more, with the reference and plain DDP; the mode keeps
    its slower rate (it is not recommended for beating an upper bound), the two ends of the split
    their faster. ``plain``: samples/s per count already
    measured (the bench's own runs, which stop after the timed steps): plain DDP runs again to
    the end for its accuracy only, its rate staying the one measured."""
    hosts = max(1, len(spec.hosts))
    return [_measure_count(spec, n, n * hosts, known=(plain or {}).get(n), link_gbit=link_gbit, tried=tried)
            for n in spec.counts if n * hosts >= 2]


def _measure_count(spec, n: int, world: int, *, known: float | None, link_gbit: float | None,
                   tried: tuple[str, ...]) -> CommResult:
    no_sync = {BENCH_NO_SYNC: "1", BENCH_FLUSH_DENORMAL: "1"}
    # OpenMP threads busy-wait between parallel regions: fastest on free cores, far slower when
    # other threads hold them; the reference takes the better of both ways of waiting.
    references = {"reference": no_sync, "reference, passive wait": {**no_sync, "OMP_WAIT_POLICY": "PASSIVE"}}
    variants = ["plain", *references, *tried]
    rates: dict[str, float] = {"plain": known} if known else {}
    paired: dict[str, float] = {}  # the fastest reference run's split
    ends: dict[str, Convergence] = {}
    state: dict[str, int] = {}
    sync_wait: dict[str, float] = {}
    kept: dict[str, float] = {}  # the rate of the run each convergence comes from
    errors: dict[str, str] = {}
    grad_bytes = None

    def one_run(name: str, label_run: str, remeasure: bool = False) -> None:
        nonlocal grad_bytes
        print(f"disttrain bench: {world} processes, {name}{label_run} ...", file=sys.stderr, flush=True)
        # PowerSGD sends plain all-reduces for its first steps: time it after them (and the
        # reference as late: a model's steps can get cheaper as it trains).
        late = name == "powersgd" or (name in references and "powersgd" in tried)
        warmup = max(spec.warmup, POWERSGD_START + 1) if late else spec.warmup
        # Every run but the references goes on to the script's end, for its accuracy.
        fields = ({"env": references[name]} if name in references else
                  {"env": {BENCH_EXIT: "0"}} if name == "plain" else
                  {"env": {BENCH_EXIT: "0"}, "grad_compression": name})
        # As many steps as the others time, half of them without sync, and one more: the first timed
        # step may be a synced one.
        steps = max(spec.steps, 2 * PAIRS) + 1 if name in references else period_steps(name, spec.steps)
        count_run = runner.run_count(
            spec.command(), spec.count(n, warmup=warmup, steps=steps, **fields),
            timeout_s=spec.timeout_s)
        parsed = runner.parse_output(count_run.stdout) if count_run.returncode == 0 else None
        rate = parsed[1].get("samples_per_s") if parsed else None
        if not rate:
            errors[name] = f"{name}: exit {count_run.returncode}, no measurement"
            return
        grad_bytes = grad_bytes or parsed[1].get("gradient_bytes")
        key = "reference" if name in references else name
        label = "none" if key == "plain" else key
        if key != "reference" and (remeasure or rate > kept.get(label, 0.0)):  # the kept run's convergence
            kept[label] = rate
            end = runner.parse_summary(count_run.stdout)
            ends[label] = Convergence(train_loss=end.get("train_loss"), val_accuracy=end.get("val_accuracy"))
            state[label] = parsed[1].get("comm_state_bytes") or 0
            timed, waited = sum(parsed[1].get("step_ms") or ()), sum(parsed[1].get("sync_blocked_ms") or ())
            if waited and timed:
                sync_wait[label] = waited / timed
        if key == "reference" and rate > rates.get(key, 0.0):
            paired.clear()
            paired.update(parsed[1].get("paired") or {})
        if key == "plain" and known and not remeasure:  # the bench's own plain runs give its rate, as before
            return
        # A run above the reference was the machine's noise (or the reference's): measured again, the
        # mode keeps the lower of its rates; the reference and plain DDP, the two ends of the split,
        # the higher, so that the split is not tilted by the reference alone rising.
        rates[key] = min(rate, rates[key]) if remeasure and key in tried else max(rate, rates.get(key, 0.0))

    for k in range(spec.repeat):
        shift = k % len(variants)
        for name in variants[shift:] + variants[:shift]:
            one_run(name, f" (run {k + 1} of {spec.repeat})" if spec.repeat > 1 else "")
    ceiling = rates.get("reference", 0.0) * (1 + REFERENCE_NOISE)
    above = [name for name in ("plain", *tried) if ceiling and rates.get(name, 0.0) > ceiling]
    for name in [*references, *dict.fromkeys(["plain", *above])] if above else []:
        one_run(name, ", measured again: a run beat the compute reference", remeasure=True)
    return CommResult(
        nproc=n, world_size=world, global_batch=spec.global_batch, plain=rates.get("plain"),
        compute_only=rates.get("reference"), compressed={k: rates[k] for k in tried if k in rates},
        gradient_bytes=grad_bytes, link_gbit=link_gbit, paired=dict(paired) or None,
        errors=tuple(e for name, e in errors.items() if name.split(",")[0] not in rates),
        convergence=ends, state_bytes=state, sync_wait=sync_wait)
