"""What a scaling run means: speed-up, efficiency, the count to use and why. Pure functions.

The numbers in, the table and JSON out; nothing here starts a process or reads a clock, so
the recommendation is unit-tested on given numbers (the seed chapter's own, for one).

Each count runs several times, the counts interleaved (:func:`combine` keeps the best run:
other work only ever slows a run down). A row is flagged as *noise*, and a recommendation
built on it says it cannot be trusted, when the numbers cannot be what the script does:

- efficiency above 100% (N processes more than N times as fast as one: the runs it is
  compared with were slowed by something else);
- its runs differ by more than :data:`NOISY_SPREAD`;
- the rest of the machine kept a different number of cores busy (by :data:`LOAD_CHANGE`
  or more) during its runs than during those of the count it is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..placement import auto_nproc

# A larger count must beat a smaller one by more than this to be worth its processes.
TOLERANCE = 0.05
# Below this parallel efficiency, more than half of every added process is lost.
LOW_EFFICIENCY = 0.5
# Repeats of one count further apart than this, (max - min) / max: the machine, not the script.
NOISY_SPREAD = 0.10
# Cores the rest of the machine kept busy, changing by this much between compared runs.
LOAD_CHANGE = 0.5

STEP_TIMER = "step-timer"
SCRIPT_SUMMARY = "script-summary"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One process count's outcome: a throughput, or the reason there is none."""

    nproc: int  # processes per host (``disttrain run -n``)
    world_size: int  # processes in all
    batch_per_process: int
    samples_per_s: float | None = None
    source: str | None = None  # STEP_TIMER or SCRIPT_SUMMARY
    seconds: float | None = None  # the time measured over
    steps: int | None = None  # timed steps (step timer only)
    threads: int | None = None  # intra-op threads per process, as the workers saw them
    cpus: int | None = None  # cores on rank 0's host, as the workers saw them
    cuda_devices: int | None = None
    notes: tuple[str, ...] = ()
    error: str | None = None
    exit_code: int | None = None
    log_dir: str | None = None
    runs: tuple[float, ...] = ()  # samples/s of each repeat that finished (the best is samples_per_s)
    others_cores: tuple[float, ...] = ()  # per repeat: cores the rest of this machine kept busy

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples_per_s) and self.samples_per_s > 0

    @property
    def spread(self) -> float | None:
        """(max - min) / max of the repeats' samples/s; None with fewer than two."""
        return (max(self.runs) - min(self.runs)) / max(self.runs) if len(self.runs) > 1 else None


def combine(repeats: Sequence[Measurement]) -> Measurement:
    """One count's repeats as one measurement: the best run's numbers (other work on the
    machine only slows a run down), every run's rate and load kept; failed runs noted."""
    finished = [m for m in repeats if m.ok]
    others = tuple(c for m in repeats for c in m.others_cores)
    if not finished:
        return replace(repeats[-1], others_cores=others)
    best = max(finished, key=lambda m: m.samples_per_s or 0.0)
    notes = list(dict.fromkeys(n for m in finished for n in m.notes))
    failed = [m for m in repeats if not m.ok]
    if failed:
        notes.append(f"{len(failed)} of {len(repeats)} runs failed: {failed[-1].error}")
    return replace(best, runs=tuple(m.samples_per_s for m in finished), others_cores=others,
                   notes=tuple(notes))


@dataclass(frozen=True)
class Row:
    """A measurement against the smallest count that finished."""

    measurement: Measurement
    speedup: float | None  # samples/s over the baseline's
    ideal: float  # world size over the baseline's: what perfect scaling would give
    efficiency: float | None  # speedup / ideal
    noise: tuple[str, ...] = ()  # why this row's numbers cannot be what the script does

    @property
    def world_size(self) -> int:
        return self.measurement.world_size


@dataclass(frozen=True)
class Recommendation:
    nproc: int | None  # per host; None when no count finished
    reasons: tuple[str, ...] = field(default=())
    trusted: bool = True  # False: built on numbers flagged as noise


def scaling(measurements: Sequence[Measurement]) -> list[Row]:
    """Rows in world-size order, relative to the smallest world size that finished."""
    ordered = sorted(measurements, key=lambda m: m.world_size)
    finished = [m for m in ordered if m.ok]
    if not finished:
        return [Row(m, None, 1.0, None) for m in ordered]
    base = finished[0]
    rows = []
    for m in ordered:
        ideal = m.world_size / base.world_size
        if not m.ok:
            rows.append(Row(m, None, ideal, None))
            continue
        speedup = m.samples_per_s / base.samples_per_s
        rows.append(Row(m, speedup, ideal, speedup / ideal, noise(m, base, speedup / ideal)))
    return rows


