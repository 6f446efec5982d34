"""The runtime in this very process, a world of one: prepare, metrics, checkpoints."""

import json
import math
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import disttrain
from disttrain import checkpoint
from disttrain.checkpoint_layout import MARKER, STATE_FILE, hash_file
from disttrain.errors import DisttrainError, UsageError
from disttrain.runtime import loop
from disttrain.runtime.samplers import EvalShardSampler


def test_world_of_one_sets_up_nothing(ctx):
    assert not torch.distributed.is_initialized()
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed) == (0, 1, True, False)
    assert disttrain.init() is ctx and disttrain.context() is ctx


def test_reductions_are_identity_and_keep_the_kind(ctx):
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    assert torch.equal(disttrain.reduce_sum(t), t.detach())
    assert not disttrain.reduce_sum(t).requires_grad
    assert disttrain.reduce_sum(3) == 3 and isinstance(disttrain.reduce_sum(3), int)
    assert disttrain.reduce_mean(3) == 3.0 and isinstance(disttrain.reduce_mean(3), float)
    assert disttrain.reduce_mean(torch.tensor([2, 4])).dtype == torch.get_default_dtype()
    assert disttrain.reduce_max(2.5) == 2.5
    with pytest.raises(TypeError):
        disttrain.reduce_sum("3")


def test_mean_meter(ctx):
    meter = disttrain.AverageMeter()
    assert math.isnan(meter.avg) and math.isnan(meter.local_avg)
    meter.update(torch.tensor(1.0), n=3)
    meter.update(5.0)
    assert (meter.sum, meter.count, meter.avg, meter.local_avg) == (8.0, 4, 2.0, 2.0)
    meter.reset()
    assert meter.count == 0


def test_topk_counts_and_accuracy():
    output = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.6, 0.1, 0.3]])
    target = torch.tensor([1, 1, 0, 2])
    assert disttrain.topk_correct(output, target, topk=(1, 2, 3)) == [1, 3, 4]
    assert disttrain.accuracy(output, target, topk=(1, 2)) == [0.25, 0.75]
    with pytest.raises(ValueError, match="between 1 and 3"):
        disttrain.topk_correct(output, target, topk=(5,))


def test_print0_prints_on_rank_zero(ctx, capsys):
    disttrain.print0("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


def test_prepare_shards_in_a_world_of_one_and_keeps_loader_settings(ctx):
    data = TensorDataset(torch.arange(10))
    train = DataLoader(data, batch_size=3, shuffle=True, drop_last=True,
                       generator=torch.Generator().manual_seed(7))
    evaluation = DataLoader(data, batch_size=4, collate_fn=lambda b: len(b))
    model, opt, train2, eval2 = disttrain.prepare(torch.nn.Linear(2, 2), None, train, evaluation)
    assert isinstance(model, torch.nn.Linear) and opt is None
    assert isinstance(train2, DataLoader) and isinstance(train2.sampler, DistributedSampler)
    assert train2.sampler.seed == 7 and train2.drop_last and train2.batch_size == 3
    assert len(train2) == 3 and train2.dataset is data
    assert isinstance(eval2.sampler, EvalShardSampler) and list(eval2) == [4, 4, 2]
    assert train2 in loop.tracked()
    assert disttrain.prepare(None, None, train2)[2] is train2  # not sharded twice


def test_prepared_loader_keeps_worker_settings(ctx):
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True,
                        num_workers=1, persistent_workers=True, prefetch_factor=3, timeout=30)
    (_, _, prepared) = disttrain.prepare(None, None, loader)
    assert (prepared.num_workers, prepared.persistent_workers) == (1, True)
    assert (prepared.prefetch_factor, prepared.timeout) == (3, 30)
    assert sorted(int(x) for (batch,) in prepared for x in batch) == list(range(8))


def test_epochs_sets_the_epoch_and_reshuffles(ctx):
    data = TensorDataset(torch.arange(20))
    (_, _, train) = disttrain.prepare(None, None, DataLoader(data, batch_size=20, shuffle=True))
    orders = {}
    for epoch in disttrain.epochs(3, start=1):
        assert train.sampler.epoch == epoch
        orders[epoch] = next(iter(train))[0].tolist()
    assert list(orders) == [1, 2] and orders[1] != orders[2]
    assert sorted(orders[1]) == list(range(20))
    with pytest.raises(UsageError, match="negative"):
        list(disttrain.epochs(-1))


# -- checkpoints --------------------------------------------------------------------------

def trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_save_and_load_latest_roundtrip(ctx, tmp_path):
    model, opt, sched = trained()
    path = checkpoint.save(tmp_path / "ck", step=100, model=model, optimizer=opt,
                           scheduler=sched, epoch=4, best={"acc": 0.5}, note="x",
                           ema=torch.ones(2))
    assert path == tmp_path / "ck" / "step_00000100"
    assert {p.name for p in path.iterdir()} == {STATE_FILE, MARKER}
    assert checkpoint.latest(tmp_path / "ck") == path

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    state = checkpoint.load_latest(tmp_path / "ck", model=model2, optimizer=opt2, scheduler=sched2)
    assert state["step"] == 100 and state["epoch"] == 4 and state["best"] == {"acc": 0.5}
    assert state["note"] == "x" and torch.equal(state["ema"], torch.ones(2))
    assert torch.equal(model2.weight, model.weight)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert sched2.last_epoch == sched.last_epoch == 1


def test_load_latest_without_checkpoint_is_none(ctx, tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path / "missing") is None


def test_keep_last_k_and_resaving_a_step(ctx, tmp_path):
    for step in (1, 2, 3, 4, 5):
        checkpoint.save(tmp_path, step=step, keep_last=2, value=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    checkpoint.save(tmp_path, step=5, keep_last=2, value=55)
    assert checkpoint.load_latest(tmp_path)["value"] == 55
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]


def test_newest_incomplete_or_corrupt_falls_back(ctx, tmp_path):
    checkpoint.save(tmp_path, step=1, value="good")
    checkpoint.save(tmp_path, step=2, value="corrupt")
    checkpoint.save(tmp_path, step=3, value="incomplete")
    (tmp_path / "step_00000003" / MARKER).unlink()                  # crashed before the marker
    (tmp_path / ".tmp-step_00000004-999").mkdir()                   # crashed before the rename
    state_file = tmp_path / "step_00000002" / STATE_FILE
    state_file.write_bytes(state_file.read_bytes()[:100])          # truncated on disk
    assert checkpoint.latest(tmp_path).name == "step_00000002"
    with pytest.warns(UserWarning, match="step_00000002"):
        state = checkpoint.load_latest(tmp_path)
    assert state == {"step": 1, "value": "good"}


class Payload:
    """Stands for anything a pickle could smuggle in."""


def rewrite_digest(step_dir, name):
    """What a writer trusted to change the file would do: record its new digest."""
    meta = json.loads((step_dir / MARKER).read_text())
    meta["digests"][name] = hash_file(step_dir / name)
    (step_dir / MARKER).write_text(json.dumps(meta))


def test_weights_only_refuses_arbitrary_objects(ctx, tmp_path):
    checkpoint.save(tmp_path, step=1, value=1)
    target = tmp_path / "step_00000001" / STATE_FILE
    torch.save({"step": 1, "value": Payload()}, target)
    # Its digest no longer matches, but a file holding code is refused, not skipped as damage.
    with pytest.raises(DisttrainError, match="weights_only=False"):
        checkpoint.load_latest(tmp_path)
    rewrite_digest(target.parent, STATE_FILE)
    with pytest.raises(DisttrainError, match="weights_only=False"):
        checkpoint.load_latest(tmp_path)
    assert isinstance(checkpoint.load_latest(tmp_path, weights_only=False)["value"], Payload)


def test_save_refuses_values_weights_only_could_not_load(ctx, tmp_path):
    with pytest.raises(UsageError, match="'args'.*Payload"):
        checkpoint.save(tmp_path, step=1, args={"nested": [Payload()]})
    Point = namedtuple("Point", "x y")
    with pytest.raises(UsageError, match="'where'.*Point"):
        checkpoint.save(tmp_path, step=1, where=Point(1, 2))
    assert not list(tmp_path.iterdir())


def test_unwritable_directory_is_named(ctx, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DisttrainError, match=str(blocker / "ck")):
        checkpoint.save(blocker / "ck", step=1, value=1)
    with pytest.raises(DisttrainError, match=f"{blocker}: it is a file"):
        checkpoint.save(blocker, step=1, value=1)
    with pytest.raises(DisttrainError, match=str(blocker)):
        checkpoint.load_latest(blocker)


def test_bad_arguments_name_the_field(ctx, tmp_path):
    with pytest.raises(UsageError, match="keep_last"):
        checkpoint.save(tmp_path, step=1, keep_last=0)
    with pytest.raises(UsageError, match="step"):
        checkpoint.save(tmp_path, step=-1)
    checkpoint.save(tmp_path, step=1, value=1)
    with pytest.raises(DisttrainError, match="no 'model'"):
        checkpoint.load_latest(tmp_path, model=torch.nn.Linear(1, 1))
