"""The runtime's step timer, in this process (a world of one), on a clock the test turns."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from disttrain.errors import UsageError
from disttrain.runtime import steptimer
from disttrain.runtime.steptimer import BenchSettings, StepTimer


@pytest.fixture(autouse=True)
def world_of_one(ctx):
    steptimer._reset()
    yield
    steptimer._reset()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batches(n: int, size: int = 4):
    return [(torch.zeros(size, 3), torch.zeros(size)) for _ in range(n)]


def make_timer(steps: int, warmup: int, *, exit_when_done: bool = False):
    clock, reports = Clock(), []
    timer = StepTimer(BenchSettings(steps=steps, warmup=warmup, exit_when_done=exit_when_done),
                      clock=clock, report=reports.append)
    return timer, clock, reports


def test_times_the_steps_after_the_warmup():
    timer, clock, reports = make_timer(steps=3, warmup=2)
    for i, _ in enumerate(timer.wrap(batches(8))):
        clock.now += 10.0 if i < 2 else 1.0  # slow warm-up steps are not counted
    (result,) = reports
    assert result["complete"] and result["steps"] == 3 and result["samples"] == 12
    assert result["seconds"] == 3.0 and result["samples_per_s"] == 4.0
    assert result["world_size"] == 1 and result["threads"] == torch.get_num_threads()
    assert timer.steps_run == 8  # it went on counting, but reported once


def test_time_between_epochs_is_not_a_step():
    timer, clock, reports = make_timer(steps=4, warmup=1)
    for _epoch in range(2):
        for _ in timer.wrap(batches(3, size=2)):
            clock.now += 1.0
        clock.now += 1000.0  # evaluation, checkpointing...
    (result,) = reports
    assert result["seconds"] == 4.0 and result["samples"] == 8
    assert result["step_ms"] == [1000.0] * 4  # the evaluation is in no step of the timeline


def test_the_timeline_splits_out_the_wait_on_a_synchronisation():
    timer, clock, reports = make_timer(steps=4, warmup=1)
    synced = []
    timer.waited = lambda: synced.pop() if synced else 0.0
    for i, _ in enumerate(timer.wrap(batches(6))):
        clock.now += 0.025
        if i % 2 == 0:  # a periodic sync at the end of every other step takes 5 ms
            synced.append(0.005)
            clock.now += 0.005
    (result,) = reports
    assert result["step_ms"] == [25.0, 30.0, 25.0, 30.0] and result["sync_blocked_ms"] == [0.0, 5.0, 0.0, 5.0]


def test_the_comm_reference_splits_each_step_from_the_synced_one_beside_it(monkeypatch):
    """bench --comm's reference: the machine's load doubles halfway through the run, and the
    split still finds the 3 ms each synced step adds, because each pair ran under one load."""
    from disttrain.workerenv import BENCH_NO_SYNC

    monkeypatch.setenv(BENCH_NO_SYNC, "1")
    timer, clock, reports = make_timer(steps=8, warmup=1)
    synced = [False]
    timer.took_sync = lambda: synced[-1]
    for i, _ in enumerate(timer.wrap(batches(10, size=8))):
        sync = i % 2 == 0  # the timed steps alternate from a step without sync
        synced.append(sync)
        clock.now += (0.1 if i < 5 else 0.2) + (0.003 if sync else 0.0)
    (result,) = reports
    assert result["paired"] == {"pairs": 4, "compute_ms": pytest.approx(150.0), "comm_ms": pytest.approx(3.0)}
    # The reference's rate is its steps without sync: 8 samples in the median 150 ms.
    assert result["samples_per_s"] == pytest.approx(8 / 0.150)


def test_stops_the_run_when_done():
    timer, clock, reports = make_timer(steps=2, warmup=0, exit_when_done=True)
    seen = 0
    with pytest.raises(SystemExit) as stop:
        for _ in timer.wrap(batches(10)):
            seen += 1
            clock.now += 0.5
    assert stop.value.code == 0 and seen == 2
    assert reports[0]["seconds"] == 1.0 and reports[0]["samples_per_s"] == 8.0


def test_a_run_shorter_than_asked_reports_what_it_has():
    timer, clock, _ = make_timer(steps=10, warmup=1)
    for _ in timer.wrap(batches(4)):
        clock.now += 2.0
    partial = timer.partial()
    assert not partial["complete"] and partial["steps"] == 3 and partial["seconds"] == 6.0
    assert partial["samples_per_s"] == 2.0
    timer, _, _ = make_timer(steps=10, warmup=5)
    for _ in timer.wrap(batches(2)):
        pass
    assert timer.partial()["samples_per_s"] is None and timer.partial()["steps_run"] == 2


def test_batch_sizes_come_from_the_batches():
    assert steptimer._batch_len(torch.zeros(5, 2)) == 5
    assert steptimer._batch_len({"x": torch.zeros(7), "y": 1}) == 7
    assert steptimer._batch_len([[torch.zeros(3)], torch.zeros(9)]) == 3
    assert steptimer._batch_len("text") == 1


def test_outside_a_bench_nothing_is_wrapped():
    data = batches(2)
    assert steptimer.timed(data) is data
    assert steptimer.active() is None


class SelfTimingLoader:
    """What PreparedLoader does once hooked: its iterator goes through timed() itself."""

    def __init__(self, n: int) -> None:
        dataset = TensorDataset(torch.zeros(n, 1))
        self.sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
        self.n = n

    def __iter__(self):
        return iter(steptimer.timed(iter(batches(self.n)), self))


def test_under_a_bench_training_loaders_are_timed_once(monkeypatch, capsys):
    monkeypatch.setenv(steptimer.BENCH_STEPS, "2")
    monkeypatch.setenv(steptimer.BENCH_WARMUP, "1")
    monkeypatch.setenv(steptimer.BENCH_EXIT, "0")
    evaluation = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)  # SequentialSampler
    for _ in steptimer.timed(iter(evaluation), evaluation):
        pass
    assert steptimer.active().steps_run == 0  # evaluation is not timed
    for _ in steptimer.timed(SelfTimingLoader(5)):  # wrapped by the script and by the loader
        pass
    assert steptimer.active().steps_run == 5  # counted once
    line = capsys.readouterr().out.strip()
    assert line.startswith(steptimer.MARKER)
    result = json.loads(line[len(steptimer.MARKER):])
    assert result["complete"] and result["steps"] == 2 and result["samples"] == 8


def test_bad_settings_are_usage_errors(monkeypatch):
    monkeypatch.setenv(steptimer.BENCH_STEPS, "x")
    with pytest.raises(UsageError, match="DISTTRAIN_BENCH_STEPS='x' is not an integer"):
        BenchSettings.from_environ()
    with pytest.raises(UsageError, match="at least 1 step"):
        BenchSettings(steps=0)
    with pytest.raises(UsageError, match="cannot be negative"):
        BenchSettings(steps=1, warmup=-1)
