"""``disttrain run --hosts``: real hosts (network namespaces), real sshd, real gloo.

The launcher runs inside node0, as a user logged into the first node would; the tool is
given the test's key and known-hosts choice through ``--ssh-option`` only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, read_ranks
from disttrain.placement import auto_nproc, usable_cpus
from rig import Cluster, cluster_fixture, skip_reason

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mnist_convnet.py"
HOSTILE = ["a b", "c'd", "g;h", "$(touch /tmp/pwned-remote)", ""]

cluster = cluster_fixture(2)


def ssh_options(cluster) -> list[str]:
    return cluster.cli_ssh_args()


def launch_argv(cluster, *args: str, nproc: int | str = 1) -> list[str]:
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    return [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "-n", str(nproc),
            *ssh_options(cluster), *args]


def run_on_node0(cluster, *args: str, nproc: int | str = 1, timeout: float = 120):
    return cluster.run_in("node0", launch_argv(cluster, *args, nproc=nproc), timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(150)
def test_torchrun_script_across_two_hosts(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_on_node0(cluster, str(SCRIPTS / "ranks_report.py"), str(out), *HOSTILE, nproc=2)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
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
    cluster.assert_nothing_left()


@pytest.mark.timeout(150)
def test_failing_remote_rank_stops_every_host(cluster):
    result = run_on_node0(cluster, str(SCRIPTS / "fail_rank1.py"))
    assert result.returncode == 3, result.stderr
    node1 = cluster.nodes[1].ip
    assert f"disttrain: rank 1 on {node1} exited with code 3" in result.stderr
    assert "ValueError: rank one cannot go on: bad shard 17" in result.stderr
    cluster.assert_nothing_left()


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_host(cluster):
    launcher = start_sleepers(cluster)
    assert worker_pids(cluster, "node1", "sleeper.py")  # the remote rank is really running
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) == 130
    cluster.assert_nothing_left()


@pytest.mark.timeout(120)
def test_script_missing_on_a_host_is_reported_before_launch(cluster):
    result = run_on_node0(cluster, "no/such/train.py")
    assert result.returncode == 2
    assert f"{cluster.nodes[0].ip}: no/such/train.py not found" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(240)
def test_two_hosts_reach_the_same_loss_as_one_host(cluster):
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

    # 2 hosts x 2 at half the batch: every step averages the same 64 samples, but each
    # rank draws its own dropout masks, so the loss agrees closely rather than exactly.
    args[args.index("32")] = "16"
    four = run_on_node0(cluster, "--ranks", "0", "--env", "OMP_NUM_THREADS=1", str(EXAMPLE), *args, nproc=2)
    assert four.returncode == 0, four.stderr
    four = summary(four.stdout)
    assert four["world_size"] == 4 and four["global_batch_size"] == one["global_batch_size"] == 64
    assert four["train_loss"] == pytest.approx(one["train_loss"], rel=0.05)


def doctor_on_node0(cluster, *args: str, timeout: float = 120):
    # 2-3 s quiet, 10 s beside 6 busy loops; CI's once took over 60 s, saying nothing (its stderr now names
    # a host silent for 15 s, and what it waits for).
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    argv = [sys.executable, "-m", "disttrain", "doctor", "--hosts", hosts, *ssh_options(cluster), *args]
    return cluster.run_in("node0", argv, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(150)
def test_doctor_all_clear(cluster):
    result = doctor_on_node0(cluster, "--json", "--path", "examples/mnist_convnet.py")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = json.loads(result.stdout)
    assert {c["status"] for c in checks} == {"ok"}
    kinds = {c["check"] for c in checks}
    assert {"ssh", "path", "versions", "interface", "master port", "rendezvous port", "host to host"} <= kinds
    cluster.assert_nothing_left()


@pytest.mark.timeout(270)
def test_blocked_master_port_is_named_by_doctor_and_run_fails_fast(cluster):
    node0, node1 = cluster.nodes
    cluster.block_port("node0", 29500)
    result = doctor_on_node0(cluster)
    assert result.returncode == 1
    assert "FAIL  rendezvous port" in result.stdout
    assert f"root@{node1.ip} -> root@{node0.ip}:29500" not in result.stdout  # hosts are named as given
    assert f"{node1.ip} -> {node0.ip}:29500: timed out" in result.stdout
    run = run_on_node0(cluster, str(SCRIPTS / "sleeper.py"))
    assert run.returncode == 1
    assert f"{node1.ip} -> {node0.ip}:29500: timed out" in run.stderr
    assert "open TCP port 29500" in run.stderr
    cluster.assert_nothing_left()


@pytest.mark.timeout(210)
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
    cluster.assert_nothing_left()


@pytest.mark.timeout(120)
def test_mesh_blocked_without_preflight_still_ends_with_a_clear_error(cluster):
    """The case the checks would have caught, with them skipped: the runtime's bound ends it."""
    for node in ("node0", "node1"):
        cluster.only_allow(node, [22, 29500])
    run = run_on_node0(cluster, "--no-preflight", "--env", "DISTTRAIN_CONNECT_TIMEOUT=8",
                       str(SCRIPTS / "runtime_init_only.py"), timeout=90)
    assert run.returncode == 75, run.stderr
    assert "could not connect to the other 1 rank(s) within 8 s" in run.stderr
    assert "allow all TCP between the hosts" in run.stderr
    cluster.assert_nothing_left()


