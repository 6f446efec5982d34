"""A rank that dies by SIGABRT after its script returned (torch's teardown at exit) is a finished rank;
one that dies by SIGABRT while its script still ran fails the run. Both provoked deterministically
(tests/scripts/abort_at_exit.py), on the c10d rendezvous path and in a recorded job."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import SCRIPTS, cli_env, disttrain

pytestmark = pytest.mark.timeout(150)
SCRIPT = str(SCRIPTS / "abort_at_exit.py")


def test_abort_after_the_script_returned_is_finished(tmp_path):
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), OUT=str(tmp_path))
    result = disttrain("run", "-n", "2", "--rdzv-backend", "c10d", SCRIPT, "after", env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "counted as finished" in line]
    assert len(said) == 1 and said[0].startswith("disttrain: rank 1 finished its script, then died by SIGABRT in "
                                                 "torch's teardown at exit (exit code -6"), result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank*.done")) == ["rank0.done", "rank1.done"]


def test_abort_while_the_script_ran_fails(tmp_path):
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), OUT=str(tmp_path))
    result = disttrain("run", "-n", "2", "--rdzv-backend", "c10d", SCRIPT, "during", env=env, timeout=120)
    assert result.returncode != 0
    assert "counted as finished" not in result.stderr
    assert "rank 1 on" in result.stderr and "SIGABRT" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "rank1.done").exists()


@pytest.mark.parametrize("when, state", [("after", "Completed"), ("during", "Failed")])
def test_a_job_whose_rank_aborts(tmp_path, when, state):
    """Two instances: the job is Completed when rank 1 aborted after its script returned, Failed when
    it aborted before."""
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"),
                  OUT=str(tmp_path))
    spec = tmp_path / "abort.yaml"
    spec.write_text(yaml.safe_dump({"name": "abort", "entry_point": "abort_at_exit.py", "source_dir": str(SCRIPTS),
                                    "instance_count": 2, "processes_per_instance": 1,
                                    "env": {"OUT": str(tmp_path), "WHEN": when}}))
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    record = json.loads(disttrain("jobs", "show", "1", "--json", env=env).stdout)
    assert record["state"] == state, result.stderr[-3000:]
    assert ("counted as finished" in result.stderr) == (when == "after")
