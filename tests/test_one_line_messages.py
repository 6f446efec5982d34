"""Messages a user meets on a damaged or odd machine: one line, the right exit code (issue 35 item 5)."""

from __future__ import annotations

import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import cli_env, disttrain


def in_mount_namespace(setup: str, *argv: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m disttrain ARGV`` in a mount namespace of its own, after the shell ``setup`` (a
    read-only bind mount, a tiny tmpfs): the machine's mounts are never touched."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --mount is not allowed here (needs root or user namespaces)")
    command = f"{setup} && exec {shlex.join([sys.executable, '-m', 'disttrain', *argv])}"
    return subprocess.run(["unshare", "--mount", "sh", "-c", command], capture_output=True, text=True,
                          timeout=timeout, env=env)


def read_only(folder: Path) -> str:
    return f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_another_programs_sqlite_file_is_refused_untouched(tmp_path):
    other = tmp_path / "app.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    result = disttrain("jobs", "ls", "--store", str(other), env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home")))
    assert result.returncode == 2
    assert "it is another program's SQLite database (tables users), not a disttrain job store" in one_line(result)
    with sqlite3.connect(other) as db:
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == ["users"]


def test_a_read_only_store_is_listed_and_a_write_is_one_line(tmp_path):
    from disttrain.store import JobStore

    folder = tmp_path / "shared"
    folder.mkdir()
    with JobStore(folder / "jobs.db") as store:
        store.create(name="done", spec={}, job_dir=str(tmp_path / "job"))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(folder / "jobs.db"))
    listed = in_mount_namespace(read_only(folder), "jobs", "ls", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "done" in listed.stdout
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "hi.py").write_text("print('hi')\n")
    spec = tmp_path / "hi.yaml"
    spec.write_text(yaml.safe_dump({"name": "hi", "entry_point": "hi.py", "source_dir": str(tmp_path / "src")}))
    run = in_mount_namespace(read_only(folder), "job", "run", str(spec), env=env)
    assert run.returncode == 2
    assert f"cannot write the job store {folder / 'jobs.db'}: it is read-only here" in one_line(run)


def test_tune_ls_on_a_damaged_store_or_a_read_only_home_makes_nothing(tmp_path):
    pytest.importorskip("optuna")
    damaged = tmp_path / "jobs.db"
    damaged.write_bytes(b"not a database " * 400)
    result = disttrain("tune", "ls", "--store", str(damaged), env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home")))
    assert result.returncode == 2
    assert f"cannot open the job store {damaged}: file is not a database" in one_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.db"]  # no jobs-tuning.db beside it
    home = tmp_path / "home"
    home.mkdir()
    listed = in_mount_namespace(read_only(home), "tune", "ls", env=cli_env(DISTTRAIN_HOME=str(home / ".disttrain")))
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert listed.stdout.split() == ["NAME", "STATUS", "STRATEGY", "CREATED", "TRIALS", "BEST", "JOB", "OBJECTIVE"]


BIG_MODEL = """
import os
with open(os.path.join(os.environ["SM_MODEL_DIR"], "model.bin"), "wb") as f:
    f.write(os.urandom(700_000))  # random: the archive is as large as the model
print("saved", flush=True)
"""


@pytest.mark.timeout(150)
def test_a_full_disk_while_packing_the_model_is_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.py").write_text(BIG_MODEL)
    spec = tmp_path / "big.yaml"
    spec.write_text(yaml.safe_dump({"name": "big", "entry_point": "big.py", "source_dir": str(tmp_path / "src"),
                                    "processes_per_instance": 1, "private_opt_ml": "off",
                                    "output_path": str(tmp_path / "out")}))
    small = tmp_path / "small"
    small.mkdir()
    env = cli_env(DISTTRAIN_HOME=str(small), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = in_mount_namespace(f"mount -t tmpfs -o size=1200k tmpfs {small}", "job", "run", str(spec), env=env)
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("disttrain: error:")]
    assert "Traceback" not in result.stderr and len(error) == 1, result.stderr  # the runner's own lines, then it
    assert result.stderr.splitlines()[-1] == error[0]
    assert "/packed/model.tar.gz failed: No space left on device (" in result.stderr
    assert "MiB free there); free space, or set DISTTRAIN_HOME" in result.stderr
    show = disttrain("jobs", "show", "1", "--json", env=env)
    assert '"state": "Failed"' in show.stdout and "No space left on device" in show.stdout


FAIL_RANK1 = """
import os, sys, time
if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    time.sleep(0.5)
    sys.exit(5)
time.sleep(30)
"""


@pytest.mark.timeout(150)
def test_the_mpi_launchers_failure_names_the_rank(tmp_path):
    import shutil

    if not shutil.which("mpirun"):
        pytest.skip("Open MPI's mpirun is not installed (tests/rig_setup.sh installs it)")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "fail.py").write_text(FAIL_RANK1)
    spec = tmp_path / "mpi.yaml"
    spec.write_text(yaml.safe_dump({"name": "mpi", "entry_point": "fail.py", "source_dir": str(tmp_path / "src"),
                                    "instance_count": 2, "private_opt_ml": "off",
                                    "distribution": {"mpi": {"enabled": True, "processes_per_host": 1}}}))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 5, result.stderr
    show = disttrain("jobs", "show", "1", "--json", env=env)
    assert ("algo-2 rank1 exited with code 5, the first to fail; mpirun stopped the others (exit code 5)"
            in show.stdout), show.stdout


