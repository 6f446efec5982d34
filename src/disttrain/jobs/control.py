"""Acting on recorded jobs from another process: stop one, and notice runners that died.

A job's runner records its host, pid and process start time; a stop request signals that
process (SIGTERM: it stops its instances, then records Stopped). The start time guards
against a recycled pid. A runner killed outright (SIGKILL, a reboot) records nothing more;
such a job is marked Failed the next time the history is read on that host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from ..errors import DisttrainError
from ..process_start import same_process
from ..store import JobRecord, JobState, JobStore, TransitionError


def runner_alive(record: JobRecord) -> bool | None:
    """True/False for a runner on this host; None when it ran elsewhere (cannot tell)."""
    import psutil

    if record.runner_host != socket.gethostname() or record.runner_pid is None:
        return None
    if not same_process(record.runner_pid, record.runner_started):
        return False
    try:
        return psutil.Process(record.runner_pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def refresh(store: JobStore, record: JobRecord) -> JobRecord:
    """A job that says it is running whose runner is gone is marked Failed, saying so."""
    if record.state.final or runner_alive(record) is not False:
        return record
    try:
        return store.transition(
            record.id, JobState.FAILED,
            failure=f"the job's runner (pid {record.runner_pid} on {record.runner_host}) ended without "
                    f"recording an outcome (killed?) while the job was {record.state}",
        )
    except TransitionError:
        return store.get(record.id)


def stop_job(store: JobStore, ref: str, *, timeout_s: float = 30.0) -> JobRecord:
    """Ask the runner to stop; after ``timeout_s`` kill it and record Stopped ourselves.

    A Slurm job is also cancelled here (``scancel``) when its runner cannot do it: gone, killed,
    or on another host.
    """
    record = store.get(ref)
    if record.state.final:
        return record
    alive = runner_alive(record)
    if alive is None and not record.slurm_job_id:
        raise DisttrainError(
            f"job {record.name} runs on {record.runner_host} (pid {record.runner_pid}); stop it there")
    if alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.runner_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = store.get(record.id)
            if record.state.final:
                return record
            time.sleep(0.2)
        # The instances' agents see their stdin close when the runner dies and stop their workers.
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.runner_pid, signal.SIGKILL)
    record = store.get(record.id)  # the Slurm job id may have been recorded meanwhile
    note = "" if alive else " (runner was gone)" if alive is False else f" (runner on {record.runner_host})"
    if record.slurm_job_id:
        from ..launch.slurm import SlurmJob

        if not SlurmJob(record.slurm_job_id, Path(record.log_dir or record.job_dir)).cancel():
            note += f"; Slurm job {record.slurm_job_id} is still in the queue (`squeue -j {record.slurm_job_id}`)"
    try:
        return store.transition(record.id, JobState.STOPPED, exit_code=137 if alive else None,
                                failure="stopped by `disttrain jobs stop`" + note)
    except TransitionError:
        return store.get(record.id)
