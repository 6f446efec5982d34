"""No silent hang for any script (issue 24), with real processes and plain torchrun scripts (no
``import disttrain``): a verdict from every rank's Flight Recorder and stack, on one host and
across two (real sshd in network namespaces); a host cut off mid-run stops on its own; and
nothing a worker starts, in any session, outlives the job."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_multinode import ROOT, launch_argv, run_on_node0

from conftest import SCRIPTS, assert_all_gone, cli_env, descendants
from disttrain import torchcompat
from disttrain.agent import flight
from rig import cluster_fixture
from slurm_rig import slurm_fixture

PLAIN = SCRIPTS / "plain_hang.py"
GIL = SCRIPTS / "plain_gil.py"
# --hang-timeout of the hang tests (5 s, as test_launch_diagnostics gives its hang across hosts): its clock
# is armed only once a rank moved (agent/watchdog.py's freshest(), policies.HangWatch), so a slow start-up
# cannot trip it, and until the branch each rank moves every 0.2 s. The waits for the verdict and the exit
# (RUN_WAIT_S, ACROSS_WAIT_S) stay what they were with 10 s.
HANG_S = 5
RUN_WAIT_S = 40
ACROSS_WAIT_S = 70


def hang_line(case: str, script: Path = PLAIN) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if f"# HANG: {case}" in line)


def run_hang(case: str, nproc: int = 2, script: Path = PLAIN) -> tuple[int, str, Path]:
    """``disttrain run --hang-timeout`` of plain_hang.py CASE: it must end with exit 124 within
    RUN_WAIT_S of the hang (once every rank is at the branch), leaving nothing behind."""
    assert "import disttrain" not in script.read_text()  # a plain script
    launcher = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "-n", str(nproc), "--hang-timeout", str(HANG_S), str(script),
         *([case] if script == PLAIN else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        for _ in range(nproc):
            assert "at the branch" in launcher.stdout.readline()
        workers = descendants(launcher.pid)
        _, err = launcher.communicate(timeout=RUN_WAIT_S)
        assert_all_gone(workers)
    finally:
        launcher.kill()
        launcher.wait()
    return launcher.returncode, err, Path(err.split("logs: ")[1].split()[0])


# A plain script's progress is its collectives, read from gloo's recorder through torch's worker server.
needs_gloo_recorder = pytest.mark.skipif(
    flight.CPU_FR_HANDLER not in torchcompat.worker_handlers(),
    reason=f"torch {torchcompat.torch_version()} serves no gloo recorder: said in one line (tests/test_compat.py)")


@needs_gloo_recorder
@pytest.mark.timeout(120)
def test_a_collective_mismatch_ends_in_a_verdict_naming_both_ranks_and_ops(home):
    code, err, run_dir = run_hang("op")
    assert code == 124, err
    assert ("cause: a mismatch in collective #6 of the default group: rank 0 called all_reduce [4] Float; "
            "rank 1 called all_gather [4] Float -> [2, 4]") in err, err
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
            f"waits in: it is at plain_hang.py:{hang_line('lock')} in <module> (the script's own code)") in err, err


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


# ---- two hosts: network namespaces, real sshd (tests/rig.py)

cluster = cluster_fixture(2)


@pytest.mark.timeout(150)
def test_a_rank_stuck_in_c_code_holding_the_gil_gets_a_verdict_and_is_not_unstuck(home):
    """Before: the server's stack request needed the GIL, the fallback SIGUSR1 killed the plain script
    (exit 138) and there was no verdict. Now the bootstrap's own faulthandler dump, received by a
    thread of its own, shows the line; the rank's sleep is not interrupted by looking at it."""
    started = time.monotonic()
    code, err, run_dir = run_hang("gil", script=GIL)
    print(f"verdict {time.monotonic() - started - HANG_S:.1f} s past the start plus --hang-timeout")
    assert code == 124, err
    assert (f"cause: rank 1 never entered collective #6 of the default group (all_reduce [4] Float), which rank 0 "
            f"waits in: it is at plain_gil.py:{hang_line('gil', GIL)} in <module> (the script's own code)") in err, err
    assert "SIGUSR1" not in err  # not killed to be seen, and not unstuck either:
    assert "never gets here" not in (run_dir / "attempt_0" / "rank1.stdout").read_text()
    assert "plain_gil.py" in (run_dir / "attempt_0" / "rank1.stacks").read_text()
    print(err[err.index("disttrain: no rank made progress"):])


