"""A job across hosts: one torch elastic agent per host, started over ssh.

Every host runs ``disttrain agent`` (the same code that runs a single-node job), whose
output is already prefixed ``[host rankN]``; this module relays it, keeps a copy per rank,
and stops every host when one fails or the user interrupts. Stopping is done by closing
each agent's stdin (the agent then stops its workers, see ``cli/agent.py``); ssh clients
that do not exit within the grace period are killed.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from ..config.hosts import Host
from ..errors import DisttrainError
from ..plan.launch import LaunchPlan
from .ssh import ssh_argv

PROBE_TIMEOUT_S = 30
_PREFIX = re.compile(r"^\[(?P<host>[^\]\s]+) rank(?P<rank>\d+)\] ")


def master_address(host: Host, options: Sequence[str]) -> str:
    """The first host's IPv4 address as ssh resolves it (``~/.ssh/config`` HostName included)."""
    argv = ["ssh", "-G", *(w for o in options for w in ("-o", o)), host.destination]
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


class _Relay:
    """Copies one stream of one host's agent to the terminal and to per-rank log files."""

    def __init__(self, run_dir: Path, lock: threading.Lock) -> None:
        self._run_dir = run_dir
        self._lock = lock
        self._files: dict[int, TextIO] = {}

    def pump(self, stream, out: TextIO) -> None:
        for line in iter(stream.readline, ""):
            match = _PREFIX.match(line)
            with self._lock:
                out.write(line)
                out.flush()
                if match:
                    rank = int(match["rank"])
                    if rank not in self._files:
                        self._files[rank] = open(self._run_dir / f"rank{rank}.log", "a")
                    self._files[rank].write(line[match.end():])
                    self._files[rank].flush()

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()


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
    run_dir = Path(plan.run_dir)
    relay = _Relay(run_dir, threading.Lock())
    plan_json = plan.to_json(indent=None)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for node, host in zip(plan.nodes, hosts):
        argv = [python, "-m", "disttrain", "agent", "--plan", plan_json,
                "--node-rank", str(node.node_rank), "--watch-stdin"]
        proc = subprocess.Popen(
            ssh_argv(host, argv, options=options, cwd=cwd, env=env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,  # a Ctrl-C reaches us only; we stop the hosts
        )
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            pump = threading.Thread(target=relay.pump, args=(stream, out), daemon=True)
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
        sig = interrupted[0]
        print(f"disttrain: got {signal.Signals(sig).name}, stopped all hosts", file=sys.stderr)
        return 128 + sig
    if first_failure is None:
        return 0
    index, code = first_failure
    if code == 255:
        print(f"disttrain: lost the ssh connection to {hosts[index].name} "
              f"(node {index}); the other hosts were stopped", file=sys.stderr)
    return code


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
