"""Checkpoints at an fsspec URL (``s3://``, ``gs://``, ``file://``, ``memory://``): the layout of
:mod:`disttrain.checkpoint_layout`, committed without a rename.

::

    s3://bucket/run/
        step_00000100/    state.pt, rank_00000.pt ..., sharded/ (DCP's files), COMPLETE

Object stores have no atomic rename of a folder, so a step's objects are written under their final
names and the step counts only once its marker exists -- written last, after every object it lists
was read back from the store and matched the size and SHA-256 it was written with (or, for the
shards torch.distributed.checkpoint writes, the extents its ``.metadata`` says they hold). An upload
cut short (a killed process, a dropped connection, a store that acknowledged bytes it then lost:
pytorch#183878) therefore leaves a folder without a marker, which readers never take, and the next
writer of the same step removes the marker first. Pruning removes the marker before the objects too.

Credentials and the endpoint come from the store's own chain (for S3: the AWS variables, profiles,
instance roles; ``AWS_ENDPOINT_URL`` for an S3-compatible server), never from the URL: a URL with a
user or password in it is refused, so that no secret reaches a command line or a log. Torch-free,
like :mod:`disttrain.checkpoint_layout`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .checkpoint_layout import DIGEST, FORMAT, MARKER, SHARDED_DIR, CheckpointLayout, FileDigest
from .checkpoint_retry import DEFAULT_RETRY_S, StoreRetry, retrying
from .errors import UsageError, one_line

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 8 << 20
# Stores whose first path component is a bucket (or container).
BUCKET_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def is_url(location: Any) -> bool:
    """Whether ``location`` names a checkpoint folder by URL (``scheme://...``), not a local path."""
    return isinstance(location, RemotePath) or (isinstance(location, str) and _URL.match(location) is not None)


def location(value: Any) -> Path | str:
    """A checkpoint folder as the runtime keeps it: a URL as it is, a local path as a ``Path``."""
    if isinstance(value, RemotePath):
        return str(value)
    return value if is_url(value) else Path(value)


def join(folder: Path | str, name: str) -> Path | str:
    """``folder/name`` for a local path or a URL (``Path`` would collapse the URL's ``//``)."""
    return f"{folder.rstrip('/')}/{name}" if isinstance(folder, str) else folder / name


@dataclass(frozen=True)
class RemotePath:
    """A path on a store: its fsspec filesystem and the path as that filesystem names it. ``/``,
    ``name`` and ``parent`` as a ``Path`` has them, so messages read the same for both."""

    fs: Any
    path: str
    # the store's retry (checkpoint_retry.StoreRetry), for writers that reach it by other means: DCP's
    retry: Any = field(default=None, compare=False, repr=False)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.fs, f"{self.path.rstrip('/')}/{name}", self.retry)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, self.path.rstrip("/").rsplit("/", 1)[0], self.retry)

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)


def check_url(url: str) -> str:
    """``url``, refused when it carries a user or password (they would reach command lines and logs)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise UsageError(f"checkpoint URL {parts.scheme}://{parts.hostname}/...: take the user and password "
                         "out of the URL; credentials come from the store's own chain (for S3: AWS_ACCESS_KEY_ID/"
                         "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role; AWS_ENDPOINT_URL for the server)")
    return url


def s3_endpoint() -> str | None:
    """The S3-compatible server the AWS variables name (``AWS_ENDPOINT_URL_S3`` first), or None for AWS."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def store_options(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsspec's options for ``url``. For S3, the endpoint that ``AWS_ENDPOINT_URL(_S3)`` names is made an
    option: fsspec keeps one filesystem per set of options, and one made while the variable named another
    endpoint would otherwise be handed back."""
    options = dict(options or {})
    endpoint = s3_endpoint()
    if (urlsplit(url).scheme.lower() in ("s3", "s3a") and endpoint and "endpoint_url" not in options
            and "endpoint_url" not in options.get("client_kwargs", {})):
        options["endpoint_url"] = endpoint
    return options


def open_url(url: str) -> RemotePath:
    """The store behind ``url``; one line naming what to install or fix when it cannot be opened."""
    parts = urlsplit(check_url(url))
    try:
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise UsageError("checkpoints at a URL need fsspec: pip install fsspec") from None
    try:
        fs, path = url_to_fs(url, **store_options(url))
    except ImportError as err:
        extra = " (pip install 'disttrain[s3]')" if parts.scheme in ("s3", "s3a") else ""
        raise UsageError(f"cannot open checkpoint URL {url}: {err}{extra}") from None
    except ValueError as err:
        raise UsageError(f"cannot open checkpoint URL {url}: {err}") from None
    return RemotePath(fs, path.rstrip("/") or path)


def has_buckets(fs: Any) -> bool:
    """Whether ``fs`` keeps objects in buckets, which only the user creates (``--create-bucket``):
    a missing one is a typo, and a save must not make it."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(set(protocols) & BUCKET_STORES)


