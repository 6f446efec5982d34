"""The job store: the state machine is enforced, and concurrent writers never corrupt it."""

from __future__ import annotations

import multiprocessing
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS
from disttrain.errors import UsageError
from disttrain.store import FINAL, TRANSITIONS, JobState, JobStore, TransitionError, db

HAPPY_PATH = (JobState.STAGING, JobState.RUNNING, JobState.UPLOADING, JobState.COMPLETED)


def test_transitions_only_move_forward_and_final_states_are_final(tmp_path):
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create(name="a", spec={"name": "a"}, job_dir="/jobs/a")
        assert job.state is JobState.PENDING
        with pytest.raises(TransitionError, match="job a is Pending; it cannot become Running"):
            store.transition(job.id, JobState.RUNNING)
        for state in HAPPY_PATH:
            job = store.transition(job.id, state)
        assert job.state is JobState.COMPLETED and job.started and job.ended >= job.started
        assert [s for s, _ in job.events] == ["Pending", *(str(s) for s in HAPPY_PATH)]
        with pytest.raises(TransitionError, match="is Completed; it cannot become Stopped"):
            store.transition(job.id, JobState.STOPPED)
    assert all(not TRANSITIONS[state] for state in FINAL)
    assert all({JobState.FAILED, JobState.STOPPED} <= TRANSITIONS[s] for s in JobState if s not in FINAL)


def test_fields_round_trip_and_lookup_by_id_or_name(tmp_path):
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create(name="b", spec={"hyperparameters": {"lr": 0.1}}, job_dir="/jobs/b")
        store.transition(job.id, JobState.STAGING)
        store.transition(job.id, JobState.RUNNING, hosts=[{"instance": "algo-1", "host": "vm"}])
        done = store.transition(job.id, JobState.FAILED, exit_code=3, failure="rank 1 ...", metrics={"loss": 1.5})
        assert store.get("b") == store.get(str(job.id)) == done
        assert (done.exit_code, done.failure, done.metrics) == (3, "rank 1 ...", {"loss": 1.5})
        assert done.spec == {"hyperparameters": {"lr": 0.1}} and done.hosts[0]["instance"] == "algo-1"
        with pytest.raises(Exception, match="already recorded"):
            store.create(name="b", spec={}, job_dir="/jobs/b2")


def test_store_is_in_wal_mode(tmp_path):
    JobStore(tmp_path / "jobs.db").close()
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _writer(path: str, prefix: str, count: int, start_at: float = 0.0) -> None:
    time.sleep(max(0.0, start_at - time.time()))  # the writers open the new store at once: a race for its WAL switch
    with JobStore(path) as store:
        for i in range(count):
            job = store.create(name=f"{prefix}-{i}", spec={"i": i}, job_dir=f"/jobs/{prefix}-{i}")
            for state in HAPPY_PATH:
                store.transition(job.id, state, **({"exit_code": 0} if state is JobState.COMPLETED else {}))


class _RefusedWal(sqlite3.Connection):
    """SQLite's answer to the loser of two processes switching one new file into WAL."""

    refusals = 0

    def execute(self, sql, *args):
        if sql == "PRAGMA journal_mode=WAL" and _RefusedWal.refusals:
            _RefusedWal.refusals -= 1
            raise sqlite3.OperationalError("database is locked")
        return super().execute(sql, *args)


def test_a_store_refused_its_switch_into_wal_tries_again_within_the_busy_timeout(tmp_path, monkeypatch):
    connect = db._Connection._connect
    monkeypatch.setattr(db._Connection, "_connect", staticmethod(lambda *a, **kw: connect(*a, factory=_RefusedWal, **kw)))
    monkeypatch.setattr(_RefusedWal, "refusals", 3)
    with JobStore(tmp_path / "a.db") as store:
        assert store.list() == [] and _RefusedWal.refusals == 0
    monkeypatch.setattr(_RefusedWal, "refusals", 10**6)
    monkeypatch.setattr(db, "BUSY_TIMEOUT_S", 0.2)
    with pytest.raises(UsageError, match=r"cannot open the job store .*b\.db: database is locked"):
        JobStore(tmp_path / "b.db")


@pytest.mark.timeout(60)
def test_concurrent_writers_keep_the_store_intact(tmp_path):
    path = str(tmp_path / "jobs.db")
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    start_at = time.time() + 3  # after the spawned interpreters' imports
    procs = [ctx.Process(target=_writer, args=(path, f"w{k}", 25, start_at)) for k in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=50)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    with JobStore(path) as store:
        assert store.integrity() == "ok"
        jobs = store.list()
        assert len(jobs) == 100 and len({j.id for j in jobs}) == 100
        for job in jobs:
            full = store.get(job.id)
            assert full.state is JobState.COMPLETED and full.exit_code == 0
            assert [s for s, _ in full.events] == ["Pending", "Staging", "Running", "Uploading", "Completed"]


