"""Run a script under one process count through ``disttrain run`` and read what it measured.

Each count is its own run in a subprocess (``disttrain run-spec``, the launch spec as JSON on
its stdin: one serialiser, no flags rendered again, no ``--env`` value on a command line), so
that host flags, logs, failure reports and cleanup are exactly those of a normal run, and so
that one count crashing or hanging costs only its own result. The throughput comes from the runtime's
step timer (:mod:`disttrain.runtime.steptimer`: a ``disttrain-bench:`` line from rank 0)
or, for a script whose loader the timer does not see, from the script's own last JSON
line with ``train_samples_per_s`` (what ``examples/mnist_convnet.py`` prints).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psutil

from ..config.launch import LaunchSpec
from ..wire import RunSpec
from ..workerenv import BENCH_MARKER as MARKER
from ..workerenv import BENCH_STEPS, BENCH_WARMUP
from .report import SCRIPT_SUMMARY, STEP_TIMER, Measurement

# disttrain run stops its workers on SIGTERM within its --stop-grace (15 s); past this,
# whatever is left of the count's processes is killed.
TERMINATE_GRACE_S = 30.0
_TAIL_LINES = 3


@dataclass(frozen=True)
class CountRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    others_cores: float | None = None  # cores the rest of this machine kept busy meanwhile


class OtherLoad:
    """How many cores the rest of this machine kept busy while a count ran here.

    The machine's busy time (``/proc/stat``) minus this process's and its reaped children's
    CPU time (the count's launcher reaps its agents and workers, so all of their CPU lands
    in our ``RUSAGE_CHILDREN`` once it has ended), over the wall time. None where
    ``/proc/stat`` is not readable.
    """

    def __init__(self) -> None:
        self._start = (_machine_busy(), _own_cpu(), time.perf_counter())

    def cores(self) -> float | None:
        busy0, own0, t0 = self._start
        busy, wall = _machine_busy(), time.perf_counter() - t0
        if busy is None or busy0 is None or wall <= 0:
            return None
        return max(0.0, (busy - busy0) - (_own_cpu() - own0)) / wall


def _machine_busy() -> float | None:
    """CPU seconds every core has spent busy since boot (user, nice, system, irq, softirq)."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def count_spec(base: LaunchSpec, *, nproc: int, batch_per_process: int, batch_arg: str, steps: int,
               warmup: int, env: Mapping[str, str] | None = None, **fields) -> LaunchSpec:
    """The launch spec of one count: rank 0's output only, the bench's variables in ``env`` (so
    they reach workers on other hosts too; the user's ``--env`` wins), the per-process batch
    before the user's script arguments."""
    return replace(
        base, nproc_per_node=nproc, ranks=(0,), script_args=(batch_arg, str(batch_per_process), *base.script_args),
        env={BENCH_STEPS: str(steps), BENCH_WARMUP: str(warmup), **(env or {}), **base.env}, **fields)


