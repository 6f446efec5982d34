"""``disttrain tune run SCRIPT | ls | show NAME | resume NAME | stop NAME``: hyperparameter tuning jobs."""

from __future__ import annotations

import argparse
import json
import time

from . import tune_run
from .job import add_store_arg
from .tune_run import use_store as _use_store


def add_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("tune", help="tune a script; list, inspect, resume and stop hyperparameter tuning jobs",
                          description="Tuning jobs started by `disttrain tune run SCRIPT` or a SageMaker "
                          "HyperparameterTuner (Optuna studies kept beside the job store); every trial is a "
                          "recorded job (disttrain jobs ls).")
    actions = tune.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("ls", help="tuning jobs, newest first")
    ls.add_argument("--json", action="store_true", help="print DescribeHyperParameterTuningJob for each, as JSON")
    ls.set_defaults(handler=handle_ls)
    show = actions.add_parser("show", help="one tuning job: its trials, their objective, the best")
    show.add_argument("name", metavar="NAME")
    show.add_argument("--json", action="store_true", help="DescribeHyperParameterTuningJob's shape, with the trials")
    show.set_defaults(handler=handle_show)
    resume = actions.add_parser("resume", help="go on with a tuning job whose loop was killed (waits for it)")
    resume.add_argument("name", metavar="NAME")
    resume.set_defaults(handler=handle_resume)
    stop = actions.add_parser("stop", help="stop a tuning job and its running trials")
    stop.add_argument("name", metavar="NAME")
    stop.set_defaults(handler=handle_stop)
    run = tune_run.add_parser(actions)
    for p in (run, ls, show, resume, stop):
        add_store_arg(p)


def _when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _param(text: str) -> str:
    try:
        return f"{float(text):.6g}" if "." in text or "e" in text else text
    except ValueError:
        return text


def _value(summary: dict) -> str:
    metric = summary.get("FinalHyperParameterTuningJobObjectiveMetric")
    return "-" if metric is None else f"{metric['Value']:.6g}"


def handle_ls(args: argparse.Namespace) -> int:
    from ..sagemaker.tuning import describe, tuning_names

    _use_store(args)
    described = [describe(name) for name in tuning_names()]
    if args.json:
        print(json.dumps(described, indent=2, default=str))
        return 0
    rows = [("NAME", "STATUS", "STRATEGY", "CREATED", "TRIALS", "BEST JOB", "OBJECTIVE")]
    for d in described:
        config = d["HyperParameterTuningJobConfig"]
        limits, objective = config["ResourceLimits"], config["HyperParameterTuningJobObjective"]
        best = d.get("BestTrainingJob")
        rows.append((d["HyperParameterTuningJobName"], d["HyperParameterTuningJobStatus"], config["Strategy"],
                     _when(d["CreationTime"]), f"{len(d['TrainingJobSummaries'])}/{limits['MaxNumberOfTrainingJobs']}",
                     best["TrainingJobName"] if best else "-",
                     f"{objective['MetricName']}={_value(best)}" if best else "-"))
    _table(rows)
    return 0


def handle_show(args: argparse.Namespace) -> int:
    from ..sagemaker.tunerbase import log_path
    from ..sagemaker.tuning import describe

    _use_store(args)
    d = describe(args.name)
    if args.json:
        print(json.dumps(d, indent=2, default=str))
        return 0
    config = d["HyperParameterTuningJobConfig"]
    objective = config["HyperParameterTuningJobObjective"]
    best = d.get("BestTrainingJob")
    for key, value in (("name", d["HyperParameterTuningJobName"]), ("status", d["HyperParameterTuningJobStatus"]),
                       ("strategy", f"{config['Strategy']}, early stopping {config['TrainingJobEarlyStoppingType']}"),
                       ("objective", f"{objective['Type']} {objective['MetricName']}"),
                       ("limits", f"{config['ResourceLimits']['MaxNumberOfTrainingJobs']} trial(s), "
                                  f"{config['ResourceLimits']['MaxParallelTrainingJobs']} at a time"),
                       ("created", _when(d["CreationTime"])), ("ended", _when(d["HyperParameterTuningEndTime"])),
                       ("best", f"{best['TrainingJobName']} ({objective['MetricName']}={_value(best)})" if best else "-"),
                       ("log", str(log_path(args.name)))):
        print(f"{key + ':':<11}{value}")
    summaries = d["TrainingJobSummaries"]
    params = list(dict.fromkeys(k for s in summaries for k in s["TunedHyperParameters"]))
    rows = [("", "JOB", "STATUS", objective["MetricName"].upper(), *params)]
    for s in summaries:
        mark = "*" if best and s["TrainingJobName"] == best["TrainingJobName"] else ""
        status = s["TrainingJobStatus"] + (" (early)" if s["ObjectiveStatus"] == "Failed" and
                                           s["TrainingJobStatus"] == "Stopped" else "")
        rows.append((mark, s["TrainingJobName"] or "-", status, _value(s),
                     *(_param(s["TunedHyperParameters"].get(p, "-")) for p in params)))
    print()
    _table(rows)
    return 0


def handle_resume(args: argparse.Namespace) -> int:
    from ..sagemaker.tunerloop import run_tuning

    _use_store(args)
    state = run_tuning(args.name, say=lambda line: print(line, flush=True))
    return 0 if state == "Completed" else 1


def handle_stop(args: argparse.Namespace) -> int:
    from ..sagemaker.tunerbase import TuningJob

    _use_store(args)
    TuningJob(args.name).stop()
    print(f"disttrain: tuning job {args.name} {TuningJob(args.name).refresh().hyper_parameter_tuning_job_status}")
    return 0
