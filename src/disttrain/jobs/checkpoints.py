"""``checkpoint_s3_uri`` ⇄ ``checkpoint_local_path``: restored before the start, synced while running.

As on SageMaker: whatever is at the URI (any fsspec URL: ``s3://``, ``file://``, ...) is copied
into each instance's checkpoint folder before the script starts, so a restarted job resumes;
while the job runs, new or changed files are uploaded every few seconds, and once more at the
end. A file is uploaded under a temporary name and moved into place, so a reader (the next
job's restore) never sees half a checkpoint file.
"""

from __future__ import annotations

import os
import posixpath
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def restore(uri: str, dest: Path, storage_options: dict[str, Any]) -> int:
    """Copy everything under ``uri`` into ``dest``; the number of files (0: nothing there yet)."""
    from .staging import open_fs

    fs, root = open_fs(uri, storage_options, "checkpoint_s3_uri")
    root = root.rstrip("/")
    try:
        if not fs.exists(root):
            return 0
        files = [f for f in fs.find(root) if not f.endswith(".partial")]
        for remote in files:
            rel = posixpath.relpath(remote, root)
            if rel.startswith("..") or posixpath.isabs(rel):
                raise UsageError(f"checkpoint_s3_uri: {uri} lists {remote!r}, outside the prefix")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(target))
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
        """Upload what changed since the last call; the number of files uploaded."""
        from .staging import open_fs

        with self._lock:
            fs, root = open_fs(self.uri, self.storage_options, "checkpoint_s3_uri")
            root = root.rstrip("/")
            uploaded = 0
            for folder in self.folders:
                for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                    rel = path.relative_to(folder).as_posix()
                    stat = path.stat()
                    mark = (stat.st_size, stat.st_mtime_ns)
                    if self._seen.get(rel) == mark:
                        continue
                    remote = f"{root}/{rel}"
                    partial = f"{remote}.{uuid.uuid4().hex[:8]}.partial"
                    try:
                        fs.makedirs(posixpath.dirname(remote), exist_ok=True)
                        fs.put_file(str(path), partial)
                        fs.mv(partial, remote)
                    except Exception as err:
                        raise DisttrainError(f"syncing checkpoints to {self.uri} failed: "
                                             f"{type(err).__name__}: {err}") from None
                    self._seen[rel] = mark
                    uploaded += 1
            return uploaded
