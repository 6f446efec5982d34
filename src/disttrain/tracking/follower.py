"""The run's one writer, in the launcher's process: the records of a run (``track.jsonl``, then
``goodput.json``) and, with ``--track``, the same to a tracker.

It reads what every launcher already relays (each line written to the launch's transcript): the
workers' track lines and rank 0's resume line; at the end, the membership record, the hang verdict
and the exit. The tracker is a side effect: it is opened, written and closed in a thread of its own,
so neither a slow nor a dead tracking server ever holds up or fails the run. One that cannot be
opened is said in one line and the run goes on untracked; one that stops answering mid-run is said
once, its records are kept and sent when it answers again, and the run's end waits for them a
bounded time (:data:`STOP_WAIT_S`). The records in the run folder are whole either way.
"""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from .. import goodput, trackline
from ..agent.watchdog import HANG_EXIT
from ..atomic import write_atomic
from ..errors import one_line
from ..launch.membership_record import load_record
from ..linetap import Tapped
from ..private import private_opener, redact_urls
from ..workerenv import RESUMED_MARKER
from .sink import Sink, busy, open_sink

_RESUMED = re.compile(re.escape(RESUMED_MARKER) + r"(\d+)")
FOLLOW_POLL_S = 0.25
STOP_WAIT_S = 30.0  # at the end, for the opened tracker to take what is queued (a dead one: as long as this)
RETRY_EVERY_S = 2.0  # a tracker that stopped answering is tried again this often
OPEN_PATIENCE_S = 60.0  # a server slow to answer (many runs starting at once) is asked again this long
# At the end, for a tracker still being opened: its client's import (a minute with twenty runs starting at
# once on two loaded cores, seen) and OPEN_PATIENCE_S of a slow server's answers.
OPEN_WAIT_S = 180.0
BUSY_GRACE_S = 30.0  # a server there but slow (timeouts, 5xx) is said to have stopped answering after this long
MAX_KEPT = 100_000  # records kept for a tracker that stopped answering (the oldest points go first)
HANG_FILE = "hang_verdict.txt"  # in the run folder: the hang verdict of a run it stopped
FAILURE_FILE = "failure.txt"  # in the run folder: the root-cause report of a run that failed


def _whole_metadata_finder() -> None:
    """importlib_metadata (the backport, which the trackers' clients import) puts its finder on
    ``sys.meta_path`` while its module still runs: a package-metadata lookup in another thread at
    that moment fails with ``NameError: name 'PathDistribution' is not defined`` (seen: 1 run in
    20 at once). Imported here, before the tracker's thread starts, the module is whole."""
    try:
        import importlib_metadata  # noqa: F401
    except ImportError:
        pass


