"""The job history: one SQLite file that several runners write at once.

Concurrency comes from SQLite itself: WAL mode (readers never block the writer), a busy
timeout (a writer waits for another instead of failing with "database is locked"), and
short write transactions (``BEGIN IMMEDIATE``: the state check and the update happen under
one lock, so two processes cannot both move the same job). No connection is held inside a
transaction while a job runs, so a runner that is killed leaves nothing locked.

SQLite's locks are POSIX record locks, which belong to a process and a file, not to a file
descriptor: closing *any* descriptor of ``jobs.db`` in a process drops every lock SQLite holds
on it there. Another process closing its last connection then believes it is the last one,
checkpoints and deletes the WAL that this process still writes into, and this process's later
commits are lost. So nothing here opens ``jobs.db`` outside SQLite (it is created private by a
hard link, kept private by ``chmod``), and every :class:`JobStore` of a process shares one
connection per file (the runner's metrics follower opens a second store while the first is open).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..bounds import MAX_ID
from ..errors import DisttrainError, UsageError
from ..private import make_private
from .states import JobState, allowed

STORE_ENV = "DISTTRAIN_STORE"
BUSY_TIMEOUT_S = 30.0
WAL_RETRY_S = 0.02

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    ended REAL,
    exit_code INTEGER,
    spec TEXT NOT NULL,
    hosts TEXT NOT NULL DEFAULT '[]',
    job_dir TEXT NOT NULL,
    log_dir TEXT,
    artifacts TEXT NOT NULL DEFAULT '{}',
    metrics TEXT,
    failure TEXT,
    runner_host TEXT,
    runner_pid INTEGER,
    runner_started REAL,
    slurm_job_id TEXT,
    membership TEXT,
    goodput TEXT
);
CREATE TABLE IF NOT EXISTS events (
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    state TEXT NOT NULL,
    time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id);
CREATE TABLE IF NOT EXISTS metrics (
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    name TEXT NOT NULL,
    time REAL NOT NULL,
    value REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS metrics_job ON metrics(job_id, name);
"""
# Columns added since the first release: a store written by an older disttrain gains them.
_ADDED = {"slurm_job_id": "TEXT", "membership": "TEXT", "goodput": "TEXT"}

# Columns a transition or update may set, and whether they hold JSON.
_JSON = {"spec", "hosts", "artifacts", "metrics", "membership", "goodput"}
_SETTABLE = {"exit_code", "hosts", "log_dir", "artifacts", "metrics", "failure",
             "runner_host", "runner_pid", "runner_started", "slurm_job_id", "membership", "goodput"}


class TransitionError(DisttrainError):
    """A state change the state machine forbids (e.g. a Completed job cannot be stopped)."""


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    id: int
    name: str
    state: JobState
    created: float
    started: float | None
    ended: float | None
    exit_code: int | None
    spec: dict
    hosts: list
    job_dir: str
    log_dir: str | None
    artifacts: dict
    metrics: dict | None
    failure: str | None
    runner_host: str | None
    runner_pid: int | None
    runner_started: float | None
    slurm_job_id: str | None = None  # launcher: slurm, once submitted
    membership: list | None = None  # an elastic job: every change (disttrain.launch.membership_record.Change)
    goodput: dict | None = None  # where the job's host-seconds went (disttrain.goodput)
    events: tuple[tuple[str, float], ...] = field(default=())

    @property
    def logs(self) -> Path:
        """The folder of the job's log (``job.log``) and its ranks' logs."""
        return Path(self.log_dir or Path(self.job_dir) / "logs")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = str(self.state)
        data["events"] = [{"state": s, "time": t} for s, t in self.events]
        return data


