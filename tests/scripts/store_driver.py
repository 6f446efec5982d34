"""A process that holds the job store and moves jobs on command, one command per stdin line.

Commands: ``open``, ``close``, ``reopen`` (a second JobStore opened and closed in this process,
as the job runner's metrics follower does), ``private`` (``make_private`` on the open file),
``create NAME``, ``to ID STATE``, ``get ID``,
``exit``. Each answers one line on stdout (``ok ...`` or ``error ...``), so a test can order
the steps of several processes exactly.
"""

from __future__ import annotations

import sys

from disttrain.private import make_private
from disttrain.store import JobState, JobStore


def main(path: str) -> None:
    store = None
    for line in sys.stdin:
        word, *args = line.split()
        try:
            if word == "open":
                store = JobStore(path)
                answer = "opened"
            elif word == "close":
                store.close()
                store = None
                answer = "closed"
            elif word == "reopen":
                JobStore(path).close()
                answer = "reopened"
            elif word == "private":
                make_private(path)
                answer = "private"
            elif word == "create":
                answer = str(store.create(name=args[0], spec={}, job_dir=f"/jobs/{args[0]}").id)
            elif word == "to":
                answer = str(store.transition(int(args[0]), JobState(args[1])).state)
            elif word == "get":
                answer = str(store.get(int(args[0])).state)
            elif word == "exit":
                return
            else:
                raise ValueError(f"unknown command {word!r}")
            print("ok", answer, flush=True)
        except Exception as err:  # the test reads it and fails with it
            print("error", type(err).__name__, err, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
