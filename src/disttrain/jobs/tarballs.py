"""``model.tar.gz`` and friends: packed with relative names, extracted without escaping.

A tarball from elsewhere (a ``source_dir`` on S3, an artifact someone uploaded) may name
``../../etc/cron.d/x``, an absolute path, or a link pointing out of the folder; extracting
it naively writes outside the destination. Every member is checked first and the whole
archive refused, naming the member, before anything is written.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path, PurePosixPath

from ..atomic import atomic_path
from ..errors import UsageError


def pack_dir(src: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """``src``'s contents (not the folder itself, as SageMaker packs /opt/ml/model) → ``dest``.

    Written to a temporary name next to ``dest`` and renamed, so a reader never sees half an archive.
    """
    src, dest = Path(src), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp, tarfile.open(tmp, mode="w:gz") as tar:
        for path in sorted(src.rglob("*")) if src.is_dir() else ():
            tar.add(path, arcname=path.relative_to(src).as_posix(), recursive=False)
    return dest


def _unsafe_reason(member: tarfile.TarInfo, dest: Path) -> str | None:
    name = PurePosixPath(member.name)
    if name.is_absolute() or member.name.startswith(("/", "\\")):
        return "is an absolute path"
    if ".." in name.parts:
        return "climbs out with '..'"
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return "is a device, fifo or other special file"
    if member.issym() or member.islnk():
        target = PurePosixPath(member.linkname)
        base = dest / name.parent if member.issym() else dest
        if target.is_absolute() or not os.path.normpath(base / target).startswith(str(dest) + os.sep):
            return f"links outside the destination (to {member.linkname!r})"
    return None


def safe_extract(archive: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Extract ``archive`` into ``dest``; refuse the whole archive if any member would escape it."""
    dest = Path(dest).resolve()
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                reason = _unsafe_reason(member, dest)
                if reason:
                    raise UsageError(f"refusing to extract {archive}: member {member.name!r} {reason}")
            dest.mkdir(parents=True, exist_ok=True)
            # The "data" filter (Python >= 3.12, and backported to 3.10.12/3.11.4) checks
            # the same again and also drops set-uid bits and odd permissions.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:  # pragma: no cover - old interpreters; every member was checked above
                tar.extractall(dest, members=members)
    except (tarfile.TarError, OSError) as err:
        raise UsageError(f"cannot extract {archive}: {err}") from None
    return dest
