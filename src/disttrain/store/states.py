"""A job's life as a ``str`` Enum with the transitions the runner may make.

::

    Pending ──> Staging ──> Running ──> Uploading ──> Completed
       │           │           │            │
       └───────────┴───────────┴────────────┴──> Failed | Stopped

A job only moves forward; Completed, Failed and Stopped are final, so a record that says
Completed can never later be overwritten by a late Failed (or the other way round) when two
processes (the runner and ``jobs stop``) race.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    PENDING = "Pending"  # recorded, nothing done yet
    STAGING = "Staging"  # job directory, code and input channels being prepared
    RUNNING = "Running"  # the instances' agents are up
    UPLOADING = "Uploading"  # the script succeeded; model.tar.gz / output.tar.gz being written
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPED = "Stopped"  # `disttrain jobs stop`, SIGTERM or Ctrl-C to the runner

    def __str__(self) -> str:
        return self.value

    @property
    def final(self) -> bool:
        return self in FINAL


FINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED})
_ENDINGS = frozenset({JobState.FAILED, JobState.STOPPED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STAGING}) | _ENDINGS,
    JobState.STAGING: frozenset({JobState.RUNNING}) | _ENDINGS,
    JobState.RUNNING: frozenset({JobState.UPLOADING}) | _ENDINGS,
    JobState.UPLOADING: frozenset({JobState.COMPLETED}) | _ENDINGS,
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


def allowed(current: JobState, new: JobState) -> bool:
    return new in TRANSITIONS[current]
