"""Start a script as N real processes on this machine with ``disttrain run``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

import psutil

from disttrain import workerenv


def launch_argv(
    script_path: str | os.PathLike[str], nproc: int, args: Sequence[str] = ()
) -> list[str]:
    return [sys.executable, "-m", "disttrain", "run", "-n", str(nproc), str(script_path), *map(str, args)]


# What a launcher hands its workers (workerenv's contract): inherited from an outer job,
# these would make a worker think it is already placed.
_JOB_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", workerenv.DIST_BACKEND, workerenv.RUN_DIR,
             workerenv.CHECKPOINT_DIR, workerenv.CHECKPOINT_EVERY, workerenv.PG_TIMEOUT,
             workerenv.BENCH_STEPS, workerenv.BENCH_WARMUP, workerenv.BENCH_EXIT}


def worker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment minus any outer job's placement, plus ``env``."""
    merged = {k: v for k, v in os.environ.items() if k not in _JOB_VARS}
    merged.setdefault("OMP_NUM_THREADS", "1")  # 2 workers on a 2-core machine
    merged.update(env or {})
    return merged


def run_ranks(
    script_path: str | os.PathLike[str],
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script_path`` as ``nproc`` ranks and wait; output captured as text.

    On timeout the launcher and every process under it are killed, so that a hung
    collective never outlives the test, and ``subprocess.TimeoutExpired`` is raised.
    """
    proc = subprocess.Popen(
        launch_argv(script_path, nproc, args),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(env),
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def kill_tree(pid: int) -> None:
    """Kill ``pid`` and all its descendants (torch's agent puts each worker in a session
    of its own, so killing a process group would miss them)."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def run_single(script_path: str | os.PathLike[str], args: Sequence[str] = (), timeout: float = 60,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python script_path`` with no launcher at all: a world of one."""
    return subprocess.run(
        [sys.executable, str(script_path), *map(str, args)],
        capture_output=True, text=True, env=worker_env(env), timeout=timeout,
    )
