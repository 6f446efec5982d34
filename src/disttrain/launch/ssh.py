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
import socket
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..config.hosts import DEFAULT_MULTIHOST_PORT, Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError
from ..plan.launch import LaunchPlan, NodeFacts
from ..preflight.checks import check_facts, raise_on_failure, reach_checks
from ..ssh import ssh_argv
from ..workerenv import BOOTSTRAP_NAMES, forwarded_env
from .base import Context, Events, Facts, Launcher, Outcome
from .flow import agent_argv, run_agents
from .sync import sync_all

PROBE_TIMEOUT_S = 30


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


class SshLauncher(Launcher):
    """``--hosts a,b``: node K on the K-th host, the first being the master."""

    name = "ssh"

    def __init__(self, hosts: Sequence[Host], *, options: Sequence[str] = (), sync: bool = False) -> None:
        self.hosts = tuple(hosts)
        self.options = tuple(options)
        self.sync = sync  # copy the working directory to every host before the probe looks for the script

    def facts(self, spec: LaunchSpec, ctx: Context) -> Facts:
        if self.sync:
            sync_all(self.hosts, ctx.cwd, python=ctx.python, options=self.options)
        master = spec.master_addr or master_address(self.hosts[0], self.options)
        port = spec.master_port or DEFAULT_MULTIHOST_PORT
        facts = probe_all(self.hosts, python=ctx.python, master=master, port=port, paths=list(ctx.paths),
                          options=self.options, cwd=ctx.cwd, env=bootstrap_env(ctx.environ))
        check_facts(self.hosts, facts, master_port=port)
        if ctx.preflight:
            raise_on_failure(reach_checks(self.hosts, facts, master_port=port, python=ctx.python,
                                          options=self.options))
        nodes = tuple(NodeFacts(hostname=h.name, cpus=f["cpus"], cuda_devices=f["cuda_devices"],
                                socket_ifname=f["ifname"], address=f["address"], slots=h.slots)
                      for h, f in zip(self.hosts, facts))
        return Facts(nodes=nodes, master_addr=master, master_port=port, where=tuple(h.name for h in self.hosts),
                     forwarded_env=forwarded_env(ctx.environ, everything=spec.forward_env))

    def launch(self, plan: LaunchPlan, events: Events, ctx: Context) -> Outcome:
        """One agent per host; a lost ssh connection (255) is named in the report."""
        env = bootstrap_env(ctx.environ)
        commands = [ssh_argv(host, agent_argv(ctx.python), options=self.options, cwd=ctx.cwd, env=env)
                    for host in self.hosts[: len(plan.nodes)]]
        outcome = run_agents(plan, commands, transcript=events.transcript)
        if outcome.failed is not None and outcome.exit_code == 255:
            lost = (f"disttrain: lost the ssh connection to {self.hosts[outcome.failed].name} "
                    f"(node {outcome.failed}); the other hosts were stopped")
            events.say(lost)
            outcome = replace(outcome, report="\n".join(filter(None, (lost, outcome.report))))
        return outcome
