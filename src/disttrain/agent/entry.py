"""A node's agent process, from its first line to its exit: the one owner of that process.

A launcher starts one process per node -- ``disttrain agent``, over ssh, srun or as a plain
process (:mod:`disttrain.launch.probe`) -- and talks to it over its stdin/stdout/stderr with
the messages of :mod:`disttrain.wire`. This module is that process's whole life, as torch's
``launch_agent`` is torchrun's and submitit's ``process_job`` a job's: the CLI only parses
the flags and calls :func:`agent_main`, which never returns.

1. the kernel's parent-death signal is armed before anything slow (torch's import), so a
   launcher SIGKILLed meanwhile is not missed (:func:`disttrain.agent.lifeline.follow_parent`);
2. the probe round: a hello (before torch's import), the host's facts out, what to connect to in, what it reached out;
3. the plan is read, then stdin is watched for the rest of the run: a line is a request (the
   hang dump) or the launcher's keep-alive, EOF asks the node to stop (SIGTERM to itself, which
   torch's agent turns into stopping its workers), and so does silence: no line for
   :data:`~disttrain.wire.CUT_OFF_S` seconds means the launcher is cut off (a dropped network
   sends no EOF), said in the node's log on this host. The stop has a deadline -- the workers'
   grace plus :data:`STOP_MARGIN_S` -- after which the process exits whatever torch's
   shutdown is doing;
4. the node runs (:func:`disttrain.agent.node.run_node`, torch's elastic agent);
5. the process ends with ``os._exit``: at interpreter exit Python would join torch's log-tailer
   threads, and a stop that cut torch's shutdown short leaves them tailing for ever.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from ..errors import DisttrainError, UsageError, error_line
from ..private import private_dirs
from ..wire import (
    CUT_OFF_S,
    Alive,
    ConnectResults,
    ConnectTargets,
    DumpRequest,
    Listening,
    NodeDone,
    PlanMessage,
    ProbeFacts,
    ProbeHello,
    Regroup,
    StopRequest,
    WireError,
    one_of,
)
from ..workerenv import login_env
from .cgroup import kill_all_now
from .lifeline import follow_parent

if TYPE_CHECKING:
    from .link import LauncherLink

STOP_MARGIN_S = 10  # after the workers' stop grace, for the agent's own shutdown


class Lines:
    """Lines from a raw descriptor, without a buffered reader (see :func:`watch_stdin`)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def next(self) -> bytes | None:
        """The next line; None when the launcher closed the stream first (it went away or is done)."""
        while b"\n" not in self.buffer:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def end_process(code: int) -> NoReturn:
    """Flush what was said, then exit at once (no interpreter shutdown: see the module's doc).
    Whatever the workers left running in their cgroup dies first: no cleanup runs after this."""
    kill_all_now()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_to_exit(body: Callable[[], int]) -> NoReturn:
    """Run ``body`` and end the process with its exit code, whatever it raises: a known error
    is one line, anything else (a second stop signal in torch's shutdown, say) a traceback."""
    try:
        code = body()
    except DisttrainError as err:
        print(error_line(err), file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        print("disttrain: interrupted", file=sys.stderr)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    end_process(code)


def agent_main(*, master: str, port: int | None, paths: Sequence[str] = (), cwd: str | None = None,
               listen: Sequence[int] = ()) -> NoReturn:
    """``disttrain agent``: a node's process for a whole launch -- one connection, one Python
    start, torch imported once (for the facts, then by torch's agent).

    It says this host's facts (and listens on ``listen``), reads what to connect to and says
    what it reached, then reads its plan -- on stdin, never on the command line, which ``ps``
    shows every user of the host -- and runs the node to its end. EOF before the plan ends it
    quietly (``doctor``, a check that failed on another host).
    """

    def body() -> int:
        from ..preflight import reach
        from ..preflight.facts import node_facts

        # The launcher (ssh session, job runner, srun) gone, even SIGKILLed: stop. Armed before
        # importing torch (seconds), so that a launcher dying meanwhile is not missed.
        parent = os.getppid()
        armed = follow_parent(signal.SIGTERM, parent=parent)
        print(ProbeHello().to_line(), flush=True)
        facts = node_facts(master=master, port=port, paths=list(paths), cwd=cwd)
        socks, listening = reach.open_listeners(list(listen)) if listen else ([], Listening())
        print(ProbeFacts(facts=facts, listen=listening).to_line(), flush=True)
        lines = Lines(sys.stdin.fileno())
        try:
            line = lines.next()
            if line is None:
                return 0
            targets = ConnectTargets.from_line(line).targets
            print(ConnectResults(results=reach.connect(list(targets)) if targets else {}).to_line(), flush=True)
            line = lines.next()
        finally:
            reach.close_listeners(socks)  # the master port is the rendezvous' next
        if line is None:
            return 0
        return serve(PlanMessage.from_line(line), lines, signalled_by=parent if armed else None)

    run_to_exit(body)


def serve(message: PlanMessage, lines: Lines, *, signalled_by: int | None = None) -> int:
    """Run the node ``message`` names, watching stdin for requests and the stop.

    ``signalled_by``: the parent whose death already sends this process SIGTERM.
    """
    from .link import LauncherLink
    from .node import run_node  # torch's elastic agent: not for every command

    plan = message.plan
    if message.cwd:
        try:
            os.chdir(message.cwd)
        except OSError as err:
            raise UsageError(f"cannot work in {message.cwd}: {err.strerror}") from None
    nodes = [n for n in plan.nodes if n.node_rank == message.node_rank]
    if not nodes:
        raise UsageError(f"the plan has no node rank {message.node_rank}")
    os.environ.update(login_env(os.environ))  # an agent started without a login (srun --export)
    private_dirs(plan.run_dir)  # made here on a host without the launcher's filesystem
    link = LauncherLink()
    log = node_log(plan.run_dir, message.node_rank)
    watch_stdin(lines, lambda line: _request(line, link), signalled_by=signalled_by,
                host=nodes[0].name, grace_s=plan.stop_grace_s, log=log, on_stop=link.stopping)
    return run_node(plan, nodes[0], link=link)


def node_log(run_dir: str, node_rank: int) -> Path:
    """The agent's own log on its host, for what it cannot tell a launcher it lost."""
    return Path(run_dir) / f"node{node_rank}.log"


def _request(line: bytes, link: LauncherLink) -> None:
    """A line from the launcher after the plan: the keep-alive, the dump request, another node done,
    an elastic job's regroup, why the job stops."""
    try:
        request = one_of(line, Alive, DumpRequest, NodeDone, Regroup, StopRequest)
    except WireError as err:
        print(f"disttrain: warning: ignored a line from the launcher: {err}", file=sys.stderr, flush=True)
        return
    if isinstance(request, DumpRequest):
        link.dump()
    elif isinstance(request, NodeDone):
        link.peer_done(request)
    elif isinstance(request, Regroup):
        link.regroups.request(request.lost, request.in_place)
    elif isinstance(request, StopRequest):
        link.stopping(request.why)


def watch_stdin(lines: Lines, on_line: Callable[[bytes], None], *, signalled_by: int | None, host: str,
                grace_s: float, log: Path | None = None, cut_off_s: float = CUT_OFF_S,
                on_stop: Callable[[str], None] = lambda why: None) -> None:
    """In daemon threads: each line to ``on_line``; at EOF, or after ``cut_off_s`` without a line,
    stop this node, with a deadline; ``on_stop`` hears why first (the node's last line says it).

    ssh/srun give the agent the launcher's pipe as stdin: EOF means the launcher is gone or
    wants us to stop. A launcher cut off by the network sends nothing at all, not even EOF
    (the TCP connection stays open for hours): it sends :class:`~disttrain.wire.Alive` every few
    seconds, and its silence is the signal. Raw reads, not sys.stdin: a daemon thread blocked
    inside a buffered reader aborts the interpreter at exit ("could not acquire lock ... at
    interpreter shutdown").
    """
    heard = [time.monotonic()]
    stopping = threading.Lock()

    def stop(kill_self: bool, why: str | None, reason: str) -> None:
        if not stopping.acquire(blocking=False):
            return  # the other thread is stopping the node already
        on_stop(reason)
        if why:
            _note(why, log)
        if kill_self:
            os.kill(os.getpid(), signal.SIGTERM)
        # Stopping is bounded whatever happens in torch's shutdown: its grace, then a margin.
        time.sleep(grace_s + STOP_MARGIN_S)
        _note(f"disttrain: the agent on {host} was still running {grace_s + STOP_MARGIN_S:.0f} s after it "
              "was asked to stop; exiting (its workers die with it)", log)
        kill_all_now()
        os._exit(128 + signal.SIGTERM)

    def watch() -> None:
        while (line := lines.next()) is not None:
            heard[0] = time.monotonic()
            on_line(line)
        # A launcher that died has had the kernel send us SIGTERM already (PR_SET_PDEATHSIG).
        # A second one, landing while torch's agent stops the workers, cuts that short and can
        # leave it waiting at exit for log tailers that were never stopped: one signal only.
        gone = signalled_by is not None and parent_gone(signalled_by)
        stop(not gone, None, "its launcher is gone" if gone else "the launcher stopped the job")

    def listen() -> None:
        while True:
            time.sleep(1.0)
            silent = time.monotonic() - heard[0]
            if silent >= cut_off_s:
                stop(True, f"disttrain: the agent on {host} heard nothing from its launcher for {silent:.0f} s "
                           "(the connection to it is lost: a network dropped, or its host is down); stopping "
                           "this node's workers", f"cut off from its launcher ({silent:.0f} s without a word)")
                return

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()
    threading.Thread(target=listen, name="launcher-silence", daemon=True).start()


def _note(line: str, log: Path | None) -> None:
    """Say it to the launcher (which may be gone, and its pipe with it) and in the node's log."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
    if log is not None:
        try:
            with open(log, "a") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass


def parent_gone(parent: int, wait_s: float = 0.2) -> bool:
    """Whether ``parent`` has exited: the kernel re-parents us just after it closed our stdin."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
