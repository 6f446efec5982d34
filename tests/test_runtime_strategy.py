"""The pure decisions behind prepare(strategy=..., mixed_precision=...): which blocks FSDP
shards, which precision runs where (the CUDA choices included, without a GPU), and how
bad options are refused."""

from __future__ import annotations

import pytest
import torch

import disttrain
from disttrain.errors import UsageError
from disttrain.runtime.precision import resolve
from disttrain.runtime.strategies import PrepareOptions
from disttrain.runtime.strategies.fsdp import default_blocks, select_blocks


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(4, 10)


def test_default_blocks_are_the_outermost_repeated_modules():
    tower = Tower()
    assert default_blocks(tower) == list(tower.layers)


def test_without_repeats_the_large_children_are_the_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 2))
    # Linear repeats (twice), so both Linears are blocks; the ReLU holds nothing.
    assert default_blocks(model) == [model[0], model[2]]
    single = torch.nn.ModuleDict({"big": torch.nn.Conv2d(3, 64, 7), "tiny": torch.nn.BatchNorm2d(64)})
    assert default_blocks(single) == [single["big"]]


def test_blocks_can_be_chosen_by_class_or_predicate():
    tower = Tower()
    assert select_blocks(tower, [torch.nn.Linear]) == [*(m for b in tower.layers for m in (b.a, b.b)), tower.head]
    assert select_blocks(tower, lambda m: isinstance(m, (Block, torch.nn.Linear))) == list(tower.layers) + [tower.head]
    with pytest.raises(UsageError, match="module classes"):
        select_blocks(tower, ["Block"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"strategy": "zero3"}, "unknown strategy"),
    ({"strategy": "ddp", "blocks": [Block]}, "with strategy='fsdp'"),
    ({"grad_clip": 1.0}, "unknown option 'grad_clip'"),
])
def test_bad_options_name_the_fix(kwargs, message):
    with pytest.raises(UsageError, match=message):
        PrepareOptions.from_kwargs(kwargs)


def test_precision_choices_per_device():
    assert resolve(None, torch.device("cpu")).dtype is None
    assert resolve("bf16", torch.device("cpu")).dtype == torch.bfloat16
    fp16 = resolve("fp16", torch.device("cuda:1"))
    assert fp16.dtype == torch.float16 and fp16.needs_scaler and fp16.device_type == "cuda"
    assert not resolve("bf16", torch.device("cuda:0")).needs_scaler
    with pytest.raises(UsageError, match="needs a CUDA GPU.*'bf16'"):
        resolve("fp16", torch.device("cpu"))
    with pytest.raises(UsageError, match="unknown precision"):
        resolve("fp32x", torch.device("cpu"))


def test_bf16_on_cpu_computes_in_bf16_and_returns_float32(ctx):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    prepared, _ = disttrain.prepare(model, None, mixed_precision="bf16")
    out = prepared(torch.randn(3, 8))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in prepared.state_dict().values())


def test_accumulate_in_a_world_of_one_matches_the_big_batch(ctx):
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    models = []
    for micro in (1, 4):
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = disttrain.prepare(model, opt)
        step = disttrain.accumulate(model, opt, micro, clip_grad_norm=0.1)
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with step:
                step.backward(torch.nn.functional.mse_loss(model(xs), ys))
        assert step.stepped and step.grad_norm is not None
        models.append(model)
    torch.testing.assert_close(models[0].weight, models[1].weight)


def test_accumulate_refuses_bad_counts(ctx):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="integer >= 1"):
        disttrain.accumulate(model, opt, 0)
    with pytest.raises(UsageError, match="positive norm"):
        disttrain.accumulate(model, opt, 2, clip_grad_norm=-1)
