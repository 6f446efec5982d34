"""A run's folder, rank logs and checkpoints are the user's own: 0700 folders, 0600 files (issue 35 item 4)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import cli_env, disttrain
from disttrain.private import private_dirs

SAVE = """
import os
import torch
import disttrain
disttrain.init()
model = torch.nn.Linear(2, 1)
disttrain.checkpoint.save(os.environ["DISTTRAIN_CHECKPOINT_DIR"], step=1, model=model)
print("secret-token-123", flush=True)
disttrain.shutdown()
"""


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def reachable_tmp():
    """A folder every user may enter (pytest's tmp_path is under a 0700 folder)."""
    path = Path(tempfile.mkdtemp(prefix="disttrain-private-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def unreadable_by_others(path: Path) -> bool:
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(path)],
                          capture_output=True, text=True, timeout=30)
    return done.returncode != 0 and "Permission denied" in done.stderr


@pytest.mark.timeout(150)
def test_run_folder_rank_logs_and_checkpoints_are_the_users_own(reachable_tmp):
    (reachable_tmp / "save.py").write_text(SAVE)
    env = cli_env(DISTTRAIN_HOME=str(reachable_tmp / "home"))
    result = disttrain("run", "-n", "2", "--log-dir", str(reachable_tmp / "runs" / "r1"),
                       "--checkpoint-dir", str(reachable_tmp / "ckpt" / "a"), str(reachable_tmp / "save.py"),
                       env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    run_dir, ckpt = reachable_tmp / "runs" / "r1", reachable_tmp / "ckpt" / "a"
    step = next(ckpt.glob("step_*"))
    for folder in (reachable_tmp / "runs", run_dir, run_dir / "attempt_0", reachable_tmp / "ckpt", ckpt, step):
        assert mode(folder) == 0o700, folder
    rank_logs = sorted(run_dir.glob("attempt_0/rank*.std*"))
    assert len(rank_logs) == 4 and "secret-token-123" in rank_logs[1].read_text() + rank_logs[3].read_text()
    files = [p for p in step.rglob("*") if p.is_file()]
    assert files
    for path in (*rank_logs, *files):
        assert mode(path) == 0o600, path
    if os.geteuid() == 0:  # and another user, for real, can read none of it
        for path in (rank_logs[1], files[0]):
            assert unreadable_by_others(path), path


@pytest.mark.timeout(150)
def test_an_existing_folder_keeps_its_mode(reachable_tmp):
    (reachable_tmp / "save.py").write_text(SAVE)
    shared_runs, shared_ckpt = reachable_tmp / "team-runs", reachable_tmp / "team-ckpt"
    for folder in (shared_runs, shared_ckpt):
        folder.mkdir()
        folder.chmod(0o750)  # the user chose a group-readable folder
    result = disttrain("run", "-n", "1", "--log-dir", str(shared_runs), "--checkpoint-dir", str(shared_ckpt),
                       str(reachable_tmp / "save.py"), env=cli_env(DISTTRAIN_HOME=str(reachable_tmp / "home")),
                       timeout=120)
    assert result.returncode == 0, result.stderr
    assert mode(shared_runs) == 0o750 and mode(shared_ckpt) == 0o750
    assert mode(next(shared_ckpt.glob("step_*"))) == 0o700  # what disttrain made is private


def test_private_dirs_makes_only_the_missing_folders_private(tmp_path):
    (tmp_path / "a").mkdir(mode=0o755)
    private_dirs(tmp_path / "a" / "b" / "c")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o755, 0o700, 0o700]
