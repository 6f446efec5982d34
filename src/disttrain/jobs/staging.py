"""Getting a job's inputs into place: code and channels, from local paths or any fsspec URL.

Local inputs are linked (no copy of a large dataset per instance); a URL (``s3://`` through
s3fs, ``gs://``, ``https://``, ...) is copied once into the job directory and linked into
every instance. Everything is checked first, so a missing channel is reported, naming the
channel and the URL, before anything is copied or started.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint_url import store_options
from ..errors import UsageError
from .layout import JobLayout
from .spec import JobSpec, is_url
from .tarballs import safe_extract

TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def local_path(location: str) -> Path | None:
    """The local path ``location`` names (a plain path or ``file://``), else None."""
    if location.startswith("file://"):
        return Path(location[len("file://"):])
    return None if is_url(location) else Path(location)


def open_fs(url: str, storage_options: dict[str, Any], key: str):
    """``(filesystem, path)`` for ``url``; a missing protocol package is named with its fix."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **store_options(url, storage_options))
    except ImportError as err:
        extra = " (pip install 'disttrain[s3]')" if url.startswith("s3://") else ""
        raise UsageError(f"{key}: cannot open {url}: {err}{extra}") from None
    except (ValueError, TypeError) as err:
        raise UsageError(f"{key}: cannot open {url}: {err}") from None


def _exists(location: str, storage_options: dict[str, Any], key: str) -> bool:
    path = local_path(location)
    if path is not None:
        return path.exists()
    fs, remote = open_fs(location, storage_options, key)
    try:
        return fs.exists(remote)
    except Exception as err:  # credentials, endpoint, network: all reported the same way
        raise UsageError(f"{key}: cannot reach {location}: {type(err).__name__}: {err}") from None


def check_inputs(spec: JobSpec) -> None:
    """Every channel and the entry point exist: a clear error now, not a failure mid-run."""
    source, entry = spec.program.source_dir, spec.program.entry_point
    storage_options = spec.container.storage_options
    if source.endswith(TARBALL_SUFFIXES):
        if not _exists(source, storage_options, "source_dir"):
            raise UsageError(f"source_dir: {source} does not exist")
    else:
        path = local_path(source)
        if path is None:
            raise UsageError(f"source_dir: {source} must be a local folder or a .tar.gz (local or a URL)")
        if not path.is_dir():
            raise UsageError(f"source_dir: {path} is not a folder")
        if entry and not (path / entry).is_file():  # a command job may name no entry point
            raise UsageError(f"entry_point: {entry} not found in source_dir {path}")
    for channel, location in spec.container.inputs.items():
        if not _exists(location, storage_options, f"inputs.{channel}"):
            raise UsageError(f"inputs.{channel}: {location} does not exist")


def code_folder(spec: JobSpec, layout: JobLayout) -> Path:
    """The folder the script runs in: ``source_dir`` itself, or the job's ``code/`` its tarball goes to."""
    source = spec.program.source_dir
    if not source.endswith(TARBALL_SUFFIXES):
        return Path(local_path(source) or source)
    return layout.code


def stage_source(spec: JobSpec, layout: JobLayout) -> Path:
    """The folder the script runs in (:func:`code_folder`), with a tarball extracted safely into it."""
    source = spec.program.source_dir
    if not source.endswith(TARBALL_SUFFIXES):
        return code_folder(spec, layout)
    archive = local_path(source)
    if archive is None:
        archive = layout.packed / "sourcedir" / posixpath.basename(source)
        _copy(source, archive.parent, spec.container.storage_options, "source_dir")
    safe_extract(archive, layout.code)
    if spec.program.entry_point and not (layout.code / spec.program.entry_point).is_file():
        raise UsageError(f"entry_point: {spec.program.entry_point} not found in source_dir {source}")
    return layout.code


def stage_channels(spec: JobSpec, layout: JobLayout, say=print) -> None:
    for channel, location in sorted(spec.container.inputs.items()):
        path = local_path(location)
        if path is None:
            say(f"disttrain: staging channel {channel} from {location}")
            path = layout.staged_channel(channel)
            _copy(location, path, spec.container.storage_options, f"inputs.{channel}")
        for inst in layout.instances:
            _link_channel(path.resolve(), inst.channel(channel))


def _link_channel(source: Path, channel_dir: Path) -> None:
    if source.is_dir():
        channel_dir.symlink_to(source, target_is_directory=True)
    else:  # a channel is a folder; a single file appears inside it
        channel_dir.mkdir(parents=True, exist_ok=True)
        (channel_dir / source.name).symlink_to(source)


def _copy(location: str, dest: Path, storage_options: dict[str, Any], key: str) -> None:
    """Copy a remote file, or every file under a remote folder, into ``dest``; whole or not at all."""
    fs, root = open_fs(location, storage_options, key)
    partial = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        root = root.rstrip("/")
        if fs.isdir(root):
            files = [(f, posixpath.relpath(f, root)) for f in fs.find(root)]
        else:
            files = [(root, posixpath.basename(root))]
        for remote, rel in files:
            if rel.startswith("..") or posixpath.isabs(rel):  # a listing must stay under the prefix
                raise UsageError(f"{key}: {location} lists {remote!r}, outside the prefix")
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(target))
        os.replace(partial, dest)
    except UsageError:
        raise
    except Exception as err:  # any fsspec backend's error, named with the URL
        raise UsageError(f"{key}: copying {location} failed: {type(err).__name__}: {err}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
