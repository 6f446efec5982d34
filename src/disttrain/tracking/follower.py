"""The run's one writer, in the launcher's process: the records of a run (``track.jsonl``, then
``goodput.json``) and, with ``--track``, the same to a tracker.

It reads what every launcher already relays (each line written to the launch's transcript): the
workers' track lines and rank 0's resume line; at the end, the membership record, the hang verdict
and the exit. Tracker calls run in a thread of their own, so a slow tracking server never holds
up the relay of the run's output; a tracker that fails is said once and dropped (the run goes on,
its records in the run folder are whole).
"""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from .. import goodput, trackline
from ..agent.watchdog import HANG_EXIT
from ..atomic import write_atomic
from ..launch.elastic import load_record
from ..linetap import Tapped
from ..private import private_opener
from ..workerenv import RESUMED_MARKER
from .sink import Sink, open_sink

_RESUMED = re.compile(re.escape(RESUMED_MARKER) + r"(\d+)")
FOLLOW_POLL_S = 0.25
STOP_WAIT_S = 60.0  # at the end, for the tracker to take what is queued
HANG_FILE = "hang_verdict.txt"  # in the run folder: the hang verdict of a run it stopped
FAILURE_FILE = "failure.txt"  # in the run folder: the root-cause report of a run that failed


class RunTracker:
    """One run's records and, when ``tracker`` names one, its tracker run (see the module)."""

    def __init__(self, run_dir: str | Path, *, tracker: str | None, name: str, params: Mapping[str, str],
                 parent: str | None = None, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.run_dir = Path(run_dir)
        self.name = name
        self.clock = clock
        self.say = say or (lambda message: print(message, file=sys.stderr, flush=True))
        self.began = clock()
        self.sink: Sink | None = open_sink(tracker, name, params=params, parent=parent) if tracker else None
        self.goodput: dict[str, Any] | None = None
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, tuple] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send, name="disttrain-tracker", daemon=True)
        self._failed = False
        self._follower: threading.Thread | None = None
        if self.sink is not None:
            self._thread.start()

    # -- the launch's side ------------------------------------------------------------------

    def starting(self, hosts: int) -> None:
        """The agents start on ``hosts`` hosts: the run's start record (dated from its launch)."""
        with self._lock:
            if self._file is None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._file = open(self.run_dir / goodput.RECORD, "a", opener=private_opener)
                self._record({"kind": "start", "t": self.began, "hosts": hosts})

    def line(self, text: str, when: float | None = None) -> None:
        """One line of the run's output (any thread), at ``when`` (default now)."""
        if trackline.MARKER in text:
            record = trackline.decode(text)
        elif RESUMED_MARKER in text:
            found = _RESUMED.search(text)
            record = {"kind": "resumed", "step": int(found[1])} if found else None
        else:
            return
        if record is None:
            return
        record["t"] = self.clock() if when is None else when
        with self._lock:
            if self._file is not None:
                self._record(record)
        if record["kind"] == "metrics" and record.get("values"):
            values = record["values"]
            if record.get("reduced") is False:
                values = {f"rank{record.get('rank')}/{k}": v for k, v in values.items()}
            self._put("metrics", values, record.get("step"), record["t"])

    def follow_files(self, poll_s: float = FOLLOW_POLL_S) -> None:
        """Read the ranks' stdout files in the run folder as they grow (``attempt_<k>/rank<R>.stdout``):
        the launcher that runs its node in this process (``disttrain run`` on this machine) relays
        through torch's own tail, not through a transcript."""
        self._stop_follow = threading.Event()
        self._follower = threading.Thread(target=self._follow, args=(poll_s,), name="disttrain-track-files",
                                          daemon=True)
        self._follower.start()

    def _follow(self, poll_s: float) -> None:
        offsets: dict[Path, int] = {}
        partial: dict[Path, bytes] = {}
        while True:
            stopping = self._stop_follow.wait(poll_s)
            now = self.clock()
            for path in sorted(self.run_dir.glob("attempt_*/rank*.stdout")):
                try:
                    with open(path, "rb") as fh:
                        fh.seek(offsets.get(path, 0))
                        chunk = fh.read()
                except OSError:
                    continue
                offsets[path] = offsets.get(path, 0) + len(chunk)
                *lines, partial[path] = (partial.get(path, b"") + chunk).split(b"\n")
                for line in lines:
                    self.line(line.decode(errors="replace"), now)
            if stopping:
                return

    def tap(self, transcript: TextIO | None) -> TextIO:
        """A transcript for the launch (``Events.transcript``) whose lines also come here."""
        return Tapped(transcript, lambda when, line: self.line(line, when))

    def finish(self, exit_code: int, *, report: str | None = None, artifacts: Sequence[Path] = ()) -> dict | None:
        """The run ended: its end record, ``goodput.json``, and to the tracker the goodput, the
        membership changes, the hang verdict, ``artifacts`` and the exit; the goodput (or None)."""
        hung = exit_code == HANG_EXIT
        if self._follower is not None:  # read to the end first
            self._stop_follow.set()
            self._follower.join(timeout=STOP_WAIT_S)
        with self._lock:
            if self._file is not None:
                self._record({"kind": "end", "t": self.clock(), "exit_code": exit_code, "hung": hung})
                self._file.close()
                self._file = None
        if report and (hung or exit_code):  # the run's own root cause, kept for the user and `disttrain ui`
            try:
                write_atomic(self.run_dir / (HANG_FILE if hung else FAILURE_FILE), report.rstrip("\n") + "\n",
                             mode=0o600)
            except OSError:  # the run folder went away: the terminal said it
                pass
        self.goodput = goodput.from_run_dir(self.run_dir)
        if self.goodput is not None:
            write_atomic(self.run_dir / goodput.FILE, json.dumps(self.goodput, indent=1) + "\n", mode=0o600)
        if self.goodput is not None and self.sink is not None:  # without a tracker: the file only
            self.say(f"disttrain: {goodput.summary(self.goodput)} ({self.run_dir / goodput.FILE})")
        if self.sink is not None:
            if self.goodput is not None:
                self._put("metrics", {"goodput": self.goodput["goodput"] or 0.0,
                                      **{f"goodput/{k}_s": v for k, v in self.goodput["seconds"].items()}},
                          None, self.clock())
                self._put("text", goodput.FILE, json.dumps(self.goodput, indent=1))
            changes = load_record(self.run_dir)
            for number, change in enumerate(changes):
                self._put("metrics", {"membership/hosts": float(len(change.get("hosts") or ()))}, number,
                          float(change.get("time") or self.clock()))
            if changes:
                self._put("text", "membership.json", json.dumps(changes, indent=1))
            if hung and report:
                self._put("text", HANG_FILE, report)
            elif exit_code:
                self._put("text", FAILURE_FILE, report or f"the run ended with exit code {exit_code}; "
                          f"its logs: {self.run_dir}")
            for path in artifacts:
                if Path(path).is_file():
                    self._put("artifact", Path(path))
            self._put("finish", exit_code)
            self._queue.put(None)
            self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():
                self.say(f"disttrain: warning: the {self.sink.tracker} tracker did not take the run's last "
                         f"records within {STOP_WAIT_S:.0f} s")
            elif not self._failed:
                self.say(f"disttrain: tracked in {self.sink.tracker} as run {self.sink.run_id} ({self.name})")
        return self.goodput

    # -- the tracker's thread ---------------------------------------------------------------

    def _record(self, record: Mapping[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
        except (OSError, ValueError):  # the run folder went away: the tracker still gets it
            pass

    def _put(self, what: str, *args) -> None:
        if self.sink is not None and not self._failed:
            self._queue.put((what, args))

    def flush(self) -> None:
        """Wait until the tracker took every record queued so far."""
        if self.sink is not None and self._thread.is_alive():
            self._queue.join()

    def _send(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:  # what else came meanwhile: consecutive points go in one call
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._do([item for item in items if item is not None])
            finally:
                for _ in items:
                    self._queue.task_done()
            if None in items:
                return

    def _do(self, items: list[tuple[str, tuple]]) -> None:
        points: list[tuple] = []
        for what, args in items:
            if what == "metrics":
                points.append(args)
                continue
            if points:
                self._call("points", points)
                points = []
            self._call(what, *args)
        if points:
            self._call("points", points)

    def _call(self, what: str, *args) -> None:
        if self._failed:
            return
        try:
            getattr(self.sink, what)(*args)
        except Exception as err:  # a tracker must never fail the run: said once, then dropped
            self._failed = True
            first = str(err).splitlines()[0] if str(err) else ""
            self.say(f"disttrain: warning: the {self.sink.tracker} tracker failed ({type(err).__name__}: {first}); "
                     f"the run's records stay in {self.run_dir}")
