"""What a newcomer meets first: the messages of a failed, waiting or mistyped run are right."""

from __future__ import annotations

import json
import os
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
def test_ctrl_c_ends_a_rendezvous_wait_at_once(tmp_path):
    """A node waiting for the others says what it waits for; Ctrl-C ends it with 130, not at the timeout.
    Node rank 0 (whose address the others join) and node rank 1, each waiting alone on a port of its own,
    at the same time (their first word comes after the same fixed wait)."""
    ports = [_free_port(), _free_port()]
    while ports[1] == ports[0]:  # one port for both would join them into one job
        ports[1] = _free_port()
    procs = {node_rank: subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nnodes", "2", "--node-rank", str(node_rank),
         "--master-addr", "127.0.0.1", "--master-port", str(ports[node_rank]), "--rdzv-timeout", "120", "-n", "1",
         GOOD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(DISTTRAIN_HOME=str(tmp_path / f"node{node_rank}"))) for node_rank in (0, 1)}
    try:
        deadline = time.monotonic() + 30
        for node_rank, proc in procs.items():
            lines = []
            while time.monotonic() < deadline:
                line = proc.stderr.readline()
                lines.append(line)
                if "still waiting" in line:
                    break
            assert "still waiting" in lines[-1], (node_rank, lines)
            assert "127.0.0.1" in lines[-1] and "Ctrl-C to stop" in lines[-1], (node_rank, lines)
        for node_rank, proc in procs.items():
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 130, node_rank
            rest = proc.stderr.read()
            assert "SIGINT while waiting" in rest and "no worker was started" in rest, (node_rank, rest)
    finally:
        for proc in procs.values():
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


@pytest.fixture
def small_memory_cgroup(tmp_path):
    """A child of this process's memory cgroup limited to 700 MiB (no swap), removed afterwards."""
    from disttrain.agent.oom import memory_cgroup

    mine = memory_cgroup()
    if mine is None:
        pytest.skip("no readable memory cgroup here (neither cgroup v2's memory controller nor v1's memory)")
    child = mine.path / f"disttrain-oom-test-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a memory cgroup under {mine.path}: {err.strerror}")
    try:
        limit = str(700 << 20)
        if mine.version == 2:
            (child / "memory.max").write_text(limit)
            if (child / "memory.swap.max").exists():
                (child / "memory.swap.max").write_text("0")
        else:
            (child / "memory.limit_in_bytes").write_text(limit)
            if (child / "memory.memsw.limit_in_bytes").exists():
                (child / "memory.memsw.limit_in_bytes").write_text(limit)
        yield child
    finally:
        for _ in range(50):  # its processes are gone once the test's command has ended
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.2)


@pytest.mark.timeout(120)
def test_a_rank_killed_by_the_oom_killer_is_named_so(small_memory_cgroup):
    """Issue 23: a rank the kernel's OOM killer ended was reported as "killed by SIGKILL", no more."""
    procs = small_memory_cgroup / "cgroup.procs"

    def enter_cgroup() -> None:  # the whole command (launcher, agent, rank) in the small cgroup
        procs.write_text(str(os.getpid()))

    result = subprocess.run([sys.executable, "-m", "disttrain", "run", "-n", "1", str(SCRIPTS / "oom_rank.py")],
                            capture_output=True, text=True, timeout=100, env=cli_env(), preexec_fn=enter_cgroup)
    assert result.returncode == 137, result.stderr
    assert "[rank0] allocating" in result.stdout and "not killed" not in result.stdout
    assert "disttrain: rank 0 on" in result.stderr
    assert "was killed by the kernel's OOM killer (SIGKILL: out of memory)" in result.stderr
    assert "(memory cgroup limit 700 MiB)" in result.stderr
    assert "fix: fewer processes per host, a smaller batch per process, or more memory" in result.stderr


def test_oom_evidence_is_read_from_the_cgroup_and_the_kernel_log(tmp_path):
    """The files as the kernel writes them (fixtures), for machines where the real test cannot run."""
    from disttrain.agent.oom import MemoryCgroup, OomWatch, kernel_oom_line, memory_cgroup, oom_kill_count

    assert oom_kill_count("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n") == 2  # v2
    assert oom_kill_count("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n") == 0  # v1
    assert oom_kill_count("nothing here\n") is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.events").write_text("oom 0\noom_kill 0\n")
    (v2 / "memory.max").write_text(f"{256 << 20}\n")
    watch = OomWatch(MemoryCgroup(v2, 2), kmsg=str(tmp_path / "no-kmsg"))
    assert watch.explain(4242) is None
    (v2 / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert watch.explain(4242) == (f"the memory cgroup {v2} counted 1 OOM kill(s) since the workers started "
                                   "(memory.events) (memory cgroup limit 256 MiB)")
    (v2 / "memory.max").write_text("max\n")
    assert MemoryCgroup(v2, 2).limit() is None
    kmsg = tmp_path / "kmsg"  # /dev/kmsg gives one record per read; a file gives all: the first is read
    kmsg.write_text("3,812,1,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:90000kB\n")
    assert kernel_oom_line(4242, since=0.0, kmsg=str(kmsg)) == \
        "Memory cgroup out of memory: Killed process 4242 (python) total-vm:90000kB"
    assert kernel_oom_line(4243, since=0.0, kmsg=str(kmsg)) is None
    assert kernel_oom_line(4242, since=5.0, kmsg=str(kmsg)) is None  # logged before the workers started
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
    found = memory_cgroup(mountinfo=str(mountinfo))
    assert found is None or found.version in (1, 2)  # this process's own cgroup, where the mount matches
