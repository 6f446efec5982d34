"""``--launcher slurm --nnodes MIN:MAX``: a node lost from an allocation (a namespace Slurm cluster,
tests/slurm_rig.py), under sbatch and under salloc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_rig import (  # noqa: F401 (field_load: the autouse fixture)
    JOB,
    ROOT,
    WORKER,
    bench,
    field_load,
    finish,
    nothing_of_the_job_left,
    record_of,
    wait_for,
)
from slurm_rig import slurm_fixture

slurm3 = slurm_fixture(3, scope="function", name="slurm3")
slurm4 = slurm_fixture(4, scope="function", name="slurm4")


@pytest.mark.timeout(500)
def test_a_slurm_node_that_loses_power_is_left_behind(slurm3, tmp_path):
    """``--launcher slurm --nnodes 2:3``: sbatch --nodes=2-3 --no-kill; the node cut off is noticed by its
    agent's silence (srun says nothing), the allocation goes on with the other two."""
    out, ckpt, run = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    argv = [sys.executable, "-m", "disttrain", "run", "--launcher", "slurm", "--nnodes", "2:3", "-n", "1",
            "--log-dir", str(run), str(WORKER), "--out", str(out), "--ckpt", str(ckpt), *JOB]
    proc = slurm3.popen_in("node0", argv, cwd=ROOT, env=slurm3.env(PYTHONPATH=bench.worker_env()["PYTHONPATH"]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    wait_for(proc, lambda: bench.complete_checkpoints(ckpt) and bench.step_of(out) >= 6, timeout=300)
    assert "#SBATCH --nodes=2-3\n#SBATCH --no-kill\n" in (run / "job.sbatch").read_text()
    slurm3.rig.power_off("node2")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith("disttrain: membership: node2 left (its agent said nothing for 5 s) -> 2 hosts, "
                           "world size 2, resumed from step "), line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][0]["world_size"] == 3 and accounting["attempts"][-1]["world_size"] == 2
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"] == 0, accounting
    assert [c["change"] for c in record_of(tmp_path)] == ["start", "left"]
    nothing_of_the_job_left(slurm3)


@pytest.mark.timeout(500)
def test_the_allocations_first_node_lost_under_salloc_is_a_loss_like_any_other(slurm4, tmp_path):
    """``salloc --no-kill`` on a login host (node0, outside the allocation): the launcher runs there and
    holds the store; the allocation's first node (node1, once the store's host) is powered off: the
    other two go on, no sample lost. (Under sbatch the launcher is the batch step, on the first node:
    its loss is the launcher's -- Slurm's batch host -- and ends the job, as any launcher's does.)"""
    out, ckpt, run = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    argv = ["salloc", "--nodes=3", "--exclude=node0", "--no-kill", sys.executable, "-m", "disttrain", "run",
            "--nnodes", "2:3", "-n", "1", "--log-dir", str(run), str(WORKER), "--out", str(out), "--ckpt", str(ckpt),
            *JOB]
    proc = slurm4.popen_in("node0", argv, cwd=ROOT, env=slurm4.env(PYTHONPATH=bench.worker_env()["PYTHONPATH"]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    wait_for(proc, lambda: bench.complete_checkpoints(ckpt) and bench.step_of(out) >= 6, timeout=300)
    slurm4.rig.power_off("node1")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith("disttrain: membership: node1 left (") and "-> 2 hosts, world size 2, resumed from step " \
        in line, line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][0]["world_size"] == 3 and accounting["attempts"][-1]["world_size"] == 2
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert [c["change"] for c in record_of(tmp_path)] == ["start", "left"]
    print(f"recovery (the allocation's first node): {record_of(tmp_path)[1]['seconds']} s; {line}")
    nothing_of_the_job_left(slurm4)
