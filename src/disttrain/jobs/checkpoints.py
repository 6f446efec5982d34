"""``checkpoint_s3_uri`` ⇄ ``checkpoint_local_path``: restored before the start, synced while running.

As on SageMaker: whatever is at the URI (any fsspec URL: ``s3://``, ``file://``, ...) is copied
into each instance's checkpoint folder before the script starts, so a restarted job resumes;
while the job runs, new or changed files are uploaded every few seconds, and once more at the
end. A file is uploaded under a temporary name and moved into place, so a reader (the next
job's restore) never sees half a checkpoint file.

disttrain's own checkpoints (:mod:`disttrain.checkpoint_layout`) stay whole on the remote side
too: a checkpoint's marker goes up after every other file of it (a sync cut short leaves a
checkpoint without marker, which readers ignore), one being written is not uploaded, and the
remote keeps the checkpoints the writing folder keeps: those its keep-last-k deleted locally
are deleted remotely, marker first.
"""

from __future__ import annotations

import os
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..checkpoint_layout import MARKER, is_scratch, is_step_dir
from ..errors import DisttrainError, UsageError
from .layout import InstancePaths

SYNC_EVERY_S = 5.0
DEFAULT_LOCAL = "/opt/ml/checkpoints"


def local_dir(inst: InstancePaths, checkpoint_local_path: str | None) -> Path:
    """The folder on this machine behind ``checkpoint_local_path`` for one instance.

    Paths under /opt/ml are the instance's own folder (what it sees at /opt/ml); any other
    path is used as written, shared by the instances on one machine.
    """
    path = checkpoint_local_path or DEFAULT_LOCAL
    if path == "/opt/ml" or path.startswith("/opt/ml/"):
        return inst.root / os.path.relpath(path, "/opt/ml")
    return Path(path)


def marker_last(names: Iterable[str]) -> list[str]:
    """``names`` (relative paths) in upload order: every checkpoint marker after every other
    file, so that a checkpoint counts on the other side only once all of it is there."""
    return sorted(names, key=lambda name: (posixpath.basename(name) == MARKER, name))


def restore(uri: str, dest: Path, storage_options: dict[str, Any]) -> int:
    """Copy everything under ``uri`` into ``dest``; the number of files (0: nothing there yet)."""
    from .staging import open_fs

    fs, root = open_fs(uri, storage_options, "checkpoint_s3_uri")
    root = root.rstrip("/")
    try:
        if not fs.exists(root):
            return 0
        files = [f for f in fs.find(root) if not f.endswith(".partial")]
        rels = []
        for remote in files:
            rel = posixpath.relpath(remote, root)
            if rel.startswith("..") or posixpath.isabs(rel):
                raise UsageError(f"checkpoint_s3_uri: {uri} lists {remote!r}, outside the prefix")
            rels.append(rel)
        for rel in marker_last(rels):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{rel}", str(target))
    except UsageError:
        raise
    except Exception as err:  # any fsspec backend's error, named with the URL
        raise UsageError(f"checkpoint_s3_uri: restoring from {uri} failed: {type(err).__name__}: {err}") from None
    return len(files)


