"""``model.tar.gz`` and friends: packed with relative names, extracted without escaping.

A tarball from elsewhere (a ``source_dir`` on S3, an artifact someone uploaded) may name
``../../etc/cron.d/x``, an absolute path, or a link pointing out of the folder; extracting
it naively writes outside the destination. Every member is checked first and the whole
archive refused, naming the member, before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import zlib
from pathlib import Path, PurePosixPath

from ..atomic import atomic_path
from ..errors import UsageError


def pack_dir(src: str | os.PathLike, dest: str | os.PathLike, *, mode: int = 0o600) -> Path:
    """``src``'s contents (not the folder itself, as SageMaker packs /opt/ml/model) → ``dest``.

    Written to a temporary name next to ``dest`` and renamed, so a reader never sees half an archive;
    ``mode``: a job's artifacts are its owner's only.
    """
    src, dest = Path(src), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest, mode=mode) as tmp, tarfile.open(tmp, mode="w:gz") as tar:
        for path in sorted(src.rglob("*")) if src.is_dir() else ():
            tar.add(path, arcname=path.relative_to(src).as_posix(), recursive=False)
    return dest


MAX_LINK_HOPS = 40  # as the kernel's ELOOP limit: a longer chain is refused, not followed


class _Refused(Exception):
    """A member that would land (or point) outside the destination; ``str`` says why."""


class _Tree:
    """What the destination holds at each point of the extraction, without touching the disk.

    Every member's place is resolved against the links extracted before it (and any already
    in the folder), as the kernel would resolve it when the member is written. Names alone
    are not enough: ``d/l -> ../..`` then ``s -> d/l/..`` then ``s/evil`` each look harmless.
    """

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.links: dict[tuple[str, ...], str] = {}
        self.kinds: dict[tuple[str, ...], str] = {}  # "file", "dir" or "link", per member written
        self.sources: dict[tuple[str, ...], tuple[str, ...]] = {}  # hard link → the file it copies

    def _link_at(self, parts: tuple[str, ...]) -> str | None:
        if parts in self.links:
            return self.links[parts]
        if parts in self.kinds:
            return None
        on_disk = self.dest.joinpath(*parts)
        return os.readlink(on_disk) if on_disk.is_symlink() else None

    def _kind_at(self, parts: tuple[str, ...]) -> str | None:
        if parts in self.kinds:
            return self.kinds[parts]
        on_disk = self.dest.joinpath(*parts)
        if on_disk.is_symlink():
            return "link"
        return "dir" if on_disk.is_dir() else "file" if on_disk.exists() else None

    def resolve(self, start: tuple[str, ...], path: str, hops: int = 0) -> tuple[str, ...]:
        """``path`` (relative to the folder ``start``) → its place inside dest, links followed."""
        if path.startswith("/"):
            raise _Refused(f"links outside the destination (to {path!r})")
        current = list(start)
        for part in path.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not current:
                    raise _Refused("would land outside the destination")
                current.pop()
                continue
            target = self._link_at((*current, part))
            if target is None:
                current.append(part)
                continue
            if hops >= MAX_LINK_HOPS:
                raise _Refused("goes through too many links")
            if target.startswith("/"):
                raise _Refused(f"goes through a link outside the destination (to {target!r})")
            current = list(self.resolve(tuple(current), target, hops + 1))
        return tuple(current)

    def place(self, member: tarfile.TarInfo) -> tuple[str, ...]:
        """Where ``member`` is written: its folder resolved, its own name not followed."""
        *parent, name = _parts(member)
        where = (*self.resolve((), "/".join(parent)), name)
        for depth in range(1, len(where)):
            if self._kind_at(where[:depth]) == "file":
                raise _Refused(f"would be inside {'/'.join(where[:depth])!r}, a file, not a folder")
        existing = self._kind_at(where)
        if existing == "link" and not member.issym():  # writing a file there would write through the link
            raise _Refused("would replace a link extracted before it")
        if existing == "dir" and not member.isdir():
            raise _Refused("would replace a folder extracted before it")
        if member.issym() or member.islnk():
            try:  # a symlink is relative to its folder, a hard link's name to the archive's root
                source = self.resolve(where[:-1] if member.issym() else (), member.linkname)
            except _Refused:
                raise _Refused(f"links outside the destination (to {member.linkname!r})") from None
        if member.issym():
            self.links[where] = member.linkname
            self.kinds[where] = "link"
        elif member.islnk():
            if self.kinds.get(source) != "file":
                raise _Refused(f"is a hard link to {member.linkname!r}, which is not a file earlier in the archive")
            self.kinds[where] = "file"
            self.sources[where] = source
        else:
            self.links.pop(where, None)
            self.kinds[where] = "dir" if member.isdir() else "file"
        return where

    def recheck_links(self) -> None:
        """A link may point somewhere that a later member turned into a way out."""
        for where, target in self.links.items():
            try:
                self.resolve(where[:-1], target)
            except _Refused:
                raise _Refused(f"links outside the destination (to {target!r})") from None


def _parts(member: tarfile.TarInfo) -> list[str]:
    name = PurePosixPath(member.name)
    if name.is_absolute() or member.name.startswith(("/", "\\")):
        raise _Refused("is an absolute path")
    if ".." in name.parts:
        raise _Refused("climbs out with '..'")
    parts = [p for p in name.parts if p not in ("", ".")]
    if not parts:
        raise _Refused("has no name")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise _Refused("is a device, fifo or other special file")
    return parts


def _plan(tar: tarfile.TarFile, archive, dest: Path) -> tuple[_Tree, list[tuple[tarfile.TarInfo, tuple[str, ...]]]]:
    tree = _Tree(dest)
    placed = []
    for member in tar.getmembers():
        try:
            if (member.issym() or member.islnk()) and (member.linkname.startswith("/") or not member.linkname):
                raise _Refused(f"links outside the destination (to {member.linkname!r})")
            placed.append((member, tree.place(member)))
        except _Refused as why:
            raise UsageError(f"refusing to extract {archive}: member {member.name!r} {why}") from None
    try:
        tree.recheck_links()
    except _Refused as why:
        raise UsageError(f"refusing to extract {archive}: {why}") from None
    return tree, placed


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, where: tuple[str, ...], tree: _Tree) -> None:
    dest = tree.dest
    path = dest.joinpath(*where)
    path.parent.mkdir(parents=True, exist_ok=True)
    if member.isdir():
        path.mkdir(exist_ok=True)
        return
    if path.is_symlink() or path.is_file():  # a later member of the same name wins, as with tar
        path.unlink()
    if member.issym():
        os.symlink(member.linkname, path)
    elif member.islnk():
        os.link(dest.joinpath(*tree.sources[where]), path, follow_symlinks=False)
    else:
        # No set-uid/set-gid/sticky bits and nothing writable by others, as Python's "data" filter.
        mode = (member.mode & 0o755) | 0o600
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as out:
            source = tar.extractfile(member)
            if source is not None:
                shutil.copyfileobj(source, out)
        with contextlib.suppress(OSError, OverflowError, ValueError):  # a time out of range is no reason to fail
            os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def safe_extract(archive: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Extract ``archive`` into ``dest``; refuse the whole archive if any member would escape it.

    The rules are disttrain's own, the same on every Python (``filter="data"`` only exists from
    3.10.12/3.11.4/3.12): every member is placed against what the members before it made, and
    the archive is refused, naming the member, before anything is written.
    """
    dest = Path(dest).resolve()
    try:
        with tarfile.open(archive) as tar:
            tree, placed = _plan(tar, archive, dest)
            fresh = not dest.exists()
            dest.mkdir(parents=True, exist_ok=True)
            try:
                for member, where in placed:
                    _write(tar, member, where, tree)
            except BaseException:
                if fresh:  # a full disk, a truncated archive: leave no half-extracted folder
                    shutil.rmtree(dest, ignore_errors=True)
                raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise UsageError(f"cannot extract {archive}: {err}") from None
    return dest