def test_mpiruns_words_for_a_killed_rank_name_it():
    from disttrain.launch.mpi import FirstFailure, Untag

    first = FirstFailure(Untag(["algo-1", "algo-2"], ranks_per_instance=2))
    first.feed("mpirun noticed that process rank 3 with PID 0 on node vm exited on signal 9 (Killed).\n")
    assert first.report(137) == ("disttrain: algo-2 rank3 was killed by signal 9 (Killed), the first to fail; "
                                 "mpirun stopped the others (exit code 137)")
    assert FirstFailure(Untag(["algo-1"], 1)).report(1) == "disttrain: mpirun exited with code 1"


HI = "print('hi', flush=True)\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("options", "code", "said"), [
    (["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=abc"], 2,
     "disttrain: error: --rdzv-conf join_timeout=abc: join_timeout is a whole number of seconds"),
    (["--rdzv-backend", "c10d", "--rdzv-conf", "timeout=abc"], 0,
     "disttrain: note: --rdzv-conf timeout is not read by the c10d rendezvous (torch ignores it)"),
    (["--local-ranks-filter", "9"], 0,
     "disttrain: note: --local-ranks-filter 9 names no local rank of 2 worker(s) a node (local ranks 0..1)"),
])
def test_torchrun_options_are_checked_before_anything_starts(tmp_path, options, code, said):
    (tmp_path / "hi.py").write_text(HI)
    result = disttrain("run", "-n", "2", *options, str(tmp_path / "hi.py"), cwd=tmp_path,
                       env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home")))
    assert result.returncode == code, result.stderr
    assert [line for line in result.stderr.splitlines() if said in line], result.stderr
    if code:
        assert result.stderr.count("\n") == 1 and not (tmp_path / "home").exists()  # nothing started


HOLD_PORT = """
import socket, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
print(sock.getsockname()[1], flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(150)
def test_a_rendezvous_port_held_by_another_program_is_named_with_its_holder(tmp_path):
    (tmp_path / "hi.py").write_text(HI)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_PORT], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        result = disttrain("run", "-n", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                           str(tmp_path / "hi.py"), cwd=tmp_path, env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home")),
                           timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("disttrain: error:")]
    assert len(error) == 1 and "Traceback" not in result.stderr, result.stderr
    assert (f"port {port} of the rendezvous endpoint localhost:{port} is held by another program "
            f"(pid {holder.pid} (") in error[0]
    assert "give --rdzv-endpoint (or --master-port) a free port" in error[0]
