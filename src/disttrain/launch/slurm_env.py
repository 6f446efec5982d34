"""What a Slurm job tells its processes about itself: pure functions of an environment.

``disttrain run`` inside an allocation (an sbatch script, ``salloc``) reads the nodes and
their CPUs from here; inside a job step (a task started by ``srun``) it runs as a local job
on the CPUs Slurm gave that node.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UsageError

# Step ids Slurm uses for steps that are not tasks started by srun (slurm.h): a shell in an
# interactive step (LaunchParameters=use_interactive_step), the batch script, the extern step.
_NOT_TASK_STEPS = {"4294967290", "4294967291", "4294967292", "interactive", "batch", "extern"}
_BRACKET = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``node[01-03,7],gpu[1-2]-ib`` → node01, node02, node03, node7, gpu1-ib, gpu2-ib.

    Slurm's compressed host list, expanded here rather than with ``scontrol show hostnames``
    so that detection needs no running Slurm. Leading zeros set the width of a range.
    """
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        parts = _BRACKET.split(item)  # literal, ranges, literal, ranges, ..., literal
        choices = [[parts[i]] if i % 2 == 0 else _expand_ranges(parts[i], text) for i in range(len(parts))]
        names.extend("".join(combo) for combo in itertools.product(*choices))
    return tuple(names)


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot read the Slurm host list {whole!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1))
    return out


def expand_counts(text: str) -> tuple[int, ...]:
    """``2(x3),4`` (SLURM_JOB_CPUS_PER_NODE's form) → (2, 2, 2, 4)."""
    counts: list[int] = []
    for item in filter(None, text.strip().split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not match:
            raise ValueError(f"cannot read the Slurm count list {text!r}")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return tuple(counts)


def gpus_from(text: str | None) -> int | None:
    """``2``, ``a100:2`` or ``gpu:a100:2`` (SLURM_GPUS_PER_NODE / SLURM_GPUS_ON_NODE) → 2."""
    if not text:
        return None
    match = re.search(r"(\d+)$", text.strip())
    return int(match[1]) if match else None


@dataclass(frozen=True, kw_only=True)
class SlurmAllocation:
    """The Slurm job a process runs in, as its environment describes it."""

    job_id: str
    nodes: tuple[str, ...]
    cpus_per_node: tuple[int, ...]
    gpus_per_node: int | None = None
    this_node: str | None = None  # SLURMD_NODENAME: unset in a salloc shell on a login node
    in_job_step: bool = False  # a task started by srun, not the batch script or a salloc shell
    job_step_tasks: int = 1
    cpus_on_node: int | None = None
    restart_count: int = 0  # how many times Slurm requeued the job

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmAllocation | None:
        """None outside Slurm; a UsageError naming the variable when Slurm's are unreadable."""
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not job_id:
            return None
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
        try:
            nodes = expand_hostlist(nodelist)
            cpus = expand_counts(environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
        except ValueError as err:
            raise UsageError(f"Slurm job {job_id}: {err}") from None
        if not nodes:
            raise UsageError(f"Slurm job {job_id} has SLURM_JOB_ID but no SLURM_JOB_NODELIST: "
                             "run disttrain in the job's own environment (sbatch script, salloc shell)")
        if len(cpus) != len(nodes):  # unknown or unreadable: what a node has is asked at launch
            cpus = ()
        step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
        return cls(
            job_id=job_id,
            nodes=nodes,
            cpus_per_node=cpus,
            gpus_per_node=gpus_from(environ.get("SLURM_GPUS_PER_NODE")),
            this_node=environ.get("SLURMD_NODENAME") or None,
            in_job_step=step is not None and step not in _NOT_TASK_STEPS,
            job_step_tasks=_int(environ.get("SLURM_STEP_NUM_TASKS"), 1),
            cpus_on_node=_int(environ.get("SLURM_CPUS_ON_NODE"), None),
            restart_count=_int(environ.get("SLURM_RESTART_COUNT"), 0),
        )

    @property
    def on_first_node(self) -> bool:
        """True in the batch script (Slurm runs it on the allocation's first node)."""
        return self.this_node == self.nodes[0]


def _int(raw: str | None, default):
    try:
        return int(raw) if raw else default
    except ValueError:
        return default
