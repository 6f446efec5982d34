"""A rank that exits 0 while the others still call collectives breaks the job: the failure block
names it, not the peer that then lost its connection, on any number of instances (issue 27), and
the terminal shows no C++ frame dump (the logs keep them)."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import SCRIPTS, cli_env, disttrain


@pytest.mark.timeout(150)
def test_a_two_instance_job_names_the_rank_that_left_early(tmp_path):
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    spec = tmp_path / "early.yaml"
    spec.write_text(yaml.safe_dump({"name": "early", "entry_point": "early_exit_rank1.py", "source_dir": str(SCRIPTS),
                                    "instance_count": 2, "processes_per_instance": 1}))
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    causes = [line for line in result.stderr.splitlines() if line.startswith("disttrain: rank")]
    expected = ("disttrain: rank 1 on algo-2 exited with code 0 while the other ranks were still running, and the "
                "job broke: rank 0 then exited with code 1 because it lost its peer")
    assert causes and causes[0].startswith(expected), result.stderr[-3000:]
    assert "frame #" not in result.stderr + result.stdout
    assert "steps/s per host" not in result.stderr
    record = json.loads(disttrain("jobs", "show", "1", "--json", env=env).stdout)
    assert record["failure"].startswith(expected)
