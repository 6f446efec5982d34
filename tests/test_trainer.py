"""disttrain.trainer.Trainer: resume bit for bit, metrics files, best model, and 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from _launch import run_ranks
from conftest import SCRIPTS
from disttrain.errors import UsageError
from disttrain.trainer import BEST_MODEL, METRICS_FILE, Trainer

pytestmark = pytest.mark.usefixtures("ctx")  # a fresh world of one for every test


def make_trainer(tmp_path: Path, name: str, **kwargs) -> Trainer:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = (x[:, 0] - x[:, 2] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(3))
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=10)
    return Trainer(model, optimizer, train, val, F.cross_entropy, scheduler=scheduler,
                   metrics=("top1", "top2"), checkpoint_dir=tmp_path / name / "ckpt",
                   run_dir=tmp_path / name / "run", progress=False, **kwargs)


@pytest.mark.timeout(60)
def test_a_resumed_fit_ends_where_an_unbroken_one_does(tmp_path):
    straight = make_trainer(tmp_path, "a")
    assert [r["epoch"] for r in straight.fit(3)] == [0, 1, 2]

    make_trainer(tmp_path, "b").fit(2)  # stopped after two epochs...
    resumed = make_trainer(tmp_path, "b")  # ...and started again, from fresh objects
    ran = resumed.fit(3)
    assert [r["epoch"] for r in ran] == [2]
    for mine, theirs in zip(resumed.model.state_dict().values(), straight.model.state_dict().values()):
        assert torch.equal(mine, theirs)
    assert ran[0]["lr"] == straight.history[2]["lr"] == 0.3 * 0.25  # the scheduler resumed too
    assert resumed.fit(3) == []  # nothing left to do

    records = [json.loads(line) for line in (tmp_path / "b" / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert {"train_loss", "val_loss", "val_top1", "val_top2", "lr", "seconds", "best"} <= records[0].keys()
    assert records[0]["val_top2"] == 1.0  # two classes: always in the top 2
    assert [r["val_top1"] for r in records] == [r["val_top1"] for r in straight.history]


@pytest.mark.timeout(60)
def test_the_best_model_is_kept_by_the_first_metric(tmp_path):
    trainer = make_trainer(tmp_path, "c")
    history = trainer.fit(2)
    best = max(history, key=lambda r: r["val_top1"])
    assert trainer.best == best["val_top1"] and best["best"]
    state = torch.load(tmp_path / "c" / "ckpt" / BEST_MODEL, weights_only=True)
    assert set(state) == {"weight", "bias"}
    assert not [p for p in (tmp_path / "c" / "ckpt").iterdir() if p.name.endswith(".tmp")]


def test_accumulated_bf16_fit_resumes_like_an_unbroken_one(tmp_path):
    options = {"mixed_precision": "bf16", "accumulate": 2, "clip_grad_norm": 1.0}
    unbroken = make_trainer(tmp_path, "unbroken", **options)
    unbroken.fit(3)
    first = make_trainer(tmp_path, "broken", **options)
    first.fit(2)
    second = make_trainer(tmp_path, "broken", **options)
    assert second.fit(3)[0]["epoch"] == 2
    assert torch.equal(second.model.weight, unbroken.model.weight)
    assert second.step.grad_norm is not None


def test_unknown_metric_is_a_usage_error():
    model = torch.nn.Linear(1, 1)
    loader = DataLoader(TensorDataset(torch.zeros(2, 1), torch.zeros(2, 1)))
    with pytest.raises(UsageError, match="unknown metric 'accuracy'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=1), loader, None, F.mse_loss,
                metrics=("accuracy",))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_reduce_the_validation_metrics(tmp_path, strategy):
    result = run_ranks(SCRIPTS / "trainer_ranks.py", 2, [tmp_path / "ckpt", strategy], timeout=110)
    assert result.returncode == 0, result.stderr
    line = [x for x in result.stdout.splitlines() if x.startswith("[rank0] {")][-1]
    report = json.loads(line[len("[rank0] "):])
    # the ranks' counts over their shares, summed, equal one count over the whole set
    assert report["last"]["val_top1"] == report["whole_val_top1"]
    assert report["last"]["epoch"] == 1
    assert sum(x.startswith("[rank0] epoch 0 step 0/") for x in result.stdout.splitlines()) == 1
    run_dir = Path(result.stderr.split("logs: ")[1].split()[0])
    assert len((run_dir / METRICS_FILE).read_text().splitlines()) == 2  # rank 0 writes, once
    # TensorBoard's scalars, written without importing TensorFlow (installed here): before,
    # torch.utils.tensorboard imported it after epoch 0, seconds of CPU inside the run.
    assert report["tensorflow_imported"] is False
    assert tensorboard_scalars(run_dir / "tensorboard", "val_top1") == [(0, pytest.approx(report["history"][0])),
                                                                         (1, pytest.approx(report["last"]["val_top1"]))]


def tensorboard_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = logdir.glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]
