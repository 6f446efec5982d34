"""``HyperparameterTuner`` (SDK v2 over an estimator, v3 over a ModelTrainer), searched by Optuna.

Every trial is a real recorded job (a runner, an agent, the script); the scripts are tiny (a
loss computed from the hyperparameters), so a trial takes seconds. A trial that must be stopped
early, or must outlive a killed tuning loop, waits where the test can see it instead of sleeping
for a guessed time.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from conftest import HP_LOSS_SCRIPT, disttrain, hp_loss, write
from disttrain.errors import UsageError
from disttrain.store import JobStore

pytest.importorskip("optuna")
pytest.importorskip("pandas")
pytestmark = pytest.mark.timeout(300)

LOSS_SCRIPT = HP_LOSS_SCRIPT + """\
    print(f"epoch {a.epochs} loss={loss:.6f}", flush=True)
"""
DEFINITIONS = [{"Name": "loss", "Regex": r"loss=([0-9.]+)"}]


def check_trials(tuner, frame, *, count: int, params: list[str]) -> list:
    """What a user checks: the SDK's columns, each trial a recorded Completed job with the trial's
    hyperparameters, and best_training_job() the row with the best FinalObjectiveValue."""
    assert list(frame.columns) == [*params, "TrainingJobName", "TrainingJobStatus", "FinalObjectiveValue",
                                   "TrainingStartTime", "TrainingEndTime", "TrainingElapsedTimeSeconds"]
    assert len(frame) == count and set(frame["TrainingJobStatus"]) == {"Completed"}
    best = frame.loc[frame["FinalObjectiveValue"].idxmin(), "TrainingJobName"]
    assert tuner.best_training_job() == best
    name = tuner.latest_tuning_job.name
    with JobStore() as store:
        records = {r.name: r for r in store.list()}
    assert set(records) == set(frame["TrainingJobName"])  # every trial is in the job store, nothing else
    for row in frame.itertuples():
        record = records[row.TrainingJobName]
        assert row.TrainingJobName.startswith(f"{name}-") and str(record.state) == "Completed"
        hps = record.spec["hyperparameters"]
        assert hps["epochs"] == 2  # the static hyperparameter, with the trial's own
        assert row.FinalObjectiveValue == hp_loss(hps["lr"], int(hps["layers"]), hps["opt"])
    return list(records.values())


def test_v2_tuner_four_trials_two_at_a_time(job_home):
    from disttrain.sagemaker.pytorch import PyTorch
    from disttrain.sagemaker.tuner import (
        CategoricalParameter,
        ContinuousParameter,
        HyperparameterTuner,
        IntegerParameter,
    )

    write(job_home / "src" / "loss.py", LOSS_SCRIPT)
    est = PyTorch(entry_point="loss.py", source_dir="src", instance_type="ml.c5.xlarge", framework_version="2.1",
                  py_version="py3", hyperparameters={"epochs": 2}, disttrain={"private_opt_ml": "off"})
    ranges = {"lr": ContinuousParameter(0.01, 1.0, scaling_type="Logarithmic"), "layers": IntegerParameter(1, 4),
              "opt": CategoricalParameter(["adam", "sgd"])}
    tuner = HyperparameterTuner(est, "loss", ranges, metric_definitions=DEFINITIONS, objective_type="Minimize",
                                max_jobs=4, max_parallel_jobs=2, random_seed=7, base_tuning_job_name="lin")
    tuner.fit()
    name = tuner.latest_tuning_job.name
    frame = tuner.analytics().dataframe()
    records = check_trials(tuner, frame, count=4, params=["lr", "layers", "opt"])
    # never more than max_parallel_jobs trials at once
    events = sorted([(r.created, 1) for r in records] + [(r.ended, -1) for r in records])
    running = [sum(step for _, step in events[:i + 1]) for i in range(len(events))]
    assert max(running) <= 2
    described = tuner.describe()
    assert described["HyperParameterTuningJobStatus"] == "Completed"
    assert described["TrainingJobStatusCounters"]["Completed"] == 4
    assert described["HyperParameterTuningJobConfig"]["ResourceLimits"] == {"MaxNumberOfTrainingJobs": 4,
                                                                            "MaxParallelTrainingJobs": 2}
    assert Path(tuner.best_estimator().model_data).is_file()  # the best trial's model.tar.gz
    shown = disttrain("tune", "show", name)
    assert shown.returncode == 0, shown.stderr
    best_line = [line for line in shown.stdout.splitlines() if line.startswith("*")]
    assert len(best_line) == 1 and tuner.best_training_job() in best_line[0]
    listed = disttrain("jobs", "ls")
    assert all(job in listed.stdout for job in frame["TrainingJobName"])
    assert name in disttrain("tune", "ls").stdout


V3_SCRIPT = """\
    import argparse, json, os
    p = argparse.ArgumentParser()
    for name in ("--lr", "--layers", "--opt", "--epochs"):
        p.add_argument(name)
    a = p.parse_args()
    assert os.environ["SM_HOST_COUNT"] == "1" and json.loads(os.environ["SM_HPS"])["epochs"] == 2
    loss = (float(a.lr) - 0.3) ** 2 + 0.01 * int(a.layers) + (0.1 if a.opt == "sgd" else 0.0) + 0.001 * int(a.epochs)
    print(f"loss={loss:.6f}", flush=True)
