"""``disttrain bench --hosts`` and the ResNet-18 example on two hosts (the netns rig)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rig import cluster_fixture

ROOT = Path(__file__).resolve().parent.parent
RESNET = ROOT / "examples" / "resnet18_stl10.py"

cluster = cluster_fixture(2)


@pytest.mark.timeout(240)
def test_bench_the_resnet_example_across_two_hosts(cluster):
    """The AWS tutorial's shape, 2 nodes, from one command: each count runs on both hosts."""
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    ssh = cluster.cli_ssh_args()
    argv = [sys.executable, "-m", "disttrain", "bench", str(RESNET), "--hosts", hosts, *ssh,
            "-n", "1", "--global-batch", "16", "--steps", "2", "--warmup", "1", "--json",
            "--env", "OMP_NUM_THREADS=1",
            "--", "--samples", "64", "--val-samples", "20", "--epochs", "1", "--log-every", "0"]
    result = cluster.run_in("node0", argv, timeout=220, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["hosts"]) == 2
    (entry,) = data["results"]
    assert entry["nproc"] == 1 and entry["world_size"] == 2 and entry["batch_per_process"] == 8
    assert entry["samples_per_s"] > 0 and entry["error"] is None
    # the runtime's step timer once the prepared loader calls it, else the example's summary
    assert entry["source"] in ("step-timer", "script-summary")
    assert data["recommendation"]["nproc"] == 1
    # first, when the two runs of the count were far apart on a busy machine: that they are noise
    assert any(reason.startswith("1 process per host (2 in all): the most samples/s")
               for reason in data["recommendation"]["reasons"])
    assert len(entry["runs"]) == 2 and entry["others_cores"] == []  # --repeat 2; other hosts' load unknown
