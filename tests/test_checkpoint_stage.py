"""The staging of a checkpoint's state, in-process on CPU: which staging a process chooses, host
buffers kept between saves (sized once, grown only when a leaf grows; an injected allocator counts
them), copies queued before the one event a reader waits on, one save's staging at a time (a fake
clock times the wait), and torch's DCP stager kept through the close() some torch versions call.
The CUDA side (pinned memory, the side stream) runs in tests/gpu and bench/gpu_check.py."""

from __future__ import annotations

import threading

import pytest
import torch

from disttrain.runtime.checkpoint_stage import HostBuffers, KeptStager, Staging, stage, staging_for


@pytest.mark.parametrize("cuda, default, takes, expected", [
    (False, True, True, Staging(host="as-is", dcp="writer")),
    (False, False, False, Staging(host="as-is", dcp="writer")),
    (True, True, True, Staging(host="pinned-kept", dcp="pinned-kept")),
    (True, False, True, Staging(host="pinned-kept", dcp="writer")),  # torch before DefaultStager
    (True, True, False, Staging(host="pinned-kept", dcp="writer")),  # async_save takes no stager
])
def test_staging_is_chosen_from_what_the_process_has(cuda, default, takes, expected):
    assert staging_for(cuda=cuda, has_default_stager=default, async_save_takes_stager=takes) == expected


class Allocator:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class Event:
    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


class Copier:
    """Copies at once (CPU), logging the order: the copies, then the one event."""

    def __init__(self) -> None:
        self.log: list = []

    def copy(self, host: torch.Tensor, device: torch.Tensor) -> None:
        host.copy_(device)
        self.log.append(("copy", tuple(device.shape)))

    def finish(self) -> Event:
        self.log.append("finish")
        return Event(self.log)


def state(width: int) -> dict:
    return {"model": {"w": torch.randn(width, width), "b": torch.randn(width)},
            "opt": [{"step": 3, "exp_avg": torch.randn(width, dtype=torch.float64)}], "name": "x"}


def test_buffers_are_allocated_once_and_grown_only_when_the_state_grows():
    allocate = Allocator()
    buffers = HostBuffers(allocate)
    first = state(8)
    staged = stage(first, buffers, Copier(), on_device=lambda t: True)
    assert allocate.sizes == [8 * 8 * 4, 8 * 4, 8 * 8]  # w, b, exp_avg (float64), in the tree's order
    value = staged.wait()
    assert torch.equal(value["model"]["w"], first["model"]["w"]) and value["opt"][0]["step"] == 3
    assert value["name"] == "x" and value["opt"][0]["exp_avg"].dtype == torch.float64
    staged.release()

    for _ in range(3):  # the same shapes: no allocation at all
        staged = stage(state(8), buffers, Copier(), on_device=lambda t: True)
        staged.release()
    assert len(allocate.sizes) == 3

    grown = state(8)
    grown["model"]["b"] = torch.randn(20)
    staged = stage(grown, buffers, Copier(), on_device=lambda t: True)
    assert allocate.sizes[3:] == [20 * 4]  # only the leaf that grew
    assert torch.equal(staged.wait()["model"]["b"], grown["model"]["b"])
    staged.release()

    smaller = state(4)  # fits in what is there
    staged = stage(smaller, buffers, Copier(), on_device=lambda t: True)
    assert len(allocate.sizes) == 4
    assert torch.equal(staged.wait()["model"]["w"], smaller["model"]["w"])
    staged.release()
    assert buffers.allocations == 4


def test_copies_are_queued_before_the_one_event_the_reader_waits_on():
    copier = Copier()
    staged = stage(state(4), HostBuffers(Allocator()), copier, on_device=lambda t: t.dtype == torch.float32)
    assert copier.log == [("copy", (4, 4)), ("copy", (4,)), "finish"]  # float64 kept on the "host"
    staged.wait()
    staged.wait()
    assert copier.log[-1] == "synchronize" and copier.log.count("synchronize") == 1
    staged.release()


def test_host_tensors_are_cloned_when_serialised_later():
    live = state(4)
    staged = stage(live, HostBuffers(Allocator()), Copier(), copy_host=True,
                   on_device=lambda t: t.dtype == torch.float32)
    before = live["opt"][0]["exp_avg"].clone()
    live["opt"][0]["exp_avg"].add_(1)  # the training's next step, in place
    live["model"]["w"].add_(1)
    value = staged.wait()
    assert torch.equal(value["opt"][0]["exp_avg"], before)
    assert not torch.equal(value["model"]["w"], live["model"]["w"])
    staged.release()


