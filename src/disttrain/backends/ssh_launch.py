"""A job across hosts: one torch elastic agent per host, started over ssh.

Every host runs ``disttrain agent`` (the same code that runs a single-node job), whose
output is already prefixed ``[host rankN]``; this module relays it, keeps a copy per rank,
and stops every host when one fails or the user interrupts. Stopping is done by closing
each agent's stdin (the agent then stops its workers, see ``cli/agent.py``); ssh clients
that do not exit within the grace period are killed.

That flow (:func:`run_agents`) is shared: a job's instances on this machine
(``disttrain job run``, backend ``local``) are the same agents started without ssh.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from ..config.hosts import DEFAULT_MULTIHOST_PORT, Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError
from ..plan.launch import LaunchPlan, NodeFacts, make_plan
from ..preflight.checks import check_facts, raise_on_failure, reach_checks
from ..workerenv import forwarded_env
from .ssh import ssh_argv

PROBE_TIMEOUT_S = 30
AGENT_LINES_KEPT = 200
_PREFIX = re.compile(r"^\[(?P<host>[^\]\s]+) rank(?P<rank>\d+)\] ")


def master_address(host: Host, options: Sequence[str]) -> str:
    """The first host's IPv4 address as ssh resolves it (``~/.ssh/config`` HostName included)."""
    argv = ["ssh", "-G", *(w for o in options for w in ("-o", o)), "--", host.destination]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise DisttrainError(f"cannot ask ssh how to reach {host.name}: {err}") from None
    name = next((line.split(None, 1)[1] for line in out.splitlines() if line.startswith("hostname ")), host.name)
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        raise DisttrainError(f"cannot resolve {name} (host {host.name}); give --master-addr") from None