def noise(m: Measurement, base: Measurement, efficiency: float) -> tuple[str, ...]:
    """Why ``m``'s numbers, against ``base``'s, are the machine's rather than the script's."""
    reasons = []
    if round(efficiency * 100) > 100:
        reasons.append(f"{efficiency:.0%} efficiency: {m.world_size} processes cannot be more than "
                       f"{m.world_size / base.world_size:g}x as fast as {base.world_size}; "
                       f"{'they' if base.world_size > 1 else 'it'} ran slowed by other work")
    if m.spread is not None and m.spread > NOISY_SPREAD:
        reasons.append(f"its {len(m.runs)} runs differ by {m.spread:.0%}")
    loads = m.others_cores + (base.others_cores if base is not m else ())
    if loads and max(loads) - min(loads) >= LOAD_CHANGE:
        reasons.append(f"the machine's other work changed while it was measured ({min(loads):.1f} to "
                       f"{max(loads):.1f} cores busy)")
    return tuple(reasons)


def processes(n: int, hosts: int = 1) -> str:
    """``1 process``, ``4 processes``, ``2 processes per host (4 in all)``."""
    word = "process" if n == 1 else "processes"
    if hosts > 1:
        return f"{n} {word} per host ({n * hosts} in all)"
    return f"{n} {word}"


def limits(nproc: int, *, cpus: int | None, gpus: int, explain: bool = True) -> list[str]:
    """Why ``nproc`` processes on one host cannot all run at full speed, if they cannot."""
    if gpus > 0:
        return [f"{nproc} processes share {gpus} GPU{'s' if gpus > 1 else ''}"] if nproc > gpus else []
    if cpus and nproc * 2 > cpus:
        why = (" (a DDP process on CPU needs a core for compute and one for gloo and data "
               "loading)") if explain else ""
        return [f"{nproc} processes oversubscribe {cpus} core{'s' if cpus > 1 else ''}{why}"]
    return []


def recommend(rows: Sequence[Row], *, cpus: int | None, gpus: int = 0, hosts: int = 1,
              tolerance: float = TOLERANCE) -> Recommendation:
    """The count to use on these hosts, and why.

    The count with the most samples/s, unless a smaller one comes within ``tolerance`` of
    it: then the smallest such (fewer processes for the same speed leave cores, memory and
    GPUs free, and change the training less). Each larger count gets its reason not to be
    chosen: cores or GPUs oversubscribed (``cpus``/``gpus``: per host), efficiency below
    50%, or simply no gain; each failed count its error.
    """
    finished = [r for r in rows if r.measurement.ok]
    failed = [r for r in rows if not r.measurement.ok]
    failures = tuple(
        f"{processes(r.measurement.nproc, hosts)} failed: {r.measurement.error}" for r in failed
    )
    if not finished:
        return Recommendation(None, ("no process count finished, nothing to compare", *failures))
    noisy = tuple(f"{processes(r.measurement.nproc, hosts)}: {'; '.join(r.noise)}" for r in finished if r.noise)
    if noisy:
        distrust = ("not to be trusted: the numbers are noise (marked !), not this script's scaling; run the "
                    "bench again on a quiet machine, or with more --repeat",)
        chosen = recommend([replace(r, noise=()) for r in rows], cpus=cpus, gpus=gpus, hosts=hosts,
                           tolerance=tolerance)
        return Recommendation(chosen.nproc, (*distrust, *noisy, *chosen.reasons), trusted=False)

    def rate(row: Row) -> float:
        return row.measurement.samples_per_s or 0.0

    best = max(finished, key=rate)
    chosen = min((r for r in finished if rate(r) >= rate(best) * (1 - tolerance)),
                 key=lambda r: r.world_size)
    name = processes(chosen.measurement.nproc, hosts)
    if chosen is best:
        reasons = [f"{name}: the most samples/s ({rate(best):,.0f})"]
    else:
        reasons = [f"{name}: within {tolerance:.0%} of the fastest "
                   f"({processes(best.measurement.nproc, hosts)}, {rate(best):,.0f} samples/s) "
                   "with fewer processes"]
    explained = False
    for row in finished:
        if row.world_size <= chosen.world_size:
            continue
        gain = round((rate(row) / rate(chosen) - 1) * 100)  # in whole percent, as printed
        head = f"{-gain}% slower" if gain < 0 else f"only {gain}% faster" if gain else "no faster"
        why = limits(row.measurement.nproc, cpus=cpus, gpus=gpus, explain=not explained)
        explained = explained or bool(why)
        efficiency = round((row.efficiency or 0) * 100)
        if efficiency < LOW_EFFICIENCY * 100:
            why.append(f"efficiency drops below {LOW_EFFICIENCY:.0%} ({efficiency}%)")
        reasons.append(f"{processes(row.measurement.nproc, hosts)}: {'; '.join([head, *why])}")
    if cpus or gpus:
        auto = auto_nproc(cuda_devices=gpus, cpus=cpus or 1)
        if auto != chosen.measurement.nproc:
            reasons.append(f"`-n auto` would start {auto} here (one per GPU, or per two cores); "
                           f"for this script pass -n {chosen.measurement.nproc}")
    largest = max(finished, key=lambda r: r.world_size)
    if chosen is largest and len(finished) > 1 and (chosen.efficiency or 0) >= 0.8:
        more = 2 * chosen.measurement.nproc
        if not limits(more, cpus=cpus, gpus=gpus):
            reasons.append(f"the largest count tried still scales ({chosen.efficiency:.0%} "
                           f"efficient) and this host has room: try -n {more} too")
    return Recommendation(chosen.measurement.nproc, (*reasons, *failures))


