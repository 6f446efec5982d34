"""``backend: slurm``: a job's instances are the nodes of one Slurm batch job.

Staging and uploading happen where the runner runs, as for the other backends; in between
the runner submits an sbatch script whose one command is the hidden step
``disttrain job _in-allocation STEP.json``. That step runs inside the allocation and does
what the runner does for ``local``/``ssh`` between placing and launching: plan one node per
instance (instance K is the K-th allocated node), add the SageMaker variables, start one
agent per node with srun (:mod:`disttrain.backends.slurm_alloc`). The runner records the
Slurm job id, streams the job's output into its own, and reads the step's outcome from the
job directory (which, like the script, must be on a filesystem the nodes share).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..backends.ssh_launch import AgentsOutcome
from ..errors import UsageError
from ..store import JobState
from .backends import Placement
from .layout import JobLayout, instance_names
from .spec import spec_from_mapping

if TYPE_CHECKING:
    from .runner import _Run

STEP_FILE = "slurm_step.json"  # in the job's logs: what the step inside the allocation runs
OUTCOME_FILE = "outcome.json"  # in the job's logs: how the step's launch ended


class _Tee:
    """The job's output to the terminal and to the job's transcript (``jobs logs``)."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> None:
        for stream in self.streams:
            stream.write(text if text.endswith("\n") else text + "\n")

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def submit_and_follow(run: _Run, cwd: Path) -> AgentsOutcome:
    """Submit the job's batch script, record its Slurm job id, follow it to its end."""
    from ..backends.slurm import SlurmPaths, _write_atomic, render_sbatch, submit
    from ..config.launch import LaunchSpec

    spec, layout = run.spec, run.layout
    python = spec.python or sys.executable
    step = layout.logs / STEP_FILE
    _write_atomic(step, json.dumps({"name": run.record.name, "job_dir": str(layout.root), "cwd": str(cwd),
                                    "spec": spec.to_dict()}, indent=2))  # whole: the step runs it
    script = render_sbatch(LaunchSpec(entry=spec.entry_point), spec.slurm_options(job_name=run.record.name),
                           run_dir=str(layout.logs), python=python, cwd=str(cwd),
                           command=[python, "-m", "disttrain", "job", "_in-allocation", str(step)])
    job = submit(script, layout.logs)
    run.store.transition(run.id, JobState.RUNNING, slurm_job_id=job.job_id)
    run.say(f"disttrain: submitted Slurm job {job.job_id} ({spec.instance_count} node(s)); logs: {layout.logs}")
    try:
        # Our own SIGTERM/SIGINT handling (JobStopped, KeyboardInterrupt) stops the job, so that
        # the record says Stopped; follow's would return 128+signal like any exit code.
        code = job.follow(out=_Tee(sys.stdout, run.transcript), err=_Tee(sys.stderr, run.transcript),
                          stop_on_signals=False)
    except BaseException:
        gone = job.cancel()
        run.say(f"disttrain: cancelled Slurm job {job.job_id}"
                + ("" if gone else f" (still in the queue: check `squeue -j {job.job_id}`)"))
        raise
    plan_file = layout.logs / "plan.json"
    if plan_file.exists():  # the nodes the step placed the instances on
        nodes = json.loads(plan_file.read_text())["nodes"]
        run.store.update(run.id, hosts=[{"instance": i, "host": n["host"]} for i, n in zip(layout.hosts, nodes)])
    outcome_file = layout.logs / OUTCOME_FILE
    if outcome_file.exists():
        return AgentsOutcome(**json.loads(outcome_file.read_text()))
    # The step ended before its launch did (a bad node, no disttrain there): its own words are last.
    err = SlurmPaths(layout.logs).stderr
    lines = err.read_text(errors="replace").strip().splitlines() if err.exists() else []
    return AgentsOutcome(exit_code=code or 1, report=f"Slurm job {job.job_id} exited with code {code} before its "
                         f"instances ended: {lines[-1] if lines else 'no output'} (see {err})")


def run_step(step_file: str) -> int:
    """``disttrain job _in-allocation STEP.json``: place and launch the instances on this allocation."""
    from ..backends import slurm_alloc
    from ..backends.slurm import _write_atomic
    from ..backends.slurm_env import SlurmAllocation
    from .runner import launch_spec, with_sagemaker_env

    alloc = SlurmAllocation.from_environ(os.environ)
    if alloc is None:
        raise UsageError("disttrain job _in-allocation runs inside the Slurm job that `disttrain job run` submits")
    step = json.loads(Path(step_file).read_text())
    cwd = Path(step["cwd"])
    spec = spec_from_mapping(step["spec"], base_dir=cwd, source=step_file)
    layout = JobLayout(Path(step["job_dir"]), instance_names(spec.instance_count))
    python = spec.python or sys.executable
    plan = slurm_alloc.place(launch_spec(spec, layout, cwd), alloc, nodes=spec.instance_count, python=python,
                             cwd=str(cwd), run_id=step["name"], run_dir=str(layout.logs))
    n = len(plan.nodes)
    placement = Placement(
        plan=plan, ifnames=tuple(node.env.get("GLOO_SOCKET_IFNAME", "lo") for node in plan.nodes),
        where=tuple(node.host for node in plan.nodes), gpus=(alloc.gpus_per_node or 0,) * n,
        cpus=alloc.cpus_per_node[:n] or (os.cpu_count() or 1,) * n)
    plan = with_sagemaker_env(spec, layout, placement, cwd)
    print(f"disttrain: {plan.world_size} worker(s) ({plan.backend}) on "
          f"{', '.join(f'{i} on {w}' for i, w in zip(layout.hosts, placement.where))} (Slurm job {alloc.job_id}), "
          f"rendezvous {plan.master_addr}:{plan.master_port}", file=sys.stderr, flush=True)
    outcome = slurm_alloc.launch(plan, alloc, python=python, cwd=str(cwd))
    _write_atomic(layout.logs / OUTCOME_FILE, json.dumps(dataclasses.asdict(outcome)))
    return outcome.exit_code
