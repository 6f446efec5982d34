"""What a newcomer meets first: the messages of a failed, waiting or mistyped run are right."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from test_cli_input import assert_usage_error

from _launch import kill_tree, run_ranks
from conftest import SCRIPTS, cli_env, disttrain

GOOD = str(SCRIPTS / "sleeper.py")


@pytest.mark.timeout(90)
def test_error_only_in_torch_error_file_is_the_root_cause():
    result = run_ranks(SCRIPTS / "error_file_only.py", 2)
    assert result.returncode == 1
    block = result.stderr[result.stderr.index("disttrain: rank 1"):]
    assert "rank1.error.json" in block
    assert "RuntimeError: shard index 17 is corrupt" in block


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_early_with_code_0_is_named_as_the_cause():
    result = run_ranks(SCRIPTS / "early_exit_rank1.py", 2)
    assert result.returncode == 1
    cause = [line for line in result.stderr.splitlines() if line.startswith("disttrain: rank")]
    assert cause and cause[0].startswith("disttrain: rank 1 on "), result.stderr
    assert "exited with code 0 while the other ranks were still running" in cause[0]
    assert "rank 0 then exited with code 1 because it lost its peer" in cause[0]


@pytest.mark.timeout(90)
def test_a_world_of_one_does_not_claim_other_ranks_were_stopped(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    result = run_ranks(script, 1)
    assert result.returncode == 3
    assert "disttrain: rank 0 on " in result.stderr and "exited with code 3" in result.stderr
    assert "other ranks" not in result.stderr


@pytest.mark.timeout(90)
def test_traceback_lines_carry_one_rank_prefix():
    result = run_ranks(SCRIPTS / "init_then_raise.py", 2)
    assert result.returncode == 1
    assert "[rank1] Traceback (most recent call last):" in result.stderr
    assert "[rank1] [rank1]" not in result.stderr
    assert "    ValueError: bad shard 17" in result.stderr  # the root-cause block, unprefixed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node_rank", [0, 1])
def test_ctrl_c_ends_a_rendezvous_wait_at_once(node_rank, tmp_path):
    """A node waiting for the others says what it waits for; Ctrl-C ends it with 130, not at the timeout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nnodes", "2", "--node-rank", str(node_rank),
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--rdzv-timeout", "120", "-n", "1",
         GOOD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    try:
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "still waiting" in line:
                break
        assert "still waiting" in lines[-1], lines
        assert "127.0.0.1" in lines[-1] and "Ctrl-C to stop" in lines[-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        rest = proc.stderr.read()
        assert "SIGINT while waiting" in rest and "no worker was started" in rest
    finally:
        kill_tree(proc.pid)
        proc.communicate()


def _free_port() -> int:
    from disttrain.net import free_port

    return free_port("127.0.0.1")


@pytest.mark.timeout(60)
def test_log_dir_that_is_a_file_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    result = disttrain("run", "--log-dir", str(blocker), GOOD, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert_usage_error(result, f"cannot write the run folder {blocker}", "--log-dir")


@pytest.mark.timeout(60)
def test_unusable_disttrain_home_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    result = disttrain("run", GOOD, env=cli_env(DISTTRAIN_HOME=str(blocker / "home")))
    assert_usage_error(result, "cannot write the run folder", "DISTTRAIN_HOME")


@pytest.mark.timeout(60)
def test_nccl_without_cuda_is_refused_before_start(tmp_path):
    result = disttrain("run", "--dist-backend", "nccl", GOOD, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert_usage_error(result, "--dist-backend nccl needs CUDA GPUs", "use --dist-backend gloo")
    assert "--backend gloo" not in result.stderr.replace("--dist-backend gloo", "")
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_more_processes_than_cores_gets_a_hint(tmp_path):
    result = disttrain("run", "-n", "64", "--dry-run", GOOD, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "disttrain: note: 64 processes on" in result.stderr and "disttrain bench" in result.stderr
    quiet = disttrain("run", "-n", "1", "--dry-run", GOOD, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert "note:" not in quiet.stderr


@pytest.mark.timeout(60)
def test_forgotten_run_is_one_line_naming_the_fix():
    result = disttrain("train.py")
    assert_usage_error(result, "unknown command 'train.py'", "disttrain run train.py")
    assert result.stderr.count("disttrain:") == 1
    for internal in ("agent", "probe", "receive"):
        assert internal not in result.stderr
    top = disttrain("--help")
    assert "agent" not in top.stdout and "probe" not in top.stdout


@pytest.mark.timeout(60)
def test_job_help_lists_no_internal_action():
    result = disttrain("job", "--help")
    assert result.returncode == 0
    assert "SUPPRESS" not in result.stdout and "_in-allocation" not in result.stdout


@pytest.mark.timeout(60)
def test_module_run_folder_is_named_after_the_module(tmp_path):
    result = disttrain("run", "--dry-run", "-m", "dtpkg.entry", cwd=SCRIPTS,
                       env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    run_id = json.loads(result.stdout)["run_id"]
    assert "-entry-" in run_id and "dtpkg" not in run_id


@pytest.mark.timeout(120)
def test_doctor_without_hosts_checks_this_machine(tmp_path):
    result = disttrain("doctor", "--json", "--master-port", str(_free_port()), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {r["check"]: r for r in json.loads(result.stdout)}
    assert rows["versions"]["status"] == "ok" and "torch" in rows["versions"]["detail"]
    assert rows["master port"]["status"] == "ok"
    missing = disttrain("doctor", "--path", "nothere.py", cwd=tmp_path)
    assert missing.returncode == 1 and "nothere.py not found" in missing.stdout


@pytest.mark.timeout(120)
def test_two_nodes_started_by_hand_form_one_job(tmp_path):
    """torchrun-style: the same command on each node, only --node-rank differs."""
    script = tmp_path / "sum.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "t = torch.ones(1); dist.all_reduce(t); print('sum', int(t.item()))\n"
                      "dist.destroy_process_group()\n")
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nnodes", "2", "--node-rank", str(rank), "--master-addr",
         "127.0.0.1", "--master-port", port, "--rdzv-timeout", "60", "-n", "1", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
        for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
        assert "sum 2" in out
