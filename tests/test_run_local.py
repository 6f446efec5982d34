"""``disttrain run`` on this machine: real workers, gloo over loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import SCRIPTS, assert_all_gone, cli_env, descendants, disttrain, read_ranks

HOSTILE = ["a b", "c'd", 'e"f', "g;h", "$(touch /tmp/pwned)", "--flag=x y", "", "*"]


@pytest.mark.timeout(90)
def test_torchrun_script_runs_unchanged_with_prefixed_output_and_logs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    result = disttrain("run", "-n", "2", "--log-dir", str(logs), "--env", "DT_TEST_EXTRA=yes",
                       str(SCRIPTS / "ranks_report.py"), str(out), *HOSTILE)
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
    assert set(ranks) == {0, 1}
    for rank, rec in ranks.items():
        assert rec["world_size"] == 2 and rec["local_rank"] == rank
        assert rec["sum"] == 3.0  # all_reduce of 1 + 2 over gloo
        assert rec["argv"] == HOSTILE
        assert rec["backend"] == "gloo"
        assert rec["extra"] == "yes"
        assert rec["omp"] == "1"  # the test's OMP_NUM_THREADS is the user's and is kept
    assert "[rank0] hello from rank 0" in result.stdout
    assert "[rank1] hello from rank 1" in result.stdout
    assert "[rank1] warning line from rank 1" in result.stderr
    assert f"logs: {logs}" in result.stderr
    assert (logs / "attempt_0" / "rank1.stdout").read_text() == "hello from rank 1\n"
    assert "warning line from rank 1" in (logs / "attempt_0" / "rank1.stderr").read_text()
    assert not Path("/tmp/pwned").exists()


@pytest.mark.timeout(90)
def test_ranks_filter_shows_rank0_only_but_logs_all(tmp_path, home):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--ranks", "0", str(SCRIPTS / "ranks_report.py"), str(out))
    assert result.returncode == 0, result.stderr
    assert "[rank0] hello from rank 0" in result.stdout
    assert "rank 1" not in result.stdout
    (run_dir,) = (home / "runs").iterdir()
    assert f"logs: {run_dir}" in result.stderr
    assert (run_dir / "attempt_0" / "rank1.stdout").read_text() == "hello from rank 1\n"
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 2


@pytest.mark.timeout(60)
def test_module_launch(home):
    env = cli_env(PYTHONPATH=str(SCRIPTS))
    result = disttrain("run", "-n", "2", "-m", "dtpkg.entry", "x y", env=env)
    assert result.returncode == 0, result.stderr
    assert "[rank1] module rank 1 of 2 args ['x y']" in result.stdout


@pytest.mark.timeout(60)
def test_dry_run_prints_plan_and_starts_nothing(home):
    result = disttrain("run", "-n", "2", "--dry-run", str(SCRIPTS / "sleeper.py"), "--x", "1")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["world_size"] == 2 and plan["dist_backend"] == "gloo"
    assert plan["argv"][1:] == ["-u", str(SCRIPTS / "sleeper.py"), "--x", "1"]
    assert [w["env"]["RANK"] for w in plan["nodes"][0]["workers"]] == ["0", "1"]
    assert not (home / "runs").exists()


@pytest.mark.timeout(90)
def test_failing_rank_sets_exit_code_and_reports_root_cause(home):
    start = time.monotonic()
    result = disttrain("run", "-n", "2", str(SCRIPTS / "fail_rank1.py"), timeout=60)
    assert result.returncode == 3, result.stderr
    report = result.stderr[result.stderr.index("disttrain: rank 1"):]
    assert report.startswith("disttrain: rank 1 on ") and "exited with code 3" in report
    assert "ValueError: rank one cannot go on: bad shard 17" in report
    assert "rank1.stderr" in report
    # rank 0 was sleeping for 600 s: it was stopped, not waited for
    assert time.monotonic() - start < 60
    pids = [int(line.split()[2]) for line in result.stdout.splitlines() if " pid " in line]
    assert len(pids) == 2
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_every_worker(home, sig, code):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "-n", "2", str(SCRIPTS / "sleeper.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
    )
    try:
        ready = 0
        while ready < 2:  # both workers are up and have printed
            line = launcher.stdout.readline()
            assert line, launcher.stderr.read()
            ready += "ready" in line
        tree = descendants(launcher.pid)
        assert len([p for p in tree if "sleeper.py" in " ".join(p.cmdline())]) == 2
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == code
        assert_all_gone(tree)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()
