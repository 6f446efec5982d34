"""An elastic job in the field: namespace hosts (tests/rig.py) with busy loops beside the job, as
a loaded machine is. What a user checks: the job ends 0, every sample trained once (bench/elastic.py's
accounting), the late hosts let in, and membership.json true to what happened -- each round's
world is its hosts' (one worker each), every restart says why, "in place" only where the
survivors' processes are the ones they were."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_elastic import wait_for

from conftest import elastic_bench
from rig import cluster_fixture

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "elastic_train.py"
SAMPLES = 480
JOB = ["--samples", str(SAMPLES), "--epochs", "2", "--batch-size", "2", "--every", "8", "--pause", "0.2"]
HOG = 4  # busy loops beside the job (2 cores here: a load of 6 or more with the job's own)

bench = elastic_bench()
cluster4 = cluster_fixture(4, name="cluster4", bridge=True)

pytestmark = [pytest.mark.slow, pytest.mark.rig, pytest.mark.field]


@contextmanager
def cpu_hog(n: int = HOG):
    """``n`` busy loops for the block's length, ended (and reaped) after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _check_record(record: list[dict], out: Path) -> None:
    """Every entry true: world size = its hosts (-n 1), a restart says why, "in place" kept the pids."""
    for entry in record:
        if entry["world_size"] is not None:
            assert entry["world_size"] == len(entry["hosts"]), entry
        assert not any(h in (entry.get("waiting") or []) for h in entry["hosts"]), entry
        assert "Warning" not in entry["why"] and "Warning" not in (entry.get("path_why") or ""), entry
        if entry["change"] != "start" and entry["path"] == "restart":
            assert entry["path_why"], entry


@pytest.mark.timeout(600)
def test_two_hosts_booting_late_under_load_all_train_and_the_record_is_true(cluster4, tmp_path):
    """``--nnodes 2:4`` on 4 hosts, two of them down at the start and booting 10 s apart, busy
    loops beside: a round of all 4 trains, no sample lost or trained twice but as the runtime says."""
    out, ckpt, run = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    hosts = ",".join(f"root@{node.ip}" for node in cluster4.nodes)
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "--nnodes", "2:4", "-n", "1",
            "--log-dir", str(run), *cluster4.cli_ssh_args(), str(WORKER), "--out", str(out), "--ckpt", str(ckpt), *JOB]
    cluster4.power_off("node2")
    cluster4.power_off("node3")
    with cpu_hog():
        proc = cluster4.popen_in("node0", argv, cwd=ROOT, env=bench.worker_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        wait_for(proc, lambda: bench.step_of(out) >= 2, timeout=300)
        cluster4.power_on("node2")
        time.sleep(10)
        cluster4.power_on("node3")
        try:
            _, err = proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"the job did not end:\n{proc.communicate()[1][-4000:]}") from None
    assert proc.returncode == 0, err[-4000:]
    accounting = bench.account(out, SAMPLES)
    assert accounting["attempts"][0]["world_size"] == 2
    assert max(a["world_size"] for a in accounting["attempts"]) == 4, accounting["attempts"]
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    record = json.loads((run / "membership.json").read_text())
    _check_record(record, out)
    joined = [c for c in record if c["change"] == "joined"]
    assert {c["host"] for c in joined} == {cluster4.nodes[2].ip, cluster4.nodes[3].ip}, record
    assert "Traceback" not in err, err[-4000:]
    print("late hosts under load:", json.dumps([{k: c[k] for k in ("change", "host", "world_size", "path",
                                                                    "path_why", "seconds")} for c in record]))
    cluster4.assert_nothing_left()
