"""``--sync``: the working directory copied to the same path on every host, over ssh.

The tutorial has no shared filesystem: code and data are copied to every node by hand.
One ssh connection per host carries a small exchange, both ends being disttrain:

1. the launcher sends a manifest (path, size, mtime of every file: :class:`~disttrain.wire.SyncOffer`);
2. the host answers (:class:`~disttrain.wire.SyncWanted`) with the paths it lacks or holds in another version (size or mtime
   differ, as rsync's quick check), so a host that already has the files -- the launcher's
   own machine, a shared filesystem, a second run -- gets nothing;
3. the launcher streams those files as a tar archive; the host unpacks them in place.

Version-control folders, caches and virtual environments are not copied: they are large,
and a virtual environment only works on the machine that made it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from ..config.hosts import Host
from ..errors import DisttrainError
from ..ssh import ssh_argv
from ..wire import SyncOffer, SyncWanted

SKIPPED_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "node_modules",
})

Manifest = dict[str, tuple[int, int]]  # relative path -> (size, whole seconds of mtime)


def manifest(root: str) -> Manifest:
    """Every file and symlink under ``root`` (skipped folders pruned), by relative path."""
    files: Manifest = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in names:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            files[os.path.relpath(path, root)] = (st.st_size, int(st.st_mtime))
    return files


def wanted(root: Path, offered: Manifest) -> list[str]:
    """The offered paths that ``root`` lacks or holds in another version."""
    need = []
    for rel, (size, mtime) in offered.items():
        try:
            st = os.lstat(root / rel)
        except OSError:
            need.append(rel)
            continue
        if (st.st_size, int(st.st_mtime)) != (size, mtime):
            need.append(rel)
    return need


def receive(root: str, stdin: BinaryIO, stdout) -> int:
    """The host's end (``disttrain receive DIR``): answer the manifest, unpack what comes."""
    target = Path(root)
    target.mkdir(parents=True, exist_ok=True)
    offered = SyncOffer.from_line(stdin.readline()).files
    need = wanted(target, offered)
    print(SyncWanted(paths=tuple(need)).to_line(), file=stdout, flush=True)
    if not need:
        return 0
    allowed = set(need)
    with tarfile.open(fileobj=stdin, mode="r|") as archive:
        for member in archive:
            # Only what was asked for, and never outside the folder.
            if member.name not in allowed or os.path.isabs(member.name) or ".." in Path(member.name).parts:
                raise DisttrainError(f"--sync: refusing unexpected archive member {member.name!r}")
            archive.extract(member, target, **_TRUSTED)
    return 0


# Python >= 3.12 warns unless told how far to trust an archive; the sender is the user.
_TRUSTED = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}


def send(host: Host, root: str, files: Manifest, *, python: str, options: Sequence[str],
         env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Bring ``host``'s copy of ``root`` up to date; (files sent, bytes sent). ``env``: what the
    receiving disttrain needs to start (its import path), as for the agent."""
    argv = ssh_argv(host, [python, "-m", "disttrain", "receive", root], options=options, env=env)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    need: list[str] = []
    try:
        proc.stdin.write(SyncOffer(files=files).to_line().encode() + b"\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        if answer:
            need = list(SyncWanted.from_line(answer).paths)
            if need:
                with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as archive:
                    for rel in need:
                        archive.add(os.path.join(root, rel), arcname=rel, recursive=False)
        proc.stdin.close()
    except (BrokenPipeError, ValueError):
        pass  # the host's end is gone; its exit status and stderr say why
    proc.stdout.read()
    err = proc.stderr.read()
    proc.wait()
    if proc.returncode != 0:
        last = (err.decode(errors="replace").strip().splitlines() or [""])[-1]
        what = "ssh failed" if proc.returncode == 255 else f"`{python} -m disttrain receive` failed"
        raise DisttrainError(f"{host.name}: --sync could not copy {root}: {what}: {last}")
    return len(need), sum(files[rel][0] for rel in need)


def sync_all(hosts: Sequence[Host], root: str, *, python: str, options: Sequence[str],
             env: Mapping[str, str] | None = None) -> None:
    """Copy ``root`` to every host in parallel, saying what went where."""
    start = time.monotonic()
    files = manifest(root)
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = [pool.submit(send, h, root, files, python=python, options=options, env=env) for h in hosts]
    for host, future in zip(hosts, futures):
        if future.exception():
            raise future.exception()
        count, size = future.result()
        state = f"{count} of {len(files)} files ({size / 1e6:.1f} MB) copied" if count else "up to date"
        print(f"disttrain: --sync {root} -> {host.name}: {state}", file=sys.stderr)
    print(f"disttrain: --sync took {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
