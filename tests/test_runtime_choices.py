"""The runtime's pure decisions, GPU paths included, on a machine without a GPU."""

from collections import namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from disttrain.errors import DisttrainError, UsageError
from disttrain.runtime.context import resolve
from disttrain.runtime.data import shard_sampler
from disttrain.runtime.device import (
    batch_target,
    ddp_device_ids,
    move_to,
    non_blocking_for,
    pin_memory_for,
)
from disttrain.runtime.samplers import EvalShardSampler
from disttrain.workerenv import WorkerEnv

GPU = torch.device("cuda:1")
CPU = torch.device("cpu")


def test_gpu_device_pins_copies_async_and_names_its_index():
    assert pin_memory_for(GPU) and non_blocking_for(GPU)
    assert batch_target(GPU) == GPU
    assert ddp_device_ids(GPU) == [1]


def test_cpu_device_leaves_batches_alone():
    assert not pin_memory_for(CPU) and not non_blocking_for(CPU)
    assert batch_target(CPU) is None
    assert ddp_device_ids(CPU) is None


def test_move_to_keeps_nested_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": (torch.ones(2), [torch.zeros(1), "label", 3]), "b": Pair(torch.ones(1), None)}
    moved = move_to(batch, CPU)
    assert isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list)
    assert moved["a"][1][1:] == ["label", 3]
    assert isinstance(moved["b"], Pair) and moved["b"].y is None
    assert torch.equal(moved["a"][0], torch.ones(2))


def launched(**kw):
    return WorkerEnv(master_addr="127.0.0.1", master_port=29500, **kw)


def test_context_on_a_gpu_node_takes_its_local_gpu_and_nccl():
    ctx = resolve(launched(rank=3, local_rank=1, world_size=4, local_world_size=2), cuda_devices=2)
    assert ctx.device == GPU and ctx.dist_backend == "nccl"
    assert ctx.distributed and not ctx.is_main and ctx.rank == 3


def test_context_launcher_backend_wins_over_the_scripts():
    env = launched(world_size=2, dist_backend="gloo")
    assert resolve(env, cuda_devices=2, backend="nccl").dist_backend == "gloo"
    assert resolve(env, cuda_devices=2).dist_backend == "gloo"  # dist_backend's old name, which scripts read
    assert resolve(launched(world_size=2), cuda_devices=0, backend=None).dist_backend == "gloo"


def test_context_world_of_one_has_no_backend():
    ctx = resolve(WorkerEnv(), cuda_devices=0)
    assert ctx == resolve(WorkerEnv(), cuda_devices=0, backend="gloo")
    assert ctx.dist_backend is None and not ctx.distributed and ctx.is_main and ctx.device == CPU


def test_context_refuses_a_world_without_rendezvous():
    with pytest.raises(DisttrainError, match="MASTER_ADDR"):
        resolve(WorkerEnv(world_size=2), cuda_devices=0)


def test_context_refuses_nccl_without_gpus():
    with pytest.raises(UsageError, match="nccl"):
        resolve(launched(world_size=2), cuda_devices=0, backend="nccl")


@given(n=st.integers(0, 200), world=st.integers(1, 9))
def test_eval_shards_cover_each_sample_exactly_once(n, world):
    shards = [list(EvalShardSampler(n, num_replicas=world, rank=r)) for r in range(world)]
    assert sorted(i for shard in shards for i in shard) == list(range(n))
    assert [len(EvalShardSampler(n, num_replicas=world, rank=r)) for r in range(world)] == [
        len(s) for s in shards]


@given(n=st.integers(1, 60), world=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_training_shards_are_equal_length_and_complete(n, world, seed):
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=2, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    samplers = [shard_sampler(loader, rank=r, world_size=world) for r in range(world)]
    assert all(isinstance(s, DistributedSampler) and s.seed == seed for s in samplers)
    shards = [list(s) for s in samplers]
    assert len({len(s) for s in shards}) == 1
    assert set().union(*map(set, shards)) == set(range(n))
    if n % world == 0:
        assert sum(map(len, shards)) == n  # no padding: disjoint


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(("loader", "advice"), [
    (DataLoader(Stream()), "split the stream by rank"),
    (DataLoader(range(5), sampler=[4, 3, 2]), "yields only this rank's indices"),
    (DataLoader(range(5), batch_sampler=[[0, 1], [2]]), "yield only this rank's batches"),
    (DataLoader(range(5), sampler=torch.utils.data.RandomSampler(range(5), replacement=True)),
     "shuffle=True"),
])
def test_loaders_that_cannot_be_sharded_say_what_to_do(loader, advice):
    with pytest.raises(UsageError, match=advice):
        shard_sampler(loader, rank=0, world_size=2)
