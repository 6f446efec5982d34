"""``--launcher ssh``: one torch elastic agent per host, started over ssh.

Every host runs a probe session (:mod:`disttrain.launch.probe`) that becomes its agent (the
same code that runs a single-node job) through the shared flow (:mod:`disttrain.launch.flow`):
its plan, with the user's variables, arrives on the ssh connection's stdin, so no value of
theirs is ever on a command line; only ``PYTHONPATH`` (which the agent needs to start at all)
is. Before that, every host says its facts, and the preflight checks every host can reach
the master port and every other host.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..config.hosts import DEFAULT_MULTIHOST_PORT, Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError
from ..plan.launch import LaunchPlan, NodeFacts
from ..preflight.checks import CheckResult, fact_checks
from ..ssh import ssh_config
from ..wire import HostFacts, Outcome
from ..workerenv import BOOTSTRAP_NAMES
from .base import Events, Facts, LaunchContext
from .probe import SessionLauncher, ask_facts, close_all, open_sessions, reach_round
from .sync import sync_all
from .transport import SshTransport, Transport

# An elastic range goes on without a host that stops answering: ssh says so (exit 255) after 3 s
# of unanswered keep-alives instead of the kernel's TCP timeout (minutes), and a host that is down
# at the start (or when tried again) fails its connect in 5 s. The user's -o come first and win.
ELASTIC_OPTIONS = ("ConnectTimeout=5", "ServerAliveInterval=1", "ServerAliveCountMax=3")
CONTROL_PERSIST_S = 5  # an idle control master outlives its last session this long (a SIGKILLed launcher's too): bridges the steps of one run, no more


def master_address(host: Host, options: Sequence[str]) -> str:
    """The first host's IPv4 address as ssh resolves it (``~/.ssh/config`` HostName included)."""
    name = ssh_config(host, options).get("hostname", host.name)
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        raise DisttrainError(f"cannot resolve {name} (host {host.name}); give --master-addr") from None


def bootstrap_env(environ) -> dict[str, str]:
    """What a remote disttrain process needs before it can read anything: its import path."""
    return {k: environ[k] for k in BOOTSTRAP_NAMES if k in environ}


class SshLauncher(SessionLauncher):
    """``--hosts a,b``: node K on the K-th host, the first being the master.

    One remote round per host before the agent: every host's probe session (facts, listeners,
    then the connects) runs in parallel and becomes that host's agent once the plan is sent.
    Connections are shared through an OpenSSH control master whose socket lives in a private
    folder, removed at the end (with ``--sync``, the copy and the session share one login).
    """

    name = "ssh"

    def __init__(self, hosts: Sequence[Host], *, options: Sequence[str] = (), sync: bool = False) -> None:
        super().__init__()
        self.hosts = tuple(hosts)
        self.user_options = tuple(options)
        self.sync = sync  # copy the working directory to every host before the probe looks for the script
        self._control_dir: str | None = None

    def options(self, *, elastic: bool = False) -> tuple[str, ...]:
        """ssh's options for every connection; ``elastic`` (``--nnodes MIN:MAX``): a lost host is
        noticed within seconds (:data:`ELASTIC_OPTIONS`)."""
        if self._control_dir is None:
            self._control_dir = tempfile.mkdtemp(prefix="disttrain-ssh-")  # 0700: only we reach the sockets
        # The user's own -o come first (ssh keeps the first value): theirs win, ControlMaster=no included.
        return (*self.user_options, "ControlMaster=auto", f"ControlPath={self._control_dir}/%C",
                f"ControlPersist={CONTROL_PERSIST_S}", *(ELASTIC_OPTIONS if elastic else ()))

    def facts(self, spec: LaunchSpec, ctx: LaunchContext) -> Facts:
        if self.sync:
            sync_all(self.hosts, ctx.cwd, python=ctx.python, options=self.options(), env=bootstrap_env(ctx.environ))
        return super().facts(spec, ctx)

    def rendezvous(self, spec: LaunchSpec, ctx: LaunchContext) -> tuple[str, int]:
        return (spec.master_addr or master_address(self.hosts[0], self.user_options),
                spec.master_port or DEFAULT_MULTIHOST_PORT)

    def transports(self, spec: LaunchSpec, ctx: LaunchContext) -> list[Transport]:
        env, options = bootstrap_env(ctx.environ), self.options(elastic=spec.elastic)
        return [SshTransport(host, options=options, env=env) for host in self.hosts]

    def node_facts(self, spec: LaunchSpec, ctx: LaunchContext, facts: Mapping[int, HostFacts]) -> tuple[NodeFacts, ...]:
        return tuple(NodeFacts(name=self.hosts[i].name, cpus=f.cpus, cuda_devices=f.cuda_devices,
                               socket_ifname=f.ifname, address=f.address, slots=self.hosts[i].slots)
                     for i, f in facts.items())

    def launch(self, plan: LaunchPlan, events: Events, ctx: LaunchContext) -> Outcome:
        """A lost ssh connection (255) is named in the report."""
        outcome = super().launch(plan, events, ctx)
        if outcome.failed is not None and outcome.exit_code == 255 and not plan.elastic:  # (elastic: said already)
            lost = (f"disttrain: lost the ssh connection to {self.hosts[outcome.failed].name} "
                    f"(node {outcome.failed}); the other hosts were stopped")
            events.say(lost)
            outcome = replace(outcome, report="\n".join(filter(None, (lost, outcome.report))))
        return outcome

    def close(self) -> None:
        """End sessions that never became agents, stop the control masters, remove their folder."""
        super().close()
        if self._control_dir is not None:
            with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
                list(pool.map(lambda h: subprocess.run(
                    ["ssh", "-O", "exit", *(w for o in self.options() for w in ("-o", o)),
                     *(["-p", str(h.port)] if h.port else []), "--", h.destination],
                    capture_output=True, timeout=10, stdin=subprocess.DEVNULL), self.hosts))
            shutil.rmtree(self._control_dir, ignore_errors=True)
            self._control_dir = None


def check_hosts(hosts: Sequence[Host], *, python: str, master: str, port: int, paths: Sequence[str], cwd: str,
                options: Sequence[str], environ: Mapping[str, str]) -> list[CheckResult]:
    """``doctor --hosts``: what each host says about itself, compared with the first, then real
    TCP connects from every host to the master port and to every other host -- the round a
    launch runs, over one probe session per host, none of which becomes an agent."""
    env = bootstrap_env(environ)
    sessions = open_sessions([SshTransport(host, options=options, env=env) for host in hosts], python=python,
                             master=master, port=port, cwd=cwd, paths=paths)
    try:
        answers = ask_facts(sessions)
        facts = [a if isinstance(a, Exception) else a.facts for a in answers]
        results = fact_checks(hosts, facts, master_port=port)
        if not any(isinstance(a, Exception) for a in answers):
            results += reach_round(sessions, hosts, facts, [a.listen for a in answers])
        return results
    finally:
        close_all(sessions)
