"""Asking the nodes about themselves: one probe session per node, over a transport.

A probe session is ``python -m disttrain agent`` on the node (:func:`disttrain.agent.entry.agent_main`),
started through a :class:`~disttrain.launch.transport.Transport` -- ssh to a host, srun to a node of a Slurm allocation,
or a plain process on this machine -- and spoken to with :mod:`disttrain.wire`'s messages on
its stdin and stdout:

1. it says hello (:class:`~disttrain.wire.ProbeHello`) as soon as its Python runs, then its facts
   (:class:`~disttrain.wire.ProbeFacts`, torch imported), listening on the ports it was given;
2. it is told what to connect to (:class:`~disttrain.wire.ConnectTargets`) and says what it
   reached (:class:`~disttrain.wire.ConnectResults`);
3. it is sent its plan (:class:`~disttrain.wire.PlanMessage`) and becomes that node's agent --
   or its stdin is closed and it ends (``doctor``, a check that failed).

One connection and one Python start per node for a whole launch, and the same code for every
transport: the same round (:func:`ask_facts`, :func:`reach_round`), the same errors naming
the node.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

from ..config.hosts import Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError, UsageError
from ..plan.launch import LaunchPlan, NodeFacts
from ..preflight.checks import (
    CONNECT_ROUND_S,
    CheckResult,
    check_facts,
    fact_checks,
    first_failure,
    listen_ports,
    raise_on_failure,
    reach_results,
    reach_targets,
    targets_for,
)
from ..ssh import last_word
from ..wire import (
    ConnectResults,
    ConnectTargets,
    HostFacts,
    Listening,
    Message,
    Outcome,
    PlanMessage,
    ProbeFacts,
    ProbeHello,
    WireError,
    one_of,
)
from ..workerenv import forwarded_env
from .base import AgentLauncher, Events, Facts, LaunchContext
from .elastic import Membership, Ready, starting_hosts
from .flow import run_agents, start, stop
from .knobs import backoff, probe_limit, slow_limit
from .rendezvous_store import LauncherStore, launcher_address
from .transport import Transport

PROBE_TIMEOUT_S = 30  # for a node's hello: the transport's connect, a Python start, disttrain's import
FACTS_TIMEOUT_S = 180  # then for its facts: torch's import, which a loaded host can stretch past a minute
WAITING_NOTE_S = 15  # a node silent this long in the round of facts is named, with what it is waiting for

M = TypeVar("M", bound=Message)


# ``python -m disttrain`` puts the folder it starts in first on sys.path, so a job's own
# ``copy.py`` or ``json.py`` there would shadow the standard library inside the agent itself. The
# agent starts with ``-c`` instead, whose first act is to drop that entry (``-P`` would need 3.11).
AGENT_BOOT = "import sys; del sys.path[0]; import runpy; runpy.run_module('disttrain', run_name='__main__')"


def probe_command(python: str, *, master: str, port: int | None, cwd: str, paths: Sequence[str] = (),
                  listen: Sequence[int] = ()) -> list[str]:
    """``disttrain agent`` with what the node is asked about (no ``cd`` into ``cwd``: it may
    not exist there yet, which is a finding, not a failure)."""
    argv = [python, "-c", AGENT_BOOT, "agent", "--master", master, "--cwd", cwd]
    if port is not None:
        argv += ["--port", str(port)]
    for path in paths:
        argv += ["--path", path]
    if listen:
        argv += ["--listen", ",".join(map(str, listen))]
    return argv


class ProbeSession:
    """One node's probe session: its process, read and written one message at a time."""

    def __init__(self, transport: Transport, command: Sequence[str], *, cwd: str | None = None) -> None:
        self.transport, self.command = transport, list(command)
        # What the round of facts waits for from it (for the note of a slow round); None: answered.
        self.awaited: str | None = "its hello (the connection, then its Python's start)"
        argv = transport.argv(command)
        try:
            self.proc = start(argv, cwd=cwd)
        except OSError as err:  # no ssh/srun here, or a working folder that is not
            raise DisttrainError(f"{transport.name}: cannot start `{argv[0]}`: {err.strerror}") from None

    @property
    def name(self) -> str:
        return self.transport.name

    def read(self, kind: type[M], timeout: float, what: str, *, late: str | None = None) -> M:
        """The next message; an error naming the node when it does not come in time (``late``
        says why, if given), is not ``kind``, or the session ended (with the transport's or the
        command's own last words)."""
        return self._read((kind,), timeout, what, late=late)

    def read_facts(self, hello_s: float) -> ProbeFacts:
        """The node's hello within ``hello_s``, then its facts. An agent of a disttrain without
        the hello says its facts first: they are taken, and the version check says the rest."""
        try:
            said = self._read((ProbeHello, ProbeFacts), hello_s, "the probe")
            if isinstance(said, ProbeFacts):
                return said
            self.awaited = "its facts (torch's import there)"
            return self.read(ProbeFacts, max(hello_s, FACTS_TIMEOUT_S), "its facts",
                             late=f"its Python started, but its facts (torch's import) took over {FACTS_TIMEOUT_S} s: "
                                  "is the host overloaded, or its disk slow?")
        finally:
            self.awaited = None

    def _read(self, kinds: tuple[type[Message], ...], timeout: float, what: str, *, late: str | None = None):
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise DisttrainError(f"{self.name}: {late or f'no answer {self.transport.over} within {timeout:.0f} s ({what})'}")
        if line and line[0].strip():
            try:
                return one_of(line[0], *kinds)
            except WireError as err:
                raise DisttrainError(f"{self.name}: unexpected answer to {what}: {err}") from None
        code = self.proc.wait()
        last = last_word(self.proc.stderr.read().splitlines())
        own = self.transport.own_failure(code, last)
        if own:
            raise DisttrainError(f"{self.name}: {own}")
        raise DisttrainError(
            f"{self.name}: `{self.command[0]} -m disttrain agent` failed (exit {code}): {last}; "
            "is disttrain installed there (same path, or pass --python)?")

    def send(self, message: Message) -> None:
        try:
            self.proc.stdin.write(message.to_line() + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it ended; the next read says why


def open_sessions(transports: Sequence[Transport], *, python: str, master: str, port: int | None, cwd: str,
                  paths: Sequence[str] = (), reach: bool = True) -> list[ProbeSession]:
    """A probe session per node, in node order; ``reach``: each listens for the reachability
    round (the master on the rendezvous port too)."""
    sessions: list[ProbeSession] = []
    try:
        for i, transport in enumerate(transports):
            command = probe_command(python, master=master, port=port, cwd=cwd, paths=paths,
                                    listen=listen_ports(i, port) if reach else ())
            sessions.append(ProbeSession(transport, command, cwd=cwd))
    except BaseException:
        close_all(sessions)
        raise
    return sessions


def close_all(sessions: Sequence[ProbeSession], grace_s: float = 10) -> None:
    """End sessions that will not become agents (stdin closed: each ends quietly), all at once."""
    stop([session.proc for session in sessions], grace_s=grace_s)


def _each(sessions: Sequence[ProbeSession], call) -> list:
    """``call(session)`` for every session in parallel; a DisttrainError is that session's result."""
    def safe(session: ProbeSession):
        try:
            return call(session)
        except DisttrainError as err:
            return err

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(sessions)))) as pool:
        return list(pool.map(safe, sessions))


