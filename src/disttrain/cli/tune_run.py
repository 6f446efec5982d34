"""``disttrain tune run SCRIPT``: tune any script's arguments, on the SageMaker tuner's engine.

The ranges (``--param lr=1e-4:1e-1:log``), the objective (a metric pattern of the script's
output) and the limits become one :class:`~disttrain.sagemaker.tuning.TuningConfig` whose trials
are ordinary recorded jobs running the script with ``--NAME VALUE`` arguments; the study is
created and its loop (:mod:`disttrain.sagemaker.tunerloop`) runs here, in the foreground, as
``disttrain tune resume`` runs it. So ``tune ls/show/resume/stop`` and ``jobs ls`` see these
tuning jobs and trials as they see a ``HyperparameterTuner``'s. The same keys may be given in a
YAML file (``--config``); an option on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ..errors import UsageError

# A number as scripts print it (1, -0.5, 3.2e-04, nan is not one): the default objective pattern
# is "NAME", then "=" or ":", then this.
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
STRATEGIES = ("Bayesian", "Random", "Grid", "Hyperband")
# The --config file's keys: each is the long option's name with "_" for "-".
FILE_KEYS = ("script", "param", "set", "objective", "pattern", "direction", "trials", "parallel", "strategy",
             "early_stopping", "seed", "name", "launcher", "hosts", "nnodes", "nproc_per_node", "partition",
             "time")
_INT = re.compile(r"[-+]?\d+")


def add_parser(actions: argparse._SubParsersAction) -> argparse.ArgumentParser:
    run = actions.add_parser(
        "run", help="tune any script: trials run it with --NAME VALUE arguments, the objective read from its output",
        description="Tune a script's arguments with Optuna: each trial is a recorded job that runs SCRIPT with "
        "--NAME VALUE for every parameter; the objective is the last value the metric pattern matched in its "
        "output. Prints each trial and the best; `disttrain tune show NAME` shows them again.")
    run.add_argument("script", nargs="?", default=None, metavar="SCRIPT", help="the script to tune (or script: "
                     "in --config)")
    run.add_argument("--config", default=None, metavar="TUNE.yaml",
                     help="a YAML file of the same keys (param, set, objective, trials, ...); options given here win")
    run.add_argument("--param", action="append", default=None, metavar="NAME=RANGE",
                     help="a tuned argument: LOW:HIGH (both integers: an integer range), LOW:HIGH:log "
                     "(logarithmic), or A,B,C (choices); repeat for each")
    run.add_argument("--set", action="append", default=None, metavar="NAME=VALUE",
                     help="a fixed argument every trial gets (--NAME VALUE); repeat for each")
    run.add_argument("--objective", default=None, metavar="NAME", help="the metric to optimise (required)")
    run.add_argument("--pattern", default=None, metavar="REGEX",
                     help="where the objective is in the script's output: a regex whose first group is the value "
                     "(default: NAME, then = or :, then a number)")
    way = run.add_mutually_exclusive_group()
    way.add_argument("--minimize", dest="direction", action="store_const", const="minimize",
                     help="the lower the objective the better")
    way.add_argument("--maximize", dest="direction", action="store_const", const="maximize",
                     help="the higher the objective the better")
    run.add_argument("--trials", type=int, default=None, metavar="N", help="how many trials in all (default 10)")
    run.add_argument("--parallel", type=int, default=None, metavar="N",
                     help="trials running at once (default 1); on this machine they share its cores")
    run.add_argument("--strategy", default=None, metavar="|".join(STRATEGIES),
                     help="Optuna's sampler: Bayesian (TPE, default), Random, Grid (every combination of "
                     "integer and choice ranges), Hyperband (TPE, stopping poor trials early)")
    run.add_argument("--early-stopping", action="store_true", default=None,
                     help="stop a trial whose objective is behind the median of earlier trials at the same point")
    run.add_argument("--seed", type=int, default=None, metavar="N", help="the sampler's seed (repeatable studies)")
    run.add_argument("--name", default=None, metavar="NAME", help="the tuning job's name (default: the script's "
                     "name and the time)")
    place = run.add_argument_group("where each trial runs (as disttrain run)")
    place.add_argument("--launcher", default=None, metavar="local|ssh|slurm",
                       help="this machine (default), --hosts over ssh, or Slurm")
    place.add_argument("--hosts", default=None, metavar="H1,H2", help="the ssh hosts of each trial")
    place.add_argument("--nnodes", type=int, default=None, metavar="N", help="machines per trial (default 1)")
    place.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="processes per machine; given (or --nnodes > 1), the script runs under torch's "
                       "elastic agent with RANK, WORLD_SIZE, MASTER_ADDR set")
    place.add_argument("--partition", default=None, metavar="NAME", help="the Slurm partition (--launcher slurm)")
    place.add_argument("--time", default=None, metavar="LIMIT", help="the Slurm time limit (--launcher slurm)")
    run.set_defaults(handler=handle_run)
    return run


def handle_run(args: argparse.Namespace) -> int:
    from ..sagemaker.tunerbase import _check_trial, log_path
    from ..sagemaker.tunerloop import run_tuning
    from ..sagemaker.tuning import create_study, describe, new_tuning_name

    use_store(args)
    keys = merged(args)
    name = keys["name"] or new_tuning_name(Path(keys["script"]).stem)
    config = tuning_config(keys, name)
    _check_trial(config)  # one trial's job checked as a job is: a missing script, a bad host, one line
    create_study(config)
    log = log_path(name)  # what `disttrain tune show` names, as for a tuner's loop
    log.parent.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, flush=True)
        with open(log, "a") as fh:
            fh.write(line + "\n")

    say(f"disttrain: tuning job {name}: {config.max_jobs} trial(s), {config.max_parallel_jobs} at a time, "
        f"{config.strategy}, {config.objective_type.lower()} {config.objective_metric_name}")
    state = run_tuning(name, say=say)
    if state == "Completed" and "BestTrainingJob" not in describe(name):
        say(f"disttrain: tuning job {name}: no trial gave a {config.objective_metric_name} value "
            f"(disttrain tune show {name}; disttrain jobs logs JOB)")
        return 1
    return 0 if state == "Completed" else 1


def use_store(args: argparse.Namespace) -> None:
    """--store: the job store (and the tuning store beside it) for everything a ``tune`` action does,
    the loop's trials included."""
    if args.store:
        os.environ["DISTTRAIN_STORE"] = os.path.abspath(args.store)


