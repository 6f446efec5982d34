"""A checkpoint location's mistakes are told before any worker starts: exit 2, one line, nothing
started (the script would leave a file). Object stores are a real moto server on loopback
(conftest's ``s3_endpoint``); a bucket is made only with ``--create-bucket``; a probe object is
written and removed. A run with a checkpoint folder that never wrote a checkpoint says so at its
end, and why."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conftest import cli_env, disttrain
from disttrain.checkpoint_check import PROBE_PREFIX, check_location
from disttrain.checkpoint_url import RemoteLayout
from disttrain.errors import UsageError

STARTED = """
import pathlib, sys
pathlib.Path(sys.argv[1]).write_text("started")
"""

NO_RESUME = """
import disttrain
disttrain.init()
disttrain.print0("trained without checkpoints")
"""

# AWS's credential chain pointed at nothing: no file, no instance role (which would wait for a timeout).
NO_AWS = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
          "AWS_EC2_METADATA_DISABLED": "true"}


def run_with(tmp_path: Path, location: str, *extra: str, env: dict | None = None):
    script = tmp_path / "started.py"
    script.write_text(STARTED)
    marker = tmp_path / "worker-started"
    result = disttrain("run", "-n", "1", "--checkpoint-dir", location, *extra, str(script), str(marker),
                       env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), **NO_AWS, **(env or {})))
    return result, marker.exists()


def assert_refused(result, started: bool, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert not started, "a worker started before the mistake was told"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disttrain: error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("location, words", [
    ("nosuchproto://bucket/run", ("nosuchproto",)),
    ("memory://run", ("memory://", "lost when the job ends")),
    ("/proc/self/ckpt", ("/proc", "kernel")),
])
def test_location_mistakes_are_one_line_before_the_start(tmp_path, location, words):
    assert_refused(*run_with(tmp_path, location), *words)


def test_a_file_where_the_folder_should_be_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert_refused(*run_with(tmp_path, str(tmp_path / "afile")), "is a file")
    assert_refused(*run_with(tmp_path, str(tmp_path / "afile" / "below")), "is a file")


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_gs_without_gcsfs_is_refused(tmp_path):
    assert_refused(*run_with(tmp_path, "gs://bucket/run"), "gcsfs")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any folder")
def test_unwritable_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert_refused(*run_with(tmp_path, str(locked)), "cannot be written")
        assert_refused(*run_with(tmp_path, str(locked / "new")), "not writable")
    finally:
        locked.chmod(0o700)


def test_s3_without_credentials_is_refused(tmp_path, s3_endpoint, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    result, started = run_with(tmp_path, "s3://some-bucket/run", env={"AWS_ENDPOINT_URL": s3_endpoint})
    assert_refused(result, started, "credentials", "AWS_ACCESS_KEY_ID")


def test_missing_bucket_is_refused_and_never_created_unless_asked(tmp_path, s3):
    fs, bucket = s3
    missing = f"{bucket}-typo"
    result, started = run_with(tmp_path, f"s3://{missing}/run")
    assert_refused(result, started, f"bucket {missing} does not exist", "--create-bucket")
    fs.invalidate_cache()
    assert not fs.exists(missing)

    result, started = run_with(tmp_path, f"s3://{missing}/run", "--create-bucket")
    assert result.returncode == 0, result.stderr
    assert started
    fs.invalidate_cache()
    assert fs.exists(missing)
    assert not [p for p in fs.find(missing) if PROBE_PREFIX in p]  # the probe object was removed


def test_a_save_never_creates_a_bucket(s3):
    fs, bucket = s3
    layout = RemoteLayout.at(f"s3://{bucket}-gone/run", retry_s=0)
    with pytest.raises(OSError):
        layout.put(layout.step_dir(1), "state.pt", b"data")
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}-gone")


def test_probe_leaves_nothing_in_a_writable_place(tmp_path, s3):
    fs, bucket = s3
    assert check_location(f"s3://{bucket}/deep/run") == f"s3://{bucket}/deep/run"
    fs.invalidate_cache()
    assert fs.find(bucket) == []
    folder = tmp_path / "ck"
    folder.mkdir()
    assert check_location(str(folder)) == str(folder)
    assert list(folder.iterdir()) == []
    assert check_location(str(tmp_path / "not" / "yet")) == str(tmp_path / "not" / "yet")
    assert not (tmp_path / "not").exists()  # nothing made before the start


def test_job_checkpoint_uri_gets_the_same_check(tmp_path):
    from disttrain.jobs.runner import check_job
    from disttrain.jobs.spec import spec_from_mapping

    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = spec_from_mapping({"name": "ck", "entry_point": "train.py", "checkpoint_s3_uri": "memory://ck"},
                             base_dir=tmp_path, source="test")
    with pytest.raises(UsageError, match=r"^checkpoint_s3_uri memory://ck: a memory:// store"):
        check_job(spec)


def test_create_bucket_for_a_folder_is_refused(tmp_path):
    assert_refused(*run_with(tmp_path, str(tmp_path / "ck"), "--create-bucket"), "--create-bucket")


def test_a_run_that_never_saves_is_told_at_its_end(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(NO_RESUME)
    result = disttrain("run", "-n", "1", "--checkpoint-dir", str(tmp_path / "ck"), str(script),
                       env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home")))
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "no checkpoint was written" in line]
    assert notes == [f"disttrain: note: --checkpoint-dir {tmp_path / 'ck'}: no checkpoint was written; the script "
                     "never calls disttrain.resume() or the Trainer, which are what save there (or pass the "
                     "folder to disttrain.checkpoint.save)"]
    assert "trained without checkpoints" in result.stdout


MEMORY_SAVE = """
import torch, disttrain
disttrain.init()
disttrain.checkpoint.save("memory://shared", step=1, model=torch.nn.Linear(2, 2))
"""


def test_memory_store_is_refused_by_ranks_of_a_launched_job(tmp_path):
    script = tmp_path / "memory_save.py"
    script.write_text(MEMORY_SAVE)
    result = disttrain("run", "-n", "2", str(script), env=cli_env(DISTTRAIN_HOME=str(tmp_path / "home")))
    assert result.returncode == 1, result.stderr  # a worker's mistake fails the job, its line in the report
    assert "checkpoint folder memory://shared: a memory:// store lives in one process's memory" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_s3_store_is_reached_at_the_endpoint_named_now(monkeypatch):
    """fsspec keeps one filesystem per set of options for the process: one made while
    AWS_ENDPOINT_URL named another server is never handed back."""
    pytest.importorskip("s3fs")
    from disttrain.checkpoint_url import open_url

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    first = open_url("s3://bucket/run").fs
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    assert (first.endpoint_url, open_url("s3://bucket/run").fs.endpoint_url) == ("http://127.0.0.1:1",
                                                                                 "http://127.0.0.1:2")
