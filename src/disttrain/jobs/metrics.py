"""``metric_definitions``: SageMaker's regexes over the job's live output, stored as time series.

The job's transcript (every rank's relayed lines) is followed while the job runs; each line
that a definition's ``Regex`` matches adds a point (name, time, value) to the job store, the
value being the regex's first group (the whole match when it has none), as SageMaker reads
CloudWatch metrics from the log. When TensorBoard is installed, each point is also appended to
an event file in the job folder as it arrives, so ``tensorboard --logdir ~/.disttrain/jobs``
shows a running job's curves growing.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..tbevents import EventFile

POLL_S = 0.5


def check_definitions(definitions: Any) -> list[tuple[str, re.Pattern]]:
    """``[{"Name": ..., "Regex": ...}]`` → compiled pairs; a mistake names the entry."""
    if not isinstance(definitions, (list, tuple)):
        raise UsageError(f"metric_definitions must be a list of {{'Name': ..., 'Regex': ...}}, got {definitions!r}")
    compiled = []
    for index, entry in enumerate(definitions):
        if not isinstance(entry, dict) or set(entry) != {"Name", "Regex"}:
            raise UsageError(f"metric_definitions[{index}] must be {{'Name': 'loss', 'Regex': 'loss=([0-9.]+)'}}, "
                             f"got {entry!r}")
        name, regex = entry["Name"], entry["Regex"]
        if not isinstance(name, str) or not name:
            raise UsageError(f"metric_definitions[{index}].Name must be a non-empty string, got {name!r}")
        try:
            compiled.append((name, re.compile(regex)))
        except (re.error, TypeError) as err:
            raise UsageError(f"metric_definitions[{index}].Regex {regex!r} is not a regular expression: {err}") from None
    return compiled


def match_line(definitions: Sequence[tuple[str, re.Pattern]], line: str) -> list[tuple[str, float]]:
    points = []
    for name, pattern in definitions:
        for found in pattern.finditer(line):
            text = found.group(1) if pattern.groups else found.group(0)
            try:
                points.append((name, float(text)))
            except (TypeError, ValueError):
                continue  # a match that is not a number (e.g. "nan" parses; "n/a" does not)
    return points


class MetricWatcher:
    """Follows ``transcript`` in a thread; each matched point goes to the store at once, and to
    the TensorBoard event file in ``events_dir`` (opened at the first point).

    Its own store connection: SQLite connections stay in the thread that made them.
    """

    def __init__(self, definitions: list[dict[str, str]], transcript: Path, store_path: Path, job_id: int,
                 events_dir: Path | None = None) -> None:
        self.definitions = check_definitions(definitions)
        self.transcript, self.store_path, self.job_id = transcript, store_path, job_id
        self.events_dir = events_dir
        self._events: EventFile | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="disttrain-metrics", daemon=True)
        self.error: str | None = None

    def __enter__(self) -> MetricWatcher:
        if self.definitions:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _follow(self) -> None:
        from ..store import JobStore

        try:
            with JobStore(self.store_path) as store:
                offset, partial = 0, b""
                while True:
                    stopping = self._stop.is_set()  # read the file once more after the stop
                    offset, partial = self._read(store, offset, partial)
                    if stopping:
                        return
                    self._stop.wait(POLL_S)
        except Exception as err:  # metrics must never fail the job; say why they stopped
            self.error = f"disttrain: metrics stopped: {type(err).__name__}: {err}"
        finally:
            if self._events is not None:
                self._events.close()

    def _read(self, store, offset: int, partial: bytes) -> tuple[int, bytes]:
        try:
            with open(self.transcript, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            return offset, partial
        if not data:
            return offset, partial
        lines = (partial + data).split(b"\n")
        now = time.time()
        rows = [(name, now, value) for line in lines[:-1]
                for name, value in match_line(self.definitions, line.decode(errors="replace"))]
        store.add_metrics(self.job_id, rows)
        if rows and self.events_dir is not None:
            if self._events is None:
                self._events = EventFile.open(self.events_dir)
                if self._events is None:
                    self.events_dir = None  # no TensorBoard: do not try again
            if self._events is not None:
                self._events.add(rows)
        return offset + len(data), lines[-1]


def plot_series(series: dict[str, list[tuple[float, float]]], png: Path, title: str) -> None:
    """One panel per metric, value over seconds since the first point."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'disttrain[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series:
        raise UsageError(f"{title}: no metrics recorded (give metric_definitions)")
    start = min(points[0][0] for points in series.values())
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.6 * len(series)), squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], sorted(series.items())):
        ax.plot([t - start for t, _ in points], [v for _, v in points], marker=".")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first point")
    axes[0, 0].set_title(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
