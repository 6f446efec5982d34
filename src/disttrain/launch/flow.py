"""The flow every agent-per-node launcher shares: start, relay, first failure, stop all.

Each node's agent (``disttrain agent``, started as a probe session: see
:mod:`disttrain.launch.probe`) is one local process: ``ssh host ...``, ``srun ...`` or the
agent itself. Its plan, values of the user's variables included, is the line it reads on
stdin after the probe round (:class:`~disttrain.wire.PlanMessage`) -- never on a command line,
which every user of a host can read with ``ps``. stdin then stays open: closing it asks the
agent to stop its workers (see :mod:`disttrain.agent.entry`), which is how every node is
stopped at the first failure or on Ctrl-C; agents that do not exit within the grace period
are killed.

The agents' output is already prefixed ``[host rankN]``; it is relayed (:mod:`.relay`) to the
terminal, to a per-rank log in the run folder and to an optional transcript, and each agent's own
lines are kept for its root-cause block.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..agent.verdict import verdict, warm
from ..agent.watchdog import HANG_EXIT
from ..plan.launch import LaunchPlan
from ..wire import (
    ALIVE_EVERY_S,
    Alive,
    AttemptStarted,
    Beats,
    DumpRequest,
    HangReport,
    NodeDone,
    Outcome,
    PlanMessage,
    RankFailed,
    Regroup,
    StopRequest,
    WireError,
)
from ..workerenv import REGROUP_MODE
from .diagnostics import Diagnostics
from .elastic import Membership
from .knobs import backoff, probe_limit, slow_limit
from .policies import REGROUP_MARGIN_S, Elastic, FailFast, HangWatch, ranks_said
from .relay import Relay
from .rendezvous_store import round_counter
from .rootcause import first_in_time
from .supervision import (
    Admit,
    AgentState,
    Dump,
    Event,
    EventKind,
    Held,
    Join,
    Probe,
    RegroupWithout,
    Slow,
    Stop,
    Supervisor,
)


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
    What happens is decided by :class:`~disttrain.launch.supervision.Supervisor`; this function
    and :class:`_Supervised` do the I/O.
    """
    Path(plan.run_dir).mkdir(parents=True, exist_ok=True)
    job = _Supervised(plan, membership, transcript)
    previous = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return job.run(started, agent_cwd)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Solo:
    """The membership of a job without a range: nobody joins, nothing to record."""

    def start(self, say) -> None: ...
    def close(self) -> None: ...
    def poll(self) -> None: ...
    def agent_line(self, slot: int, line: str) -> bool: return False
    def rank_line(self, text: str) -> None: ...
    def joined(self) -> list[subprocess.Popen]: return []
    def ready(self) -> list[str]: return []
    def missed(self) -> list[str]: return []
    def unreachable(self) -> list[int]: return []
    def probe(self, slot: int, timeout_s: float) -> None: ...
    def try_hosts(self, names) -> None: ...
    def go(self, names) -> None: ...
    def transport_cause(self, slot: int, code: int, last: str, quiet_s: float | None = None) -> str | None: return None
    def leave(self, slot: int, why: str, *, backoff: float | None = None) -> list[int]: return []
    def ended(self, slot: int) -> None: ...