def _store_op(method: Callable) -> Callable:
    """The store's client raises its own errors (botocore's ``EndpointConnectionError``,
    ``NoCredentialsError``...): told as an ``OSError`` of one line, which the checkpoint's
    reader and writer already turn into one line on every rank -- once the layout's retry
    (:mod:`disttrain.checkpoint_retry`) has given up on an outage."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return retrying(getattr(self, "retry", None), method, self, *args, **kwargs)
        except OSError:
            raise
        except Exception as err:
            raise OSError(one_line(err)) from err

    return wrapper


def digest_bytes(data: bytes) -> FileDigest:
    return {DIGEST: hashlib.new(DIGEST, data).hexdigest(), "bytes": len(data)}


def _mismatch(name: str, actual: FileDigest, expected: FileDigest) -> str | None:
    if actual["bytes"] != expected.get("bytes"):
        return f"{name} has {actual['bytes']} bytes, {expected.get('bytes')} were written"
    if actual[DIGEST] != expected.get(DIGEST):
        return f"{name} does not match its {DIGEST} digest (changed after it was written)"
    return None


class RemoteLayout:
    """The names and the operations of a checkpoint folder on a store (what
    :class:`~disttrain.checkpoint_layout.CheckpointLayout` is for a local one)."""

    rank_file = staticmethod(CheckpointLayout.rank_file)
    # The step folders this process last saw under each root (listed, written or removed by it), so
    # that a save of a step known to be absent skips the deletes of begin(): they are requests to
    # the store on the path that blocks the training step. Only one job writes a folder at a time.
    _seen: dict[str, set[int]] = {}

    # One retry per store and bound in a process, so that an outage is told once whatever reaches it.
    _retries: dict[tuple[str, float], StoreRetry] = {}

    def __init__(self, root: RemotePath, *, retry_s: float | None = None) -> None:
        self.fs = root.fs
        bound = DEFAULT_RETRY_S if retry_s is None else retry_s
        key = (str(root), bound)
        self.retry = self._retries.get(key) or self._retries.setdefault(key, StoreRetry(str(root), bound))
        self.root = RemotePath(root.fs, root.path, self.retry)
        # What load reads whole (rank 0's file, a rank file): fetched once, for its digest check
        # and for torch.load both, which run on two threads at once.
        self._fetched: dict[str, bytes] = {}
        self._fetching: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    @classmethod
    def at(cls, url: str, *, retry_s: float | None = None) -> RemoteLayout:
        return cls(open_url(url), retry_s=retry_s)

    def step_dir(self, step: int) -> RemotePath:
        return self.root / f"step_{step:08d}"

    @_store_op
    def _steps(self) -> dict[int, bool]:
        """Every step folder in the root, and whether it holds the marker."""
        self.fs.invalidate_cache()  # another host may have written or pruned since
        try:
            entries = self.fs.ls(self.root.path, detail=False)
        except FileNotFoundError:
            return {}
        steps = {}
        for entry in entries:
            match = _STEP_DIR.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1])
            if match:
                steps[int(match.group(1))] = False
        for marker in self.fs.glob(f"{self.root.path}/step_*/{MARKER}"):
            match = _STEP_DIR.fullmatch(marker.rstrip("/").rsplit("/", 2)[-2])
            if match:
                steps[int(match.group(1))] = True
        self._seen[str(self.root)] = set(steps)
        return steps

    def complete(self) -> list[tuple[int, RemotePath]]:
        """``(step, folder)`` of every checkpoint with a marker, oldest first."""
        return [(step, self.step_dir(step)) for step, whole in sorted(self._steps().items()) if whole]

    # -- reading (the three operations checkpoint_read asks of a layout) ------------------------

    @_store_op
    def marker(self, path: RemotePath) -> dict:
        meta = json.loads(self.fs.cat_file((path / MARKER).path))
        if not isinstance(meta, dict) or not isinstance(meta.get("digests", {}), dict):
            raise ValueError("not a JSON object with digests")
        return meta

    def check(self, path: RemotePath, name: str, expected: FileDigest) -> str | None:
        """Why the object ``path/name`` is not the one its digest describes, or None when it is.
        A shard is streamed through the digest (DCP reads it again itself); a file that load
        reads whole is fetched once, for both."""
        try:
            if name.startswith(f"{SHARDED_DIR}/"):
                actual = self.digest(path / name)
            else:
                actual = digest_bytes(self._whole(path / name))
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} is unreadable: {err}"
        return _mismatch(name, actual, expected)

    @_store_op
    def source(self, path: RemotePath, name: str) -> io.BytesIO:
        """The object ``path/name`` read whole, for ``torch.load``."""
        return io.BytesIO(self._whole(path / name))

    @_store_op
    def _whole(self, target: RemotePath) -> bytes:
        with self._lock:
            once = self._fetching.setdefault(target.path, threading.Lock())
        with once:
            if target.path not in self._fetched:
                self._fetched[target.path] = self.fs.cat_file(target.path)
        return self._fetched[target.path]

    # -- writing --------------------------------------------------------------------------------

    @_store_op
    def digest(self, target: RemotePath) -> FileDigest:
        """The size and digest of the object as the store gives it back (streamed)."""
        digest = hashlib.new(DIGEST)
        size = 0
        with self.fs.open(target.path, "rb", block_size=_CHUNK, cache_type="none") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return {DIGEST: digest.hexdigest(), "bytes": size}

    @_store_op
    def files_under(self, folder: RemotePath) -> list[str]:
        """Every object below ``folder``, as paths relative to it, sorted."""
        self.fs.invalidate_cache(folder.path)
        prefix = folder.path.rstrip("/") + "/"
        try:
            found = self.fs.find(folder.path)
        except FileNotFoundError:
            return []
        return sorted(p[len(prefix):] for p in found if p.startswith(prefix))

    @_store_op
    def put(self, folder: RemotePath, name: str, data: bytes) -> FileDigest:
        """Upload ``data`` as ``folder/name`` and read it back: its digest once the store holds
        exactly these bytes, else an ``OSError`` naming the object."""
        expected = digest_bytes(data)
        target = folder / name
        if not has_buckets(self.fs):  # a local or memory store needs the folder; s3fs would make a bucket
            self.fs.makedirs(folder.path, exist_ok=True)
        self.fs.pipe_file(target.path, data)
        self.fs.invalidate_cache(target.path)
        problem = _mismatch(name, self.digest(target), expected)  # read back from the store
        if problem is not None:
            raise OSError(f"{target} was not stored whole: {problem}")
        return expected

    def begin(self, step: int) -> RemotePath:
        """The folder of ``step``, emptied: a checkpoint already there (a resumed run saving the
        same step again, or an upload cut short) loses its marker first, then its objects."""
        folder = self.step_dir(step)
        seen = self._seen.get(str(self.root))
        if seen is None or step in seen:
            self.discard(folder)
        self._seen.setdefault(str(self.root), set()).add(step)
        return folder

    @_store_op
    def discard(self, folder: RemotePath | None) -> None:
        if folder is None:
            return
        try:
            self.fs.rm_file((folder / MARKER).path)
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(folder.path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(folder.path)

    def publish(self, step: int, digests: dict[str, FileDigest], meta: dict) -> RemotePath:
        """Write the marker of ``step`` -- call it only once every object in ``digests`` was
        verified on the store -- and read it back."""
        files = sorted({name.split("/")[0] for name in digests})
        marker = json.dumps({"format": FORMAT, "step": step, "files": files, **meta,
                             "digests": dict(sorted(digests.items()))}, indent=1)
        folder = self.step_dir(step)
        self.put(folder, MARKER, marker.encode())
        return folder

    def prune(self, keep_last: int | None) -> list[RemotePath]:
        """Delete all but the newest ``keep_last`` complete checkpoints (marker first), and the
        folders without a marker older than the newest complete one (uploads cut short)."""
        steps = self._steps()
        whole = sorted(step for step, done in steps.items() if done)
        doomed = [] if keep_last is None else whole[: max(0, len(whole) - keep_last)]
        if whole:
            doomed += [step for step, done in steps.items() if not done and step < whole[-1]]
        removed = []
        for step in sorted(doomed):
            self.discard(self.step_dir(step))
            removed.append(self.step_dir(step))
            self._seen[str(self.root)].discard(step)
        return removed
