"""Restarts start from a clean store: a torchrun-style script (its own init_process_group)
restarted by --max-restarts finds none of the keys its first attempt wrote, and the restarted
group forms (gloo's stale addresses used to fail it with "Connection refused" or hang it)."""

from __future__ import annotations

import pytest
from test_multinode import run_on_node0

from conftest import SCRIPTS, cli_env, disttrain, read_ranks
from rig import cluster_fixture

cluster = cluster_fixture(2)
SCRIPT = str(SCRIPTS / "store_keys_restart.py")


def assert_clean_restart(out, ranks: set[int]) -> None:
    seen = read_ranks(out, prefix="attempt1_rank")
    assert set(seen) == ranks, "the restarted attempt did not run on every rank"
    assert all(s == {"group": False, "direct": False} for s in seen.values()), seen
    assert set(read_ranks(out, prefix="attempt0_rank")) == ranks


@pytest.mark.timeout(150)
def test_restarted_script_sees_no_stale_key_on_one_host(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--max-restarts", "1", SCRIPT, str(out),
                       env=cli_env(DISTTRAIN_HOME=str(tmp_path)), timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_clean_restart(out, {0, 1})


@pytest.mark.timeout(200)
def test_restarted_script_sees_no_stale_key_across_hosts(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_on_node0(cluster, "--max-restarts", "1", SCRIPT, str(out), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_clean_restart(out, {0, 1})
    cluster.assert_nothing_left()