"""


def test_v3_tuner_of_three_over_a_model_trainer(job_home):
    from disttrain.sagemaker.core.parameter import CategoricalParameter, ContinuousParameter, IntegerParameter
    from disttrain.sagemaker.train import ModelTrainer
    from disttrain.sagemaker.train.configs import Compute, MetricDefinition, SourceCode
    from disttrain.sagemaker.train.tuner import HyperparameterTuner

    write(job_home / "src" / "loss.py", V3_SCRIPT)
    trainer = ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="loss.py"),
                           compute=Compute(instance_type="ml.m5.large", instance_count=1),
                           hyperparameters={"epochs": 2}, base_job_name="v3-loss",
                           disttrain={"private_opt_ml": "off"}).with_metric_definitions(
        [MetricDefinition(name="loss", regex=r"loss=([0-9.]+)")])
    tuner = HyperparameterTuner(trainer, "loss", {"lr": ContinuousParameter(0.01, 1.0),
                                                  "layers": IntegerParameter(1, 4),
                                                  "opt": CategoricalParameter(["adam", "sgd"])},
                                strategy="Random", objective_type="Minimize", max_jobs=3, max_parallel_jobs=3,
                                random_seed=3)  # the three at once: one trial at a time is the v2 tests' way
    tuner.tune()
    frame = tuner.analytics().dataframe()
    records = check_trials(tuner, frame, count=3, params=["lr", "layers", "opt"])
    assert {r.spec["contract"] for r in records} == {"model_trainer"}  # v3's contract in every trial
    best = tuner.best_model_trainer()._latest_training_job
    assert best.training_job_name == tuner.best_training_job() and best.training_job_status == "Completed"
    assert tuner.latest_tuning_job.refresh().best_training_job.training_job_name == best.training_job_name


EARLY_SCRIPT = """\
    import argparse, time
    p = argparse.ArgumentParser()
    p.add_argument("--quality", type=float)
    a = p.parse_args()
    for step in range(3):
        print(f"step {step} loss={a.quality / (step + 1):.4f}", flush=True)
        time.sleep(0.2)
    if a.quality > 5:  # the trial that is behind waits: only early stopping can end it in time
        time.sleep(120)
    print(f"step 3 loss={a.quality / 4:.4f}", flush=True)
"""


def test_early_stopping_stops_the_trial_that_is_behind(job_home):
    from disttrain.sagemaker.estimator import Estimator
    from disttrain.sagemaker.tuner import CategoricalParameter, HyperparameterTuner

    write(job_home / "src" / "early.py", EARLY_SCRIPT)
    est = Estimator(entry_point="early.py", source_dir="src", disttrain={"private_opt_ml": "off"})
    tuner = HyperparameterTuner(est, "loss", {"quality": CategoricalParameter([1, 2, 9])},
                                metric_definitions=DEFINITIONS, objective_type="Minimize", strategy="Grid",
                                max_parallel_jobs=1, early_stopping_type="Auto")
    assert tuner.max_jobs is None  # Grid: every combination
    tuner.fit()
    frame = tuner.analytics().dataframe().set_index("quality")
    assert frame.loc[1.0, "TrainingJobStatus"] == frame.loc[2.0, "TrainingJobStatus"] == "Completed"
    assert frame.loc[9.0, "TrainingJobStatus"] == "Stopped"
    assert frame.loc[1.0, "FinalObjectiveValue"] == 0.25
    assert tuner.best_training_job() == frame.loc[1.0, "TrainingJobName"]
    described = tuner.describe()
    stopped = [s for s in described["TrainingJobSummaries"] if s["TrainingJobStatus"] == "Stopped"]
    assert [s["ObjectiveStatus"] for s in stopped] == ["Failed"]
    log = (job_home / "tuning" / f"{tuner.latest_tuning_job.name}.log").read_text()
    assert "stopping trial 3" in log and "is behind the earlier trials" in log


WAIT_SCRIPT = """\
    import argparse, os, time
    p = argparse.ArgumentParser()
    p.add_argument("--pos", type=float)
    p.add_argument("--go")
    a = p.parse_args()
    while not os.path.exists(a.go):  # the test lets it end once the tuning loop is gone
        time.sleep(0.1)
    print(f"loss={abs(a.pos - 0.5):.6f}", flush=True)