def test_a_job_whose_runner_died_is_marked_failed_when_read(tmp_path):
    import socket
    import subprocess
    import sys

    import psutil

    from disttrain.jobs.control import refresh
    from disttrain.process_start import started, this_process

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    began = started(gone.pid)
    gone.wait()
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create(name="orphan", spec={}, job_dir="/jobs/o", runner_host=socket.gethostname(),
                           runner_pid=gone.pid, runner_started=began)
        store.transition(job.id, JobState.STAGING)
        store.transition(job.id, JobState.RUNNING)
        job = refresh(store, store.get(job.id))
        assert job.state is JobState.FAILED
        assert f"runner (pid {gone.pid} on {socket.gethostname()}) ended without recording" in job.failure
        mine = store.create(name="alive", spec={}, job_dir="/jobs/a", runner_host=socket.gethostname(),
                            runner_pid=psutil.Process().pid, runner_started=this_process())
        assert refresh(store, mine).state is JobState.PENDING  # its runner (this process) is alive


def test_a_store_from_before_slurm_jobs_gains_the_slurm_job_id_column(tmp_path):
    path = tmp_path / "jobs.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE, state TEXT NOT NULL,
            created REAL NOT NULL, started REAL, ended REAL, exit_code INTEGER, spec TEXT NOT NULL,
            hosts TEXT NOT NULL DEFAULT '[]', job_dir TEXT NOT NULL, log_dir TEXT,
            artifacts TEXT NOT NULL DEFAULT '{}', metrics TEXT, failure TEXT, runner_host TEXT,
            runner_pid INTEGER, runner_started REAL);
        INSERT INTO jobs (name, state, created, spec, job_dir) VALUES ('old', 'Completed', 1.0, '{}', '/jobs/old');
    """)
    old.close()
    with JobStore(path) as store:
        assert store.get("old").slurm_job_id is None and store.get("old").state is JobState.COMPLETED
        job = store.create(name="new", spec={}, job_dir="/jobs/new")
        job = store.transition(store.transition(job.id, JobState.STAGING).id, JobState.RUNNING, slurm_job_id="42")
        assert job.slurm_job_id == "42" and store.get("new").to_dict()["slurm_job_id"] == "42"
    with JobStore(path) as again:  # opened once more: nothing to add
        assert again.get("new").slurm_job_id == "42" and again.integrity() == "ok"


class Driver:
    """A process holding the store, moved one step at a time (tests/scripts/store_driver.py)."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "store_driver.py"), str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split(maxsplit=1)
        assert answer and answer[0] == "ok", f"{command}: {answer}"
        return answer[1].strip()

    def end(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        finally:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def drivers(tmp_path):
    started: list[Driver] = []

    def start() -> Driver:
        started.append(Driver(tmp_path / "jobs.db"))
        return started[-1]

    yield start
    for driver in started:
        driver.end()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aside", ["reopen", "private"])
def test_a_commit_survives_a_second_open_in_the_runners_process(drivers, aside):
    """Issue 23's lost write: a second JobStore (or make_private) in the runner's process dropped its
    SQLite locks, so the next process to close checkpointed and deleted the WAL the runner wrote into."""
    runner = drivers()
    runner("open")
    job = runner("create lost")
    for state in ("Staging", "Running"):
        runner(f"to {job} {state}")
    runner(aside)  # the metrics follower's store, opened and closed (or make_private on the open file)
    other = drivers()
    assert [other("open"), other(f"get {job}"), other("close")] == ["opened", "Running", "closed"]
    assert [runner(f"to {job} Uploading"), runner(f"to {job} Completed")] == ["Uploading", "Completed"]
    third = drivers()
    third("open")
    assert third(f"get {job}") == "Completed"
    runner("close")
    assert third(f"get {job}") == "Completed"
    fourth = drivers()
    assert [fourth("open"), fourth(f"get {job}"), fourth("close")] == ["opened", "Completed", "closed"]
    third("close")
    last = drivers()
    assert [last("open"), last(f"get {job}"), last("close")] == ["opened", "Completed", "closed"]


def _reached(lines: list[str]) -> tuple[str | None, str | None, int, int]:
    """(last state committed, state being committed when it stopped, metric points done, tried)."""
    done = tried = None
    points = tries = 0
    for line in lines:
        word, what, *_ = line.split()
        if what == "metric":
            points += word == "done"
            tries += word == "try"
        elif word == "done":
            done, tried = "Pending" if what == "create" else what, None
        else:
            tried = "Pending" if what == "create" else what
    return done, tried, points, tries


@pytest.mark.timeout(90)
def test_runners_killed_at_random_leave_every_record_where_its_runner_got(tmp_path):
    """≥ 12 runners at once, each with a metrics follower, readers opening and closing the store
    around them, some runners SIGKILLed at random moments: every record ends in the state its
    runner last committed, with every metric point it committed."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    path = tmp_path / "jobs.db"
    script = str(SCRIPTS / "store_runner.py")
    names = [f"r{k}" for k in range(24)]
    runners = {name: subprocess.Popen([sys.executable, script, str(path), name, str(rng.randrange(1 << 30))],
                                      stdout=subprocess.PIPE, text=True) for name in names}
    readers = [subprocess.Popen([sys.executable, script, str(path), "--reader"]) for _ in range(3)]
    # Half the runners are killed after a random line of their output (a full run prints 18), a
    # random moment later: before, inside or after any commit of the runner or its follower.
    doomed = {name: (rng.randrange(1, 18), rng.uniform(0.0, 0.02)) for name in rng.sample(names, len(names) // 2)}
    outputs: dict[str, list[str]] = {name: [] for name in names}

    def follow(name: str) -> None:
        proc = runners[name]
        for line in proc.stdout:
            outputs[name].append(line.strip())
            if name in doomed and len(outputs[name]) == doomed[name][0]:
                time.sleep(doomed[name][1])
                proc.send_signal(signal.SIGKILL)

    followers = [threading.Thread(target=follow, args=(name,)) for name in names]
    try:
        for thread in followers:
            thread.start()
        for proc in runners.values():
            proc.wait(timeout=60)
        assert [reader.poll() for reader in readers] == [None] * len(readers)  # still reading
    finally:
        for proc in [*runners.values(), *readers]:
            proc.kill()
            proc.wait()
        for thread in followers:
            thread.join(timeout=10)
    counts: dict[str, int] = {}
    with JobStore(path) as store:
        assert store.integrity() == "ok"
        for name, proc in runners.items():
            done, tried, points, tries = _reached(outputs[name])
            if proc.returncode == 0:
                assert (done, tried) == ("Completed", None), (name, outputs[name])
            else:
                assert name in doomed and proc.returncode == -signal.SIGKILL, (name, proc.returncode)
            recorded = store.list()
            record = next((r for r in recorded if r.name == name), None)
            state = str(record.state) if record else None
            assert state in {done, tried}, f"seed {seed}: {name} reached {done} (trying {tried}), recorded {state}"
            kept = len(store.metric_series(record.id).get("loss", [])) if record else 0
            assert points <= kept <= tries, f"seed {seed}: {name} committed {points} point(s), recorded {kept}"
            counts[state or "none"] = counts.get(state or "none", 0) + 1
    print(f"seed {seed}: {len(doomed)} of {len(names)} runners killed; records: {counts}")


def test_stores_of_one_process_share_a_connection_and_outlive_each_other(tmp_path):
    path = tmp_path / "jobs.db"
    first = JobStore(path)
    job = first.create(name="shared", spec={}, job_dir="/jobs/shared")
    with JobStore(tmp_path / "." / "jobs.db") as second:  # the same file by another spelling
        second.transition(job.id, JobState.STAGING)
        second.close()  # closing twice is harmless
    assert first.transition(job.id, JobState.RUNNING).state is JobState.RUNNING  # still open
    errors: list[BaseException] = []

    def points(k: int) -> None:
        try:
            with JobStore(path) as store:  # another thread's store: the same connection, under its lock
                for i in range(50):
                    store.add_metrics(job.id, [(f"m{k}", float(i), float(i))])
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=points, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for _ in range(20):
        first.get(job.id)
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert {name: len(series) for name, series in first.metric_series(job.id).items()} == {"m0": 50, "m1": 50, "m2": 50}
    first.close()


def test_a_runner_recorded_by_an_older_disttrain_is_still_told_alive(tmp_path):
    """0.7.8 and before recorded a runner's start as psutil's create_time(): such a job that still runs is not
    marked Failed by this version's `jobs list`."""
    import socket

    import psutil

    from disttrain.jobs.control import refresh

    with JobStore(tmp_path / "jobs.db") as store:
        old = store.create(name="old", spec={}, job_dir="/jobs/o", runner_host=socket.gethostname(),
                           runner_pid=psutil.Process().pid, runner_started=psutil.Process().create_time())
        assert refresh(store, old).state is JobState.PENDING