def default_store_path() -> Path:
    """``$DISTTRAIN_STORE``, else ``$DISTTRAIN_HOME/jobs.db``."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV])
    from ..home import disttrain_home

    return disttrain_home() / "jobs.db"


class _Connection:
    """One process's connection to one store file, shared by its JobStores (and their threads).

    A store this process may read but not write (a read-only mount, another user's file) is
    opened read-only: ``jobs ls`` and ``jobs show`` work, a write says so in one line. A SQLite
    file of another program is refused before anything is written into it.
    """

    def __init__(self, path: Path) -> None:
        make_private(path)  # job specs hold env values; SQLite gives -wal/-shm the same mode
        self.path, self.read_only = path, False
        try:
            self.db = self._connect(str(path))
            self._into_wal()
        except sqlite3.OperationalError:
            if not path.is_file() or (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
                raise
            self.db, self.read_only = self._read_only(path), True
        self.lock = threading.RLock()
        self.users = 0
        try:
            self._refuse_others()
            if not self.read_only:
                self.db.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint; WAL stays consistent
                self.db.executescript(_SCHEMA)  # each statement commits on its own; all are idempotent
        except BaseException:
            self.db.close()
            raise

    @staticmethod
    def _connect(target: str, **kw: Any) -> sqlite3.Connection:
        # isolation_level=None: transactions are begun explicitly, and kept short. Threads share
        # the connection under ``lock`` (a runner's metrics follower writes while the runner does).
        db = sqlite3.connect(target, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False, **kw)
        db.row_factory = sqlite3.Row
        return db

    def _into_wal(self) -> None:
        # Processes creating one store at once: SQLite answers the loser of the switch "locked" at
        # once, without its busy handler (which would have waited for the winner).
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
            time.sleep(WAL_RETRY_S)

    def _read_only(self, path: Path) -> sqlite3.Connection:
        """``mode=ro``; where not even SQLite's ``-shm`` file can be made beside it, ``immutable``
        (no locks: nothing can write a file on a read-only mount either)."""
        from urllib.parse import quote

        for flag in ("mode=ro", "immutable=1"):
            db = self._connect(f"file:{quote(str(path.resolve()))}?{flag}", uri=True)
            try:
                db.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return db
            except sqlite3.OperationalError:
                db.close()
        raise sqlite3.OperationalError("unable to open database file, even to read it")

    def _refuse_others(self) -> None:
        tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = {row["name"] for row in self.db.execute("PRAGMA table_info(jobs)")}
        if tables and not {"name", "state", "created", "spec", "job_dir"} <= columns:
            shown = ", ".join(sorted(t for t in tables if not t.startswith("sqlite_"))[:5])
            raise UsageError(f"cannot open the job store {self.path}: it is another program's SQLite database "
                             f"(tables {shown}), not a disttrain job store; nothing was written to it "
                             f"(set --store or {STORE_ENV} to a new file)")


_OPEN: dict[tuple[int, str], _Connection] = {}  # (pid, real path): a forked child opens its own
_OPEN_LOCK = threading.Lock()


class JobStore:
    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path else default_store_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            key = (os.getpid(), os.path.realpath(self.path))
            with _OPEN_LOCK:
                shared = _OPEN.get(key)
                if shared is None:
                    shared = _OPEN[key] = _Connection(self.path)
                shared.users += 1
            self._key, self._shared, self._db, self._closed = key, shared, shared.db, False
            self._add_columns()
        except (OSError, sqlite3.Error) as err:
            if getattr(self, "_key", None):
                self.close()
            raise UsageError(f"cannot open the job store {self.path}: {err} (set --store or {STORE_ENV})") from None

    def _add_columns(self) -> None:
        def missing() -> list[str]:
            have = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
            return [column for column in _ADDED if column not in have]

        with self._read():
            if not missing():
                return
        with self._write() as db:  # checked again under the lock: two processes opening an old store
            for column in missing():
                db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {_ADDED[column]}")

    def close(self) -> None:
        """Closes the process's connection with its last user (SQLite checkpoints the WAL then)."""
        with _OPEN_LOCK:
            if self._closed:
                return
            self._closed = True
            self._shared.users -= 1
            if self._shared.users == 0:
                del _OPEN[self._key]
                self._shared.db.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """The shared connection for a read, not in the middle of another thread's transaction."""
        with self._shared.lock:
            yield self._db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front: a read-then-write inside a deferred
        # transaction could fail with SQLITE_BUSY halfway, after the busy timeout is moot.
        if self._shared.read_only:
            raise UsageError(f"cannot write the job store {self.path}: it is read-only here (a read-only "
                             f"folder or file system); set --store or {STORE_ENV} to a writable file")
        with self._shared.lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def create(self, *, name: str, spec: dict, job_dir: str, **fields: Any) -> JobRecord:
        now = time.time()
        columns = {"name": name, "state": JobState.PENDING.value, "created": now, "spec": spec,
                   "job_dir": job_dir, **_checked(fields)}
        values = [json.dumps(v) if k in _JSON else v for k, v in columns.items()]
        with self._write() as db:
            try:
                cur = db.execute(
                    f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})", values)
            except sqlite3.IntegrityError:
                raise UsageError(f"a job named {name!r} is already recorded in {self.path}") from None
            db.execute("INSERT INTO events VALUES (?, ?, ?)", (cur.lastrowid, JobState.PENDING.value, now))
            job_id = cur.lastrowid
        return self.get(job_id)

    def transition(self, job_id: int, new: JobState, **fields: Any) -> JobRecord:
        """Move a job to ``new`` (setting ``fields`` with it), or raise TransitionError."""
        now = time.time()
        sets = {"state": new.value, **_checked(fields)}
        if new is JobState.RUNNING:
            sets["started"] = now
        if new.final:
            sets["ended"] = now
        with self._write() as db:
            row = db.execute("SELECT name, state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise UsageError(f"no job with id {job_id} in {self.path}")
            current = JobState(row["state"])
            if not allowed(current, new):
                raise TransitionError(f"job {row['name']} is {current}; it cannot become {new}")
            self._set(db, job_id, sets)
            db.execute("INSERT INTO events VALUES (?, ?, ?)", (job_id, new.value, now))
        return self.get(job_id)

    def update(self, job_id: int, **fields: Any) -> JobRecord:
        """Set fields without a state change (hosts once known, the log folder)."""
        with self._write() as db:
            self._set(db, job_id, _checked(fields))
        return self.get(job_id)

    @staticmethod
    def _set(db: sqlite3.Connection, job_id: int, sets: dict[str, Any]) -> None:
        values = [json.dumps(v) if k in _JSON else v for k, v in sets.items()]
        db.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in sets)} WHERE id = ?", (*values, job_id))

    def get(self, ref: int | str) -> JobRecord:
        """A job by id (``12``) or by name."""
        with self._read() as db:
            # an id past SQLite's 64 bits is no job's (not an OverflowError)
            if isinstance(ref, int) or (str(ref).isascii() and str(ref).isdigit()):
                row = db.execute("SELECT * FROM jobs WHERE id = ?", (int(ref),)).fetchone() \
                    if int(ref) <= MAX_ID else None
            else:
                row = db.execute("SELECT * FROM jobs WHERE name = ?", (ref,)).fetchone()
            if row is None:
                raise UsageError(f"no job {ref!r} in {self.path} (see `disttrain jobs ls`)")
            events = db.execute(
                "SELECT state, time FROM events WHERE job_id = ? ORDER BY time, rowid", (row["id"],)).fetchall()
        return _record(row, tuple((e["state"], e["time"]) for e in events))

    def list(self, limit: int | None = None) -> list[JobRecord]:
        """Newest first."""
        with self._read() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY id DESC LIMIT ?",
                              (min(limit, MAX_ID) if limit else -1,)).fetchall()
        return [_record(row) for row in rows]

    def add_metrics(self, job_id: int, rows: list[tuple[str, float, float]]) -> None:
        """Points of a job's metric time series: (name, time, value)."""
        if rows:
            with self._write() as db:
                db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?)", [(job_id, *row) for row in rows])

    def metric_series(self, job_id: int) -> dict[str, list[tuple[float, float]]]:
        """Every series of a job, by name, in time order."""
        series: dict[str, list[tuple[float, float]]] = {}
        with self._read() as db:
            rows = db.execute("SELECT name, time, value FROM metrics WHERE job_id = ? ORDER BY name, time, rowid",
                              (job_id,)).fetchall()
        for row in rows:
            series.setdefault(row["name"], []).append((row["time"], row["value"]))
        return series

    def integrity(self) -> str:
        with self._read() as db:
            return db.execute("PRAGMA integrity_check").fetchone()[0]


def _checked(fields: dict[str, Any]) -> dict[str, Any]:
    unknown = set(fields) - _SETTABLE
    if unknown:
        raise TypeError(f"not a settable job field: {', '.join(sorted(unknown))}")
    return fields


def _record(row: sqlite3.Row, events: tuple = ()) -> JobRecord:
    data = {key: row[key] for key in row.keys()}
    for key in _JSON:
        data[key] = json.loads(data[key]) if data[key] is not None else None
    data["state"] = JobState(data["state"])
    return JobRecord(**data, events=events)
