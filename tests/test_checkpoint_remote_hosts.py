"""Three hosts with no checkpoint folder in common: the checkpoints live on ``s3://``, a moto server
process inside the first host's namespace on its bridge address (the root namespace has no route to
the rig, and each namespace's loopback is its own). The third host loses power; the other two
resume from the store, and every sample is trained once (bench/elastic.py's accounting). The
workers get the AWS variables with ``--env KEY`` (values taken from the launcher's environment,
never typed on a command line), and the secret appears in no output and no file of the run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import elastic_bench, stop_server
from rig import cluster_fixture

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "elastic_train.py"
SECRET = "s3cr3t-of-the-rig"
# 72 samples: 12 steps an epoch on 3 hosts, 18 on 2 (120 before: 50 steps of 0.2 s after the regroup, 29 now).
# The host is lost at step 6 of the first epoch, and the 2 hosts left cannot step without it until they
# regroup: fewer samples cannot let the job end before the loss is seen.
SAMPLES = 72
JOB = ["--samples", str(SAMPLES), "--epochs", "2", "--batch-size", "2", "--every", "4", "--pause", "0.2"]
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


bench = elastic_bench()
cluster3 = cluster_fixture(3, name="cluster3", bridge=True)

# Run inside node0: wait until the server answers, then do one thing on the store.
STORE = """
import sys, time, s3fs
fs = s3fs.S3FileSystem(skip_instance_cache=True)
deadline = time.monotonic() + 60
while True:
    try:
        fs.ls("")
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
if sys.argv[1] == "mkbucket":
    fs.mkdir(sys.argv[2])
else:
    for entry in sorted(fs.ls(sys.argv[2], detail=False)):
        print(entry.rsplit("/", 1)[-1], fs.exists(entry + "/COMPLETE"))
"""


@pytest.fixture
def store(cluster3, tmp_path):
    """moto_server in node0 on its bridge address, a bucket on it, and the AWS variables set; stopped after."""
    node0 = cluster3.nodes[0]
    env = {"AWS_ACCESS_KEY_ID": "rig", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{node0.ip}:9000"}
    server = Path(sys.executable).with_name("moto_server")
    log = open(tmp_path / "moto.log", "wb")
    proc = cluster3.popen_in("node0", [str(server), "-H", node0.ip, "-p", "9000"], stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        made = cluster3.run_in("node0", [sys.executable, "-c", STORE, "mkbucket", "rig"], timeout=90,
                               env={**bench.worker_env(), **env})
        assert made.returncode == 0, made.stderr[-2000:]
        yield env, proc
    finally:
        stop_server(proc)
        log.close()


def steps_on_store(cluster, env: dict) -> dict[str, bool]:
    listed = cluster.run_in("node0", [sys.executable, "-c", STORE, "ls", "rig/run"], timeout=90,
                            env={**bench.worker_env(), **env})
    assert listed.returncode == 0, listed.stderr[-2000:]
    return {name: whole == "True" for name, whole in (line.split() for line in listed.stdout.splitlines())}


@pytest.mark.timeout(500)
def test_a_host_lost_and_the_others_resume_from_s3_with_no_shared_folder(cluster3, store, tmp_path):
    store, server = store
    out = tmp_path / "out"
    out.mkdir()
    hosts = ",".join(f"root@{node.ip}" for node in cluster3.nodes)
    forwarded = [arg for key in AWS_KEYS for arg in ("--env", key)]
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "--nnodes", "2:3", "-n", "1",
            "--log-dir", str(tmp_path / "run"), *cluster3.cli_ssh_args(), *forwarded,
            str(WORKER), "--out", str(out), "--ckpt", "s3://rig/run", *JOB]
    # The survivors restart their workers (not the in-place regroup, which goes on from memory): what they
    # resume from is the store's newest checkpoint, read back over S3.
    proc = cluster3.popen_in("node0", argv, cwd=ROOT, env={**bench.worker_env(), **store, "DISTTRAIN_REGROUP": "restart"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 240
    while bench.step_of(out) < 6:  # a checkpoint every 4 steps: step 4's is on the store
        assert proc.poll() is None, f"the job ended early (exit {proc.returncode}):\n{proc.stderr.read()[-4000:]}"
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"step 6 not reached within 240 s:\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.2)
    cluster3.power_off("node2")
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not end within 300 s:\n{proc.communicate()[1][-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert f"{cluster3.nodes[2].ip} left" in line and "-> 2 hosts, world size 2, resumed from step " in line, line
    assert "restarted" in line and "regrouped in place" not in line, line
    accounting = bench.account(out, SAMPLES)
    assert accounting["attempts"][0]["world_size"] == 3 and accounting["attempts"][-1]["world_size"] == 2
    assert accounting["attempts"][-1]["first_step"] > 0  # from a checkpoint on the store, not from scratch
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    saved = steps_on_store(cluster3, store)
    assert saved and all(saved.values()) and len(saved) <= 3, saved  # keep_last=3, every one complete
    assert SECRET not in err
    for path in (tmp_path / "run").rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
    stop_server(server)
    cluster3.assert_nothing_left()