def count_argv(where: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The command every count runs: ``disttrain run-spec``, its spec on stdin (``where``: the
    launcher flags, e.g. ``--hosts``)."""
    return [python, "-m", "disttrain", "run-spec", *where]


def run_count(argv: Sequence[str], spec: LaunchSpec, *, timeout_s: float, env: Mapping[str, str] | None = None,
              cwd: str | None = None) -> CountRun:
    """Run ``argv`` with ``spec`` on its stdin, to completion or ``timeout_s``; nothing it
    started outlives it.

    On a timeout (or Ctrl-C) the launcher gets SIGTERM, which makes ``disttrain run`` stop
    its workers the way it always does; whatever is still alive after
    :data:`TERMINATE_GRACE_S` is killed, from a list of its processes taken first (torch's
    agent gives each worker a session of its own, so a process group would miss them).
    """
    start = time.perf_counter()
    load = OtherLoad()
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=None if env is None else dict(env), cwd=cwd)
    try:
        stdout, stderr = proc.communicate(input=RunSpec(spec=spec).to_line() + "\n", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        return CountRun(proc.returncode, stdout, stderr, time.perf_counter() - start, timed_out=True)
    except KeyboardInterrupt:
        _stop(proc)
        raise
    return CountRun(proc.returncode, stdout, stderr, time.perf_counter() - start, others_cores=load.cores())


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.terminate()
    try:
        # Reading while waiting: a launcher reporting on a full pipe would never exit.
        output = proc.communicate(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:  # the launcher, or a worker holding its pipes, is left
        proc.kill()
        _kill(family)
        try:
            output = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired as err:  # a process we never saw holds the pipes
            output = (err.stdout, err.stderr)
    else:
        _kill(family)  # workers that outlived their launcher
    return _text(*output)


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def _text(*streams: str | bytes | None) -> tuple[str, str]:
    out = [s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in streams]
    return out[0], out[1]


def rank0_lines(stdout: str) -> list[str]:
    """Output lines without the launcher's ``[rank0] `` / ``[node0 rank0] `` prefix."""
    lines = []
    for line in stdout.splitlines():
        if line.startswith("[") and "] " in line:
            prefix, rest = line.split("] ", 1)
            if "rank" in prefix:
                line = rest
        lines.append(line)
    return lines


def parse_output(stdout: str) -> tuple[str, dict[str, Any]] | None:
    """``(source, values)`` from the step timer's line, else the script's summary line."""
    lines = rank0_lines(stdout)
    for line in reversed(lines):
        if line.startswith(MARKER):
            try:
                return STEP_TIMER, json.loads(line[len(MARKER):])
            except json.JSONDecodeError:
                continue
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                values = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(values, dict) and "train_samples_per_s" in values:
                return SCRIPT_SUMMARY, values
    return None


def parse_summary(stdout: str) -> dict[str, Any]:
    """The script's last JSON line from rank 0 with ``val_accuracy`` or ``train_loss`` (where
    its training ended up), or {}."""
    for line in reversed(rank0_lines(stdout)):
        if line.startswith("{"):
            try:
                values = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(values, dict) and ("val_accuracy" in values or "train_loss" in values):
                return values
    return {}


def measurement(count_run: CountRun, *, nproc: int, world_size: int, batch_per_process: int,
                timeout_s: float, threads: int | None = None, local: bool = True) -> Measurement:
    """What ``count_run`` says about this count: a throughput with notes, or the error.

    ``threads``: intra-op threads per process when known in advance; the step timer's
    report, which the workers make, wins. ``local``: the count ran on this machine alone, so
    the load of the rest of it applies (on other hosts it is not known)."""
    others = (count_run.others_cores,) if local and count_run.others_cores is not None else ()
    base: dict[str, Any] = {"nproc": nproc, "world_size": world_size,
                            "batch_per_process": batch_per_process, "threads": threads,
                            "exit_code": count_run.returncode, "log_dir": _log_dir(count_run.stderr),
                            "others_cores": others}
    if count_run.timed_out:
        return Measurement(**base, error=f"timed out after {timeout_s:g} s (--timeout)")
    parsed = parse_output(count_run.stdout)
    if count_run.returncode != 0:
        return Measurement(**base, error=f"exit {count_run.returncode}: {_reason(count_run.stderr)}")
    if parsed is None:
        return Measurement(**base, error=(
            "no measurement: the script neither went through the runtime's step timer (a "
            "loader from disttrain.prepare()) nor printed a JSON line with "
            "train_samples_per_s"))
    source, values = parsed
    if source == STEP_TIMER:
        return _from_timer(base, values, world_size=world_size, batch=batch_per_process)
    return _from_summary(base, values, world_size=world_size, batch=batch_per_process)


def _from_timer(base: dict, values: dict, *, world_size: int, batch: int) -> Measurement:
    notes = []
    rate = values.get("samples_per_s")
    if not values.get("complete", True):
        if not rate:
            return Measurement(**base, error=(
                f"the script ran {values.get('steps_run', 0)} training steps per process, not "
                f"enough for {values.get('warmup')} warm-up steps and the timed ones: give "
                "it more data or epochs, or lower --steps/--warmup"))
        notes.append(f"the run ended after {values.get('steps')} timed steps, fewer than "
                     "asked; rank 0's own time")
    steps, samples = values.get("steps"), values.get("samples")
    if steps and samples and values.get("complete", True):
        per_process = samples / steps / world_size
        if abs(per_process - batch) > 0.5:
            notes.append(f"the steps averaged {per_process:.0f} samples per process, not "
                         f"{batch}: does the script take its per-process batch from the "
                         "flag --batch-arg names?")
    if values.get("world_size") not in (None, world_size):
        notes.append(f"the script ran as {values['world_size']} processes, not {world_size}")
    base["threads"] = values.get("threads") or base["threads"]
    return Measurement(**base, samples_per_s=rate, source=STEP_TIMER,
                       seconds=values.get("seconds"), steps=steps, cpus=values.get("cpus"),
                       cuda_devices=values.get("cuda_devices"), notes=tuple(notes))


def _from_summary(base: dict, values: dict, *, world_size: int, batch: int) -> Measurement:
    notes = ["measured by the script over whole epochs, warm-up included: its loader does "
             "not go through the runtime's step timer, so --steps and --warmup had no effect"]
    reported = values.get("global_batch_size")
    if isinstance(reported, (int, float)) and reported != batch * world_size:
        notes.append(f"the script reports a global batch of {reported}, not "
                     f"{batch * world_size}: does it take its per-process batch from the flag "
                     "--batch-arg names?")
    if values.get("world_size") not in (None, world_size):
        notes.append(f"the script ran as {values['world_size']} processes, not {world_size}")
    seconds = values.get("epoch_seconds")
    return Measurement(**base, samples_per_s=values.get("train_samples_per_s"),
                       source=SCRIPT_SUMMARY,
                       seconds=sum(seconds) if isinstance(seconds, list) else None,
                       notes=tuple(notes))


def _log_dir(stderr: str) -> str | None:
    for line in stderr.splitlines():
        if line.startswith("disttrain: ") and "; logs: " in line:
            return line.rsplit("; logs: ", 1)[1].strip()
    return None


def _reason(stderr: str) -> str:
    """The launcher's root-cause line (``rank 1 on vm exited with code 3 ...``), or the
    last lines of its stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("disttrain: ") and "; logs: " not in line:  # not the start line
            return line[len("disttrain: "):]
    return " | ".join(lines[-_TAIL_LINES:]) or "no output on stderr"
