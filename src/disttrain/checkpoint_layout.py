"""The on-disk layout of a checkpoint directory, and the file operations that keep it valid.

::

    <directory>/
        step_00000100/          one complete checkpoint per step
            state.pt            what rank 0 saved (model, optimizer, ..., step)
            rank_00000.pt       each rank's own values (RNG states), when saved with them
            rank_00001.pt
            sharded/            FSDP models and their optimizers: torch.distributed.checkpoint,
                                one file per rank written by that rank, and .metadata
            COMPLETE            marker, written last: JSON listing every file with its digest
        .tmp-step_00000200-4242/   being written by process 4242; never read

A step directory counts only when it holds the marker, and it only gets its final name
through ``os.rename`` after everything in it was written and fsynced, so a crash at any
point leaves either the old set of checkpoints or the new one. Rank 0 writes every file,
the per-rank ones included (gathered from the other ranks first), so one rename commits
them together -- except the shards of a sharded model, which each rank writes into rank
0's temporary directory before rank 0 writes the marker and renames.

The marker holds each file's size and SHA-256 (format 2), so that a file damaged or cut
short after the checkpoint was written -- a disk error, a partial copy from remote storage,
a hand edit -- is found before anything is loaded from it; each digest is read back while
its file is fsynced (:func:`sync_and_digest`). This module is torch-free: the runtime
writes and reads checkpoints with it, the job runner's remote sync
(:mod:`disttrain.jobs.checkpoints`) uploads them marker last.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .private import private_dirs, private_opener

STATE_FILE = "state.pt"
MARKER = "COMPLETE"
# torch.distributed.checkpoint's directory (every rank's shard plus .metadata), in
# checkpoints of sharded models only.
SHARDED_DIR = "sharded"
# 2: the marker holds "digests" ({file: {"sha256", "bytes"}}); 1: file names only.
FORMAT = 2
# SHA-256: hashlib runs it on the CPU's SHA extensions where there are some, faster than
# blake2b there (bench/checkpoint_digest.py measures both against the save itself).
DIGEST = "sha256"
_CHUNK = 1 << 20

_STEP_DIR = re.compile(r"step_(\d+)")
_TEMP_DIR = re.compile(r"\.tmp-step_\d+-\d+")
_TRASH_DIR = re.compile(r"\.trash-step_\d+-\d+")

FileDigest = dict[str, Any]  # {"sha256": hex, "bytes": size}


def is_step_dir(name: str) -> bool:
    """Whether ``name`` is a checkpoint's directory name (complete when it holds the marker)."""
    return _STEP_DIR.fullmatch(name) is not None


def is_scratch(name: str) -> bool:
    """Whether ``name`` is a checkpoint being written or being deleted: never read, never synced."""
    return _TEMP_DIR.fullmatch(name) is not None or _TRASH_DIR.fullmatch(name) is not None


@dataclass(frozen=True)
class CheckpointLayout:
    """The one place that knows the names inside a checkpoint directory."""

    root: Path

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    @staticmethod
    def rank_file(rank: int) -> str:
        return f"rank_{rank:05d}.pt"

    def temp_dir(self, step: int) -> Path:
        # Hidden and not matching step_N, so readers never mistake it for a checkpoint.
        return self.root / f".tmp-step_{step:08d}-{os.getpid()}"

    def trash_dir(self, step: int) -> Path:
        return self.root / f".trash-step_{step:08d}-{os.getpid()}"

    def complete(self) -> list[tuple[int, Path]]:
        """``(step, directory)`` of every complete checkpoint, oldest first."""
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        found = []
        for path in entries:
            match = _STEP_DIR.fullmatch(path.name)
            if match and (path / MARKER).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    # The three reads checkpoint_read asks of a layout (a store's is disttrain.checkpoint_url's).
    def marker(self, path: Path) -> dict:
        return read_marker(path)

    def check(self, path: Path, name: str, expected: FileDigest) -> str | None:
        return check_file(path, name, expected)

    def source(self, path: Path, name: str) -> Path:
        return path / name

    def leftovers(self) -> list[Path]:
        """Temporary directories left by writers that died before renaming."""
        try:
            return [p for p in self.root.iterdir() if is_scratch(p.name)]
        except FileNotFoundError:
            return []


def hash_file(path: Path) -> FileDigest:
    """The digest of the file at ``path``, read in chunks."""
    digest = hashlib.new(DIGEST)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {DIGEST: digest.hexdigest(), "bytes": size}


def check_file(directory: Path, name: str, expected: FileDigest) -> str | None:
    """Why ``directory/name`` is not the file its digest describes, or None when it is."""
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as err:
        return f"{name} is unreadable: {err.strerror or err}"
    if size != expected.get("bytes"):
        return f"{name} has {size} bytes, {expected.get('bytes')} were written"
    try:
        actual = hash_file(path)
    except OSError as err:
        return f"{name} is unreadable: {err.strerror or err}"
    if actual[DIGEST] != expected.get(DIGEST):
        return f"{name} does not match its {DIGEST} digest (changed after it was written)"
    return None