class _Supervised:
    """One launch's agents: their processes, streams and stdins, the supervisor that decides, and
    what carries its decisions out."""

    def __init__(self, plan: LaunchPlan, membership: Membership | None, transcript: TextIO | None) -> None:
        self.plan = plan
        self.lock = threading.Lock()
        self.transcript = transcript
        self.membership = membership or _Solo()
        store = f"{plan.master_addr}:{plan.master_port}"
        in_place = os.environ.get(REGROUP_MODE, "in-place") != "restart"  # the survivors' workers stay
        self.elastic = Elastic(
            min_nnodes=plan.min_nnodes or plan.nnodes, max_nnodes=min(plan.nnodes, len(membership.hosts)),
            regroup_s=plan.rdzv_timeout_s + REGROUP_MARGIN_S, store=store, backoff=backoff(),
            slow_s=slow_limit() if membership.kept_alive else None,
            probe_s=probe_limit() if membership.kept_alive else None,
            next_round=round_counter(store) if in_place else None,
            hosts=membership.hosts) if membership is not None else None
        # An elastic launch's table is its membership's (who is a member is recorded once).
        self.sup = Supervisor(tuple(n.name for n in plan.nodes),
                              policies=[self.elastic or FailFast(), HangWatch(plan.hang_timeout_s)],
                              agents=membership.table if membership is not None else None)
        self.diag = Diagnostics(say=self.say, late=self.sup.late)
        self.hangs: list[HangReport] = []
        self.failed: dict[int, RankFailed] = {}  # per agent: its root cause, timed on its worker
        self.dumped: tuple[int, ...] = ()
        self.relay = Relay(Path(plan.run_dir), self.lock, transcript, self.consume, self.membership.rank_line)
        self.stdins = Stdins()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.interrupted: list[int] = []
        self.recorded: set[int] = set()  # lost slots the membership recorded
        self.events: list[Event] = []  # from the relay threads to the loop
        self.events_lock = threading.Lock()
        self.wake = threading.Event()  # the watch's wait ends at once: an event posted, an agent's end

    def say(self, message: str) -> None:
        with self.lock:
            for out in filter(None, (sys.stderr, self.transcript)):
                out.write(message + "\n")
                out.flush()

    def on_signal(self, signum, _frame) -> None:
        self.interrupted.append(signum)

    def post(self, event: Event) -> None:
        with self.events_lock:
            self.events.append(event)
        self.wake.set()

    def consume(self, agent: int, line: str) -> bool:
        """An agent's message for the launcher, not shown: its heartbeats, its ranks at a hang,
        its workers done (passed on to the other agents), an elastic round's world."""
        now = time.monotonic()
        if AttemptStarted.matches(line):
            try:
                started = AttemptStarted.from_line(line)
                self.post(Event(EventKind.ROUND, at=now, slot=agent, attempt=started.attempt, ranks=started.ranks))
            except WireError:
                pass
        if self.membership.agent_line(agent, line):
            self.diag.reset()  # a new round: its ranks and their step counts start again
            return True
        if Beats.matches(line):
            try:
                beats = Beats.from_line(line)
            except WireError:
                beats = None
            progress = max((now - age for _, age in beats.ranks.values()), default=None) if beats else None
            self.post(Event(EventKind.HEARD, at=now, slot=agent, progress=progress,
                            held=beats.stopped if beats else None))
        else:
            self.post(Event(EventKind.HEARD, at=now, slot=agent))
        try:
            if HangReport.matches(line):
                self.hangs.append(HangReport.from_line(line))
                return True
            if RankFailed.matches(line):
                self.failed[agent] = RankFailed.from_line(line)
                return True
            if NodeDone.matches(line):
                done = NodeDone.from_line(line)
                for index, proc in enumerate(self.procs):
                    if index != agent and proc.poll() is None:
                        self.stdins.send(proc, done.to_line())
                return True
        except WireError:
            return False
        return self.diag.consume(line)

    def relay_agent(self, proc: subprocess.Popen) -> None:
        index = len(self.procs)
        self.procs.append(proc)
        for stream, out, agent in ((proc.stdout, sys.stdout, None), (proc.stderr, sys.stderr, index)):
            pump = threading.Thread(target=self._pump, args=(proc, stream, out, agent), daemon=True)
            pump.start()
            self.pumps.append(pump)
        self.relay.drained[index] = self.pumps[-1]  # its own lines, read to the end once it exited

    def _pump(self, proc: subprocess.Popen, stream, out: TextIO, agent: int | None) -> None:
        """Relay one of an agent's streams to its end, then wake the watch: the stream's end is the
        agent's (its exit status follows within moments), seen without waiting for the next look."""
        self.relay.pump(stream, out, agent)
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:  # a child of it still holds the stream: the watch polls on
            pass
        self.wake.set()

    def run(self, started: Sequence[subprocess.Popen], agent_cwd: str | None) -> Outcome:
        plan, done = self.plan, threading.Event()
        ended: Stop | None = None
        try:
            for index, proc in enumerate(started):
                self.stdins.send(proc, PlanMessage(node_rank=plan.nodes[index].node_rank, plan=plan,
                                                   cwd=agent_cwd).to_line())
                self.relay_agent(proc)
            self.stdins.keep_alive(self.procs, done)
            if plan.hang_timeout_s:  # the verdict's import, ahead (see verdict.warm)
                threading.Thread(target=warm, name="verdict-import", daemon=True).start()
            self.membership.start(self.say)
            ended = self.watch()
            self.membership.close()
            if self.dumped:
                self._collect_hang_reports(grace_s=plan.stop_grace_s + 15)
            done.set()
            stop(self.procs, grace_s=plan.stop_grace_s + 5, stdins=self.stdins, why=self.why_stop(ended))
        finally:
            done.set()
            self.membership.close()
            for pump in self.pumps:
                pump.join(timeout=5)
            self.relay.close()
        return self.outcome(ended)

    def why_stop(self, ended: Stop | None) -> str | None:
        """What an agent still running is told when the launcher stops it."""
        if self.interrupted:
            return f"the launcher got {signal.Signals(self.interrupted[0]).name}"
        if ended is None:
            return None
        if ended.slot is not None:
            row = self.sup.agents[ended.slot]
            cause = (f"{row.host} was lost ({row.why})" if row.state is AgentState.LOST
                     else f"the agent on {row.host} failed (exit {ended.code})")
            return f"stopped by the launcher: {cause}" + (f", {ended.reason}" if ended.reason == "below the minimum"
                                                          else "")
        return f"stopped by the launcher: {ended.reason}"

    def outcome(self, ended: Stop | None) -> Outcome:
        summary = self.diag.summary()
        if summary and not self.dumped and ended is None and not self.interrupted:
            self.say(summary)
        if self.dumped:
            return Outcome(exit_code=HANG_EXIT, failed=None, report=self.verdict)
        if self.interrupted:
            return Outcome(exit_code=128 + self.interrupted[0], signal=self.interrupted[0])
        if ended is None:
            return Outcome(exit_code=0)
        if ended.report:  # the launcher's own block (below the elastic minimum, a regroup that never formed)
            self.say(ended.report)
            return Outcome(exit_code=ended.code, failed=ended.slot, report=ended.report)
        # Every agent has stopped: all have said. (An elastic job's hosts that left earlier failed in
        # rounds already over: there the agent heard of first stays the one reported.)
        index, code = first_in_time(ended.slot, ended.code, {} if self.elastic else self.failed)
        return Outcome(exit_code=code, failed=index, report=self.relay.report(index))

    def watch(self) -> Stop | None:
        """Until every agent ended well (None), one failed, no rank moved for --hang-timeout (None,
        ``self.dumped``: every agent is asked for its ranks) or a signal came: events in, decisions out."""
        while not self.interrupted:
            self.wake.clear()  # before looking: whatever happens from now on ends the wait below
            ended = self._handle_pending()
            if ended is not False:
                return ended
            for index, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or self.sup.agents[index].state.final or index in self.recorded:
                    continue
                if self.sup.agents[index].state is AgentState.HUNG:
                    continue  # it reports its ranks, then stops: collected after the watch
                cause, last = None, ""
                if code != 0:
                    last = self.relay.last_line(index)
                    ended = self._handle_pending()  # its last lines, read to the end, are events too
                    if ended is not False:
                        return ended
                    if self.sup.agents[index].state.final:
                        continue  # judged meanwhile (its silence)
                    quiet = time.monotonic() - self.sup.agents[index].heard
                    cause = self.membership.transport_cause(index, code, last, quiet)
                else:
                    self.membership.ended(index)
                ended = self.act(self.sup.handle(Event(EventKind.EXITED, at=time.monotonic(), slot=index,
                                                       code=code, cause=cause, last=last)))
                if ended is not False:
                    return ended
            ended = self.act(self.sup.tick())
            if ended is not False:
                return ended
            self.membership.poll()
            for slot in self.membership.unreachable():  # a silent agent's host took no connection
                ended = self.act(self.sup.handle(Event(EventKind.UNREACHABLE, at=time.monotonic(), slot=slot)))
                if ended is not False:
                    return ended
            for host in self.membership.missed():  # tried again later (the supervisor's Backoff)
                self.sup.handle(Event(EventKind.MISSED, at=time.monotonic(), host=host))
            for host in self.membership.ready():  # the supervisor batches them (a Join decision)
                self.sup.handle(Event(EventKind.READY, at=time.monotonic(), host=host))
            for proc in self.membership.joined():  # each has its row in the table: slot len(self.procs)
                slot = len(self.procs)
                self.sup.handle(Event(EventKind.JOINED, at=time.monotonic(), slot=slot,
                                      host=self.membership.host_of(slot)))
                self.relay_agent(proc)
            if all(row.state.final for row in self.sup.agents.rows):
                return None
            self.wake.wait(0.1)  # the supervisor's clock still ticks every 0.1 s
        return None

    def _handle_pending(self) -> Stop | None | bool:
        """The events the relay threads posted, in order; the watch's end if one decided it, else False."""
        with self.events_lock:
            events, self.events = self.events, []
        for event in events:
            ended = self.act(self.sup.handle(event))
            if ended is not False:
                return ended
        return False

    def act(self, decisions: list) -> Stop | None | bool:
        """Carry the decisions out; the watch's end (a Stop, or None after a Dump), else False."""
        self._record_losses()
        for decision in decisions:
            if isinstance(decision, Stop):
                return decision
            if isinstance(decision, Dump):
                self.dumped = decision.slots
                for slot in decision.slots:
                    self.stdins.send(self.procs[slot], DumpRequest().to_line())
                return None
            if isinstance(decision, Slow) and decision.training:
                self.say(f"disttrain: {decision.host}: no word from its agent for {decision.silent_s:.0f} s, "
                         f"its connection up, but its round steps, so its ranks do: it stays while they do "
                         f"(its agent is stuck, not its training)")
            elif isinstance(decision, Slow):
                self.say(f"disttrain: {decision.host} is slow: no word from its agent for {decision.silent_s:.0f} s, "
                         f"its connection up; it is waited for up to {decision.limit_s:.0f} s")
            if isinstance(decision, Held):
                self.say(f"disttrain: {decision.host}: {ranks_said(decision.ranks)} stopped by a "
                         f"signal (SIGSTOP) {decision.held_s:.0f} s ago; no rank can step without "
                         f"{'them' if len(decision.ranks) > 1 else 'it'} (kill -CONT resumes"
                         + (", --hang-timeout ends the job)" if self.plan.hang_timeout_s else ")"))
            if isinstance(decision, Probe):
                self.membership.probe(decision.slot, decision.timeout_s)
            if isinstance(decision, Admit):
                self.membership.try_hosts(decision.hosts)
            if isinstance(decision, Join):  # each says its line as its agent is relayed (membership.joined)
                self.membership.go(decision.hosts)
            if isinstance(decision, RegroupWithout):
                self.membership.rounds.restart_why = decision.restart_why  # the record's, should the round restart
                for slot in decision.slots:
                    self.stdins.send(self.procs[slot], Regroup(lost=decision.lost, in_place=decision.in_place).to_line())
        return False

    def _record_losses(self) -> None:
        """Every host the supervisor found lost, into the membership's record once; a silent agent's
        process is ended (its host's connection may hang for minutes)."""
        for row in self.sup.agents.in_state(AgentState.LOST):
            if row.slot in self.recorded:
                continue
            self.recorded.add(row.slot)
            elastic = self.elastic
            members = self.membership.leave(row.slot, row.why or "lost",
                                            backoff=elastic.backoff.wait(row.host, time.monotonic()) if elastic else None)
            if elastic is not None and len(members) >= elastic.min_nnodes:
                self.say(f"disttrain: lost {row.host} ({row.why or 'lost'}): the other {len(members)} host(s) "
                         f"regroup (--nnodes {elastic.min_nnodes}:{elastic.max_nnodes})")
            proc = self.procs[row.slot]
            if proc.poll() is None:
                proc.kill()

    @property
    def verdict(self) -> str:
        states = [state for report in self.hangs for state in report.ranks]
        return verdict(states, world_size=self.plan.world_size, timeout_s=self.plan.hang_timeout_s)

    def _collect_hang_reports(self, *, grace_s: float) -> None:
        """Every agent asked reports its ranks: the verdict as soon as all did (or the grace ran out),
        then the stop. No agent stops its workers before that (:meth:`.Watchdog.dump`)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            hosts = {report.host for report in self.hangs}
            if len(hosts) >= len(self.dumped) or all(self.procs[s].poll() is not None for s in self.dumped):
                break
            time.sleep(0.05)
        if all(self.procs[s].poll() is not None for s in self.dumped):
            for slot in self.dumped:  # their last lines (a report) may still be in the pipe
                pump = self.relay.drained.get(slot)
                if pump is not None:
                    pump.join(timeout=2)
        self.say(self.verdict)
        self.say(f"disttrain: stopped the job on all {len(self.procs)} hosts (exit {HANG_EXIT})")


def stop(procs: list[subprocess.Popen], *, grace_s: float, stdins: Stdins | None = None,
         why: str | None = None) -> None:
    """Close every agent's stdin (it stops its workers; ``why`` first, for its last line), then kill
    what outlives the grace."""
    stdins = stdins or Stdins()
    for proc in procs:
        if why and proc.poll() is None:
            stdins.send(proc, StopRequest(why=why).to_line())
        stdins.close(proc)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
