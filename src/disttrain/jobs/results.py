"""What a finished job leaves: artifacts at ``output_path/<job name>/`` and its final metrics."""

from __future__ import annotations

import errno
import json
import os
import posixpath
import shutil
import uuid
from pathlib import Path
from typing import Any

from ..errors import DisttrainError
from ..workerenv import rank_file
from .layout import JobLayout, private_folder
from .staging import open_fs
from .tarballs import pack_dir


def final_metrics(logs: Path) -> dict | None:
    """The last JSON object line rank 0 printed (of its last attempt), or None."""
    numbers = (p.name.removeprefix("attempt_") for p in logs.glob("attempt_*"))
    attempts = sorted((int(n) for n in numbers if n.isdigit()), reverse=True)
    candidates = [rank_file(logs, 0, a, "stdout") for a in attempts]
    candidates.append(logs / "rank0.log")  # the relayed copy, e.g. when the attempt files live on another host
    for path in candidates:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            line = line.strip()
            if line.startswith("{") and line.endswith("}"):
                try:
                    value = json.loads(line)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    return value
        return None
    return None


def artifact_url(output_path: str, job_name: str, filename: str) -> str:
    """``output_path/<job name>/<filename>``; an output_path of ``/`` (or ``file:///``) is the root,
    not the empty string that stripping its slash would leave (a path relative to the runner's cwd)."""
    stripped = output_path.rstrip("/")
    if not stripped or stripped.endswith(":"):  # "/" or "file:///": keep the root's own slash(es)
        stripped = output_path[:len(stripped) + (3 if stripped else 1)]
    return posixpath.join(stripped, job_name, filename)


def upload_artifacts(layout: JobLayout, *, output_path: str, job_name: str,
                     storage_options: dict[str, Any]) -> dict[str, str]:
    """algo-1's ``model/`` → ``model.tar.gz``, its ``output/data/`` → ``output.tar.gz``."""
    packed = {
        "model": _pack(layout.first.model, layout.packed / "model.tar.gz"),
        "output": _pack(layout.first.output_data, layout.packed / "output.tar.gz"),
    }
    urls = {}
    for kind, local in packed.items():
        url = artifact_url(output_path, job_name, local.name)
        _publish(local, url, storage_options)
        urls[kind] = url
    return urls


def _pack(src: Path, dest: Path) -> Path:
    """:func:`pack_dir`, its failure in one line (a full disk is the usual one: say how much is free)."""
    try:
        return pack_dir(src, dest)
    except OSError as err:
        why = err.strerror or str(err)
        if err.errno == errno.ENOSPC:
            try:
                why += f" ({shutil.disk_usage(dest.parent).free / 2**20:.1f} MiB free there)"
            except OSError:
                pass
            why += "; free space, or set DISTTRAIN_HOME to a file system with room for the packed model"
        raise DisttrainError(f"packing {src} into {dest} failed: {why}") from None


def _publish(local: Path, url: str, storage_options: dict[str, Any]) -> None:
    """Upload under a temporary name, then move into place: a reader never sees half a file. On this
    machine's filesystem the job's folder is 0700 and the file 0600, as the job's own folder."""
    from fsspec.implementations.local import LocalFileSystem

    fs, path = open_fs(url, storage_options, "output_path")
    partial = f"{path}.{uuid.uuid4().hex[:8]}.partial"
    try:
        if isinstance(fs, LocalFileSystem):
            private_folder(Path(posixpath.dirname(path)))  # before the file: never reachable by others
        else:
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.put_file(str(local), partial)
        if isinstance(fs, LocalFileSystem):
            os.chmod(partial, 0o600)
        fs.mv(partial, path)
    except BaseException as err:  # a stop (SIGTERM) mid-upload leaves no partial object either
        try:
            if fs.exists(partial):
                fs.rm(partial)
        except Exception:  # the upload error below is what matters
            pass
        if isinstance(err, Exception):  # any fsspec backend's error, named with the URL
            raise DisttrainError(f"uploading {local.name} to {url} failed: {type(err).__name__}: {err}") from None
        raise
