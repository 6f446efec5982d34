"""``metric_definitions``: SageMaker's regexes over the job's live output, stored as time series.

Every line the launch writes to the job's transcript (every rank's relayed lines) is handed
to the watcher with the time it was written, and each line that a definition's ``Regex``
matches adds a point (name, time, value) to the job store, the value being the regex's first
group, as SageMaker reads CloudWatch metrics from the log (a regex without a group is refused
when the spec is read). A point is timed when its line was relayed, not when the watcher got
to it: a curve has no steps where a poll collected several lines at once. The patterns see each
line's last ``TAIL`` characters, in a process of their own, within a CPU budget per line
(:mod:`.patterns` says why): a pattern that spends it is named once and dropped, the job goes on.
When TensorBoard is
installed, each point is also appended to an event file in the job folder as it arrives, so
``tensorboard --logdir ~/.disttrain/jobs`` shows a running job's curves growing.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ..errors import UsageError
from ..linetap import Tapped
from ..tbevents import EventFile
from .patterns import BUDGET_S, TAIL, PatternMatcher

STEP_NAMES = ("step", "iteration", "iter", "epoch")  # a series by one of these names is the plots' x axis


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
            pattern = re.compile(regex)
        except (re.error, TypeError) as err:
            raise UsageError(f"metric_definitions[{index}].Regex {regex!r} is not a regular expression: {err}") from None
        if not pattern.groups:  # SageMaker reads the value from the first group; without one, nothing
            raise UsageError(f"metric_definitions[{index}].Regex {regex!r} has no group: put the value in "
                             f"parentheses, as SageMaker reads the first group (e.g. 'loss=([0-9.eE+-]+)')")
        compiled.append((name, pattern))
    return compiled


class MetricWatcher:
    """Matches the lines handed to :meth:`feed` in a thread; each point goes to the store at once,
    and to the TensorBoard event file in ``events_dir`` (opened at the first point).

    Its own store (the process's connection, shared under its lock): writing there never holds
    up the relay that feeds it.
    """

    def __init__(self, definitions: list[dict[str, str]], store_path: Path, job_id: int,
                 events_dir: Path | None = None, say: Callable[[str], None] = print) -> None:
        self.definitions = check_definitions(definitions)
        self.say = say
        self.store_path, self.job_id = store_path, job_id
        self.events_dir = events_dir
        self._events: EventFile | None = None
        self._lines: queue.SimpleQueue[tuple[float, str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._follow, name="disttrain-metrics", daemon=True)
        self._open = False
        self.error: str | None = None

    def feed(self, when: float, line: str) -> None:
        """One line of the job's output, written at ``when`` (any thread)."""
        if self._open:
            self._lines.put((when, line))

    def tap(self, transcript: TextIO) -> TextIO:
        """``transcript``, with each line written to it also fed here, timed as written."""
        return Tapped(transcript, self.feed, keep=TAIL) if self.definitions else transcript

    def __enter__(self) -> MetricWatcher:
        if self.definitions:
            self._open = True
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._open:
            self._open = False
            self._lines.put(None)  # after every line fed so far
            self._thread.join(timeout=30)

    def _follow(self) -> None:
        from ..store import JobStore

        try:
            with JobStore(self.store_path) as store, PatternMatcher(
                    [pattern.pattern for _, pattern in self.definitions], self._blown) as self._matcher:
                ending = False
                while not ending:
                    batch = [self._lines.get()]  # block until the next line (or the end)
                    while True:  # and take what else has come meanwhile: one transaction for all
                        try:
                            batch.append(self._lines.get_nowait())
                        except queue.Empty:
                            break
                    ending = None in batch
                    self._add(store, [item for item in batch if item is not None])
        except Exception as err:  # metrics must never fail the job; say why they stopped
            self.error = f"disttrain: metrics stopped: {type(err).__name__}: {err}"
        finally:
            if self._events is not None:
                self._events.close()

    def _add(self, store, lines: list[tuple[float, str]]) -> None:
        rows = []
        for start in range(0, len(lines), 256):  # a request to the pattern process stays small
            chunk = lines[start:start + 256]
            for (when, _), points in zip(chunk, self._matcher.match([line for _, line in chunk])):
                rows.extend((self.definitions[i][0], when, value) for i, value in points)
        if not rows:
            return
        store.add_metrics(self.job_id, rows)
        if self.events_dir is not None:
            if self._events is None:
                self._events = EventFile.open(self.events_dir)
                if self._events is None:
                    self.events_dir = None  # no TensorBoard: do not try again
            if self._events is not None:
                self._events.add(rows)


    def _blown(self, index: int) -> None:
        name, pattern = self.definitions[index]
        self.say(f"disttrain: metric_definitions {name!r}: Regex {pattern.pattern!r} spent over {BUDGET_S:g} s of "
                 f"CPU on one line (its last {TAIL} characters) and is no longer matched in this job; "
                 f"write it without nested repetition or a leading .* (e.g. 'loss=([0-9.eE+-]+)')")



def plot_axes(series: dict[str, list[tuple[float, float]]]) -> tuple[str, dict[str, tuple[list, list]]]:
    """The x label and each series' (xs, ys) as drawn: by step where the job reports one (a
    series named step, iteration, iter or epoch: each point takes the step its line, or the
    last line before it, reported), else by seconds since the first point."""
    steps_name = next((n for want in STEP_NAMES for n in series if n.lower() == want), None)
    if steps_name is None:
        start = min(points[0][0] for points in series.values())
        return "seconds since the first point", {
            name: ([t - start for t, _ in points], [v for _, v in points]) for name, points in series.items()}
    steps = sorted(series[steps_name])
    drawn: dict[str, tuple[list, list]] = {}
    for name, points in series.items():
        if name == steps_name:
            continue
        xs, ys = [], []
        k = -1
        for t, v in sorted(points):
            while k + 1 < len(steps) and steps[k + 1][0] <= t:
                k += 1
            if k >= 0:  # a point before the first step has no place on this axis
                xs.append(steps[k][1])
                ys.append(v)
        drawn[name] = (xs, ys)
    return steps_name, drawn


def plot_series(series: dict[str, list[tuple[float, float]]], png: Path, title: str) -> Path:
    """One panel per metric (see :func:`plot_axes`); the path written (from ``plot_path``)."""
    from ..plotfile import require_matplotlib, save

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series:
        raise UsageError(f"{title}: no metrics recorded (give metric_definitions)")
    xlabel, drawn = plot_axes(series)
    if not drawn:
        drawn = {xlabel: ([t - series[xlabel][0][0] for t, _ in series[xlabel]], [v for _, v in series[xlabel]])}
        xlabel = "seconds since the first point"
    fig, axes = plt.subplots(len(drawn), 1, figsize=(7, 2.6 * len(drawn)), squeeze=False)
    try:
        for ax, (name, (xs, ys)) in zip(axes[:, 0], sorted(drawn.items())):
            ax.plot(xs, ys, marker=".")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel(xlabel)
        axes[0, 0].set_title(title)
        fig.tight_layout()
        return save(fig, png)
    finally:
        plt.close(fig)
