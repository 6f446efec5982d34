"""``disttrain run --launcher slurm`` on a one-node Slurm that talks over loopback only."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from test_cli_input import assert_usage_error

from conftest import SCRIPTS, read_ranks
from slurm_rig import slurm_fixture

ROOT = Path(__file__).resolve().parent.parent

slurm1 = slurm_fixture(1, name="slurm1")


def run_on_slurm(slurm, *args: str, home: Path, timeout: float = 120):
    argv = [sys.executable, "-m", "disttrain", "run", "--launcher", "slurm", *args]
    return slurm.run_in("node0", argv, timeout=timeout, cwd=ROOT, env=slurm.env(DISTTRAIN_HOME=str(home)))


@pytest.mark.timeout(150)
def test_two_ranks_on_one_slurm_node_over_loopback(slurm1, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_on_slurm(slurm1, "-n", "2", str(SCRIPTS / "ranks_report.py"), str(out), "a b", home=tmp_path)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
    assert set(ranks) == {0, 1}
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 and r["argv"] == ["a b"] for r in ranks.values())
    assert all(r["ifname"] is None for r in ranks.values())  # one node: loopback, no interface to pin
    assert "[rank1] hello from rank 1" in result.stdout
    assert "[rank0] warning line from rank 0" in result.stderr
    run_dir = Path(re.search(r"logs: (\S+); Ctrl-C", result.stderr)[1])
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["master_addr"] == "127.0.0.1" and plan["nodes"][0]["name"] == "node0"
    assert "hello from rank 1" in (run_dir / "attempt_0" / "rank1.stdout").read_text()
    slurm1.assert_nothing_left()


@pytest.mark.timeout(60)
def test_sbatch_refusing_the_job_is_one_line_and_leaves_no_run_folder(slurm1, tmp_path):
    result = run_on_slurm(slurm1, "--partition", "nope", str(SCRIPTS / "sleeper.py"), home=tmp_path)
    assert_usage_error(result, "sbatch refused the job:", "nvalid partition")
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(120)
def test_a_job_that_fails_without_output_says_so(slurm1, tmp_path):
    """Its output would go to a folder missing on the node, so Slurm cannot even start it:
    the launcher ends, non-zero, saying where to look."""
    result = run_on_slurm(slurm1, "-n", "2", "--sbatch-arg=--output=/nonexistent/x.out",
                          "--sbatch-arg=--error=/nonexistent/x.err", str(SCRIPTS / "fail_rank1.py"), home=tmp_path)
    assert result.returncode not in (0, 2), result.stderr
    job = re.search(r"submitted Slurm job (\d+)", result.stderr)[1]
    assert f"disttrain: Slurm job {job} ended FAILED (JobLaunchFailure) without any output" in result.stderr
    assert f"scontrol show job {job}" in result.stderr
    slurm1.assert_nothing_left()