# --- the keys: the file's, then the command line's ----------------------------------------------

def merged(args: argparse.Namespace) -> dict[str, Any]:
    """The file's keys overridden by the options given; every key checked, errors naming it."""
    keys: dict[str, Any] = dict.fromkeys(FILE_KEYS)
    if args.config:
        keys.update(read_file(args.config))
    for key in FILE_KEYS:
        value = getattr(args, key)
        if value is not None:
            keys[key] = value
    if not keys["script"]:
        raise UsageError("tune run: give the script to tune: disttrain tune run train.py --param lr=1e-4:1e-1:log ...")
    if not keys["param"]:
        raise UsageError("tune run: give at least one --param NAME=RANGE (e.g. --param lr=1e-4:1e-1:log)")
    if not keys["objective"]:
        raise UsageError("tune run: give --objective NAME (the metric the script prints, e.g. --objective loss)")
    if keys["direction"] not in ("minimize", "maximize"):
        raise UsageError("tune run: give --minimize or --maximize (is a higher objective better or worse?)")
    return keys


def read_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except OSError as err:
        raise UsageError(f"--config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--config {path}: not YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of keys ({', '.join(FILE_KEYS)})")
    unknown = [key for key in data if key not in FILE_KEYS]
    if unknown:
        raise UsageError(f"--config {path}: unknown key {unknown[0]!r}; known keys: {', '.join(FILE_KEYS)}")
    found = dict(data)
    for key in ("param", "set"):  # a mapping in the file, NAME=VALUE pairs on the command line
        if key in found:
            if not isinstance(found[key], dict):
                raise UsageError(f"--config {path}: {key} must be a mapping of NAME: VALUE")
            found[key] = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in found[key].items()]
    if "direction" in found:
        found["direction"] = str(found["direction"]).lower()
    if isinstance(found.get("hosts"), list):
        found["hosts"] = ",".join(found["hosts"])
    return found


