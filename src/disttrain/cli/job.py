"""``disttrain job run job.yaml``: a SageMaker-style job, recorded in the job store."""

from __future__ import annotations

import argparse


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, metavar="PATH",
                   help="the job store (default: $DISTTRAIN_STORE, else $DISTTRAIN_HOME/jobs.db)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    job = sub.add_parser("job", help="run a SageMaker-style job from a YAML spec",
                         description="Run a job: channels staged, the script launched on its instances, "
                         "model.tar.gz and output.tar.gz written to output_path/<job name>/, every step recorded.")
    actions = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="run the job a YAML spec describes, and wait for it",
                             description="Run the job JOB.yaml describes and wait for it; the exit code is the "
                             "job's (0 when Completed).")
    run.add_argument("spec", metavar="JOB.yaml")
    add_store_arg(run)
    run.set_defaults(handler=handle_run)
    # backend: slurm: the batch script's one command, on the allocation's first node.
    step = actions.add_parser("_in-allocation")  # no help=: hidden from the listing
    step.add_argument("step_file")
    step.set_defaults(handler=handle_in_allocation)


def handle_run(args: argparse.Namespace) -> int:
    from ..jobs import load_spec
    from ..jobs.runner import run_job

    spec = load_spec(args.spec)  # every key checked before anything runs or is recorded
    record = run_job(spec, store=args.store)
    return record.exit_code if record.exit_code is not None else 1


def handle_in_allocation(args: argparse.Namespace) -> int:
    from ..jobs.slurm import run_step

    return run_step(args.step_file)
