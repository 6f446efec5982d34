"""A SIGKILLed launcher leaves nothing running: locally, in a job, and on the rig's hosts.

SIGKILL gives the launcher no chance to stop anything; the workers must notice on their own
(the kernel's parent-death signal, see ``agent/lifeline.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from _launch import kill_tree, launch_argv, worker_env
from conftest import SCRIPTS, cli_env
from rig import cluster_fixture

ROOT = Path(__file__).resolve().parent.parent
SLEEPER = SCRIPTS / "sleeper.py"

cluster = cluster_fixture(2)


def _ready_pids(proc: subprocess.Popen, count: int) -> list[int]:
    """The pids the sleepers print (``ready PID``, prefixed by their rank)."""
    pids = []
    while len(pids) < count:
        line = proc.stdout.readline()
        assert line, f"launcher ended early: {proc.stderr.read()}"
        if "ready " in line:
            pids.append(int(line.split("ready ", 1)[1]))
    return pids


def _gone_within(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running (not zombies) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _sigkill_and_check(proc: subprocess.Popen, pids: list[int], *, timeout: float = 10) -> None:
    family = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    alive = _gone_within(pids, timeout)
    for leftover in family:  # leave nothing behind even when the assertion fails
        try:
            leftover.kill()
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"workers {alive} outlived their SIGKILLed launcher"


@pytest.mark.timeout(90)
def test_sigkill_of_run_leaves_no_worker(tmp_path):
    proc = subprocess.Popen(launch_argv(SLEEPER, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=worker_env({"DISTTRAIN_HOME": str(tmp_path)}))
    try:
        pids = _ready_pids(proc, 2)
        _sigkill_and_check(proc, pids, timeout=5)
    finally:
        kill_tree(proc.pid)


@pytest.mark.timeout(150)
def test_sigkill_of_job_runner_leaves_no_agent_or_worker(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "sleepy", "entry_point": "sleeper.py", "source_dir": str(SCRIPTS),
                                    "instance_count": 2, "processes_per_instance": 1}))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "job", "run", str(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        pids = _ready_pids(proc, 2)
        agents = [p.pid for p in psutil.Process(proc.pid).children()]
        assert agents
        # The agents stop their workers first, within their stop grace (15 s); an agent whose
        # shutdown torch left waiting on its log tailers exits 10 s later (agent/entry.py).
        _sigkill_and_check(proc, pids + agents, timeout=40)
    finally:
        kill_tree(proc.pid)


@pytest.mark.timeout(150)
def test_sigkill_of_run_over_ssh_leaves_nothing_on_any_host(cluster):
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "-n", "1", *cluster.cli_ssh_args(),
            str(SLEEPER)]
    launcher = cluster.popen_in("node0", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _ready_pids(launcher, 2)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = {node.name: cluster.processes_in(node) for node in cluster.nodes}
        if not any(left.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"processes left behind after SIGKILL of the launcher: {left}")