def probe(host: Host, *, python: str, master: str, port: int, paths: Sequence[str],
          options: Sequence[str], cwd: str) -> dict:
    """Run ``disttrain probe`` on ``host``; its facts as a dict, or a DisttrainError naming it."""
    # No `cd` into cwd: it may not exist there yet, which is a finding, not a failure.
    argv = [python, "-m", "disttrain", "probe", "--master", master, "--port", str(port), "--cwd", cwd]
    for path in paths:
        argv += ["--path", path]
    try:
        result = subprocess.run(
            ssh_argv(host, argv, options=options),
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise DisttrainError(f"{host.name}: no answer over ssh within {PROBE_TIMEOUT_S} s") from None
    last = (result.stderr.strip().splitlines() or [""])[-1]
    if result.returncode == 255:
        raise DisttrainError(f"{host.name}: ssh failed: {last}")
    if result.returncode != 0:
        raise DisttrainError(
            f"{host.name}: `{python} -m disttrain probe` failed (exit {result.returncode}): {last}; "
            "is disttrain installed there (same path, or pass --python)?"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def probe_all(hosts: Sequence[Host], **kwargs) -> list[dict | DisttrainError]:
    """Every host's facts, in parallel; a host that could not be probed gives its error."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = [pool.submit(probe, host, **kwargs) for host in hosts]
    return [f.exception() or f.result() for f in futures]


def plan_hosts(spec: LaunchSpec, hosts: Sequence[Host], *, python: str, options: Sequence[str], cwd: str,
               paths: Sequence[str], run_id: str, run_dir: str,
               preflight: bool = True) -> tuple[LaunchPlan, list[dict]]:
    """Ask every host for its facts over ssh, check them, and plan one node per host.

    Returns the plan and each host's facts (its route to the master, cores, GPUs).
    """
    master = spec.master_addr or master_address(hosts[0], options)
    port = spec.master_port or DEFAULT_MULTIHOST_PORT
    spec = replace(spec, nnodes=len(hosts), node_rank=0, master_addr=master, master_port=port)
    facts = probe_all(hosts, python=python, master=master, port=port, paths=paths, options=options, cwd=cwd)
    check_facts(hosts, facts, master_port=port)
    if preflight:
        raise_on_failure(reach_checks(hosts, facts, master_port=port, python=python, options=options))
    nodes = tuple(NodeFacts(hostname=h.name, cpus=f["cpus"], cuda_devices=f["cuda_devices"],
                            socket_ifname=f["ifname"], address=f["address"], slots=h.slots)
                  for h, f in zip(hosts, facts))
    plan = make_plan(spec, nodes, python=python, master_port=port, run_id=run_id, run_dir=run_dir,
                     inherited_env=forwarded_env(os.environ))
    return plan, facts


class _Relay:
    """Copies one stream of one agent to the terminal, to per-rank log files and to an
    optional transcript; keeps the agent's own lines (its root-cause block)."""

    def __init__(self, run_dir: Path, lock: threading.Lock, transcript: TextIO | None = None) -> None:
        self._run_dir = run_dir
        self._lock = lock
        self._transcript = transcript
        self._files: dict[int, TextIO] = {}
        # Per agent: its own (unprefixed) stderr lines; the root-cause block is at the end.
        self.agent_lines: dict[int, deque[str]] = {}

    def pump(self, stream, out: TextIO, agent: int | None = None) -> None:
        for line in iter(stream.readline, ""):
            match = _PREFIX.match(line)
            with self._lock:
                out.write(line)
                out.flush()
                if self._transcript is not None:
                    self._transcript.write(line)
                    self._transcript.flush()
                if match:
                    rank = int(match["rank"])
                    if rank not in self._files:
                        self._files[rank] = open(self._run_dir / f"rank{rank}.log", "a")
                    self._files[rank].write(line[match.end():])
                    self._files[rank].flush()
                elif agent is not None:
                    self.agent_lines.setdefault(agent, deque(maxlen=AGENT_LINES_KEPT)).append(line.rstrip("\n"))

    def report(self, agent: int) -> str:
        """The agent's own message about the failure: from its first ``disttrain:`` line on."""
        lines = list(self.agent_lines.get(agent, ()))
        start = next((i for i, line in enumerate(lines) if line.startswith("disttrain:")), len(lines))
        return "\n".join(lines[start:])

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()


@dataclass(frozen=True, kw_only=True)
class AgentsOutcome:
    """How a launch of one agent per node ended; the same for every backend."""

    exit_code: int
    failed: int | None = None  # index (node rank) of the agent that failed first
    report: str = ""  # that agent's own root-cause block, as it printed it
    signal: int | None = None  # SIGINT/SIGTERM that made the launcher stop every node


def agent_argv(plan: LaunchPlan, node_rank: int, python: str) -> list[str]:
    """The hidden per-node command: torch's elastic agent for one node of ``plan``."""
    return [python, "-m", "disttrain", "agent", "--plan", plan.to_json(indent=None),
            "--node-rank", str(node_rank), "--watch-stdin"]


def run_agents(
    plan: LaunchPlan,
    commands: Sequence[Sequence[str]],
    *,
    cwd: str | None = None,
    transcript: TextIO | None = None,
) -> AgentsOutcome:
    """Start one agent per node (``commands[i]`` runs node ``i``), relay their output, stop
    every node at the first failure or on SIGINT/SIGTERM, and say how it ended.

    The shared flow of every multi-node backend: a command is an ssh argv (``--hosts``) or
    a local ``disttrain agent`` (a job's instances on this machine).
    """
    relay = _Relay(Path(plan.run_dir), threading.Lock(), transcript)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for index, argv in enumerate(commands):
        proc = subprocess.Popen(
            list(argv), cwd=cwd,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,  # a Ctrl-C reaches us only; we stop the nodes
        )
        procs.append(proc)
        for stream, out, agent in ((proc.stdout, sys.stdout, None), (proc.stderr, sys.stderr, index)):
            pump = threading.Thread(target=relay.pump, args=(stream, out, agent), daemon=True)
            pump.start()
            pumps.append(pump)

    interrupted: list[int] = []

    def on_signal(signum, _frame) -> None:
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first_failure = _wait_for_first_failure(procs, interrupted)
        _stop(procs, grace_s=plan.stop_grace_s + 5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in pumps:
            pump.join(timeout=5)
        relay.close()
    if interrupted:
        return AgentsOutcome(exit_code=128 + interrupted[0], signal=interrupted[0])
    if first_failure is None:
        return AgentsOutcome(exit_code=0)
    index, code = first_failure
    return AgentsOutcome(exit_code=code, failed=index, report=relay.report(index))


def run_hosts(
    plan: LaunchPlan,
    hosts: Sequence[Host],
    *,
    python: str,
    options: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
) -> int:
    """Start every host's agent, relay output, return the exit code of the first failure."""
    outcome = launch_hosts(plan, hosts, python=python, options=options, cwd=cwd, env=env)
    if outcome.signal:
        print(f"disttrain: got {signal.Signals(outcome.signal).name}, stopped all hosts", file=sys.stderr)
    return outcome.exit_code


def launch_hosts(
    plan: LaunchPlan,
    hosts: Sequence[Host],
    *,
    python: str,
    options: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    transcript: TextIO | None = None,
) -> AgentsOutcome:
    """One agent per host over ssh; a lost ssh connection (255) is named in the report."""
    commands = [ssh_argv(host, agent_argv(plan, node.node_rank, python), options=options, cwd=cwd, env=env)
                for node, host in zip(plan.nodes, hosts)]
    outcome = run_agents(plan, commands, transcript=transcript)
    if outcome.failed is not None and outcome.exit_code == 255:
        lost = (f"disttrain: lost the ssh connection to {hosts[outcome.failed].name} "
                f"(node {outcome.failed}); the other hosts were stopped")
        print(lost, file=sys.stderr)
        if transcript is not None:
            transcript.write(lost + "\n")
        outcome = replace(outcome, report="\n".join(filter(None, (lost, outcome.report))))
    return outcome


def _wait_for_first_failure(procs: list[subprocess.Popen], interrupted: list[int]) -> tuple[int, int] | None:
    while not interrupted:
        codes = [p.poll() for p in procs]
        for index, code in enumerate(codes):
            if code:  # a host failed: the job cannot go on
                return index, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)
    return None


def _stop(procs: list[subprocess.Popen], *, grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None and proc.stdin:
            try:
                proc.stdin.close()  # the remote agent stops its workers on EOF
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