def ask_facts(sessions: Sequence[ProbeSession], timeout: float = PROBE_TIMEOUT_S, *,
              note_after_s: float = WAITING_NOTE_S) -> list[ProbeFacts | DisttrainError]:
    """Every node's facts, in node order; a node that failed gives its error. ``timeout`` is for
    its hello: a node that said it runs is slow, not lost, and gets :data:`FACTS_TIMEOUT_S` more.
    The nodes still silent after ``note_after_s`` are named once on stderr, each with what it is
    waiting for: the wait may be minutes, and a user (or a test's log) sees where it stands."""
    def note() -> None:
        for session in sessions:
            awaited = session.awaited  # read once: its reader may be answered meanwhile
            if awaited:
                print(f"disttrain: note: still waiting for {session.name} after {note_after_s:.0f} s: {awaited}",
                      file=sys.stderr, flush=True)

    timer = threading.Timer(note_after_s, note)
    timer.daemon = True
    timer.start()
    try:
        return _each(sessions, lambda s: s.read_facts(timeout))
    finally:
        timer.cancel()


def reach_round(sessions: Sequence[ProbeSession], hosts: Sequence[Host], facts: Sequence[HostFacts],
                listening: Sequence[Listening]) -> list[CheckResult]:
    """Every node connects to every other node's listeners: checks naming each pair."""
    targets = reach_targets(facts, listening)
    for i, session in enumerate(sessions):
        session.send(ConnectTargets(targets=tuple(targets_for(targets, i))))
    answers = _each(sessions, lambda s: s.read(ConnectResults, CONNECT_ROUND_S, "the reachability checks"))
    seen = [{t: "no answer from the host" for t in targets_for(targets, i)} if isinstance(a, Exception)
            else a.results for i, a in enumerate(answers)]
    return reach_results(hosts, listening, targets, seen)


