"""A node's scratch folder (agent/scratch.py): removed at the agent's end; left behind by an agent
SIGKILLed, and then removed by the next agent on the host, never one of an agent that still runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from conftest import cli_env, disttrain, write
from disttrain.agent import scratch
from disttrain.process_start import started

pytestmark = pytest.mark.timeout(120)


def _folder(tmp: Path, owner: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"{scratch.PREFIX}{owner}-", dir=tmp))
    (folder / "exit").mkdir()
    return folder


def test_the_sweep_removes_only_the_folders_of_agents_gone_from_this_host(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = scratch._host()
    mine = started(psutil.Process().pid)
    folders = {
        "gone": _folder(tmp_path, f"{host}-{gone.pid}-{mine}"),
        "pid reused": _folder(tmp_path, f"{host}-1-{started(1) - 1}"),
        "running": _folder(tmp_path, scratch._owner_tag(psutil.Process().pid)),
        "another host's": _folder(tmp_path, f"{host[::-1]}-{gone.pid}-{mine}"),
        "running, named by 0.7.8": _folder(tmp_path, f"{host}-{os.getpid()}-{int(psutil.Process().create_time())}"),
    }
    scratch.sweep(str(tmp_path))
    assert {name: folder.exists() for name, folder in folders.items()} == {
        "gone": False, "pid reused": False, "running": True, "another host's": True,
        "running, named by 0.7.8": True}


def test_a_running_agent_s_folder_outlives_a_step_of_the_wall_clock(tmp_path, monkeypatch):
    """The CI's hang verdicts without a recorder: an agent's start read from the wall clock (psutil's boot time
    plus ticks) moved by a second between two reads, and the next agent removed a live one's sockets."""
    running = _folder(tmp_path, scratch._owner_tag(psutil.Process().pid))
    before, booted = psutil.Process().create_time(), psutil.boot_time()
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: booted + 1.5)
    assert psutil.Process().create_time() == pytest.approx(before + 1.5)  # what the old tag was made of
    scratch.sweep(str(tmp_path))
    assert running.exists()


def test_a_sigkilled_agent_s_folder_is_removed_by_the_next_run(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = cli_env(TMPDIR=str(tmp), DISTTRAIN_HOME=str(tmp_path / "home"))
    # The worker's parent is the node's agent (the launcher itself, on one host).
    kill = write(tmp_path / "kill_agent.py", "import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                             "time.sleep(60)\n")
    killed = disttrain("run", "-n", "1", str(kill), env=env, timeout=90)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (left,) = tmp.glob(scratch.PREFIX + "*")
    assert (left / "exit").is_dir()
    done = disttrain("run", "-n", "1", str(write(tmp_path / "ok.py", "print('ok')\n")), env=env, timeout=90)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    assert list(tmp.glob(scratch.PREFIX + "*")) == []