class RunTracker:
    """One run's records and, when ``tracker`` names one, its tracker run (see the module)."""

    def __init__(self, run_dir: str | Path, *, tracker: str | None, name: str, params: Mapping[str, str],
                 parent: str | None = None, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time, stop_wait_s: float = STOP_WAIT_S) -> None:
        self.run_dir = Path(run_dir)
        self.name = name
        self.clock = clock
        say = say or (lambda message: print(message, file=sys.stderr, flush=True))
        self.say = lambda message: say(redact_urls(message))  # a tracking URI's password never shown
        self.began = clock()
        self.tracker = tracker
        self.sink: Sink | None = None  # once opened, in the tracker's thread
        self.goodput: dict[str, Any] | None = None
        self.stop_wait_s = stop_wait_s
        self._open_args = (name, params, parent, uuid.uuid4().hex)  # the key: one run however often opened
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, tuple] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send, name="disttrain-tracker", daemon=True)
        self._failed = False  # the tracker was dropped (it could not be opened)
        self._down = False  # it stopped answering (said): its records are kept
        self._failing_since: float | None = None  # its first failure since it last took a record
        self._closing = threading.Event()  # the run's end waited long enough: the thread gives up
        self._opened = threading.Event()  # the opening ended, either way
        self._follower: threading.Thread | None = None
        if tracker:
            _whole_metadata_finder()
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
        # the root cause of a run that started (its folder is there), kept for the user and `disttrain ui`
        if report and (hung or exit_code) and self.run_dir.is_dir():
            try:
                write_atomic(self.run_dir / (HANG_FILE if hung else FAILURE_FILE), report.rstrip("\n") + "\n",
                             mode=0o600)
            except OSError:  # the run folder went away: the terminal said it
                pass
        self.goodput = goodput.from_run_dir(self.run_dir)
        if self.goodput is not None:
            write_atomic(self.run_dir / goodput.FILE, json.dumps(self.goodput, indent=1) + "\n", mode=0o600)
        if self.goodput is not None and self.tracker:  # without a tracker: the file only
            self.say(f"disttrain: {goodput.summary(self.goodput)} ({self.run_dir / goodput.FILE})")
        if self.tracker:
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
            # The end's wait counts from the tracker's opening, not from the run's end: a short run
            # ends while the client is still imported (a minute on a loaded machine).
            opened = self._opened.wait(OPEN_WAIT_S)
            if opened:
                self._thread.join(timeout=self.stop_wait_s)
            self._closing.set()
            if not opened:
                self.say(f"disttrain: warning: the {self.tracker} tracker was still being opened after "
                         f"{OPEN_WAIT_S:g} s; the run's records stay in {self.run_dir}")
            elif self._thread.is_alive() and not self._failed:
                self.say(f"disttrain: warning: the {self.tracker} tracker did not take the run's last "
                         f"records within {self.stop_wait_s:g} s; they stay in {self.run_dir}")
            elif not self._failed and self.sink is not None:
                self.say(f"disttrain: tracked in {self.tracker} as run {self.sink.run_id} ({self.name})")
        return self.goodput

    # -- the tracker's thread ---------------------------------------------------------------

    def _record(self, record: Mapping[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
        except (OSError, ValueError):  # the run folder went away: the tracker still gets it
            pass

    def _put(self, what: str, *args) -> None:
        if self.tracker and not self._failed:
            self._queue.put((what, args))

    def flush(self) -> None:
        """Wait until the tracker took every record queued so far (or kept it: it stopped answering)."""
        if self.tracker and self._thread.is_alive():
            self._queue.join()

    def _send(self) -> None:
        kept: list[tuple[str, tuple]] = []
        ending = False
        if not self._open():
            self._failed = True
        self._opened.set()
        while True:
            try:
                items = [self._queue.get(timeout=RETRY_EVERY_S if kept else None)]
            except queue.Empty:
                items = []
            while True:  # what else came meanwhile: consecutive points go in one call
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            ending = ending or None in items
            if not self._failed:
                kept.extend(item for item in items if item is not None)
                if len(kept) > MAX_KEPT:
                    del kept[:len(kept) - MAX_KEPT]
                self._deliver(kept)
            for _ in items:
                self._queue.task_done()
            # At the end: done once all is taken, else tried again until the run's end stops waiting.
            if ending and (not kept or self._failed or self._closing.is_set()):
                return

    def _open(self) -> bool:
        """The tracker's run, opened here: a tracker that cannot be reached or does not exist is one
        line, and the run goes on untracked. A server that is there but slow to answer (many runs
        starting at once) is asked again for up to OPEN_PATIENCE_S from its first slow answer (not
        from the start: importing the client may take most of a minute), its records queued meanwhile."""
        name, params, parent, key = self._open_args
        patience: float | None = None
        while True:
            try:
                self.sink = open_sink(self.tracker, name, params=params, parent=parent, key=key)
                return True
            except Exception as err:  # a tracker must never fail the run
                patience = patience or time.monotonic() + OPEN_PATIENCE_S
                if (busy(err) and time.monotonic() < patience
                        and not self._closing.wait(RETRY_EVERY_S)):
                    continue
                self.say(f"disttrain: warning: the {self.tracker} tracker could not be opened ({one_line(err)}); "
                         f"the run goes on untracked, its records in {self.run_dir}")
                return False

    def _deliver(self, kept: list[tuple[str, tuple]]) -> None:
        """Send ``kept`` from its front, each record removed once taken; at a failure, the rest is kept
        for the next try (said once: at once for a server that is gone, after BUSY_GRACE_S for one that
        is only slow), and a record the tracker refuses for what it is, dropped."""
        while kept:
            what, args = kept[0]
            count = 1
            if what == "metrics":
                while count < len(kept) and kept[count][0] == "metrics":
                    count += 1
            try:
                if what == "metrics":
                    self.sink.points([item[1] for item in kept[:count]])
                else:
                    getattr(self.sink, what)(*args)
            except Exception as err:
                if not self.sink.retryable(err):  # this record, not the server: never sent, the rest go on
                    self.say(f"disttrain: warning: the {self.tracker} tracker refused a record "
                             f"({one_line(err)}); it stays in {self.run_dir}")
                    del kept[:count]
                    continue
                self._failing_since = self._failing_since or time.monotonic()
                if not self._down and (not busy(err) or time.monotonic() - self._failing_since >= BUSY_GRACE_S):
                    self._down = True
                    self.say(f"disttrain: warning: the {self.tracker} tracker stopped answering ({one_line(err)}); "
                             "the run goes on, its records are kept and sent when it answers again")
                return
            del kept[:count]
            self._failing_since = None
        if self._down:
            self._down = False
            self.say(f"disttrain: the {self.tracker} tracker answers again; the records kept meanwhile are sent")