def agents_and_workers(cluster, node: str) -> list[int]:
    """disttrain's processes in ``node`` (its agent and its ranks), not the ssh sessions into it."""
    found = []
    for pid in cluster.processes_in(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"python" in argv[0]:
            found.append(pid)
    return found


def hang_across(cluster, *args: str) -> subprocess.CompletedProcess:
    """``disttrain run --hang-timeout`` from node0 over both hosts; prints how long past the timeout
    (counted from the moment every rank is at the branch: their last progress) the verdict and the
    exit came -- the figure, never asserted (tests never assert wall-clock time)."""
    launcher = cluster.popen_in("node0", launch_argv(cluster, "--hang-timeout", str(HANG_S), *args),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err: list[str] = []
    verdict_at: list[float] = []

    def read_err() -> None:
        for line in launcher.stderr:
            if "no rank made progress" in line:
                verdict_at.append(time.monotonic())
            err.append(line)

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out, branch = [], 0
    while branch < 2:
        line = launcher.stdout.readline()
        if not line:
            break
        out.append(line)
        branch += "at the branch" in line
    at_branch = time.monotonic()
    out.append(launcher.stdout.read())
    code = launcher.wait(timeout=ACROSS_WAIT_S)
    exited = time.monotonic()
    reader.join(timeout=10)
    if verdict_at:
        print(f"verdict {verdict_at[0] - at_branch - HANG_S:.1f} s past --hang-timeout, "
              f"exit {exited - at_branch - HANG_S:.1f} s past it")
    return subprocess.CompletedProcess(launcher.args, code, "".join(out), "".join(err))


@pytest.mark.timeout(240)
def test_a_mismatch_across_two_hosts_is_judged_at_the_launcher(cluster):
    result = hang_across(cluster, str(PLAIN), "op")
    err = result.stderr
    assert result.returncode == 124, err[-3000:]
    a, b = (node.ip for node in cluster.nodes)
    assert ("cause: a mismatch in collective #6 of the default group: rank 0 called all_reduce [4] Float; "
            "rank 1 called all_gather [4] Float -> [2, 4]") in err, err
    assert f"  rank 0 ({a}): in #6 all_reduce" in err and f"  rank 1 ({b}): in #6 all_gather" in err
    assert f"stacks on {a}: " in err and f"flight recorder dumps on {b}: " in err
    assert "stopped the job on all 2 hosts (exit 124)" in err
    assert "disttrain-hang" not in err + result.stdout  # the agents' reports are for the launcher only
    cluster.assert_nothing_left()


@pytest.mark.timeout(240)
def test_a_rank_stuck_in_c_code_on_another_host_gets_the_same_verdict(cluster):
    result = hang_across(cluster, str(GIL))
    err = result.stderr
    assert result.returncode == 124, err[-3000:]
    a, b = (node.ip for node in cluster.nodes)
    assert (f"cause: rank 1 never entered collective #6 of the default group (all_reduce [4] Float), which rank 0 "
            f"waits in: it is at plain_gil.py:{hang_line('gil', GIL)} in <module> (the script's own code)") in err, err
    assert f"  rank 0 ({a}): in #6 all_reduce" in err and f"  rank 1 ({b}): completed #5" in err
    assert "no report" not in err and "SIGUSR1" not in err and "never gets here" not in result.stdout
    cluster.assert_nothing_left()


@pytest.mark.timeout(240)
def test_a_host_cut_off_mid_run_stops_on_its_own_and_no_straggler_is_blamed(cluster, tmp_path):
    launcher = cluster.popen_in("node0", launch_argv(cluster, str(SCRIPTS / "steady_ddp.py"), "600"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    steps = 0
    # 120 steady steps, over 12 s or more: the launcher has every rank's rate (judged once 6 s of beats are in,
    # diagnostics.MIN_WINDOW_S; a 20 s window): a straggler wrongly seen at the cut-off would be named.
    while steps < 12:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        steps += "rank 0 step" in line
    assert agents_and_workers(cluster, "node1")
    cluster.cut_off("node1")
    deadline = time.monotonic() + 60
    while agents_and_workers(cluster, "node1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not agents_and_workers(cluster, "node1"), "node1's agent or rank outlived the cut-off by 60 s"
    code = launcher.wait(timeout=90)
    err = launcher.stderr.read()
    assert code == 255, err[-3000:]  # the launcher lost its ssh connection to node1
    assert "straggler" not in err, err[-3000:]  # rank 0, waiting for rank 1, is not slow
    (log,) = tmp_path.glob("runs/*/node1.log")  # the node's own log, on its host (a shared disk here)
    assert "heard nothing from its launcher for 2" in log.read_text()
    # node1's sshd session is still waiting on its dead connection (sshd's own keep-alive is off):
    # not disttrain's; everything of disttrain's is gone on both hosts.
    assert not cluster.processes_in("node0")
    assert not agents_and_workers(cluster, "node1")


@pytest.mark.timeout(240)
def test_a_daemon_left_by_a_remote_rank_is_gone_after_the_job(cluster, tmp_path):
    """Inside ``ip netns exec`` no cgroup is mounted: the agent's subreaper catches the daemon."""
    result = run_on_node0(cluster, str(SCRIPTS / "daemon_child.py"), str(tmp_path), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = [int(p) for rank in (0, 1) for p in (tmp_path / f"rank{rank}.pids").read_text().split()]
    assert_pids_gone(pids)
    cluster.assert_nothing_left()


# ---- two Slurm nodes (tests/slurm_rig.py): the verdict comes back through the batch job

slurm_hang = slurm_fixture(2, name="slurm_hang")


@pytest.mark.timeout(300)
def test_a_mismatch_on_two_slurm_nodes_is_judged_in_one_block(slurm_hang, tmp_path):
    slurm = slurm_hang
    result = slurm.run_in("node0", [sys.executable, "-m", "disttrain", "run", "--launcher", "slurm", "--nodes", "2",
                                    "-n", "1", "--hang-timeout", str(HANG_S), str(PLAIN), "op"],
                          timeout=240, cwd=ROOT, env=slurm.env(DISTTRAIN_HOME=str(tmp_path)))
    err = result.stderr
    assert result.returncode == 124, err[-3000:]
    assert ("cause: a mismatch in collective #6 of the default group: rank 0 called all_reduce [4] Float; "
            "rank 1 called all_gather [4] Float -> [2, 4]") in err, err
    assert "  rank 0 (node0): in #6 all_reduce" in err and "  rank 1 (node1): in #6 all_gather" in err, err
    slurm.assert_nothing_left()
