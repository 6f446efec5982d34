"""Files that are whole or absent: the one temp-file-and-rename helper of the package.

A reader (another host on a shared filesystem, a resumed run, ``jobs show``) must never see
half a file. Everything is written to a temporary name in the same folder (``os.replace`` is
atomic only within one filesystem) and renamed over the target; a failure removes the
temporary file. ``mode`` is applied before the rename, so a private file (0600) is never
readable by others, not even for an instant.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = None) -> Iterator[Path]:
    """A temporary path to write (with any writer: ``torch.save``, ``tarfile``, ``savefig``);
    renamed to ``path`` when the block ends without an exception."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o644 if mode is None else mode)  # mkstemp makes 0600; keep the usual mode unless asked
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` (text or bytes) to ``path``, whole or not at all."""
    with atomic_path(path, mode=mode) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
    return Path(path)
