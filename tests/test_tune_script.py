"""``disttrain tune run SCRIPT``: a plain script tuned on the SageMaker tuner's engine.

Every trial is a real recorded job running the script (tiny: a loss computed from its
arguments), so the test checks what a user would: the trials in the job store with their
arguments and objective, never more than ``--parallel`` at once, and the best the minimum.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HP_LOSS_SCRIPT, cli_env, disttrain, hp_loss, write
from disttrain.store import JobStore

pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(300)

SCRIPT = HP_LOSS_SCRIPT + """\
    for step in range(2):
        print(f"step {step} loss: {loss + 1 - step:.6f}", flush=True)  # the last value is the objective
"""


def expected(hps: dict) -> float:
    return hp_loss(hps["lr"], int(hps["layers"]), hps["opt"], int(hps["epochs"]))


@pytest.fixture
def script_home(job_home):
    write(job_home / "loss.py", SCRIPT)
    return job_home


def tune(*args: str, cwd: Path):
    return disttrain("tune", *args, timeout=240, cwd=cwd, env=cli_env())


def test_four_trials_two_at_a_time_best_is_the_minimum(script_home):
    done = tune("run", "loss.py", "--param", "lr=0.01:1:log", "--param", "layers=1:4", "--param", "opt=adam,sgd",
                "--set", "epochs=2", "--objective", "loss", "--minimize", "--trials", "4", "--parallel", "2",
                "--seed", "7", "--name", "plain", cwd=script_home)
    assert done.returncode == 0, done.stdout + done.stderr
    with JobStore() as store:
        records = store.list()
        objective = {r.name: store.metric_series(r.id)["loss"][-1][1] for r in records}
    assert len(records) == 4 and {str(r.state) for r in records} == {"Completed"}
    for record in records:  # each trial ran the script with its own arguments and the fixed one
        hps = record.spec["hyperparameters"]
        assert record.name.startswith("plain-") and hps["epochs"] in (2, "2")
        assert objective[record.name] == pytest.approx(expected(hps), abs=1e-6)
    events = sorted([(r.created, 1) for r in records] + [(r.ended, -1) for r in records])
    assert max(sum(step for _, step in events[:i + 1]) for i in range(len(events))) <= 2
    best = min(objective, key=objective.get)
    assert done.stdout.strip().splitlines()[-1].startswith(
        f"disttrain: tuning job plain Completed: 4 trial(s); best {best}: loss={objective[best]:.6g}")
    described = json.loads(tune("show", "plain", "--json", cwd=script_home).stdout)
    assert described["BestTrainingJob"]["TrainingJobName"] == best
    assert described["HyperParameterTuningJobConfig"]["ResourceLimits"] == {"MaxNumberOfTrainingJobs": 4,
                                                                            "MaxParallelTrainingJobs": 2}
    assert "plain" in tune("ls", cwd=script_home).stdout


def test_the_same_from_a_file_grid(script_home):
    write(script_home / "tune.yaml", """\
        script: loss.py
        param: {layers: "1:2", opt: [adam, sgd]}
        set: {lr: 0.3, epochs: 1}
        objective: loss
        pattern: 'loss: ([0-9.]+)'
        direction: maximize
        strategy: Grid
        parallel: 2
        """)
    done = tune("run", "--config", "tune.yaml", "--name", "grid", cwd=script_home)
    assert done.returncode == 0, done.stdout + done.stderr
    with JobStore() as store:
        seen = sorted((int(r.spec["hyperparameters"]["layers"]), r.spec["hyperparameters"]["opt"])
                      for r in store.list())
    assert seen == [(1, "adam"), (1, "sgd"), (2, "adam"), (2, "sgd")]  # Grid: every combination, once
    assert "best grid-" in done.stdout and "opt=sgd" in done.stdout.splitlines()[-1]  # maximize


@pytest.mark.parametrize("args, says", [
    (["nothere.py", "--param", "lr=0:1", "--objective", "loss", "--minimize"], "no script 'nothere.py'"),
    (["loss.py", "--param", "lr=1:0", "--objective", "loss", "--minimize"], "LOW must be below HIGH"),
    (["loss.py", "--param", "lr=0:1:log", "--objective", "loss", "--minimize"], "a log range needs LOW > 0"),
    (["loss.py", "--param", "lr", "--objective", "loss", "--minimize"], "expected NAME=VALUE"),
    (["loss.py", "--param", "lr=0:1", "--objective", "loss"], "give --minimize or --maximize"),
    (["loss.py", "--param", "lr=0:1", "--minimize"], "give --objective NAME"),
    (["loss.py", "--param", "lr=0:1", "--objective", "loss", "--minimize", "--pattern", "loss=\\S+"], "has no group"),
    (["loss.py", "--param", "lr=0:1", "--objective", "loss", "--minimize", "--trials", "0"], "--trials must be"),
    (["loss.py", "--param", "lr=0:1", "--set", "lr=1", "--objective", "loss", "--minimize"], "both static and tuned"),
    (["loss.py", "--param", "lr=0.0:1", "--objective", "loss", "--minimize", "--strategy", "Grid"], "is Continuous"),
    (["--config", "missing.yaml"], "--config missing.yaml: No such file"),
])
def test_bad_input_is_one_line_exit_2(script_home, args, says):
    done = tune("run", *args, cwd=script_home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    with JobStore() as store:
        assert store.list() == []  # nothing recorded
