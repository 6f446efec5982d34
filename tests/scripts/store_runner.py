"""A tiny job runner for the store's stress test: the store calls of ``disttrain job run``, no job.

It records a job through Pending → Staging → Running → Uploading → Completed, with a metrics
follower (a thread with its own JobStore, as the real runner has) adding points while it runs,
and another JobStore opened and closed on the side. Before each commit it prints ``try WHAT``
and after it ``done WHAT``, flushed, so a test that SIGKILLs it knows what it had reached.

``store_runner.py PATH --reader``: ``disttrain jobs ls`` again and again instead (open, list, close),
until killed.
"""

from __future__ import annotations

import random
import sys
import threading
import time

from disttrain.store import JobState, JobStore

STATES = (JobState.STAGING, JobState.RUNNING, JobState.UPLOADING, JobState.COMPLETED)
_say = threading.Lock()


def say(line: str) -> None:
    with _say:
        print(line, flush=True)


def pause(rng: random.Random) -> None:
    time.sleep(rng.uniform(0.0, 0.1))


def follow(path: str, job_id: int, points: int, rng: random.Random) -> None:
    with JobStore(path) as store:  # the metrics follower's own store, opened while the runner's is
        for k in range(points):
            say(f"try metric {k}")
            store.add_metrics(job_id, [("loss", time.time(), float(k))])
            say(f"done metric {k}")
            pause(rng)


def main(path: str, name: str, seed: int) -> None:
    rng = random.Random(seed)
    with JobStore(path) as store:
        say("try create")
        job = store.create(name=name, spec={"seed": seed}, job_dir=f"/jobs/{name}")
        say(f"done create {job.id}")
        follower = None
        for state in STATES:
            pause(rng)
            if state is JobState.UPLOADING:  # the follower ends with the launch, as in the runner
                follower.join()
                JobStore(path).close()  # and any other store opened and closed meanwhile
            say(f"try {state}")
            store.transition(job.id, state, **({"exit_code": 0} if state.final else {}))
            say(f"done {state}")
            if state is JobState.RUNNING:
                follower = threading.Thread(target=follow, args=(path, job.id, 4, rng))
                follower.start()


def reader(path: str) -> None:
    while True:
        with JobStore(path) as store:
            store.list()
        time.sleep(0.01)


if __name__ == "__main__":
    if sys.argv[2] == "--reader":
        reader(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
