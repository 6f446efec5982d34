"""One run's page of ``disttrain ui``: steps/s, membership, goodput, checkpoints and logs of a run folder.

Read as :mod:`.runs_list` reads its line: from the files the run already writes, defensively (a field of
another version or type is shown as unknown).
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import goodput
from ..checkpoint_layout import CheckpointLayout, check_file, read_marker
from ..launch.membership_record import load_record
from ..tracking.follower import FAILURE_FILE, HANG_FILE
from ..workerenv import CHECKPOINT_DIR
from .runs_list import RunRow, json_of, number_of, read_row, text_of

TAIL_LINES = 20
# a rank's own files (attempt_<k>/rank<R>.stdout|stderr), or what the launcher relayed from another host
_RANK_LOG = re.compile(r"attempt_(\d+)/rank(\d+)\.(stdout|stderr)|rank(\d+)\.log|node(\d+)\.log")


class Rates:
    """Each rank's steps/s while the page is open, sampled from its heartbeat file (its step count
    and its time): the heartbeat holds only the latest count, so the series is this server's memory
    of what it saw, and starts when the page is first opened. A view's cache, not a record."""

    KEEP = 240

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], deque[tuple[float, int]]] = {}

    def sample(self, run_dir: Path) -> dict[int, list[tuple[float, float]]]:
        for path in run_dir.glob("heartbeat/*/rank*"):
            if not path.name[4:].isdigit():
                continue
            beat = json_of(path)
            try:
                when = path.stat().st_mtime
            except OSError:
                continue
            steps = beat.get("steps") if isinstance(beat, dict) else None
            if not isinstance(steps, int):
                continue
            seen = self._seen.setdefault((str(run_dir), int(path.name[4:])), deque(maxlen=self.KEEP))
            if not seen or when > seen[-1][0]:
                seen.append((when, steps))
        out: dict[int, list[tuple[float, float]]] = {}
        for (folder, rank), seen in self._seen.items():
            if folder == str(run_dir):
                out[rank] = _rates(list(seen))
        return out