def _pairs(option: str, items: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        if not sep or not name or not value:
            raise UsageError(f"--{option} {item!r}: expected NAME=VALUE (e.g. --{option} lr=0.1)")
        if name in found:
            raise UsageError(f"--{option} {name} is given twice; give it once")
        found[name] = value
    return found


def parse_range(name: str, text: str) -> dict[str, Any]:
    """``LOW:HIGH[:log]`` or ``A,B,C`` → a range as :meth:`ParameterRange.to_dict` writes it."""
    parts = text.split(":")
    if len(parts) == 1:
        values = [v.strip() for v in text.split(",")]
        if len(values) < 2 or not all(values):
            raise UsageError(f"--param {name}={text}: expected LOW:HIGH, LOW:HIGH:log or at least two choices A,B")
        return {"type": "Categorical", "values": values}
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("log", "linear")):
        raise UsageError(f"--param {name}={text}: expected LOW:HIGH, LOW:HIGH:log or A,B,C")
    low, high = parts[0].strip(), parts[1].strip()
    try:
        numbers = float(low), float(high)
    except ValueError:
        raise UsageError(f"--param {name}={text}: LOW and HIGH must be numbers") from None
    if not numbers[0] < numbers[1]:
        raise UsageError(f"--param {name}={text}: LOW must be below HIGH")
    scaling = "Logarithmic" if parts[2:] == ["log"] else "Linear"
    if scaling == "Logarithmic" and numbers[0] <= 0:
        raise UsageError(f"--param {name}={text}: a log range needs LOW > 0")
    if _INT.fullmatch(low) and _INT.fullmatch(high):
        return {"type": "Integer", "min": int(low), "max": int(high), "scaling": scaling}
    return {"type": "Continuous", "min": numbers[0], "max": numbers[1], "scaling": scaling}


def _pattern(keys: dict[str, Any]) -> str:
    pattern = keys["pattern"] or rf"\b{re.escape(keys['objective'])}\s*[=:]\s*({NUMBER})"
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise UsageError(f"--pattern {pattern!r} is not a regular expression: {err}") from None
    if compiled.groups < 1:
        raise UsageError(f"--pattern {pattern!r} has no group: put the value in parentheses, e.g. 'loss=(\\S+)'")
    return pattern


def trial_job(keys: dict[str, Any], name: str) -> dict[str, Any]:
    """The trials' job fields: the script, its fixed arguments, the objective's pattern, the placement."""
    script = Path(keys["script"])
    if not script.is_file():
        raise UsageError(f"tune run: no script {str(script)!r} (give the path of the script to tune)")
    fields: dict[str, Any] = {
        "name": name, "entry_point": script.name, "source_dir": str(script.resolve().parent),
        "hyperparameters": _pairs("set", keys["set"] or []),
        "metric_definitions": [{"Name": keys["objective"], "Regex": _pattern(keys)}],
        # a plain script reads its arguments, not /opt/ml: no private folder (and no namespace) needed
        "private_opt_ml": "off",
    }
    if keys["launcher"]:
        fields["launcher"] = keys["launcher"]
    if keys["hosts"]:
        fields["hosts"] = [h for h in str(keys["hosts"]).split(",") if h]
        fields.setdefault("launcher", "ssh")
        fields["instance_count"] = keys["nnodes"] or len(fields["hosts"])
    elif keys["nnodes"]:
        fields["instance_count"] = keys["nnodes"]
    if keys["nproc_per_node"] or (keys["nnodes"] or 1) > 1:
        fields["distribution"] = {"torch_distributed": {"enabled": True}}
        fields["processes_per_instance"] = keys["nproc_per_node"] or 1
    slurm = {k: keys[k] for k in ("partition", "time") if keys[k]}
    if slurm:
        fields["slurm"] = slurm
    return fields


def tuning_config(keys: dict[str, Any], name: str):
    from ..sagemaker.tuning import TuningConfig

    ranges = {}
    for pname, text in _pairs("param", keys["param"]).items():
        ranges[pname] = parse_range(pname, text)
    for number in ("trials", "parallel"):
        value = keys[number]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"--{number} must be a positive integer, got {value!r}")
    strategy = keys["strategy"] or "Bayesian"
    if strategy not in STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "Hyperband" and keys["early_stopping"]:
        raise UsageError("--early-stopping goes with --strategy Bayesian/Random/Grid; Hyperband stops trials itself")
    job = trial_job(keys, name)
    config = TuningConfig(
        name=name, job=job, ranges=ranges, objective_metric_name=keys["objective"],
        objective_type=keys["direction"].capitalize(), strategy=strategy,
        max_jobs=1, max_parallel_jobs=keys["parallel"] or 1,
        early_stopping_type="Auto" if keys["early_stopping"] else "Off", random_seed=keys["seed"], kind="script")
    trials = keys["trials"] or (len(config.grid()) if strategy == "Grid" else 10)
    return dataclasses.replace(config, max_jobs=trials)

