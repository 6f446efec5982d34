"""The flow every agent-per-node launcher shares: start, relay, first failure, stop all.

Each node's agent (``disttrain agent``, started as a probe session: see
:mod:`disttrain.launch.probe`) is one local process: ``ssh host ...``, ``srun ...`` or the
agent itself. Its plan, values of the user's variables included, is the line it reads on
stdin after the probe round (:class:`~disttrain.wire.PlanMessage`) -- never on a command line,
which every user of a host can read with ``ps``. stdin then stays open: closing it asks the
agent to stop its workers (see :mod:`disttrain.agent.entry`), which is how every node is
stopped at the first failure or on Ctrl-C; agents that do not exit within the grace period
are killed.

The agents' output is already prefixed ``[host rankN]``; it is relayed to the terminal, to a
per-rank log in the run folder and to an optional transcript, and each agent's own lines are
kept for its root-cause block.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..agent.verdict import verdict
from ..agent.watchdog import HANG_EXIT
from ..plan.launch import LaunchPlan
from ..private import private_opener
from ..wire import (
    ALIVE_EVERY_S,
    Alive,
    DumpRequest,
    HangReport,
    NodeDone,
    Outcome,
    PlanMessage,
    RankFailed,
    Regroup,
    WireError,
)
from .diagnostics import Diagnostics
from .elastic import Membership
from .rootcause import first_in_time

AGENT_LINES_KEPT = 200
_PREFIX = re.compile(r"^\[(?P<host>[^\]\s]+) rank(?P<rank>\d+)\] ")
# A C++ stack dump, as torch's c10 errors and warnings print them: kept in the logs, not shown.
_CPP_FRAME = re.compile(r"^(frame #\d+: |Exception raised from .*\(most recent call first\):$|<omitting python frames>$)")
# torch's own C++ log lines (glog style: "[W1124 03:33:59.078 TCPStore.cpp:138] ...") from an agent's
# internals -- a store that lost its server once another node failed: disttrain says what happened.
_C10_LOG = re.compile(r"^\[[WEIF]\d{4} [\d:.]+ (\d+ )?\S+:\d+\] ")


class Relay:
    """Copies one stream of one agent to the terminal, to per-rank log files and to an
    optional transcript; keeps the agent's own lines (its root-cause block) and writes them to
    ``node<k>.log``. C++ stack dumps go to the logs only."""

    def __init__(self, run_dir: Path, lock: threading.Lock, transcript: TextIO | None = None,
                 on_agent_line=None, on_rank_line=None) -> None:
        self._run_dir = run_dir
        self._lock = lock
        self._transcript = transcript
        self._files: dict[str, TextIO] = {}
        self._on_agent_line = on_agent_line
        self._on_rank_line = on_rank_line
        # Per agent: its own (unprefixed) stderr lines; the root-cause block is at the end.
        self.agent_lines: dict[int, deque[str]] = {}
        self.drained: dict[int, threading.Thread] = {}  # per agent: the thread reading its stderr

    def pump(self, stream, out: TextIO, agent: int | None = None) -> None:
        in_dump = False
        for line in iter(stream.readline, ""):
            match = _PREFIX.match(line)
            if not match and agent is not None and self._on_agent_line is not None:
                if self._on_agent_line(agent, line):  # the launcher consumed it (a heartbeat)
                    continue
            if match and self._on_rank_line is not None:
                self._on_rank_line(line[match.end():])
            text = line[match.end():] if match else line
            if _CPP_FRAME.match(text) or (not match and agent is not None and _C10_LOG.match(text)):
                in_dump = True
            elif text.strip():
                in_dump = False
            with self._lock:
                if not in_dump:
                    out.write(line)
                    out.flush()
                    if self._transcript is not None:
                        self._transcript.write(line)
                        self._transcript.flush()
                if match:
                    self._write(f"rank{match['rank']}.log", text)
                elif agent is not None:
                    self._write(f"node{agent}.log", text)
                    if not in_dump:
                        self.agent_lines.setdefault(agent, deque(maxlen=AGENT_LINES_KEPT)).append(line.rstrip("\n"))

    def _write(self, name: str, text: str) -> None:
        if name not in self._files:
            self._files[name] = open(self._run_dir / name, "a", opener=private_opener)  # a rank printed it: 0600
        self._files[name].write(text)
        self._files[name].flush()

    def report(self, agent: int) -> str:
        """The agent's own message about the failure: from its first ``disttrain:`` line on."""
        lines = list(self.agent_lines.get(agent, ()))
        start = next((i for i, line in enumerate(lines) if line.startswith("disttrain:")), len(lines))
        return "\n".join(lines[start:])

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()


