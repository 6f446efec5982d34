"""One bench: the validated spec, every count run in turn, the facts around the numbers.

:mod:`disttrain.cli.bench` parses the command line into a :class:`BenchSpec` and calls
:func:`run_all`; :mod:`.report` turns the measurements into the table.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass

from ..config.launch import LaunchSpec
from ..errors import UsageError
from . import report, runner


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """A bench, validated: every mistake is found before the first count starts."""

    launch: LaunchSpec  # what every count runs (the script, its arguments, --env...), before the count's part
    where: tuple[str, ...] = ()  # the launcher flags of every count: --hosts, --ssh-option, --sync...
    counts: tuple[int, ...]
    hosts: tuple[str, ...]  # host names; empty: this machine
    global_batch: int
    batch_arg: str
    steps: int
    warmup: int
    timeout_s: float
    repeat: int = 1  # runs of each count, the counts interleaved

    def __post_init__(self) -> None:
        for name, value, low in (("--global-batch", self.global_batch, 1), ("--steps", self.steps, 1),
                                 ("--warmup", self.warmup, 0), ("--repeat", self.repeat, 1)):
            if value < low:
                raise UsageError(f"{name} must be at least {low}, got {value}")
        if not self.timeout_s > 0:
            raise UsageError(f"--timeout must be more than 0 seconds, got {self.timeout_s:g}")
        if not self.batch_arg.startswith("-"):
            raise UsageError(f"--batch-arg {self.batch_arg!r}: name the script's flag, e.g. --batch-size")
        given = [a for a in self.script_args
                 if a == self.batch_arg or a.startswith(self.batch_arg + "=")]
        if given:
            raise UsageError(
                f"{given[0]} is in the script's arguments, but the bench sets {self.batch_arg} "
                "itself for each count (--global-batch / processes): remove it")
        hosts = max(1, len(self.hosts))
        uneven = [n for n in self.counts if self.global_batch % (n * hosts)]
        if uneven:
            worlds = [n * hosts for n in self.counts]
            multiple = math.lcm(*worlds)
            where = f" on {hosts} hosts" if hosts > 1 else ""
            raise UsageError(
                f"--global-batch {self.global_batch} cannot be split evenly over "
                f"{uneven[0] * hosts} processes{where}: pick a multiple of {multiple}")

    @property
    def script(self) -> str:
        return self.launch.entry

    @property
    def script_args(self) -> tuple[str, ...]:
        return self.launch.script_args

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(n * max(1, len(self.hosts)) for n in self.counts)

    def count(self, nproc: int, *, warmup: int | None = None, steps: int | None = None,
              env: dict[str, str] | None = None, **fields) -> LaunchSpec:
        """The launch spec of one count (``fields``: more of its fields, e.g. grad_compression)."""
        world = nproc * max(1, len(self.hosts))
        return runner.count_spec(self.launch, nproc=nproc, batch_per_process=self.global_batch // world,
                                 batch_arg=self.batch_arg, steps=self.steps if steps is None else steps,
                                 warmup=self.warmup if warmup is None else warmup, env=env, **fields)

    def command(self) -> list[str]:
        return runner.count_argv(self.where)


def parse_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: positive, without repeats, in increasing order."""
    counts = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UsageError(
                f"-n/--nproc: expected process counts like 1,2,4 (each at least 1), got {text!r}")
        counts.add(int(part))
    return tuple(sorted(counts))


def rounds(counts: tuple[int, ...], repeat: int) -> list[int]:
    """The order the counts run in: ``repeat`` rounds, every other one reversed (1,2,4,4,2,1),
    so that a machine slowing down or speeding up meanwhile weighs on every count alike."""
    order: list[int] = []
    for k in range(repeat):
        order += counts if k % 2 == 0 else counts[::-1]
    return order


