"""The runs list of ``disttrain ui``: each run folder's line, read from the files it already holds.

A view, never a second record: everything here is read from what the launcher and the workers write
(``plan.json``, ``track.jsonl``, ``hang_verdict.txt`` / ``failure.txt``; one run's page, :mod:`.run_page`,
reads the rest). Other versions add fields to these files: every read here is
defensive (a field missing or of another type is shown as unknown, never an error).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import goodput
from ..tracking.follower import FAILURE_FILE, HANG_FILE

QUIET_S = 120.0  # a run without its end record whose files all stayed still this long: its launcher is gone


@dataclass(frozen=True, kw_only=True)
class RunRow:
    """One line of the runs list."""

    id: str
    name: str  # the script (or module) it ran
    status: str  # Running | Completed | Failed | Hung | Stopped | Unknown (no end record, all quiet)
    started: float | None
    ended: float | None
    hosts: tuple[str, ...]
    world_size: int | None
    exit_code: int | None
    cause: str | None  # the first line that says why (the hang verdict's cause, the failure's first line)

    @property
    def duration(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else time.time()) - self.started


def json_of(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _ends(path: Path) -> tuple[dict | None, dict | None]:
    """The first and the last record of ``track.jsonl``, read from its two ends (a long run's file is long)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            last = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    except OSError:
        return None, None

    def parse(line: bytes) -> dict | None:
        try:
            record = json.loads(line)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    return parse(first), parse(last)


def number_of(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _hosts(plan: Any) -> tuple[str, ...]:
    nodes = plan.get("nodes") if isinstance(plan, dict) else None
    if not isinstance(nodes, list):
        return ()
    return tuple(str(n.get("address") or n.get("name")) for n in nodes if isinstance(n, dict))


def _script(plan: Any, run_id: str) -> str:
    argv = plan.get("argv") if isinstance(plan, dict) else None
    if isinstance(argv, list):
        for i, word in enumerate(argv):
            if word == "-m" and i + 1 < len(argv):
                return str(argv[i + 1])
            if isinstance(word, str) and word.endswith(".py"):
                return Path(word).name
    return run_id


def cause_line(text: str | None) -> str | None:
    """The line of a verdict or a failure report that says why: the verdict's ``cause:``, else the first line."""
    if not text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("cause:"):
            return line
    return lines[0] if lines else None


def _newest_mtime(run_dir: Path) -> float:
    newest = 0.0
    for pattern in (goodput.RECORD, "attempt_*/rank*.std*", "heartbeat/*/rank*"):
        for path in run_dir.glob(pattern):
            try:
                newest = max(newest, path.stat().st_mtime)
            except OSError:
                pass
    return newest


def status_of(end: dict | None, verdict: str | None, *, quiet: bool) -> str:
    if end is None or end.get("kind") != "end":
        return "Unknown" if quiet else "Running"
    code = end.get("exit_code")
    if end.get("hung") or verdict:
        return "Hung"
    if code == 0:
        return "Completed"
    if isinstance(code, int) and code > 128:  # the launcher was stopped by a signal (Ctrl-C, SIGTERM)
        return "Stopped"
    return "Failed"


def planned_world_size(run_dir: Path) -> int | None:
    plan = json_of(run_dir / "plan.json")
    world = plan.get("world_size") if isinstance(plan, dict) else None
    return world if isinstance(world, int) else None


def read_row(run_dir: Path, *, now: float | None = None) -> RunRow:
    """The runs list's line for one run folder: ``plan.json`` and the two ends of ``track.jsonl``."""
    plan = json_of(run_dir / "plan.json")
    start, end = _ends(run_dir / goodput.RECORD)
    if end is not None and end.get("kind") != "end":
        end = None
    succeeded = end is not None and end.get("exit_code") == 0 and not end.get("hung")
    verdict = None if succeeded else text_of(run_dir / HANG_FILE)  # a run that succeeded has no report
    failure = None if verdict or succeeded else text_of(run_dir / FAILURE_FILE)
    quiet = end is None and (now or time.time()) - _newest_mtime(run_dir) > QUIET_S
    world = plan.get("world_size") if isinstance(plan, dict) else None
    code = end.get("exit_code") if end else None
    return RunRow(
        id=run_dir.name, name=_script(plan, run_dir.name), status=status_of(end, verdict, quiet=quiet),
        started=number_of((start or {}).get("t")), ended=number_of((end or {}).get("t")), hosts=_hosts(plan),
        world_size=world if isinstance(world, int) else None, exit_code=code if isinstance(code, int) else None,
        cause=cause_line(verdict or failure),
    )


class RowCache:
    """The rows of ended runs, kept while their folder and ``track.jsonl`` stay as they were (one ``stat``
    each instead of four reads): an ended run's files no longer change, and a list of a thousand runs is
    mostly ended runs. A running run's row is read each time (its duration and quiet time move)."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[tuple, RunRow]] = {}

    def row(self, run_dir: Path, now: float) -> RunRow:
        try:
            folder, record = run_dir.stat(), (run_dir / goodput.RECORD).stat()
            key: tuple = (folder.st_mtime_ns, record.st_mtime_ns, record.st_size)
        except OSError:
            key = ()
        held = self._rows.get(str(run_dir))
        if key and held is not None and held[0] == key:
            return held[1]
        row = read_row(run_dir, now=now)
        if key and row.ended is not None:
            self._rows[str(run_dir)] = (key, row)
        return row


def list_runs(runs_dir: Path, cache: RowCache | None = None) -> list[RunRow]:
    """Every run folder under ``runs_dir``, newest first."""
    try:
        folders = [Path(e.path) for e in os.scandir(runs_dir) if e.is_dir()]
    except OSError:
        return []
    now = time.time()
    rows = [cache.row(p, now) if cache is not None else read_row(p, now=now) for p in folders]
    rows.sort(key=lambda r: (r.started or 0.0, r.id), reverse=True)
    return rows


def matches(row_name: str, row_status: str, *, name: str | None, status: str | None) -> bool:
    """The lists' filter: ``name`` a part of the name (any case), ``status`` the status itself."""
    if status and row_status.lower() != status.lower():
        return False
    return not name or name.lower() in row_name.lower()
