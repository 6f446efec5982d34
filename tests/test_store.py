"""The job store: the state machine is enforced, and concurrent writers never corrupt it."""

from __future__ import annotations

import multiprocessing
import sqlite3

import pytest

from disttrain.store import FINAL, TRANSITIONS, JobState, JobStore, TransitionError

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


def _writer(path: str, prefix: str, count: int) -> None:
    with JobStore(path) as store:
        for i in range(count):
            job = store.create(name=f"{prefix}-{i}", spec={"i": i}, job_dir=f"/jobs/{prefix}-{i}")
            for state in HAPPY_PATH:
                store.transition(job.id, state, **({"exit_code": 0} if state is JobState.COMPLETED else {}))


@pytest.mark.timeout(60)
def test_concurrent_writers_keep_the_store_intact(tmp_path):
    path = str(tmp_path / "jobs.db")
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    procs = [ctx.Process(target=_writer, args=(path, f"w{k}", 25)) for k in range(4)]
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

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(gone.pid).create_time()
    gone.wait()
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create(name="orphan", spec={}, job_dir="/jobs/o", runner_host=socket.gethostname(),
                           runner_pid=gone.pid, runner_started=started)
        store.transition(job.id, JobState.STAGING)
        store.transition(job.id, JobState.RUNNING)
        job = refresh(store, store.get(job.id))
        assert job.state is JobState.FAILED
        assert f"runner (pid {gone.pid} on {socket.gethostname()}) ended without recording" in job.failure
        mine = store.create(name="alive", spec={}, job_dir="/jobs/a", runner_host=socket.gethostname(),
                            runner_pid=psutil.Process().pid, runner_started=psutil.Process().create_time())
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
