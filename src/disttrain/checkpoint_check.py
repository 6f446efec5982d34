"""Is a checkpoint location usable? Asked once, before any worker starts.

A mistake in ``--checkpoint-dir`` (or a job's ``checkpoint_s3_uri``) used to surface at the first
checkpoint, a minute into the run, as a failure on every rank. :func:`check_location` tells it
before the start, in one line: an unknown scheme, a store whose fsspec implementation is not
installed, a store that lives in one process's memory, a file or a kernel filesystem where a folder
should be, missing credentials, a missing bucket, a folder that cannot be written. A URL is proved
writable by one probe object, written and removed; a bucket is created only when the user asks
(``--create-bucket``): on real S3 a typo in its name would otherwise make a new bucket in the user's
account. Torch-free, like :mod:`disttrain.checkpoint_url`.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .checkpoint_url import BUCKET_STORES, check_url, is_url, store_options
from .errors import UsageError, one_line

PROBE_PREFIX = ".disttrain-probe-"
# Stores that live in the memory of one process: every worker would have its own, lost at its exit.
PROCESS_STORES = frozenset({"memory"})
# Kernel filesystems: writes there fail, or land nowhere a later run can read.
VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")
CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId",
                               "SignatureDoesNotMatch", "ExpiredToken", "DefaultCredentialsError",
                               "RefreshError", "ClientAuthenticationError"})


def check_location(value: str, *, what: str = "--checkpoint-dir", create_bucket: bool = False,
                   storage_options: dict[str, Any] | None = None, here: bool = True) -> str:
    """``value`` as the workers get it (an absolute folder, or the URL as it is) once it is known
    to be usable; else :class:`UsageError`, one line saying what is wrong and what to do.
    ``here=False``: the workers run on other hosts, so a local folder is judged only when this
    machine has it (a folder only they have cannot be checked from here)."""
    if is_url(value):
        check_url(value)
        _check_url(value, what, create_bucket, storage_options or {})
        return value
    if create_bucket:
        raise UsageError(f"--create-bucket makes an object store's bucket; {what} {value} is a local folder: drop it")
    folder = Path(os.path.abspath(value))
    _check_folder(folder, what, here)
    return str(folder)


def _check_folder(folder: Path, what: str, here: bool) -> None:
    real = os.path.realpath(folder)
    for root in VIRTUAL_ROOTS:
        if real == root or real.startswith(root + "/"):
            raise UsageError(f"{what} {folder} is on {root}, a filesystem of the kernel that holds no files: "
                             "give a folder on a disk")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == folder and folder.is_dir():
        _probe_folder(folder, what)
        return
    if not here and existing == Path(existing.anchor):
        return  # only the workers' hosts may have it
    if not existing.is_dir():
        raise UsageError(f"{what} {folder}: {existing} is a file, not a folder: give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {folder} cannot be created: {existing} is not writable by this user; "
                         "give a folder you can write")


def _probe_folder(folder: Path, what: str) -> None:
    probe = folder / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"{what} {folder} cannot be written: {err.strerror or err}; give a folder you can write") \
            from None


def _check_url(url: str, what: str, create_bucket: bool, options: dict[str, Any]) -> None:
    scheme = urlsplit(url).scheme.lower()
    refuse_process_store(url, what)
    if scheme in ("file", "local"):  # a folder on this machine, whatever the spelling
        _check_folder(Path(urlsplit(url).path), what, here=True)
        return
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url, **store_options(url, options))
    except ImportError as err:
        extra = " (pip install 'disttrain[s3]')" if scheme in ("s3", "s3a") else ""
        raise UsageError(f"{what} {url}: the {scheme}:// store is not installed: {err}{extra}") from None
    except ValueError as err:
        raise UsageError(f"{what} {url}: {err} (not a store fsspec knows); give a folder or a URL such as "
                         "s3://bucket/run") from None
    except Exception as err:  # a store's client refusing its options
        raise UsageError(f"{what} {url}: cannot open the store: {one_line(err)}") from None
    path = path.rstrip("/")
    if scheme in BUCKET_STORES:
        if not path:
            raise UsageError(f"{what} {url} names no bucket: give s3://BUCKET/FOLDER")
        _check_bucket(fs, url, path.split("/", 1)[0], what, create_bucket)
    elif create_bucket:
        raise UsageError(f"--create-bucket makes an object store's bucket; {scheme}:// has none: drop it")
    _probe_url(fs, url, path, what, create_bucket=create_bucket)


def refuse_process_store(url: str, what: str) -> None:
    """A store in one process's memory (``memory://``) refused where several processes, or a later
    run, must read what is written: each worker would write its own, lost when the job ends."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in PROCESS_STORES:
        raise UsageError(f"{what} {url}: a {scheme}:// store lives in one process's memory, so every worker "
                         "would write its own and all of it is lost when the job ends; give a folder or an "
                         "object store (s3://, gs://...)")


def _check_bucket(fs: Any, url: str, bucket: str, what: str, create_bucket: bool) -> None:
    """The bucket exists (or is made, when asked); a client error is told as what it means."""
    try:
        fs.invalidate_cache()
        fs.ls(bucket, detail=False)  # listing needs the bucket and credentials both
        return
    except FileNotFoundError:
        pass
    except Exception as err:
        raise _store_refused(url, what, err) from None
    if not create_bucket:
        offer = ", or pass --create-bucket to have disttrain create it" if what == "--checkpoint-dir" else ""
        raise UsageError(f"{what} {url}: bucket {bucket} does not exist; create it{offer} (disttrain never "
                         "creates one unasked: a typo would make a new bucket in your account)")
    try:
        fs.mkdir(bucket)
    except Exception as err:
        raise UsageError(f"{what} {url}: cannot create bucket {bucket}: {one_line(err)}") from None


def _probe_url(fs: Any, url: str, path: str, what: str, *, create_bucket: bool) -> None:
    probe = f"{path}/{PROBE_PREFIX}{uuid.uuid4().hex}" if path else f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        if urlsplit(url).scheme.lower() not in BUCKET_STORES:
            if fs.isfile(path):
                raise UsageError(f"{what} {url} is a file, not a folder: give a folder")
            fs.makedirs(path, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except UsageError:
        raise
    except Exception as err:
        raise _store_refused(url, what, err) from None


def _store_refused(url: str, what: str, err: BaseException) -> UsageError:
    names = {type(e).__name__ for e in _chain(err)}
    if names & CREDENTIAL_ERRORS or isinstance(err, PermissionError):
        return UsageError(f"{what} {url}: the store refused the credentials ({one_line(err)}); for S3 set "
                          "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                          "(AWS_ENDPOINT_URL for another server)")
    if isinstance(err, (FileNotFoundError, NotADirectoryError)):
        return UsageError(f"{what} {url} cannot be written: {one_line(err)}; give a folder that exists")
    return UsageError(f"{what} {url} cannot be written: {one_line(err)}")


def _chain(err: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen
