"""checkpoint_s3_uri's sync keeps disttrain's checkpoints whole on the remote side: the
marker goes up last, a checkpoint being written stays local, and the remote keeps what
the writing folder keeps. Real checkpoints (a world of one), a real remote (file://)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import disttrain
from disttrain.checkpoint_layout import MARKER
from disttrain.errors import DisttrainError
from disttrain.jobs.checkpoints import Syncer, marker_last, restore


def syncer(remote: Path, *folders: Path) -> Syncer:
    return Syncer(f"file://{remote}", list(folders), {}, say=lambda line: None)


def remote_steps(remote: Path) -> list[str]:
    return sorted(p.name for p in remote.iterdir() if p.name.startswith("step_"))


def test_markers_go_after_every_other_file():
    names = ["step_00000002/COMPLETE", "step_00000002/state.pt", "a/step_00000001/COMPLETE",
             "step_00000002/sharded/__0_0.distcp", "notes.txt"]
    order = marker_last(names)
    assert order[-2:] == ["a/step_00000001/COMPLETE", "step_00000002/COMPLETE"]
    assert set(order) == set(names)


def test_remote_keeps_the_checkpoints_the_writer_keeps(ctx, tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    sync = syncer(remote, local)
    for step in range(1, 6):
        disttrain.checkpoint.save(local, step=step, keep_last=2, value=step)
        sync.sync()
        assert remote_steps(remote) == remote_steps(local)
    assert remote_steps(remote) == ["step_00000004", "step_00000005"]
    fresh = tmp_path / "fresh"
    restore(f"file://{remote}", fresh, {})
    assert disttrain.checkpoint.load_latest(fresh)["value"] == 5


def test_restored_copies_in_other_folders_do_not_keep_old_checkpoints(ctx, tmp_path):
    """Every instance folder gets the restore; only one writes (rank 0's)."""
    remote, writer, other = tmp_path / "remote", tmp_path / "algo-1", tmp_path / "algo-2"
    for step in (1, 2):
        disttrain.checkpoint.save(writer, step=step, keep_last=2, value=step)
    syncer(remote, writer).sync()
    restore(f"file://{remote}", other, {})
    sync = syncer(remote, writer, other)
    for step in (3, 4):
        disttrain.checkpoint.save(writer, step=step, keep_last=2, value=step)
        sync.sync()
    assert remote_steps(remote) == ["step_00000003", "step_00000004"]


def test_a_checkpoint_being_written_is_not_uploaded(ctx, tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    disttrain.checkpoint.save(local, step=1, value=1)
    (local / ".tmp-step_00000002-4242").mkdir()
    (local / ".tmp-step_00000002-4242" / "state.pt").write_bytes(b"half")
    syncer(remote, local).sync()
    assert sorted(p.name for p in remote.iterdir()) == ["step_00000001"]


@pytest.fixture
def small_remote(tmp_path):
    """A 64 KiB filesystem as the remote side: a sync runs out of space half-way."""
    where = tmp_path / "remote"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_sync_cut_short_leaves_no_marker(ctx, tmp_path, small_remote):
    """Before: COMPLETE sorted (and went up) before state.pt, so a remote copy cut short
    looked complete; restore fell back only because state.pt failed to load."""
    import torch

    local = tmp_path / "local"
    disttrain.checkpoint.save(local, step=1, weights=torch.zeros(64 * 1024))  # 256 KiB
    with pytest.raises(DisttrainError, match="No space left"):
        syncer(small_remote, local).sync()
    assert not list(small_remote.rglob(MARKER))
