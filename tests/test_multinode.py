"""``disttrain run --hosts``: real hosts (network namespaces), real sshd, real gloo.

The launcher runs inside node0, as a user logged into the first node would; the tool is
given the test's key and known-hosts choice through ``--ssh-option`` only.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS
from rig import cluster_fixture

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mnist_convnet.py"
HOSTILE = ["a b", "c'd", "g;h", "$(touch /tmp/pwned-remote)", ""]

cluster = cluster_fixture(2)


def ssh_options(cluster) -> list[str]:
    options = []
    for option in (f"IdentityFile={cluster.ssh_key}", "StrictHostKeyChecking=no",
                   "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"):
        options += ["--ssh-option", option]
    return options


def launch_argv(cluster, *args: str, nproc: int = 1) -> list[str]:
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    return [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "-n", str(nproc),
            *ssh_options(cluster), *args]


def run_on_node0(cluster, *args: str, nproc: int = 1, timeout: float = 120):
    return cluster.run_in("node0", launch_argv(cluster, *args, nproc=nproc), timeout=timeout, cwd=ROOT)


def assert_nothing_left(cluster, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {node.name: cluster.processes_in(node) for node in cluster.nodes}
        if not any(left.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"processes left behind: {left}")


@pytest.mark.timeout(150)
def test_torchrun_script_across_two_hosts(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_on_node0(cluster, str(SCRIPTS / "ranks_report.py"), str(out), *HOSTILE, nproc=2)
    assert result.returncode == 0, result.stderr
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert set(ranks) == {0, 1, 2, 3}
    for rec in ranks.values():
        assert rec["world_size"] == 4 and rec["sum"] == 10.0  # 1+2+3+4 over both hosts
        assert rec["argv"] == HOSTILE
        assert rec["ifname"] == "eth1"  # found from the route to the master, not the hostname
    node1 = cluster.nodes[1].ip
    assert f"[{node1} rank3] hello from rank 3" in result.stdout
    assert f"[{node1} rank2] warning line from rank 2" in result.stderr
    run_dir = Path(result.stderr.split("logs: ")[1].split()[0])
    assert "hello from rank 3" in (run_dir / "rank3.log").read_text()
    assert not Path("/tmp/pwned-remote").exists()
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
def test_failing_remote_rank_stops_every_host(cluster):
    result = run_on_node0(cluster, str(SCRIPTS / "fail_rank1.py"))
    assert result.returncode == 3, result.stderr
    node1 = cluster.nodes[1].ip
    assert f"disttrain: rank 1 on {node1} exited with code 3" in result.stderr
    assert "ValueError: rank one cannot go on: bad shard 17" in result.stderr
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_host(cluster):
    launcher = cluster.popen_in("node0", launch_argv(cluster, str(SCRIPTS / "sleeper.py")),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ready = 0
    while ready < 2:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        ready += "ready" in line
    assert cluster.processes_in("node1")  # the remote rank is really running
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) == 130
    assert_nothing_left(cluster)


@pytest.mark.timeout(120)
def test_script_missing_on_a_host_is_reported_before_launch(cluster):
    result = run_on_node0(cluster, "no/such/train.py")
    assert result.returncode == 2
    assert f"{cluster.nodes[0].ip}: no/such/train.py not found" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(240)
def test_two_hosts_reach_the_same_loss_as_one_host(cluster, tmp_path):
    # The same threads per process on both sides: a different OMP_NUM_THREADS changes the
    # order of float sums inside the convolutions, and so the last digits of the loss.
    args = ["--samples", "1200", "--batch-size", "32", "--log-every", "0", "--seed", "3"]
    local = subprocess.run([sys.executable, "-m", "disttrain", "run", "-n", "2", "--ranks", "0",
                            "--env", "OMP_NUM_THREADS=1", str(EXAMPLE), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert local.returncode == 0, local.stderr
    remote = run_on_node0(cluster, "--ranks", "0", "--env", "OMP_NUM_THREADS=1", str(EXAMPLE), *args)
    assert remote.returncode == 0, remote.stderr

    def summary(stdout: str) -> dict:
        return json.loads(stdout.strip().splitlines()[-1].split("] ", 1)[1])

    one, two = summary(local.stdout), summary(remote.stdout)
    assert one["world_size"] == two["world_size"] == 2
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-6)
    assert two["val_accuracy"] == pytest.approx(one["val_accuracy"], abs=1e-9)


def doctor_on_node0(cluster, *args: str, timeout: float = 60):
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    argv = [sys.executable, "-m", "disttrain", "doctor", "--hosts", hosts, *ssh_options(cluster), *args]
    return cluster.run_in("node0", argv, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(90)
def test_doctor_all_clear(cluster):
    result = doctor_on_node0(cluster, "--json", "--path", "examples/mnist_convnet.py")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = json.loads(result.stdout)
    assert {c["status"] for c in checks} == {"ok"}
    kinds = {c["check"] for c in checks}
    assert {"ssh", "path", "versions", "interface", "master port", "rendezvous port", "host to host"} <= kinds
    assert_nothing_left(cluster)


@pytest.mark.timeout(120)
def test_blocked_master_port_is_named_by_doctor_and_run_fails_fast(cluster):
    node0, node1 = cluster.nodes
    cluster.block_port("node0", 29500)
    start = time.monotonic()
    result = doctor_on_node0(cluster)
    assert time.monotonic() - start < 30
    assert result.returncode == 1
    assert f"FAIL  rendezvous port" in result.stdout
    assert f"root@{node1.ip} -> root@{node0.ip}:29500" not in result.stdout  # hosts are named as given
    assert f"{node1.ip} -> {node0.ip}:29500: timed out" in result.stdout
    start = time.monotonic()
    run = run_on_node0(cluster, str(SCRIPTS / "sleeper.py"))
    assert time.monotonic() - start < 30
    assert run.returncode == 1
    assert f"{node1.ip} -> {node0.ip}:29500: timed out" in run.stderr
    assert "open TCP port 29500" in run.stderr
    assert_nothing_left(cluster)


@pytest.mark.timeout(120)
def test_only_ssh_and_master_port_open_is_found_not_hung(cluster):
    node0, node1 = cluster.nodes
    for node in ("node0", "node1"):
        cluster.only_allow(node, [22, 29500])
    result = doctor_on_node0(cluster, "--json")
    assert result.returncode == 1
    failed = [c for c in json.loads(result.stdout) if c["status"] == "fail"]
    assert {c["check"] for c in failed} == {"host to host"}
    assert any(f"{node1.ip} -> {node0.ip} on port" in c["detail"] for c in failed)
    run = run_on_node0(cluster, str(SCRIPTS / "sleeper.py"), timeout=60)
    assert run.returncode == 1
    assert "allow all TCP between the hosts" in run.stderr
    assert_nothing_left(cluster)


@pytest.mark.timeout(120)
def test_mesh_blocked_without_preflight_still_ends_with_a_clear_error(cluster):
    """The case the checks would have caught, with them skipped: the runtime's bound ends it."""
    for node in ("node0", "node1"):
        cluster.only_allow(node, [22, 29500])
    start = time.monotonic()
    run = run_on_node0(cluster, "--no-preflight", "--env", "DISTTRAIN_CONNECT_TIMEOUT=8",
                       str(SCRIPTS / "runtime_init_only.py"), timeout=90)
    assert time.monotonic() - start < 60
    assert run.returncode == 75, run.stderr
    assert "could not connect to the other 1 rank(s) within 8 s" in run.stderr
    assert "allow all TCP between the hosts" in run.stderr
    assert_nothing_left(cluster)
