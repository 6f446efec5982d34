"""``disttrain run --launcher slurm`` on a real Slurm: two nodes in network namespaces.

slurmctld, munged and node0's slurmd run in node0, node1's slurmd in node1; the launcher
runs in node0 (the "login node"), as a user would run it there. One daemon set per module.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, read_ranks
from slurm_rig import slurm_fixture, wait_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mnist_convnet.py"
# 94 steps of 32 per rank: long enough to requeue the job in the middle of its epoch.
MNIST_ARGS = ["--samples", "6000", "--batch-size", "32", "--log-every", "0", "--seed", "3"]

slurm = slurm_fixture(2)


def disttrain_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "disttrain", "run", *args]


def slurm_run(slurm, *args: str, timeout: float = 150, home: Path):
    return slurm.run_in("node0", disttrain_argv("--launcher", "slurm", *args), timeout=timeout, cwd=ROOT,
                        env=slurm.env(DISTTRAIN_HOME=str(home)))


def run_dir_of(stderr: str) -> Path:
    return Path(re.search(r"logs: (\S+); Ctrl-C", stderr)[1])


def job_id_of(stderr: str) -> str:
    return re.search(r"submitted Slurm job (\d+)", stderr)[1]


def summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1].split("] ", 1)[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The example on one host, 2 processes: the loss and weights every Slurm run must reach."""
    out = tmp_path_factory.mktemp("reference")
    result = subprocess.run(disttrain_argv("-n", "2", "--ranks", "0", "--env", "OMP_NUM_THREADS=1", str(EXAMPLE),
                                           *MNIST_ARGS, "--output-dir", str(out)),
                            capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return summary(result.stdout), torch.load(out / "model.pt", weights_only=True)


def assert_same_weights(path: Path, expected: dict) -> None:
    weights = torch.load(path, weights_only=True)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(300)
def test_mnist_on_two_slurm_nodes_reaches_the_loss_of_one_host(slurm, reference, tmp_path):
    expected, weights = reference
    result = slurm_run(slurm, "--nodes", "2", "--ranks", "0", "--env", "OMP_NUM_THREADS=1", str(EXAMPLE),
                       *MNIST_ARGS, "--output-dir", str(tmp_path / "out"), home=tmp_path)
    assert result.returncode == 0, result.stderr
    got = summary(result.stdout)
    assert got["world_size"] == expected["world_size"] == 2  # -n auto: one per two cores, on each node
    assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-6)
    assert got["val_accuracy"] == pytest.approx(expected["val_accuracy"], abs=1e-9)
    assert_same_weights(tmp_path / "out" / "model.pt", weights)
    # the master was found on node0, at its address toward node1 (never 127.0.0.1)
    node0 = slurm.rig.nodes[0].ip
    assert re.search(rf"2 workers \(gloo\) on node0, node1 \(Slurm job \d+\), rendezvous {re.escape(node0)}:",
                     result.stderr), result.stderr
    run_dir = run_dir_of(result.stderr)
    assert (run_dir / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert slurm.job_state(job_id_of(result.stderr)) == "COMPLETED"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [n["env"]["GLOO_SOCKET_IFNAME"] for n in plan["nodes"]] == ["eth1", "eth1"]
    slurm.assert_nothing_left()


SECRET = "s3cr3t-Slurm-Value-41d7"  # a value no other file or process on the machine holds


def env_report_run(slurm, tmp_path, *extra: str):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = slurm.env(DISTTRAIN_HOME=str(tmp_path / "home"), DT_OUT_DIR="/shared/x", DT_SECRET=SECRET,
                    HOSTNAME="launcher-marker", PWD="/launcher-pwd-marker")
    result = slurm.run_in("node0", disttrain_argv("--launcher", "slurm", "--nodes", "2", "-n", "1", *extra,
                                                  "--env", "DT_SET=from-flag", str(SCRIPTS / "env_report.py"), str(out)),
                          timeout=150, cwd=ROOT, env=env)
    return result, read_ranks(out, prefix="env")


@pytest.mark.timeout(200)
def test_the_environment_rule_holds_under_slurm_and_secrets_stay_off_disk(slurm, tmp_path):
    # --env DT_SECRET (the shell's value) puts the secret in the launch spec that the batch job carries.
    result, ranks = env_report_run(slurm, tmp_path, "--env", "DT_SECRET")
    assert result.returncode == 0, result.stderr
    remote = ranks[1]
    assert remote["out_dir"] == "/shared/x" and remote["set_by_env_flag"] == "from-flag"
    assert remote["hostname"] != "launcher-marker" and remote["pwd"] != "/launcher-pwd-marker"
    assert remote["home"] == str(Path.home()) and remote["path"]  # the node's own account variables
    assert remote["secret_sha"] == hashlib.sha256(SECRET.encode()).hexdigest()
    assert remote["secret_in_argv_of"] == [] and ranks[0]["secret_in_argv_of"] == []
    assert SECRET not in result.stdout and SECRET not in result.stderr
    run_dir = run_dir_of(result.stderr)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert (run_dir / "plan.json") in files and not [p for p in files if SECRET.encode() in p.read_bytes()]
    slurm.assert_nothing_left()


@pytest.mark.timeout(200)
def test_no_forward_env_under_slurm(slurm, tmp_path):
    result, ranks = env_report_run(slurm, tmp_path, "--no-forward-env")
    assert result.returncode == 0, result.stderr
    assert ranks[1]["out_dir"] is None and ranks[1]["secret_sha"] is None
    assert ranks[1]["set_by_env_flag"] == "from-flag" and ranks[1]["path"]
    slurm.assert_nothing_left()


@pytest.mark.timeout(200)
def test_a_failing_rank_fails_the_slurm_job_with_the_root_cause(slurm, tmp_path):
    result = slurm_run(slurm, "--nodes", "2", str(SCRIPTS / "fail_rank1.py"), home=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "disttrain: rank 1 on node1 exited with code 3" in result.stderr
    assert "ValueError: rank one cannot go on: bad shard 17" in result.stderr
    assert slurm.job_state(job_id_of(result.stderr)) == "FAILED"
    slurm.assert_nothing_left()


@pytest.mark.timeout(200)
def test_ctrl_c_cancels_the_slurm_job(slurm, tmp_path):
    launcher = slurm.popen_in("node0", disttrain_argv("--launcher", "slurm", "--nodes", "2", str(SCRIPTS / "sleeper.py")),
                              cwd=ROOT, env=slurm.env(DISTTRAIN_HOME=str(tmp_path)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = 0
    while ready < 2:  # both nodes' ranks are running: their lines came through slurm.out
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        ready += "ready" in line
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=90) == 130
    err = launcher.stderr.read()
    job = job_id_of(err)
    assert f"disttrain: got SIGINT, cancelled Slurm job {job}" in err
    assert slurm.job_state(job) == "CANCELLED"
    slurm.assert_nothing_left()


@pytest.mark.timeout(300)
def test_a_requeued_job_resumes_from_its_checkpoint(slurm, reference, tmp_path):
    """Slurm requeues the job mid-epoch (as on preemption): it runs again and carries on from
    the newest checkpoint, ending with the weights of the run that never stopped."""
    _, weights = reference
    out = tmp_path / "out"
    launcher = slurm.popen_in(
        "node0",
        disttrain_argv("--launcher", "slurm", "--nodes", "2", "--requeue", "--ranks", "0", "--checkpoint-every", "10",
                       "--env", "OMP_NUM_THREADS=1", str(EXAMPLE), *MNIST_ARGS, "--output-dir", str(out)),
        cwd=ROOT, env=slurm.env(DISTTRAIN_HOME=str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = tmp_path / "runs"
    checkpoints = wait_for(lambda: next(runs.glob("*/checkpoints"), None), 120, "the checkpoint folder")
    wait_for(lambda: list(checkpoints.glob("step_*/COMPLETE")), 120, "the first checkpoint", interval=0.05)
    job = (next(runs.iterdir()) / "slurm_job_id").read_text().strip()
    requeue = slurm.run_in("node0", ["scontrol", "requeue", job])
    assert requeue.returncode == 0, requeue.stderr
    stdout, stderr = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, stderr
    resumed = re.search(r"\[node0 rank0\] disttrain: resuming from step (\d+)", stderr)
    assert resumed and int(resumed[1]) > 0, stderr
    assert f"Slurm requeued job {job} (restart 1)" in stderr
    assert_same_weights(out / "model.pt", weights)
    assert slurm.job_state(job) == "COMPLETED"
    slurm.assert_nothing_left()


@pytest.mark.timeout(200)
def test_inside_salloc_disttrain_run_uses_the_allocation(slurm, tmp_path):
    """A user's own allocation: plain `disttrain run -n auto` finds both nodes in its environment."""
    out = tmp_path / "out"
    out.mkdir()
    result = slurm.run_in("node0", ["salloc", "--nodes=2", "--exclusive", *disttrain_argv(
        "-n", "auto", str(SCRIPTS / "ranks_report.py"), str(out))], timeout=150, cwd=ROOT,
        env=slurm.env(DISTTRAIN_HOME=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
    assert set(ranks) == {0, 1}
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 and r["ifname"] == "eth1" for r in ranks.values())
    assert "[node1 rank1] hello from rank 1" in result.stdout
    assert re.search(rf"on node0, node1 \(Slurm job \d+\), rendezvous {re.escape(slurm.rig.nodes[0].ip)}:",
                     result.stderr)
    slurm.assert_nothing_left()


@pytest.mark.timeout(120)
def test_inside_a_job_step_a_run_is_local_on_the_steps_cpus(slurm, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = slurm.env(DISTTRAIN_HOME=str(tmp_path))
    env.pop("OMP_NUM_THREADS")  # so that it shows the CPUs the run planned with
    result = slurm.run_in("node0", ["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", *disttrain_argv(
        "-n", "auto", str(SCRIPTS / "ranks_report.py"), str(out))], timeout=100, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    (rank,) = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    assert rank["world_size"] == 1 and rank["omp"] == "1"  # the step's one CPU, not the node's two
    many = slurm.run_in("node0", ["srun", "--nodes=2", *disttrain_argv(str(SCRIPTS / "sleeper.py"))],
                        timeout=100, cwd=ROOT, env=env)
    assert many.returncode == 2
    assert "one of 2 tasks of a Slurm job step: run it once" in many.stderr
    slurm.assert_nothing_left()


@pytest.mark.timeout(120)
def test_a_job_pending_too_long_is_cancelled_with_the_reason(slurm, tmp_path):
    start = time.monotonic()
    result = slurm_run(slurm, "--pending-timeout", "2", "--sbatch-arg=--begin=now+1hour", str(SCRIPTS / "sleeper.py"),
                       home=tmp_path, timeout=60)
    assert time.monotonic() - start < 60
    assert result.returncode == 1
    job = job_id_of(result.stderr)
    assert f"Slurm job {job} was still pending after 2 s (reason: BeginTime); cancelled it" in result.stderr
    assert "Traceback" not in result.stderr
    slurm.assert_nothing_left()


@pytest.mark.timeout(120)
def test_no_wait_prints_the_job_id(slurm, tmp_path):
    result = slurm_run(slurm, "--no-wait", str(SCRIPTS / "ranks_report.py"), str(tmp_path), home=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip()
    assert job.isdigit()
    wait_for(lambda: slurm.job_state(job) == "COMPLETED", 90, f"job {job} to complete")
    assert json.loads((tmp_path / "rank0.json").read_text())["world_size"] == 1
    slurm.assert_nothing_left()
