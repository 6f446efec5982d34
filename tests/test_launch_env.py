"""The environment rule across hosts (real sshd in network namespaces): what the launching
shell exports reaches the remote ranks, host- and session-specific variables do not, the
opt-out works, and a secret's value is in no file of the run folder, on no terminal and on no
command line."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_multinode import ROOT, launch_argv

from conftest import SCRIPTS, read_ranks
from rig import cluster_fixture

cluster = cluster_fixture(2)
SECRET = "s3cr3t-Value-9f2c1e"  # a value no other file or process on the machine holds


def run_env_report(cluster, tmp_path, *extra: str):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    home = tmp_path / "home"
    env = {**os.environ, "DT_OUT_DIR": "/shared/x", "DT_SECRET": SECRET, "HOSTNAME": "launcher-marker",
           "PWD": "/launcher-pwd-marker", "DISTTRAIN_HOME": str(home)}
    argv = launch_argv(cluster, *extra, "--env", "DT_SET=from-flag", str(SCRIPTS / "env_report.py"), str(out))
    result = subprocess.run(cluster.ns_exec("node0", argv), env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=150, stdin=subprocess.DEVNULL)
    return result, read_ranks(out, prefix="env"), home


@pytest.mark.timeout(200)
def test_exported_variables_reach_the_remote_rank_but_host_specific_ones_do_not(cluster, tmp_path):
    result, ranks, home = run_env_report(cluster, tmp_path)
    assert result.returncode == 0, result.stderr
    assert set(ranks) == {0, 1}
    remote = ranks[1]
    assert remote["ssh_connection"], "rank 1 should run on the second host, over ssh"
    assert remote["out_dir"] == "/shared/x"  # exported in the launching shell: it follows the job
    assert remote["set_by_env_flag"] == "from-flag"
    assert remote["hostname"] != "launcher-marker"  # host-specific: not forwarded
    assert remote["pwd"] != "/launcher-pwd-marker"  # session-specific: not forwarded
    # The secret arrived (its hash matches) ...
    assert remote["secret_sha"] == hashlib.sha256(SECRET.encode()).hexdigest()
    # ... on no command line of any process on the machine while the job ran,
    assert remote["secret_in_argv_of"] == [] and ranks[0]["secret_in_argv_of"] == []
    # not on the terminal,
    assert SECRET not in result.stdout and SECRET not in result.stderr
    # and in no file of the run folder (plan.json names the variable without its value).
    run_dir = Path(result.stderr.split("logs: ")[1].split()[0])
    assert run_dir.is_relative_to(home) and (run_dir / "plan.json").exists()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files and not [p for p in files if SECRET.encode() in p.read_bytes()]
    assert '"DT_SECRET"' in (run_dir / "plan.json").read_text()
    cluster.assert_nothing_left()


@pytest.mark.timeout(200)
def test_no_forward_env_keeps_the_shell_to_itself(cluster, tmp_path):
    result, ranks, _ = run_env_report(cluster, tmp_path, "--no-forward-env")
    assert result.returncode == 0, result.stderr
    assert ranks[1]["out_dir"] is None and ranks[1]["secret_sha"] is None
    assert ranks[1]["set_by_env_flag"] == "from-flag"  # --env still applies
    cluster.assert_nothing_left()


@pytest.mark.timeout(60)
def test_dry_run_names_forwarded_variables_without_values(tmp_path):
    env = {**os.environ, "DT_SECRET": SECRET, "DISTTRAIN_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "disttrain", "run", "--dry-run", "--env", f"API_TOKEN={SECRET}x",
                             str(SCRIPTS / "env_report.py"), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout and '"API_TOKEN"' in result.stdout