def run_all(spec: BenchSpec) -> list[report.Measurement]:
    """Every count ``spec.repeat`` times, interleaved (see :func:`rounds`), each count's runs
    combined (:func:`report.combine`); a failing run is recorded and the next one runs."""
    runs: dict[int, list[report.Measurement]] = {n: [] for n in spec.counts}
    hosts = max(1, len(spec.hosts))
    for n in rounds(spec.counts, spec.repeat):
        world = n * hosts
        batch = spec.global_batch // world
        label = report.processes(n, hosts)
        which = f" (run {len(runs[n]) + 1} of {spec.repeat})" if spec.repeat > 1 else ""
        print(f"disttrain bench: {label}{which}, {batch} samples per process per step ...",
              file=sys.stderr, flush=True)
        try:
            count_run = runner.run_count(spec.command(), spec.count(n), timeout_s=spec.timeout_s)
        except KeyboardInterrupt:
            print(f"disttrain bench: interrupted during {label}", file=sys.stderr)
            raise
        if count_run.returncode == 2 and not any(m.ok for ms in runs.values() for m in ms):
            usage = [line for line in count_run.stderr.splitlines() if line.startswith("disttrain: error:")]
            if usage:  # disttrain run refused the command: every count would
                raise UsageError(usage[-1][len("disttrain: error: "):])
        result = runner.measurement(count_run, nproc=n, world_size=world, batch_per_process=batch,
                                    timeout_s=spec.timeout_s, threads=expected_threads(spec, n),
                                    local=not spec.hosts)
        if result.ok:
            print(f"disttrain bench: {label}: {result.samples_per_s:,.0f} samples/s "
                  f"({count_run.seconds:.0f} s)", file=sys.stderr, flush=True)
        else:
            where = f"; logs: {result.log_dir}" if result.log_dir else ""
            print(f"disttrain bench: {label}: FAILED: {result.error}{where}", file=sys.stderr,
                  flush=True)
        runs[n].append(result)
    return [report.combine(runs[n]) for n in spec.counts]


def expected_threads(spec: BenchSpec, nproc: int) -> int | None:
    """OMP threads per process as ``disttrain run`` sets them here: the user's setting
    (``--env`` or this environment), else cores / processes. Unknown on other hosts."""
    value = spec.launch.env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if value:
        return int(value) if value.isdigit() else None
    if spec.hosts:
        return None
    from ..placement import omp_threads, usable_cpus

    return omp_threads(cpus=usable_cpus(), nproc=nproc)


def machine_facts(measurements: list[report.Measurement], *, local: bool) -> tuple[int | None, int]:
    """Cores and GPUs per host: what the workers reported, else (on one machine) ours."""
    for m in measurements:
        if m.cpus is not None:
            return m.cpus, m.cuda_devices or 0
    if not local:
        return None, 0
    from ..placement import usable_cpus

    return usable_cpus(), _local_gpus()


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def headline(spec: BenchSpec, cpus: int | None, gpus: int) -> str:
    where = f"{len(spec.hosts)} hosts" if spec.hosts else platform.node()
    cores = f"{cpus} cores" if cpus else "cores unknown"
    gpu = f", {gpus} GPU{'s' if gpus != 1 else ''}" if gpus else ", no GPU"
    command = shlex.join([spec.script, *spec.script_args])
    return (f"disttrain bench: {command}, global batch {spec.global_batch} "
            f"({where}: {cores}{gpu}{' per host' if spec.hosts else ''})")


def json_context(spec: BenchSpec, cpus: int | None, gpus: int) -> dict:
    import torch

    return {
        "bench": "scaling",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "script": spec.script,
        "script_args": list(spec.script_args),
        "machine": platform.node(),
        "hosts": list(spec.hosts) or None,
        "cpus_per_host": cpus,
        "gpus_per_host": gpus,
        "torch": torch.__version__,
        "global_batch": spec.global_batch,
        "batch_arg": spec.batch_arg,
        "steps": spec.steps,
        "warmup": spec.warmup,
    }


def busy_before() -> tuple[float, int] | None:
    """``(1-minute load average, cores)`` when this machine is already busy, else None."""
    from ..placement import usable_cpus

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None
    cpus = usable_cpus()
    return (load, cpus) if load > cpus / 2 else None


def context_notes(*, busy: tuple[float, int] | None) -> list[str]:
    """What makes these numbers less than clean, said next to them."""
    notes = []
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        notes.append(f"OMP_NUM_THREADS={threads} is set here, so every count ran with it instead "
                     "of `disttrain run`'s cores / processes")
    if busy:
        load, cpus = busy
        notes.append(f"this machine was already busy (load average {load:.1f} on {cpus} cores) "
                     "when the bench started: other processes compete with the measured ones, "
                     "and a process with several threads suffers most; run it again when idle")
    return notes