def sync_dir(path: Path) -> None:
    # Makes the entries (new files, a rename) durable, not just the files' contents.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some network filesystems cannot fsync a directory; the rename is still atomic.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[BinaryIO], None]) -> FileDigest:
    """Create ``path`` with ``write(file)``, fsync it, and return its digest."""
    with open(path, "wb", opener=private_opener) as f:  # 0600: the model's weights
        write(f)
        f.flush()
        return sync_and_digest(path, f.fileno())


def sync_and_digest(path: Path, fd: int | None = None) -> FileDigest:
    """fsync the file at ``path`` (or open as ``fd``) and digest it, the two at once.

    The digest reads the file back from the page cache on a thread of its own (hashlib
    lets go of the GIL) while the fsync waits for the disk: with a core to spare it costs
    no time, where hashing the bytes on their way to the file would add its own
    (``bench/checkpoint_digest.py``).
    """
    found: list[Any] = []

    def digest() -> None:
        try:
            found.append(hash_file(path))
        except OSError as err:
            found.append(err)

    thread = threading.Thread(target=digest, name="disttrain-digest", daemon=True)
    thread.start()
    try:
        if fd is not None:
            os.fsync(fd)
        else:
            own = os.open(path, os.O_RDONLY)
            try:
                os.fsync(own)
            finally:
                os.close(own)
    finally:
        thread.join()
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def commit(layout: CheckpointLayout, step: int, write_files: Callable[[Path], dict[str, FileDigest]],
           meta: dict) -> Path:
    """Write a checkpoint for ``step`` into a temporary directory, then publish it.

    ``write_files(directory)`` writes the payload and returns each file's digest; the
    marker comes after them, and the rename last. A checkpoint already at this step (a
    resumed run saving the same step again) is replaced.
    """
    temp = begin(layout, step)
    try:
        digests = write_files(temp)
    except BaseException:
        discard(temp)
        raise
    return publish(layout, step, temp, digests, meta)


def begin(layout: CheckpointLayout, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of ``step``."""
    private_dirs(layout.root)  # 0700 when new: a checkpoint holds the model's weights
    temp = layout.temp_dir(step)
    if temp.exists():  # a previous writer with our pid (pid reuse) died here
        shutil.rmtree(temp)
    temp.mkdir(mode=0o700)
    return temp


def discard(temp: Path | None) -> None:
    # A full disk is the usual cause of a failed write: give the space back now.
    if temp is not None:
        shutil.rmtree(temp, ignore_errors=True)


def publish(layout: CheckpointLayout, step: int, temp: Path, digests: dict[str, FileDigest],
            meta: dict) -> Path:
    """Mark the checkpoint written in ``temp`` complete and give it its final name.

    ``digests``: every file of the checkpoint (paths relative to ``temp``) with its digest.
    """
    try:
        for name in digests:  # files another writer made (DCP's shards) are 0600 too
            os.chmod(temp / name, 0o600)
        files = sorted({name.split("/")[0] for name in digests})
        marker = json.dumps({"format": FORMAT, "step": step, "files": files, **meta,
                             "digests": dict(sorted(digests.items()))}, indent=1)
        write_durably(temp / MARKER, lambda f: f.write(marker.encode()))
        sync_dir(temp)
    except BaseException:
        discard(temp)
        raise
    final = layout.step_dir(step)
    if final.exists():
        # rename() cannot replace a non-empty directory: move the old one aside first.
        trash = layout.trash_dir(step)
        os.rename(final, trash)
        os.rename(temp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(temp, final)
    sync_dir(layout.root)
    return final


def read_marker(path: Path) -> dict:
    """The metadata in the marker of the checkpoint in ``path``."""
    meta = json.loads((path / MARKER).read_text())
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    digests = meta.get("digests", {})
    if not isinstance(digests, dict) or not all(isinstance(d, dict) for d in digests.values()):
        raise ValueError("its digests are not a JSON object of objects")
    return meta


def listed_files(path: Path) -> list[str]:
    """The file names the marker of the checkpoint in ``path`` lists."""
    return list(read_marker(path).get("files", []))


def files_under(directory: Path) -> list[str]:
    """Every file below ``directory``, as paths relative to it with ``/``, sorted."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def prune(layout: CheckpointLayout, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and dead temp dirs.

    The marker goes first, so a deletion cut short leaves an incomplete directory that
    readers ignore rather than a "complete" one with files missing.
    """
    removed = []
    complete = layout.complete()
    doomed = [] if keep_last is None else complete[: max(0, len(complete) - keep_last)]
    for _, path in doomed:
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in layout.leftovers():
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