def skip_reach(sessions: Sequence[ProbeSession]) -> None:
    """The round without connects (``--no-preflight``, Slurm): each session only answers."""
    for session in sessions:
        session.send(ConnectTargets(targets=()))
    for answer in _each(sessions, lambda s: s.read(ConnectResults, CONNECT_ROUND_S, "the probe")):
        if isinstance(answer, Exception):
            raise answer


@dataclass(kw_only=True)
class _ElasticStart:
    """What joining a host of an elastic range later needs: the spec, the context, the facts of the
    nodes placed so far (grown by each join), every host's transport, what the master said."""

    spec: LaunchSpec
    ctx: LaunchContext
    facts: Facts
    transports: list[Transport]
    master_facts: HostFacts


class SessionLauncher(AgentLauncher):
    """An agent launcher whose nodes' probe sessions become their agents: the job's instances on
    this machine, ssh hosts, the nodes of a Slurm allocation.

    A subclass says where the rendezvous is (:meth:`rendezvous`), how each node is reached
    (:meth:`transports`) and what its facts make of each node (:meth:`node_facts`); the round
    (facts, checks, reachability), the plan sent to every session and the shared flow
    (:func:`~disttrain.launch.flow.run_agents`) are here, once.
    """

    probe_timeout_s: float = PROBE_TIMEOUT_S
    reach_checks: bool = True  # the TCP round between the nodes before the start (unless --no-preflight)

    def __init__(self) -> None:
        self._sessions: list[ProbeSession] = []
        self._elastic: _ElasticStart | None = None
        self._store: LauncherStore | None = None  # an elastic job's rendezvous store, held here

    @abstractmethod
    def rendezvous(self, spec: LaunchSpec, ctx: LaunchContext) -> tuple[str, int]:
        """The master's address and port, known before the nodes are asked (they check routes to it)."""

    @abstractmethod
    def transports(self, spec: LaunchSpec, ctx: LaunchContext) -> list[Transport]:
        """How each node is reached, in node order (the first is the master)."""

    @abstractmethod
    def node_facts(self, spec: LaunchSpec, ctx: LaunchContext, facts: Mapping[int, HostFacts]) -> tuple[NodeFacts, ...]:
        """What the planner needs of each node, from what it said: ``facts`` by the node's place in
        :meth:`transports` (all of them, but for the hosts of an elastic range that wait)."""

    def where(self, facts: Sequence[HostFacts]) -> tuple[str, ...]:
        """The machine each node runs on (for records and messages)."""
        return tuple(session.name for session in self._sessions)

    def forwarded(self, spec: LaunchSpec, ctx: LaunchContext) -> Mapping[str, str]:
        """The launching shell's variables that travel with the plan (local workers inherit them)."""
        return forwarded_env(ctx.environ, everything=spec.forward_env)

    def session_python(self, ctx: LaunchContext) -> str:
        return ctx.python

    def probe_paths(self, ctx: LaunchContext) -> Sequence[str]:
        """What every node is asked to have (relative to ``ctx.cwd``)."""
        return ctx.paths

    def facts(self, spec: LaunchSpec, ctx: LaunchContext) -> Facts:
        master, port = self.rendezvous(spec, ctx)
        reach = ctx.preflight and self.reach_checks
        transports = self.transports(spec, ctx)
        if spec.elastic:
            slow_limit(), backoff(), probe_limit()  # a wrong DISTTRAIN_SLOW_S, _BACKOFF_S or _PROBE_S: said before any host is asked
        if spec.elastic and spec.min_nnodes > len(transports):
            raise UsageError(f"--nnodes {spec.min_nnodes}:{spec.nnodes} needs at least {spec.min_nnodes} hosts, "
                             f"and {len(transports)} were given")
        self._sessions = open_sessions(transports, python=self.session_python(ctx), master=master,
                                       port=port, cwd=ctx.cwd, paths=self.probe_paths(ctx), reach=reach)
        answers = ask_facts(self._sessions, self.probe_timeout_s)
        hosts = [Host(name=session.name) for session in self._sessions]
        facts = [a if isinstance(a, Exception) else a.facts for a in answers]
        starting = list(range(len(transports)))
        if spec.elastic:  # the hosts that answer start (at least MIN); the others are tried again later
            starting, waiting = starting_hosts(hosts, facts, master_port=port, min_nnodes=spec.min_nnodes,
                                               max_nnodes=min(spec.nnodes, len(transports)))
            for i, why in waiting.items():
                print(f"disttrain: note: {hosts[i].name} does not start ({why}); it is tried again while the job "
                      "runs", file=sys.stderr, flush=True)
            close_all([self._sessions[i] for i in waiting])
            self._sessions = [self._sessions[i] for i in starting]
            hosts, facts, answers = ([items[i] for i in starting] for items in (hosts, facts, answers))
        check_facts(hosts, facts, master_port=port)
        if reach:
            raise_on_failure(reach_round(self._sessions, hosts, facts, [a.listen for a in answers]))
        else:
            skip_reach(self._sessions)
        if spec.elastic:  # the rendezvous store outlives any host: this process holds it (rendezvous_store.py)
            self._store = LauncherStore(launcher_address(master), port)
            master, port = self._store.address, self._store.port
        found = Facts(nodes=self.node_facts(spec, ctx, dict(zip(starting, facts))), master_addr=master,
                      master_port=port, where=self.where(facts), forwarded_env=self.forwarded(spec, ctx),
                      node_ranks=tuple(starting) if spec.elastic else None)
        if spec.elastic:
            self._elastic = _ElasticStart(spec=spec, ctx=ctx, facts=found, transports=transports,
                                          master_facts=facts[0])
        return found

    def launch(self, plan: LaunchPlan, events: Events, ctx: LaunchContext) -> Outcome:
        """Every session becomes its node's agent (the plan tells it where to work)."""
        sessions, self._sessions = self._sessions, []
        membership = None
        if self._elastic is not None:
            start = self._elastic
            membership = Membership(
                hosts=[t.name for t in start.transports], running=start.facts.node_ranks, run_dir=plan.run_dir,
                join=lambda index: self._join(start, index, events),
                own_failure=lambda index, code, last, quiet: start.transports[index].own_failure(code, last, quiet),
                answers=lambda index, timeout_s: start.transports[index].answers(timeout_s),
                kept_alive=all(t.kept_alive for t in start.transports))
        return run_agents(plan, started=[s.proc for s in sessions], agent_cwd=ctx.cwd, transcript=events.transcript,
                          membership=membership)

    def _join(self, start: _ElasticStart, index: int, events: Events) -> Ready:
        """Host ``index`` of an elastic range, tried again: its probe session answers the preflight
        (its facts beside the master's; the rendezvous port reached): ready. When the supervisor
        lets it in (``go``), it becomes its agent, with the plan of the job's nodes so far and
        itself. A DisttrainError when it does not answer yet."""
        ctx, facts = start.ctx, start.facts
        transport = start.transports[index]
        (session,) = open_sessions([transport], python=self.session_python(ctx), master=facts.master_addr,
                                   port=facts.master_port, cwd=ctx.cwd, paths=self.probe_paths(ctx), reach=False)
        try:
            said = session.read_facts(self.probe_timeout_s).facts
            hosts = [Host(name=start.transports[0].name), Host(name=transport.name)]
            failure = first_failure(fact_checks(hosts, [start.master_facts, said], master_port=facts.master_port))
            if failure is not None and failure.host == transport.name:
                raise DisttrainError(f"{transport.name}: {failure.detail}")
            rendezvous = f"{facts.master_addr}:{facts.master_port}"
            session.send(ConnectTargets(targets=(rendezvous,)))
            reached = session.read(ConnectResults, CONNECT_ROUND_S, "the rendezvous port").results.get(rendezvous)
            if reached != "ok":
                raise DisttrainError(f"{transport.name}: the rendezvous {rendezvous}: {reached}")
        except BaseException:
            close_all([session])
            raise
        return Ready(go=lambda: self._go(start, index, session, said, events), cancel=lambda: close_all([session]))

    def _go(self, start: _ElasticStart, index: int, session: ProbeSession, said, events: Events) -> subprocess.Popen:
        """A ready host let in: its plan (the job's nodes so far and itself), sent."""
        spec, ctx, facts = start.spec, start.ctx, start.facts
        try:
            (node,) = self.node_facts(spec, ctx, {index: said})
            # A host that comes back takes its old place (its node rank, its heartbeat folder).
            kept = [(rank, n) for rank, n in zip(facts.node_ranks or (), facts.nodes) if rank != index]
            grown = replace(facts, nodes=(*(n for _, n in kept), node), node_ranks=(*(r for r, _ in kept), index))
            plan = self.place(spec, grown, ctx)
            events.joining(plan, grown)
            session.send(PlanMessage(node_rank=index, plan=plan, cwd=ctx.cwd))
            start.facts = grown
            return session.proc
        except BaseException:
            close_all([session])
            raise

    def close(self) -> None:
        """End the sessions that never became agents; stop serving the rendezvous store."""
        close_all(self._sessions)
        self._sessions = []
        if self._store is not None:
            self._store.close()
            self._store = None
