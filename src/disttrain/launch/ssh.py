"""``--launcher ssh``: one torch elastic agent per host, started over ssh.

Every host runs ``disttrain agent`` (the same code that runs a single-node job) through the
shared flow (:mod:`disttrain.launch.flow`): its plan, with the user's variables, arrives on
the ssh connection's stdin, so no value of theirs is ever on a command line; only
``PYTHONPATH`` (which the agent needs to start at all) is. Before that, every host is asked
for its facts (``disttrain probe``) in parallel, and the preflight checks every host can
reach the master port and every other host.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..config.hosts import DEFAULT_MULTIHOST_PORT, Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError
from ..plan.launch import LaunchPlan, NodeFacts
from ..preflight.checks import (
    CONNECT_ROUND_S,
    check_facts,
    listen_ports,
    raise_on_failure,
    reach_results,
    reach_targets,
    targets_for,
)
from ..ssh import ssh_argv
from ..workerenv import BOOTSTRAP_NAMES, forwarded_env
from .base import Context, Events, Facts, Launcher, Outcome
from .flow import run_agents, start, stop
from .sync import sync_all

PROBE_TIMEOUT_S = 30
CONTROL_PERSIST_S = 5  # an idle control master outlives its last session this long (a SIGKILLed launcher's too): bridges the steps of one run, no more


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
          options: Sequence[str], cwd: str, env: dict[str, str] | None = None) -> dict:
    """Run ``disttrain probe`` on ``host``; its facts as a dict, or a DisttrainError naming it."""
    # No `cd` into cwd: it may not exist there yet, which is a finding, not a failure.
    argv = [python, "-m", "disttrain", "probe", "--master", master, "--port", str(port), "--cwd", cwd]
    for path in paths:
        argv += ["--path", path]
    try:
        result = subprocess.run(
            ssh_argv(host, argv, options=options, env=env),
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


def bootstrap_env(environ) -> dict[str, str]:
    """What a remote disttrain process needs before it can read anything: its import path."""
    return {k: environ[k] for k in BOOTSTRAP_NAMES if k in environ}


class _Session:
    """``disttrain probe --session`` on one host: its facts, its reachability, then its agent,
    over one ssh connection (see ``cli/agent.py``)."""

    def __init__(self, host: Host, argv: list[str], python: str) -> None:
        self.host, self.python = host, python
        self.proc = start(argv)

    def read(self, timeout: float, what: str) -> dict:
        """The next JSON line; an error naming the host when it does not come in time."""
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise DisttrainError(f"{self.host.name}: no answer over ssh within {timeout:.0f} s ({what})")
        if line and line[0].strip():
            try:
                return json.loads(line[0])
            except ValueError:
                raise DisttrainError(f"{self.host.name}: unexpected answer to {what}: {line[0].strip()[:200]}") from None
        code = self.proc.wait()
        last = (self.proc.stderr.read().strip().splitlines() or [""])[-1]
        if code == 255:
            raise DisttrainError(f"{self.host.name}: ssh failed: {last}")
        raise DisttrainError(
            f"{self.host.name}: `{self.python} -m disttrain probe` failed (exit {code}): {last}; "
            "is disttrain installed there (same path, or pass --python)?")

    def send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it ended; the next read says why

    def close(self) -> None:
        stop([self.proc], grace_s=10)


class SshLauncher(Launcher):
    """``--hosts a,b``: node K on the K-th host, the first being the master.

    One remote round per host before the agent: every host's probe session (facts, listeners,
    then the connects) runs in parallel and becomes that host's agent once the plan is sent.
    Connections are shared through an OpenSSH control master whose socket lives in a private
    folder, removed at the end (with ``--sync``, the copy and the session share one login).
    """

    name = "ssh"

    def __init__(self, hosts: Sequence[Host], *, options: Sequence[str] = (), sync: bool = False) -> None:
        self.hosts = tuple(hosts)
        self.user_options = tuple(options)
        self.sync = sync  # copy the working directory to every host before the probe looks for the script
        self._sessions: list[_Session] = []
        self._control_dir: str | None = None

    @property
    def options(self) -> tuple[str, ...]:
        if self._control_dir is None:
            self._control_dir = tempfile.mkdtemp(prefix="disttrain-ssh-")  # 0700: only we reach the sockets
        # The user's own -o come first (ssh keeps the first value): theirs win, ControlMaster=no included.
        return (*self.user_options, "ControlMaster=auto", f"ControlPath={self._control_dir}/%C",
                f"ControlPersist={CONTROL_PERSIST_S}")

    def facts(self, spec: LaunchSpec, ctx: Context) -> Facts:
        if self.sync:
            sync_all(self.hosts, ctx.cwd, python=ctx.python, options=self.options)
        master = spec.master_addr or master_address(self.hosts[0], self.user_options)
        port = spec.master_port or DEFAULT_MULTIHOST_PORT
        env = bootstrap_env(ctx.environ)
        for i, host in enumerate(self.hosts):
            # No `cd` into cwd: it may not exist there yet, which is a finding, not a failure.
            argv = [ctx.python, "-m", "disttrain", "probe", "--session", "--master", master, "--port", str(port),
                    "--cwd", ctx.cwd, *(w for path in ctx.paths for w in ("--path", path))]
            if ctx.preflight:
                argv += ["--listen", ",".join(map(str, listen_ports(i, port)))]
            self._sessions.append(_Session(host, ssh_argv(host, argv, options=self.options, env=env), ctx.python))
        with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
            answers = list(pool.map(lambda s: _or_error(s.read, PROBE_TIMEOUT_S, "the probe"), self._sessions))
        facts = [a if isinstance(a, Exception) else a["facts"] for a in answers]
        check_facts(self.hosts, facts, master_port=port)
        if ctx.preflight:
            listening = [a["listen"] for a in answers]
            targets = reach_targets(facts, listening)
            for i, session in enumerate(self._sessions):
                session.send({"connect": targets_for(targets, i)})
            with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
                seen = list(pool.map(lambda s: _or_error(s.read, CONNECT_ROUND_S, "the reachability checks"),
                                     self._sessions))
            seen = [{t: "no answer from the host" for t in targets_for(targets, i)} if isinstance(r, Exception)
                    else r for i, r in enumerate(seen)]
            raise_on_failure(reach_results(self.hosts, listening, targets, seen))
        else:
            for session in self._sessions:
                session.send({"connect": []})
            for session in self._sessions:
                session.read(CONNECT_ROUND_S, "the probe")
        nodes = tuple(NodeFacts(hostname=h.name, cpus=f["cpus"], cuda_devices=f["cuda_devices"],
                                socket_ifname=f["ifname"], address=f["address"], slots=h.slots)
                      for h, f in zip(self.hosts, facts))
        return Facts(nodes=nodes, master_addr=master, master_port=port, where=tuple(h.name for h in self.hosts),
                     forwarded_env=forwarded_env(ctx.environ, everything=spec.forward_env))

    def launch(self, plan: LaunchPlan, events: Events, ctx: Context) -> Outcome:
        """Every session becomes its host's agent; a lost ssh connection (255) is named in the report."""
        sessions, self._sessions = self._sessions, []
        outcome = run_agents(plan, started=[s.proc for s in sessions], agent_cwd=ctx.cwd, transcript=events.transcript)
        if outcome.failed is not None and outcome.exit_code == 255:
            lost = (f"disttrain: lost the ssh connection to {self.hosts[outcome.failed].name} "
                    f"(node {outcome.failed}); the other hosts were stopped")
            events.say(lost)
            outcome = replace(outcome, report="\n".join(filter(None, (lost, outcome.report))))
        return outcome

    def run(self, spec: LaunchSpec, ctx: Context, events: Events) -> Outcome:
        try:
            return super().run(spec, ctx, events)
        finally:
            self.close()

    def dry_run(self, spec: LaunchSpec, ctx: Context) -> str:
        try:
            return super().dry_run(spec, ctx)
        finally:
            self.close()

    def close(self) -> None:
        """End sessions that never became agents, stop the control masters, remove their folder."""
        for session in self._sessions:
            session.close()
        self._sessions = []
        if self._control_dir is not None:
            with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
                list(pool.map(lambda h: subprocess.run(
                    ["ssh", "-O", "exit", *(w for o in self.options for w in ("-o", o)),
                     *(["-p", str(h.port)] if h.port else []), "--", h.destination],
                    capture_output=True, timeout=10, stdin=subprocess.DEVNULL), self.hosts))
            shutil.rmtree(self._control_dir, ignore_errors=True)
            self._control_dir = None


def _or_error(read, timeout: float, what: str):
    try:
        return read(timeout, what)
    except DisttrainError as err:
        return err