class Syncer:
    """Uploads new/changed files of ``folders`` to ``uri`` every SYNC_EVERY_S, and at ``close``."""

    def __init__(self, uri: str, folders: list[Path], storage_options: dict[str, Any],
                 say: Callable[[str], None]) -> None:
        self.uri, self.folders, self.storage_options, self.say = uri, folders, storage_options, say
        self._seen: dict[str, tuple[int, int]] = {}
        self._remote_steps: set[str] | None = None  # checkpoint folders on the remote side
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disttrain-checkpoint-sync", daemon=True)
        self._lock = threading.Lock()
        self.error: str | None = None

    def __enter__(self) -> Syncer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(SYNC_EVERY_S):
            try:
                self.sync()
            except DisttrainError as err:  # said once; the final sync raises
                if self.error is None:
                    self.error = str(err)
                    self.say(f"disttrain: {err} (will retry)")

    def sync(self) -> int:
        """Upload what changed since the last call, then delete on the remote side the
        checkpoints the writing folder no longer keeps; the number of files uploaded."""
        from .staging import open_fs

        with self._lock:
            fs, root = open_fs(self.uri, self.storage_options, "checkpoint_s3_uri")
            root = root.rstrip("/")
            try:
                if self._remote_steps is None:
                    self._remote_steps = _step_dirs(posixpath.relpath(f, root) for f in fs.find(root)) \
                        if fs.exists(root) else set()
                files, local_steps, writers = _local_view(self.folders)
                pruned = _pruned(self._remote_steps | local_steps, writers)
                uploaded = 0
                for rel in marker_last(files):
                    if not _under(rel, pruned) and self._upload(fs, root, files[rel], rel):
                        uploaded += 1
                self._remote_steps |= _step_dirs(files) - pruned
                for step_dir in sorted(self._remote_steps & pruned):
                    self._delete(fs, f"{root}/{step_dir}")
                    self._remote_steps.discard(step_dir)
                    self._seen = {rel: mark for rel, mark in self._seen.items() if not _under(rel, {step_dir})}
            except DisttrainError:
                raise
            except Exception as err:
                raise DisttrainError(f"syncing checkpoints to {self.uri} failed: {type(err).__name__}: {err}") from None
            return uploaded

    @staticmethod
    def _delete(fs: Any, remote_dir: str) -> None:
        """Delete a remote checkpoint, its marker first: cut short, it is not a checkpoint."""
        if fs.exists(f"{remote_dir}/{MARKER}"):
            fs.rm(f"{remote_dir}/{MARKER}")
        if fs.exists(remote_dir):
            fs.rm(remote_dir, recursive=True)

    def _upload(self, fs: Any, root: str, path: Path, rel: str) -> bool:
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted since the listing (a checkpoint pruned, or replaced)
            return False
        mark = (stat.st_size, stat.st_mtime_ns)
        if self._seen.get(rel) == mark:
            return False
        remote = f"{root}/{rel}"
        partial = f"{remote}.{uuid.uuid4().hex[:8]}.partial"
        fs.makedirs(posixpath.dirname(remote), exist_ok=True)
        try:
            fs.put_file(str(path), partial)
        except FileNotFoundError:
            if path.exists():
                raise
            return False
        fs.mv(partial, remote)
        self._seen[rel] = mark
        return True


def _local_view(folders: list[Path]) -> tuple[dict[str, Path], set[str], dict[str, set[int]]]:
    """Every file to upload (relative path -> local file), every complete checkpoint
    folder, and for each folder of checkpoints the steps its writer keeps. The writer is
    the instance folder holding the newest checkpoint; the others hold what was restored
    into them."""
    files: dict[str, Path] = {}
    steps: dict[str, dict[int, set[int]]] = {}  # parent -> instance folder -> its complete steps
    for index, folder in enumerate(folders):
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if any(is_scratch(part) for part in rel.split("/")):
                continue  # a checkpoint being written or deleted
            if path.is_dir() and is_step_dir(path.name) and (path / MARKER).is_file():
                parent = posixpath.dirname(rel)
                steps.setdefault(parent, {}).setdefault(index, set()).add(_step(path.name))
            elif path.is_file():
                files.setdefault(rel, path)
    complete = {posixpath.join(parent, f"step_{step:08d}")
                for parent, by_folder in steps.items() for kept in by_folder.values() for step in kept}
    writers = {parent: max(by_folder.values(), key=max) for parent, by_folder in steps.items()}
    return files, complete, writers


def _pruned(step_dirs: set[str], writers: dict[str, set[int]]) -> set[str]:
    """The checkpoint folders the writer deleted: older than its oldest, and not its own."""
    pruned = set()
    for step_dir in step_dirs:
        parent, name = posixpath.split(step_dir)
        kept = writers.get(parent)
        if kept and _step(name) < min(kept) and _step(name) not in kept:
            pruned.add(step_dir)
    return pruned


def _step(name: str) -> int:
    return int(name[len("step_"):])


def _step_dirs(rels: Iterable[str]) -> set[str]:
    """The checkpoint folders among the parents of ``rels``."""
    found = set()
    for rel in rels:
        parts = rel.split("/")
        for depth in range(len(parts) - 1):
            if is_step_dir(parts[depth]):
                found.add("/".join(parts[: depth + 1]))
    return found


def _under(rel: str, folders: set[str]) -> bool:
    return any(rel == folder or rel.startswith(f"{folder}/") for folder in folders)