SYNCED_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(open("data/value.txt").read())])
dist.all_reduce(value)
print(f"sum {value.item()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_sync_copies_the_working_directory_to_a_host_without_it(tmp_path):
    """node1 shares no filesystem with node0 here: the project folder is empty there."""
    if skip_reason():
        pytest.skip(skip_reason())
    project = tmp_path / "my project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text(SYNCED_SCRIPT)
    (project / "data" / "value.txt").write_text("2.5")
    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with Cluster(2, private={"node1": [str(project)]}) as cluster:
        node0, node1 = cluster.nodes
        assert cluster.ssh("node1", "ls", "-A", str(project)).stdout == ""

        def run(*args):
            return cluster.run_in("node0", launch_argv(cluster, *args, "train.py"), timeout=120, cwd=project)

        missing = run()
        assert missing.returncode == 2
        assert f"{node1.ip}: train.py not found" in missing.stderr
        assert "--sync" in missing.stderr  # the fix is named

        synced = run("--sync")
        assert synced.returncode == 0, synced.stderr
        assert f"[{node1.ip} rank1] sum 5.0" in synced.stdout
        assert f"--sync {project} -> {node1.ip}: 2 of 2 files" in synced.stderr
        assert f"--sync {project} -> {node0.ip}: up to date" in synced.stderr  # the same folder
        listed = cluster.ssh("node1", "find", str(project), "-type", "f").stdout.splitlines()
        assert sorted(listed) == [str(project / "data" / "value.txt"), str(project / "train.py")]

        (project / "data" / "value.txt").write_text("4.25")  # a new size: copied again
        again = run("--sync")
        assert again.returncode == 0, again.stderr
        assert f"--sync {project} -> {node1.ip}: 1 of 2 files" in again.stderr
        assert f"[{node1.ip} rank1] sum 8.5" in again.stdout
        cluster.assert_nothing_left()


def worker_pids(cluster, node: str, script: str) -> list[int]:
    """The training processes (``python -u script``) running in ``node``."""
    pids = []
    for pid in cluster.processes_in(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1] == b"-u" and argv[2].endswith(script.encode()):
            pids.append(pid)
    return pids


def start_sleepers(cluster, *args: str) -> subprocess.Popen:
    launcher = cluster.popen_in("node0", launch_argv(cluster, *args, str(SCRIPTS / "sleeper.py")),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ready = 0
    while ready < 2:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        ready += "ready" in line
    return launcher


@pytest.mark.timeout(150)
def test_a_killed_remote_rank_stops_every_host(cluster):
    node1 = cluster.nodes[1]
    launcher = start_sleepers(cluster)
    (victim,) = worker_pids(cluster, "node1", "sleeper.py")
    os.kill(victim, signal.SIGKILL)
    assert launcher.wait(timeout=60) == 137
    err = launcher.stderr.read()
    assert f"rank 1 on {node1.ip}" in err and "SIGKILL" in err
    cluster.assert_nothing_left()


@pytest.mark.timeout(150)
def test_a_host_losing_power_ends_the_job_naming_it(cluster):
    """No FIN, no RST: only ssh's keep-alives can tell; the job must not wait forever."""
    node1 = cluster.nodes[1]
    launcher = start_sleepers(cluster)
    cluster.power_off("node1")
    code = launcher.wait(timeout=90)
    assert code == 255
    assert f"lost the ssh connection to {node1.ip} (node 1)" in launcher.stderr.read()
    cluster.assert_nothing_left()


@pytest.mark.timeout(270)
def test_a_different_torch_on_one_host_is_reported_before_launch(tmp_path):
    """node1's python imports a torch whose version file says otherwise."""
    if skip_reason():
        pytest.skip(skip_reason())
    import torch

    version_py = Path(torch.__file__).parent / "version.py"
    other = tmp_path / "version.py"
    other.write_text(version_py.read_text().replace(torch.__version__, "2.99.0"))
    with Cluster(2, binds={"node1": {str(version_py): str(other)}}) as cluster:
        node0, node1 = cluster.nodes
        doctor = doctor_on_node0(cluster)
        run = run_on_node0(cluster, str(SCRIPTS / "sleeper.py"))
        assert doctor.returncode == 1
        assert f"torch 2.99.0 (vs {torch.__version__} on {node0.ip})" in doctor.stdout
        assert run.returncode == 2
        assert f"{node1.ip}: torch 2.99.0 (vs {torch.__version__} on {node0.ip}); fix: install the same" in run.stderr
        assert "Traceback" not in run.stderr
        cluster.assert_nothing_left()


@pytest.mark.timeout(150)
def test_hostfile_slots_and_c10d_rendezvous(cluster, tmp_path):
    """node0 slots=2, node1 slots=1: three ranks numbered by host order; then c10d."""
    node0, node1 = cluster.nodes
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# the lab\nroot@{node0.ip} slots=2\n\nroot@{node1.ip} slots=1  # the small one\n")
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "disttrain", "run", "--hostfile", str(hostfile), *ssh_options(cluster),
            str(SCRIPTS / "ranks_report.py"), str(out)]
    result = cluster.run_in("node0", argv, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
    assert {r: rec["world_size"] for r, rec in ranks.items()} == {0: 3, 1: 3, 2: 3}
    assert f"[{node1.ip} rank2] hello from rank 2" in result.stdout
    for p in out.glob("rank*.json"):
        p.unlink()
    # -n auto: each host says how many it takes (one per GPU, else one per two cores)
    c10d = run_on_node0(cluster, "--rdzv-backend", "c10d", str(SCRIPTS / "ranks_report.py"), str(out), nproc="auto")
    assert c10d.returncode == 0, c10d.stderr
    world = 2 * auto_nproc(cuda_devices=0, cpus=usable_cpus())
    ranks = read_ranks(out)
    assert set(ranks) == set(range(world))
    assert all(rec["sum"] == world * (world + 1) / 2 for rec in ranks.values())
    cluster.assert_nothing_left()
