"""A real Slurm on one machine: munged, slurmctld and slurmd, configured from a temp dir.

Built on ``rig.Cluster``: every Slurm node is one of its network namespaces, so every daemon,
job step and training process lives in a namespace the rig tears down (all processes there
killed, the namespaces deleted) whatever happens.

- ``SlurmCluster(n=1)``: one node that talks over loopback only (NodeAddr 127.0.0.1, inside
  its own namespace, so it never meets another test's Slurm on the machine's loopback).
- ``SlurmCluster(n=2)``: two nodes on the rig's veth pair (NodeAddr 10.77.k.1 / 10.77.k.2).

slurmctld and munged run in node0, which is also the "login node": run client commands
(sbatch, srun, squeue, ``disttrain run --launcher slurm``) there with ``run_in``/``popen_in``
and ``env()``, which points ``SLURM_CONF`` at this cluster's config. The daemons are started
with ``nsenter --net`` (``ip netns exec`` would remount /sys and hide the cgroup tree from
slurmd), the config uses no cgroups (proctrack/linuxproc, task/none) and no accounting.

Usage::

    from slurm_rig import slurm_fixture
    slurm = slurm_fixture(2, scope="module")

    def test_x(slurm):
        r = slurm.run_in("node0", ["srun", "-N2", "hostname"], env=slurm.env())
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from rig import SETUP_SCRIPT, Cluster, RigError
from rig import skip_reason as rig_skip_reason

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "squeue", "scontrol", "scancel")
START_TIMEOUT_S = 30
NODE_CPUS = 2


@lru_cache(maxsize=None)
def skip_reason() -> str | None:
    """None when the daemons can start here, else a one-line reason to skip."""
    reason = rig_skip_reason()
    if reason:
        return reason
    def missing() -> list[str]:
        return [d for d in DAEMONS if not os.access(d, os.X_OK)] + [c for c in CLIENTS if not shutil.which(c)]

    if missing() and SETUP_SCRIPT.exists():  # installs them as root (apt-get), as in CI
        subprocess.run(["bash", str(SETUP_SCRIPT)], capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
    if missing():
        return (f"slurm rig: missing {', '.join(missing())} "
                "(run tests/rig_setup.sh as root: slurmctld slurmd slurm-client munge)")
    return None


class SlurmCluster:
    """``n`` Slurm nodes (1: loopback only; 2: a veth pair; 3 or more: a bridge) and their daemons."""

    def __init__(self, n: int = 2) -> None:
        if n < 1:
            raise ValueError("n must be 1 (loopback) or more (namespaces)")
        self.n = n
        self.rig = Cluster(n)
        self.hostname = os.uname().nodename.split(".")[0]
        self.name = f"dt{os.getpid()}{secrets.token_hex(2)}"  # ClusterName: lowercase, short
        self.dir: Path | None = None
        self.conf: Path | None = None
        self.timings: dict[str, float] = {}

    # ---- addresses

    @property
    def node_names(self) -> list[str]:
        return [node.name for node in self.rig.nodes]

    def node_addr(self, index: int) -> str:
        return "127.0.0.1" if self.n == 1 else self.rig.nodes[index].ip

    # ---- lifecycle

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> SlurmCluster:
        t0 = time.perf_counter()
        self.rig.start()
        try:
            self.dir = self.rig.workdir / "slurm"
            self._write_files()
            self._start_daemons()
            self._wait_until_idle()
        except BaseException:
            self.stop()
            raise
        self.timings["up_s"] = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        """Everything runs inside the rig's namespaces: its teardown kills it all."""
        self.rig.stop()

    def _write_files(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(parents=True)
        # munged wants its socket in a directory everyone may enter, and its key in one
        # only root can read.
        os.chmod(self.rig.workdir, 0o755)
        for path in (d, d / "munge"):
            os.chmod(path, 0o755)
        keydir = d / "munge-key"
        keydir.mkdir(mode=0o700)
        key = keydir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        from disttrain.net import free_port

        ctld_addr = self.node_addr(0)
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={self.hostname} NodeAddr={self.node_addr(i)} "
            f"CPUs={NODE_CPUS} RealMemory=4000 State=UNKNOWN"
            for i, name in enumerate(self.node_names))
        self.conf = d / "slurm.conf"
        self.conf.write_text(
            f"ClusterName={self.name}\n"
            f"SlurmctldHost={self.hostname}({ctld_addr})\n"
            # Ports are per namespace; free ones keep even two loopback clusters apart.
            f"SlurmctldPort={free_port()}\n"
            f"SlurmdPort={free_port()}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\n"
            # cred_expire is also how long a requeued job waits before it may start (120 s).
            f"AuthInfo=socket={d / 'munge' / 'munge.sock'},cred_expire=10\n"
            "CredType=cred/munge\n"
            f"StateSaveLocation={d / 'state'}\n"
            f"SlurmdSpoolDir={d / 'spool'}/%n\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}\n"
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}\n"
            "ProctrackType=proctrack/linuxproc\n"
            "TaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobCompType=jobcomp/none\n"
            "SelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\n"
            "MpiDefault=none\n"
            "SwitchType=switch/none\n"
            "ReturnToService=2\n"
            # Short waits: a cancelled step gets SIGKILL 5 s after SIGTERM (default 30 s).
            "KillWait=5\n"
            "MinJobAge=300\n"
            "InactiveLimit=0\n"
            "SchedulerType=sched/builtin\n"
            "SchedulerParameters=sched_interval=1\n"  # a requeued job is started within a second
            f"{nodes}\n"
            f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _daemon(self, node: int, argv: list[str]) -> None:
        r = subprocess.run(self.rig.ns_exec(node, argv), capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL, env=self.env())
        if r.returncode != 0:
            raise RigError(f"{argv[0]} on {self.node_names[node]} exited {r.returncode}: "
                           f"{r.stderr.strip()} {self._logs()}")

    def _start_daemons(self) -> None:
        d = self.dir
        self._daemon(0, ["/usr/sbin/munged", f"--socket={d / 'munge' / 'munge.sock'}",
                         f"--key-file={d / 'munge-key' / 'munge.key'}", f"--log-file={d / 'log' / 'munged.log'}",
                         f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}", "--force"])
        self._daemon(0, ["/usr/sbin/slurmctld", "-f", str(self.conf)])
        for i, name in enumerate(self.node_names):
            self._daemon(i, ["/usr/sbin/slurmd", "-f", str(self.conf), "-N", name])

    def _wait_until_idle(self) -> None:
        """Until every node reports itself idle to slurmctld (or a clear error)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        states = ""
        while time.monotonic() < deadline:
            r = self.run_in(0, ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
            states = r.stdout.strip()
            lines = states.splitlines()
            if r.returncode == 0 and len(lines) == self.n and all(line.split()[1] == "idle" for line in lines):
                return
            time.sleep(0.2)
        raise RigError(f"slurm nodes not idle within {START_TIMEOUT_S} s: {states!r} {self._logs()}")

    def _logs(self) -> str:
        out = []
        for log in sorted((self.dir / "log").glob("*.log")) if self.dir else ():
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            out.append(f"[{log.name}] " + " | ".join(tail))
        return " ".join(out)

    # ---- running things

    def env(self, **extra: str) -> dict[str, str]:
        """The caller's environment with this cluster's config, minus any outer Slurm job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra)
        return env

    def run_in(self, node: int | str, argv, *, timeout: float = 60, env: dict | None = None, **kwargs):
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        if "input" not in kwargs:
            kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.rig.ns_exec(node, list(argv)), timeout=timeout,
                              env=env or self.env(), **kwargs)

    def popen_in(self, node: int | str, argv, *, env: dict | None = None, **kwargs) -> subprocess.Popen:
        return self.rig.popen_in(node, list(argv), env=env or self.env(), **kwargs)

    def squeue(self) -> list[str]:
        """``JOBID STATE`` of every job slurmctld still holds, finished ones included."""
        r = self.run_in(0, ["squeue", "-h", "-t", "all", "-o", "%i %T"], timeout=20)
        return r.stdout.split("\n")[:-1] if r.returncode == 0 else [f"squeue failed: {r.stderr.strip()}"]

    def job_state(self, job_id: str) -> str:
        r = self.run_in(0, ["scontrol", "show", "job", "-o", job_id], timeout=20)
        for word in r.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return ""

    def assert_nothing_left(self, timeout: float = 30) -> None:
        """No job in the queue and no process in any node but the daemons."""
        def clean():
            queued = self.run_in("node0", ["squeue", "-h"], timeout=20).stdout.strip()
            return not queued and not any(self.job_processes().values())

        try:
            wait_for(clean, timeout, "the jobs and their processes to be gone")
        except AssertionError:
            raise AssertionError(f"left behind: queue {self.squeue()}, processes {self.job_processes()}") from None

    def job_processes(self) -> dict[str, list[int]]:
        """Live processes in every node other than the daemons: job steps and their tasks."""
        daemons = set()
        for pidfile in self.dir.glob("*.pid"):
            try:
                daemons.add(int(pidfile.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return {node: [p for p in self.rig.processes_in(node) if p not in daemons and not _daemon_helper(p, daemons)]
                for node in self.node_names}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def slurm_fixture(n: int = 2, *, scope: str = "module", name: str = "slurm"):
    """A pytest fixture yielding a started ``SlurmCluster(n)``; skipped, with the reason,
    only where the daemons cannot start."""
    import pytest

    @pytest.fixture(scope=scope, name=name)
    def _slurm():
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        cluster = SlurmCluster(n)
        try:
            cluster.start()
        except RigError as err:  # start() has torn down what it made
            pytest.skip(f"slurm rig: the daemons did not start: {err}")
        try:
            yield cluster
        finally:
            cluster.stop()

    return _slurm


def _daemon_helper(pid: int, daemons: set[int]) -> bool:
    """slurmctld's own child (slurmscriptd), which lives as long as it does."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            name = fh.read().split(b"\0")[0]
    except (OSError, ValueError, IndexError):
        return False
    return ppid in daemons and name.startswith(b"slurmctld")
