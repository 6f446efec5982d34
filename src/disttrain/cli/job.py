"""``disttrain job run job.yaml``: a SageMaker-style job, recorded in the job store."""

from __future__ import annotations

import argparse


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, metavar="PATH",
                   help="the job store (default: $DISTTRAIN_STORE, else $DISTTRAIN_HOME/jobs.db)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    job = sub.add_parser("job", help="run a SageMaker-style job from a YAML spec",
                         description="Run a job: channels staged, the script launched on its instances, "
                         "model.tar.gz and output.tar.gz written to output_path/<job name>/, each state recorded.")
    actions = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="run the job a YAML spec describes, and wait for it",
                             description="Run the job JOB.yaml describes and wait for it; the exit code is the "
                             "job's (0 when Completed).")
    run.add_argument("spec", metavar="JOB.yaml")
    add_store_arg(run)
    run.add_argument("--job-name", default=None, metavar="NAME",
                     help="the run's full job name (default: the spec's name, a timestamp and 4 hex digits)")
    run.add_argument("--dry-run", action="store_true",
                     help="check everything and print the plan that would run (the instances' variables, the "
                          "job's env by name only); record, stage and start nothing. Slurm: the batch script")
    run.set_defaults(handler=handle_run)


def handle_run(args: argparse.Namespace) -> int:
    from ..jobs import load_spec
    from ..jobs.runner import dry_run_job, run_job
    from ..jobs.spec import check_name

    if args.job_name is not None:
        check_name(args.job_name, "--job-name")
    spec = load_spec(args.spec)  # every key checked before anything runs or is recorded
    if args.dry_run:
        print(dry_run_job(spec, job_name=args.job_name), end="", flush=True)
        return 0
    record = run_job(spec, store=args.store, job_name=args.job_name)
    return record.exit_code if record.exit_code is not None else 1