def start(argv: Sequence[str], *, cwd: str | None = None) -> subprocess.Popen:
    """One agent (or probe session) process, talking over pipes, out of our terminal's
    process group: a Ctrl-C reaches the launcher only, which then stops the nodes."""
    return subprocess.Popen(list(argv), cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


class Stdins:
    """The agents' stdin pipes, written from the main thread (the plan, the dump request, the stop)
    and from the keep-alive thread: one lock, so that lines never interleave."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def send(self, proc: subprocess.Popen, line: str) -> None:
        with self._lock:
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                pass  # it ended already; its exit code and stderr tell why

    def close(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if proc.poll() is None and proc.stdin:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

    def keep_alive(self, procs: Sequence[subprocess.Popen], done: threading.Event) -> threading.Thread:
        """Tell every agent, every few seconds, that its launcher is there (an agent that hears
        nothing for :data:`~disttrain.wire.CUT_OFF_S` stops on its own: see disttrain.agent.entry)."""
        def beat() -> None:
            while not done.wait(ALIVE_EVERY_S):
                for proc in procs:
                    if proc.poll() is None:
                        self.send(proc, Alive().to_line())

        thread = threading.Thread(target=beat, name="agents-alive", daemon=True)
        thread.start()
        return thread


def run_agents(
    plan: LaunchPlan,
    started: Sequence[subprocess.Popen],
    *,
    agent_cwd: str | None = None,
    transcript: TextIO | None = None,
    membership: Membership | None = None,
) -> Outcome:
    """Hand each node's agent (``started[i]`` runs node ``i``, waiting for its plan) its plan on
    stdin, relay their output, stop every node at the first failure or on SIGINT/SIGTERM, and
    say how it ended. No progress on any host for --hang-timeout: every agent reports its ranks
    and the verdict is printed here, in one block.

    ``membership`` (an elastic range): a node whose host is lost does not stop the others, which
    regroup, unless fewer than the minimum are left; hosts that answer again are relayed too.
    """
    Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            for out in filter(None, (sys.stderr, transcript)):
                out.write(message + "\n")
                out.flush()

    diag = Diagnostics(hang_timeout_s=plan.hang_timeout_s, say=say)
    hangs: list[HangReport] = []
    failed: dict[int, RankFailed] = {}  # per agent: its root cause, timed on its worker

    def consume(agent: int, line: str) -> bool:
        """An agent's message for the launcher, not shown: its heartbeats, its ranks at a hang,
        its workers done (passed on to the other agents), an elastic round's world."""
        if membership is not None and membership.agent_line(agent, line):
            diag.reset()  # a new round: its ranks and their step counts start again
            return True
        try:
            if HangReport.matches(line):
                hangs.append(HangReport.from_line(line))
                return True
            if RankFailed.matches(line):
                failed[agent] = RankFailed.from_line(line)
                return True
            if NodeDone.matches(line):
                done = NodeDone.from_line(line)
                for index, proc in enumerate(procs):
                    if index != agent and proc.poll() is None:
                        stdins.send(proc, done.to_line())
                return True
        except WireError:
            return False
        return diag.consume(line)

    relay = Relay(Path(plan.run_dir), lock, transcript, consume,
                  membership.rank_line if membership is not None else None)
    stdins = Stdins()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    interrupted: list[int] = []
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        interrupted.append(signum)

    def relay_agent(proc: subprocess.Popen) -> None:
        index = len(procs)
        procs.append(proc)
        for stream, out, agent in ((proc.stdout, sys.stdout, None), (proc.stderr, sys.stderr, index)):
            pump = threading.Thread(target=relay.pump, args=(stream, out, agent), daemon=True)
            pump.start()
            pumps.append(pump)
        relay.drained[index] = pumps[-1]  # its own lines, read to the end once it exited

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    ended: _Ended | None = None
    try:
        for index, proc in enumerate(started):
            stdins.send(proc, PlanMessage(node_rank=plan.nodes[index].node_rank, plan=plan, cwd=agent_cwd).to_line())
            relay_agent(proc)
        stdins.keep_alive(procs, done)
        if membership is not None:
            membership.start(say)
        ended = _watch(procs, interrupted, diag, membership, relay, relay_agent, stdins)
        if membership is not None:
            membership.close()
        if diag.hung:
            _collect_hang_reports(procs, grace_s=plan.stop_grace_s + 15)
        done.set()
        stop(procs, grace_s=plan.stop_grace_s + 5, stdins=stdins)
    finally:
        done.set()
        if membership is not None:
            membership.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in pumps:
            pump.join(timeout=5)
        relay.close()
    summary = diag.summary()
    if summary and not diag.hung and ended is None and not interrupted:
        say(summary)
    if diag.hung:
        states = [state for report in hangs for state in report.ranks]
        text = verdict(states, world_size=plan.world_size, timeout_s=plan.hang_timeout_s)
        say(text)
        say(f"disttrain: stopped the job on all {len(procs)} hosts (exit {HANG_EXIT})")
        return Outcome(exit_code=HANG_EXIT, failed=None, report=text)
    if interrupted:
        return Outcome(exit_code=128 + interrupted[0], signal=interrupted[0])
    if ended is None:
        return Outcome(exit_code=0)
    if ended.report:  # fewer hosts than the elastic minimum: the membership's own block
        say(ended.report)
    if ended.report:
        return Outcome(exit_code=ended.code, failed=ended.index, report=ended.report)
    # Every agent has stopped: all have said. (An elastic job's hosts that left earlier failed in
    # rounds already over: there the agent heard of first stays the one reported.)
    index, code = first_in_time(ended.index, ended.code, failed if membership is None else {})
    return Outcome(exit_code=code, failed=index, report=relay.report(index))


@dataclass(frozen=True)
class _Ended:
    """How the watch ended: agent ``index`` failed with ``code`` (``report``: the launcher's own words)."""

    index: int
    code: int
    report: str = ""


def _watch(procs: list[subprocess.Popen], interrupted: list[int], diag: Diagnostics,
           membership: Membership | None, relay: Relay, relay_agent, stdins: Stdins) -> _Ended | None:
    """Until every agent ended well (None), one failed, no rank moved for --hang-timeout (None,
    ``diag.hung``: every agent is asked for its ranks) or a signal came; with ``membership``, a
    lost host's agent is no failure while enough hosts are left."""
    done: set[int] = set()
    while not interrupted:
        if diag.stalled():  # no rank anywhere moved: every agent reports its ranks, then stops
            diag.hung = True
            for proc in procs:
                stdins.send(proc, DumpRequest().to_line())
            return None
        for index, proc in enumerate(procs):
            if index in done:
                continue
            code = proc.poll()
            why = None
            if code is None and membership is not None and membership.silent(index):
                why = f"its agent said nothing for {membership.silent_s:.0f} s"
                proc.kill()
                code = proc.wait()
            if code is None:
                continue
            done.add(index)
            if code == 0:
                if membership is not None:
                    membership.ended(index)
                continue
            if membership is not None:
                why = why or membership.why_lost(index, code, _last_line(relay, index))
            if why is None:  # a node failed: the job cannot go on
                return _Ended(index, code)
            for other in membership.leave(index, why):
                stdins.send(procs[other], Regroup(lost=(membership.host_of(index),)).to_line())
            report = membership.below_min()
            if report:
                return _Ended(index, code, report)
        if membership is not None:
            membership.poll()
            for proc in membership.joined():
                relay_agent(proc)
        if len(done) == len(procs):
            return None
        time.sleep(0.1)
    return None


def _last_line(relay: Relay, index: int) -> str:
    """Agent ``index``'s last own line (it exited: its stream is read to the end first)."""
    pump = relay.drained.get(index)
    if pump is not None:
        pump.join(timeout=2)
    lines = relay.agent_lines.get(index)
    return lines[-1] if lines else ""


def _collect_hang_reports(procs: list[subprocess.Popen], *, grace_s: float) -> None:
    """Every agent reports its ranks and stops its workers: wait for all."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def stop(procs: list[subprocess.Popen], *, grace_s: float, stdins: Stdins | None = None) -> None:
    """Close every agent's stdin (it stops its workers), then kill what outlives the grace."""
    stdins = stdins or Stdins()
    for proc in procs:
        stdins.close(proc)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