"""


def test_a_killed_tuner_is_resumed(job_home):
    import time

    from disttrain.sagemaker.estimator import Estimator
    from disttrain.sagemaker.tuner import ContinuousParameter, HyperparameterTuner

    write(job_home / "src" / "wait.py", WAIT_SCRIPT)
    go = job_home / "go"
    est = Estimator(entry_point="wait.py", source_dir="src", hyperparameters={"go": str(go)},
                    disttrain={"private_opt_ml": "off"})
    tuner = HyperparameterTuner(est, "loss", {"pos": ContinuousParameter(0, 1)}, metric_definitions=DEFINITIONS,
                                objective_type="Minimize", strategy="Random", max_jobs=3, random_seed=1)
    tuner.fit(wait=False)
    name = tuner.latest_tuning_job.name
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the first trial's job is running (it waits for `go`)
        with JobStore() as store:
            running = [r for r in store.list() if str(r.state) == "Running"]
        if running:
            break
        time.sleep(0.3)
    assert running, "the first trial never started"
    loop = tuner.latest_tuning_job._process
    loop.kill()  # the tuning loop dies outright; its trial does not
    loop.wait()
    go.write_text("")
    assert json.loads(disttrain("tune", "show", name, "--json").stdout)["HyperParameterTuningJobStatus"] == \
        "InProgress"
    resumed = disttrain("tune", "resume", name, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert f"following trial 1 ({running[0].name})" in resumed.stdout
    frame = HyperparameterTuner.attach(name).analytics().dataframe()
    assert len(frame) == 3 and set(frame["TrainingJobStatus"]) == {"Completed"}
    assert running[0].name in set(frame["TrainingJobName"])  # the first trial counted, not run again
    for row in frame.itertuples():
        assert math.isclose(row.FinalObjectiveValue, round(abs(row.pos - 0.5), 6))
    assert frame["pos"].nunique() == 3  # the resumed loop does not ask for the same point again
    assert HyperparameterTuner.attach(name).best_training_job() == \
        frame.loc[frame["FinalObjectiveValue"].idxmin(), "TrainingJobName"]


def test_bad_tuner_arguments_are_one_line_and_nothing_is_made(job_home):
    from disttrain.sagemaker.estimator import Estimator
    from disttrain.sagemaker.train import ModelTrainer
    from disttrain.sagemaker.train.configs import SourceCode
    from disttrain.sagemaker.tuner import CategoricalParameter, ContinuousParameter, HyperparameterTuner
    from disttrain.sagemaker.tuning import storage_path, tuning_names

    write(job_home / "src" / "loss.py", LOSS_SCRIPT)
    est = Estimator(entry_point="loss.py", source_dir="src", hyperparameters={"lr": 0.1},
                    metric_definitions=DEFINITIONS)
    lr = {"lr": ContinuousParameter(0.01, 1.0)}
    cases = [
        (dict(objective_metric_name="acc"), "objective_metric_name 'acc' has no metric definition (defined: loss)"),
        (dict(strategy="Genetic"), "strategy must be one of Bayesian, Random, Grid, Hyperband, got 'Genetic'"),
        (dict(strategy="Grid"), "strategy 'Grid' needs Categorical or Integer ranges; 'lr' is Continuous"),
        (dict(strategy="Hyperband", early_stopping_type="Auto"), "early_stopping_type must be 'Off' with strategy"),
        (dict(max_jobs=0), "max_jobs must be a positive integer, got 0"),
        (dict(objective_type="Max"), "objective_type must be one of Maximize, Minimize, got 'Max'"),
        (dict(hyperparameter_ranges={"lr": [0.1, 0.2]}), "hyperparameter_ranges['lr'] must be a ContinuousParameter"),
        (dict(hyperparameter_ranges={"lr": ContinuousParameter(1, 0)}), "min_value 1 is above max_value 0"),
        (dict(hyperparameter_ranges={"opt": CategoricalParameter([])}), "needs at least one value"),
        (dict(autotune=True), "autotune=True is SageMaker's own range chooser"),
    ]
    for override, message in cases:
        args = {"objective_metric_name": "loss", "hyperparameter_ranges": lr, **override}
        with pytest.raises(UsageError, match=re.escape(message)) as err:
            HyperparameterTuner(est, **args)
        assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_job'"):
        HyperparameterTuner(est, "loss", lr, max_job=2)
    trainer = ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="loss.py"))
    with pytest.raises(UsageError, match="from sagemaker.train.tuner import HyperparameterTuner"):
        HyperparameterTuner(trainer, "loss", lr)
    # the trials' job is checked before the tuning job is made: a missing channel, one line
    tuner = HyperparameterTuner(est, "loss", lr)
    with pytest.raises(UsageError, match=r"inputs.training: .*missing does not exist"):
        tuner.fit(str(job_home / "missing"))
    assert not storage_path().exists() or tuning_names() == []
    with JobStore() as store:
        assert store.list() == []


def test_strategies_map_onto_optuna():
    import optuna

    from disttrain.sagemaker.parameter import CategoricalParameter, IntegerParameter
    from disttrain.sagemaker.tuning import TuningConfig, sampler_and_pruner

    job = {"metric_definitions": DEFINITIONS}
    ranges = {"opt": CategoricalParameter(["adam", "sgd"]).to_dict(), "layers": IntegerParameter(1, 3).to_dict()}

    def made(**kwargs):
        config = TuningConfig(name="t", job=job, ranges=ranges, objective_metric_name="loss", **kwargs)
        return tuple(type(x) for x in sampler_and_pruner(config))

    samplers, pruners = optuna.samplers, optuna.pruners
    assert made() == (samplers.TPESampler, pruners.NopPruner)
    assert made(strategy="Random") == (samplers.RandomSampler, pruners.NopPruner)
    assert made(strategy="Bayesian", early_stopping_type="Auto") == (samplers.TPESampler, pruners.MedianPruner)
    assert made(strategy="Hyperband") == (samplers.TPESampler, pruners.HyperbandPruner)
    grid = TuningConfig(name="t", job=job, ranges=ranges, objective_metric_name="loss", strategy="Grid").grid()
    assert grid == [{"opt": o, "layers": n} for o in ("adam", "sgd") for n in (1, 2, 3)]  # every point, in order


def test_stop_tuning_job_stops_its_running_trial(job_home):
    import time

    from disttrain.sagemaker.estimator import Estimator
    from disttrain.sagemaker.tuner import ContinuousParameter, HyperparameterTuner

    write(job_home / "src" / "wait.py", WAIT_SCRIPT)
    est = Estimator(entry_point="wait.py", source_dir="src", hyperparameters={"go": str(job_home / "never")},
                    disttrain={"private_opt_ml": "off"})
    tuner = HyperparameterTuner(est, "loss", {"pos": ContinuousParameter(0, 1)}, metric_definitions=DEFINITIONS,
                                strategy="Random", max_jobs=3)
    tuner.fit(wait=False)
    deadline = time.monotonic() + 120
    running = []
    while not running and time.monotonic() < deadline:  # a trial that can only end by being stopped
        with JobStore() as store:
            running = [r for r in store.list() if str(r.state) == "Running"]
        time.sleep(0.3)
    assert running, "the first trial never started"
    tuner.stop_tuning_job()
    described = tuner.describe()
    assert described["HyperParameterTuningJobStatus"] == "Stopped"
    assert [s["TrainingJobStatus"] for s in described["TrainingJobSummaries"]] == ["Stopped"]
    with JobStore() as store:
        assert [str(r.state) for r in store.list()] == ["Stopped"]  # no trial started after the stop