class Clock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_one_save_stages_at_a_time():
    buffers = HostBuffers(Allocator(), clock=Clock(0.0, 0.0, 10.0, 12.5))
    first = stage(state(4), buffers, Copier(), on_device=lambda t: True)
    assert buffers.last_wait_s == 0.0
    order: list[str] = []
    leased = threading.Event()

    def second_save() -> None:
        staged = stage(state(4), buffers, Copier(), on_device=lambda t: True)
        order.append("second staged")
        leased.set()
        staged.release()

    thread = threading.Thread(target=second_save)
    thread.start()
    assert not leased.wait(0.3), "a second save staged into the buffers the first still holds"
    order.append("first released")
    first.release()
    thread.join(10)
    assert order == ["first released", "second staged"]
    assert buffers.last_wait_s == 2.5  # what the fake clock says the second save waited
    with pytest.raises(RuntimeError, match="outside a lease"):
        buffers.view(0, torch.ones(1))


def test_a_failed_stage_gives_the_buffers_back():
    class Broken(Copier):
        def copy(self, host, device):
            raise RuntimeError("copy failed")

    buffers = HostBuffers(Allocator())
    with pytest.raises(RuntimeError, match="copy failed"):
        stage(state(4), buffers, Broken(), on_device=lambda t: True)
    stage(state(4), buffers, Copier(), on_device=lambda t: True).release()  # not left leased


def test_dcp_stager_is_kept_through_torchs_close():
    closed = []

    class Inner:
        should_synchronize_after_execute = True

        def stage(self, state_dict, **kwargs):
            return {"staged": state_dict}

        def synchronize_staging(self):
            pass

        def close(self):
            closed.append(True)

    kept = KeptStager(Inner())
    assert kept.stage({"a": 1}) == {"staged": {"a": 1}}
    kept.close()  # what async_save may call after each save
    assert closed == [] and kept.should_synchronize_after_execute
    kept.dispose()
    assert closed == [True]


def test_dcp_async_save_twice_with_one_kept_stager(tmp_path):
    """torch's own DefaultStager, kept across two DCP async saves on CPU (the probe's second save
    failed with KeyError: <class 'type'> once the first had closed the stager)."""
    import torch.distributed.checkpoint as dcp

    from disttrain.runtime.checkpoint_stage import dcp_stager

    stager = dcp_stager(pinned=False)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for step in (1, 2):
        future = dcp.async_save({"model": model.state_dict(), "opt": opt.state_dict()},
                                checkpoint_id=tmp_path / f"s{step}", async_stager=stager, no_dist=True)
        getattr(future, "upload_completion", future).result()
    stager.dispose()
    restored = {"model": torch.nn.Linear(4, 4).state_dict()}
    dcp.load(restored, checkpoint_id=tmp_path / "s2", no_dist=True)
    assert torch.equal(restored["model"]["weight"], model.weight.detach())


def test_a_kept_dcp_stager_outlives_torch_closing_its_inner_stager_after_each_stage():
    """torch 2.11's DefaultStager closes its own StateDictStager at the end of every stage: its storage
    cache and its copy table emptied, the next save of FSDP state (a class among DTensor's pickled
    parts) failed with KeyError: <class 'type'> on the H200. Kept: that close is ignored, the storage
    staged once serves the next save, and dispose really closes it."""
    from disttrain.runtime.checkpoint_stage import dcp_stager

    stager = dcp_stager(pinned=False)
    inner = stager._state_dict_stager
    state = {"w": torch.randn(4), "kind": torch.nn.Linear}
    for value in (1.0, 2.0):
        state["w"].fill_(value)
        staged = stager.stage(state)
        inner.close()  # what torch 2.11's DefaultStager._stage does after each stage
        assert torch.equal(staged["w"], state["w"]) and staged["kind"] is torch.nn.Linear
    assert stager.closes_ignored == 2 and len(inner._cached_storage_mapping) == 1
    stager.dispose()
    assert not inner._deepcopy_dispatch and not len(inner._cached_storage_mapping)


def test_staged_views_serialise_to_the_state_itself():
    """torch.save of leaves that are views of byte buffers (of every dtype, a buffer larger than its
    leaf after the state shrank) loads back as the state itself."""
    import io

    from disttrain.runtime.checkpoint_write_remote import serialise_staged

    buffers = HostBuffers(Allocator())
    stage(state(8), buffers, Copier(), on_device=lambda t: True).release()
    small = {**state(4), "mask": torch.tensor([True, False]), "half": torch.randn(3, dtype=torch.bfloat16)}
    loaded = torch.load(io.BytesIO(serialise_staged(stage(small, buffers, Copier(), on_device=lambda t: True))),
                        weights_only=True)
    for key in ("w", "b"):
        assert torch.equal(loaded["model"][key], small["model"][key])
    assert torch.equal(loaded["mask"], small["mask"]) and torch.equal(loaded["half"], small["half"])
    assert loaded["opt"][0]["exp_avg"].dtype == torch.float64 and loaded["name"] == "x"