def format_table(rows: Sequence[Row], recommendation: Recommendation, *, hosts: int = 1,
                 title: str = "") -> str:
    """The table ``disttrain bench`` prints, then the recommendation and its reasons."""
    headers = ["processes", "threads each", "batch/process", "samples/s", "runs", "spread", "speed-up",
               "efficiency", "noise", "measured by"]
    lines = []
    body = []
    for row in rows:
        m = row.measurement
        count = f"{m.world_size} ({m.nproc}/host)" if hosts > 1 else str(m.world_size)
        threads = str(m.threads) if m.threads else "-"
        spread = "-" if m.spread is None else f"{m.spread:.0%}"
        if m.ok:
            cells = [count, threads, str(m.batch_per_process), f"{m.samples_per_s:,.0f}", str(len(m.runs) or 1),
                     spread, f"{row.speedup:.2f}x", f"{row.efficiency:.0%}", "!" if row.noise else "", _source(m)]
        else:
            cells = [count, threads, str(m.batch_per_process), "-", "-", "-", "-", "-", "", f"FAILED: {m.error}"]
        body.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h)
              for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        # numbers right-aligned, the last (free text) column left-aligned
        return "  ".join([*(c.rjust(w) for c, w in zip(cells[:-1], widths)), cells[-1]]).rstrip()

    if title:
        lines.append(title)
    lines.append(line(headers))
    lines.extend(line(cells) for cells in body)
    counts_of: dict[str, list[int]] = {}  # a note shared by several counts is printed once
    for m in (r.measurement for r in rows):
        for note in m.notes:
            counts_of.setdefault(note, []).append(m.nproc)
    for note, counts in counts_of.items():
        which = "" if len(counts) == len(rows) > 1 else \
            f" (-n {','.join(map(str, counts))})"
        lines.append(f"note{which}: {note}")
    if recommendation.nproc is None:
        lines.append("no recommendation")
    else:
        lines.append(f"recommended: -n {recommendation.nproc}"
                     + (" per host" if hosts > 1 else "") + " for this script on this machine"
                     + ("" if recommendation.trusted else " (NOT TRUSTED: noisy measurements)"))
    lines.extend(f"  - {reason}" for reason in recommendation.reasons)
    return "\n".join(lines)


def _source(m: Measurement) -> str:
    if m.source == STEP_TIMER:
        return f"step timer ({m.steps} steps)" if m.steps else "step timer"
    if m.source == SCRIPT_SUMMARY:
        return "script summary"
    return m.source or ""


def to_json(rows: Sequence[Row], recommendation: Recommendation, **context: Any) -> dict[str, Any]:
    """The JSON ``--json`` prints: ``context`` (script, batch, machine...), then the rows."""
    results = []
    for row in rows:
        entry = asdict(row.measurement)
        entry["notes"] = list(row.measurement.notes)
        entry.update(runs=list(row.measurement.runs), others_cores=list(row.measurement.others_cores),
                     spread=row.measurement.spread, speedup=row.speedup, ideal_speedup=row.ideal,
                     efficiency=row.efficiency, noise=list(row.noise))
        results.append(entry)
    return {
        **context,
        "results": results,
        "recommendation": {"nproc": recommendation.nproc, "reasons": list(recommendation.reasons),
                           "trusted": recommendation.trusted},
    }