def _rates(points: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """``(time, steps/s)`` between consecutive ``(time, step)`` points (a step that went back: a new round)."""
    out = []
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t1 > t0 and s1 >= s0:
            out.append((t1, (s1 - s0) / (t1 - t0)))
    return out


def mean_rates(run_dir: Path, started: float | None) -> dict[int, float]:
    """Each rank's mean steps/s over the run, from its heartbeat's last count and time (what the
    launcher's closing "steps/s per host" line says): known after the run as well."""
    out = {}
    for path in run_dir.glob("heartbeat/*/rank*"):
        beat = json_of(path)
        if not (path.name[4:].isdigit() and isinstance(beat, dict) and isinstance(beat.get("steps"), int)):
            continue
        try:
            span = path.stat().st_mtime - started if started else 0.0
        except OSError:
            continue
        if span > 0:
            out[int(path.name[4:])] = beat["steps"] / span
    return dict(sorted(out.items()))


def recorded_rates(records: list[dict]) -> dict[int, list[tuple[float, float]]]:
    """Each rank's steps/s from ``track.jsonl``: its own metrics lines (``--track-ranks``), else rank 0's
    reduced ones (the mean over ranks, drawn as rank 0)."""
    per_rank: dict[int, list[tuple[float, int]]] = {}
    reduced: list[tuple[float, int]] = []
    for r in records:
        if r.get("kind") != "metrics" or not isinstance(r.get("step"), int) or number_of(r.get("t")) is None:
            continue
        if r.get("reduced") is False and isinstance(r.get("rank"), int):
            per_rank.setdefault(r["rank"], []).append((float(r["t"]), r["step"]))
        else:
            reduced.append((float(r["t"]), r["step"]))
    if not per_rank and reduced:
        per_rank[0] = reduced
    return {rank: _rates(points) for rank, points in sorted(per_rank.items())}


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    step: int
    url: str
    size: int | None  # bytes, as its marker lists them
    digests: str  # what was checked: "n files, sizes as the marker says" / what differs / "not read (remote)"
    ok: bool | None


def checkpoint_dir(plan: Any) -> str | None:
    """The ``--checkpoint-dir`` the plan gave the workers (``DISTTRAIN_CHECKPOINT_DIR``)."""
    for node in (plan.get("nodes") or []) if isinstance(plan, dict) else []:
        if isinstance(node, dict) and isinstance(node.get("env"), dict) and node["env"].get(CHECKPOINT_DIR):
            return str(node["env"][CHECKPOINT_DIR])
    return None


def checkpoints(location: str | None) -> list[Checkpoint]:
    """The complete checkpoints of a folder, newest first: each file's size checked against its marker
    (a cheap check; the SHA-256 digests are verified where a checkpoint is loaded). A URL is listed by
    name only: the view does not open remote storage."""
    if not location:
        return []
    if "://" in location:
        return [Checkpoint(step=-1, url=location, size=None, digests="not read (remote storage)", ok=None)]
    out = []
    for step, path in reversed(CheckpointLayout(Path(location)).complete()):
        try:
            digests = read_marker(path).get("digests") or {}
        except (OSError, ValueError) as err:
            out.append(Checkpoint(step=step, url=str(path), size=None, digests=f"marker unreadable: {err}", ok=False))
            continue
        total, wrong = 0, []
        for name, digest in digests.items():
            want = digest.get("bytes") if isinstance(digest, dict) else None
            try:
                have = (path / name).stat().st_size
            except OSError:
                wrong.append(f"{name} missing")
                continue
            total += have
            if isinstance(want, int) and want != have:
                wrong.append(f"{name} {have} bytes, marker says {want}")
        said = "; ".join(wrong) if wrong else f"{len(digests)} files, sizes as the marker lists them"
        out.append(Checkpoint(step=step, url=path.as_uri(), size=total, digests=said, ok=not wrong))
    return out


def verify(location: str | None, step: int) -> tuple[bool, str] | None:
    """Every file of checkpoint ``step`` hashed against its marker's SHA-256 (what a load checks): whether all
    match, and what was found; None when the run has no such local checkpoint. Asked for, never done on
    every update (a checkpoint may be gigabytes)."""
    if not location or "://" in location:
        return None
    path = dict(CheckpointLayout(Path(location)).complete()).get(step)
    if path is None:
        return None
    try:
        digests = read_marker(path).get("digests") or {}
    except (OSError, ValueError) as err:
        return False, f"step {step}: its marker is unreadable: {err}"
    wrong = [why for name, digest in digests.items() if (why := check_file(path, name, digest))]
    if wrong:
        return False, f"step {step}: " + "; ".join(wrong)
    return True, f"step {step}: all {len(digests)} files match their SHA-256 digests"


@dataclass(frozen=True, kw_only=True)
class LogTail:
    label: str  # "rank 1 stderr (attempt 0)", "rank 1 (relayed from its host)"
    rank: int | None
    path: str  # relative to the run folder
    lines: list[str]
    size: int


def tail(path: Path, lines: int = TAIL_LINES) -> tuple[list[str], int]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            text = fh.read().decode(errors="replace")
    except OSError:
        return [], 0
    return text.splitlines()[-lines:], size


def log_tails(run_dir: Path) -> list[LogTail]:
    """Each rank's stdout and stderr of the latest attempt that has them; on several hosts, what the launcher
    relayed of each rank and each host's agent (``rank<R>.log``, ``node<N>.log``)."""
    found: list[tuple[int, int, str, Path]] = []
    relayed: list[tuple[str, int, Path]] = []
    for path in run_dir.glob("attempt_*/rank*.std*"):
        m = _RANK_LOG.fullmatch(path.relative_to(run_dir).as_posix())
        if m and m[1] is not None:
            found.append((int(m[1]), int(m[2]), m[3], path))
    for path in run_dir.glob("*.log"):
        m = _RANK_LOG.fullmatch(path.name)
        if m and m[1] is None:
            relayed.append(("rank" if m[4] is not None else "node", int(m[4] or m[5]), path))
    out = []
    latest = max((a for a, *_ in found), default=None)
    for attempt, rank, stream, path in sorted(f for f in found if f[0] == latest):
        lines, size = tail(path)
        out.append(LogTail(label=f"rank {rank} {stream} (attempt {attempt})", rank=rank,
                           path=path.relative_to(run_dir).as_posix(), lines=lines, size=size))
    for kind, number, path in sorted(relayed):
        lines, size = tail(path)
        label = f"rank {number}, relayed" if kind == "rank" else f"agent of node {number}, relayed"
        out.append(LogTail(label=label, rank=number if kind == "rank" else None, path=path.name, lines=lines,
                           size=size))
    return out


def log_path(run_dir: Path, rel: str) -> Path | None:
    """A log file by its path in the run folder; None for anything else (no path leaves the folder)."""
    m = _RANK_LOG.fullmatch(rel)
    if not m:
        return None
    path = run_dir / (f"attempt_{int(m[1])}/rank{int(m[2])}.{m[3]}" if m[1] is not None
                      else f"rank{int(m[4])}.log" if m[4] is not None else f"node{int(m[5])}.log")
    return path if path.is_file() else None


@dataclass(kw_only=True)
class RunView:
    row: RunRow
    verdict: str | None
    failure: str | None
    membership: list[dict]
    goodput: dict | None
    goodput_final: bool
    rates: dict[int, list[tuple[float, float]]]
    means: dict[int, float]
    checkpoints: list[Checkpoint]
    checkpoint_dir: str | None
    logs: list[LogTail]

    @property
    def live(self) -> bool:
        return self.row.status == "Running"


_CHANGE_TYPES = {"time": float, "change": str, "host": str, "why": str, "world_size": int, "resumed_from": int,
                 "seconds": float, "path": str, "path_why": str, "attempt": int}


def change_of(entry: dict) -> dict[str, Any]:
    """A ``membership.json`` entry with each field the page shows of its type, else None (another version's)."""
    out: dict[str, Any] = {}
    for name, kind in _CHANGE_TYPES.items():
        value = entry.get(name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
            isinstance(value, kind) and not isinstance(value, bool)
        out[name] = value if ok else None
    hosts = entry.get("hosts")
    out["hosts"] = [str(h) for h in hosts] if isinstance(hosts, list) else []
    return out


def read_view(run_dir: Path, rates: Rates | None = None) -> RunView:
    """Everything one run's page shows."""
    row = read_row(run_dir)
    plan = json_of(run_dir / "plan.json")
    record = load_record(run_dir) if (run_dir / "membership.json").exists() else []
    raw = [c for c in record if isinstance(c, dict)] if isinstance(record, list) else []
    records = goodput.load_records(run_dir)
    final = json_of(run_dir / goodput.FILE)
    if not isinstance(final, dict) or not isinstance(final.get("seconds"), dict):
        final = None
    so_far = None
    if final is None and records and row.status == "Running":  # the breakdown until now, as if it ended now
        try:
            so_far = goodput.compute([*records, {"kind": "end", "t": time.time()}], raw)
        except (ValueError, TypeError, KeyError):
            so_far = None
    drawn = recorded_rates(records)
    if rates is not None:
        for rank, series in rates.sample(run_dir).items():
            if series and not drawn.get(rank):
                drawn[rank] = series
    where = checkpoint_dir(plan)
    verdict = text_of(run_dir / HANG_FILE)
    return RunView(
        row=row, verdict=verdict, failure=None if verdict else text_of(run_dir / FAILURE_FILE),
        membership=[change_of(c) for c in raw],
        goodput=final or so_far, goodput_final=final is not None, rates=drawn,
        means=mean_rates(run_dir, row.started), checkpoints=checkpoints(where),
        checkpoint_dir=where, logs=log_tails(run_dir),
    )
