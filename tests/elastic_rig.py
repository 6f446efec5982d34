"""What the elastic rig tests share (test_elastic_ssh.py, test_elastic_slurm.py, test_elastic_load.py and
test_elastic.py's job): the training script and its job's arguments, a job started from node0 as a user
would, waiting on it, its membership record, and the processes on its hosts.

The workers (tests/scripts/elastic_train.py) log every step's samples, so the accounting over every
attempt (bench/elastic.py's) checks that no sample was lost or trained twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import elastic_bench
from rig import cpu_hog

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "elastic_train.py"

bench = elastic_bench()


@pytest.fixture(autouse=True)
def field_load():
    """``DISTTRAIN_TEST_HOG=N``: every test of a module that imports this runs beside N busy loops, as on
    a loaded machine (issue 48's field runs; the default run has none)."""
    with cpu_hog(int(os.environ.get("DISTTRAIN_TEST_HOG") or 0)):
        yield


# Why a host that lost power left: the launcher's connection probe (its agent silent 1.3 s, then no
# TCP connection in 0.8 s), or ssh's keep-alives when they came first (a loaded launcher).
POWER_LOST = ("its agent said nothing for ", "ssh failed: ")
JOB = ["--samples", "120", "--epochs", "2", "--batch-size", "2", "--every", "4", "--pause", "0.2"]


def start_job(cluster, tmp_path: Path, *extra: str, nnodes: str = "2:3", hosts=None,
              job=JOB, env=None) -> tuple[subprocess.Popen, Path, Path]:
    """The job, launched from node0; on every node of the cluster, or on ``hosts`` (node0 then runs
    only the launcher, as a login host does)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    hosts = ",".join(f"root@{node.ip}" for node in (hosts or cluster.nodes))
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "--nnodes", nnodes, "-n", "1",
            "--log-dir", str(tmp_path / "run"), *cluster.cli_ssh_args(), *extra, str(WORKER), "--out", str(out), "--ckpt", str(ckpt),
            *job]
    proc = cluster.popen_in("node0", argv, cwd=ROOT, env={**bench.worker_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    return proc, out, ckpt


def wait_for(proc: subprocess.Popen, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early (exit {proc.returncode}):\n{proc.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"not ready within {timeout} s:\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.1)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{err[-4000:]}") from None
    return proc.returncode, err


def record_of(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "run" / "membership.json").read_text())


def record_so_far(tmp_path: Path) -> list[dict]:
    """The record while the job runs: [] before its first write."""
    try:
        return record_of(tmp_path)
    except (OSError, ValueError):
        return []

def brief(record: list[dict]) -> str:
    """The record, one change a line, as a failure shows it (pytest cuts a long list short)."""
    keys = ("change", "host", "attempt", "world_size", "path", "path_why", "seconds")
    return "\n".join(" ".join(f"{k}={c.get(k)}" for k in keys) for c in record)


def logs_after(tmp_path: Path, attempt: int, lines: int = 15) -> str:
    """The last lines of each rank's stderr in the rounds after ``attempt``, and of each node's log:
    what a failure under load needs shown (the relay may not have carried a worker's last line)."""
    run = tmp_path if tmp_path.name == "run" else tmp_path / "run"
    files = sorted(run.glob("node*.log")) + sorted(
        f for f in run.glob("attempt_*/rank*.stderr") if int(f.parent.name.split("_")[1]) > attempt)
    return "\n".join(f"--- {f.relative_to(run)}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:])
                     for f in files)


def agent_of(cluster, node) -> int:
    """The pid of the disttrain agent on ``node`` (its python process whose parent is not one)."""
    import psutil

    for pid in cluster.processes_in(node):
        try:
            proc = psutil.Process(pid)
            if "run_module('disttrain'" in " ".join(proc.cmdline()) and "python" not in proc.parent().name():
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no agent on {node}")


def worker_of(cluster, node) -> int:
    """The pid of the training worker on ``node``: the process running the script (its agent's
    command line names the script too)."""
    import psutil

    for pid in cluster.processes_in(node):
        try:
            if str(WORKER) in psutil.Process(pid).cmdline()[1:3]:
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker on {node}")


def nothing_of_the_job_left(slurm) -> None:
    """Slurm's daemons stay on its nodes; within 20 s no process of the job does."""
    deadline = time.monotonic() + 20
    while True:
        left = [_cmdline(pid) for node in slurm.rig.nodes for pid in slurm.rig.processes_in(node)
                if "disttrain" in _cmdline(pid) or "elastic_train" in _cmdline(pid)]
        if not left:
            return
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
