"""The SQLite record of every job: its state machine, times, exit code, metrics, where things are."""

from .db import STORE_ENV, JobRecord, JobStore, TransitionError, default_store_path
from .states import FINAL, TRANSITIONS, JobState

__all__ = ["FINAL", "STORE_ENV", "TRANSITIONS", "JobRecord", "JobState", "JobStore", "TransitionError",
           "default_store_path"]
