"""Goodput from records constructed here (disttrain.goodput is pure computation)."""

from __future__ import annotations

import json

import pytest

from disttrain import goodput


def steps(t0: float, first: int, last: int, every: int, step_s: float, **extra):
    """Reduced metrics records at steps first..last (every ``every``), ``step_s`` apart per step."""
    return [{"kind": "metrics", "t": t0 + (s - first) * step_s, "step": s, "values": {"loss": 1.0},
             "reduced": True, **extra} for s in range(first, last + 1, every)]


def total(data) -> float:
    return sum(data["seconds"].values())


def test_one_round_startup_then_training():
    # Launched at 0, first step reported at step 10 at t=15 with 0.5 s a step: training began at t=10.
    records = [{"kind": "start", "t": 0.0, "hosts": 2}, *steps(15.0, 10, 50, 10, 0.5),
               {"kind": "end", "t": 40.0, "exit_code": 0, "hung": False}]
    data = goodput.compute(records)
    assert data["seconds"]["startup"] == pytest.approx(20.0)  # 10 s x 2 hosts
    assert data["seconds"]["training"] == pytest.approx(60.0)  # 30 s x 2 hosts
    assert data["host_seconds"] == pytest.approx(80.0) == total(data)
    assert data["goodput"] == pytest.approx(0.75)


def test_checkpoint_stalls_come_out_of_training():
    records = [{"kind": "start", "t": 0.0, "hosts": 1}, *steps(1.0, 0, 100, 10, 0.1),
               {"kind": "checkpoint", "t": 5.0, "step": 40, "seconds": 0.75},
               {"kind": "checkpoint", "t": 9.0, "step": 80, "seconds": 0.25},
               {"kind": "end", "t": 12.0, "exit_code": 0, "hung": False}]
    data = goodput.compute(records)
    assert data["seconds"]["checkpoint"] == pytest.approx(1.0)
    assert data["seconds"]["startup"] == pytest.approx(1.0)
    assert data["seconds"]["training"] == pytest.approx(10.0)
    assert total(data) == pytest.approx(12.0)


def test_a_host_lost_rendezvous_and_redone_work():
    # 3 hosts train steps 0..60 at 1 s a step from t=5; a host is lost at t=70 (step 65 reached),
    # the 2 others resume from the checkpoint of step 50 and report step 52 at t=82.
    changes = [{"time": 0.0, "change": "start", "host": None, "hosts": ["a", "b", "c"]},
               {"time": 70.0, "change": "left", "host": "c", "hosts": ["a", "b"], "resumed_from": 50,
                "seconds": 10.0}]
    records = [{"kind": "start", "t": 0.0, "hosts": 3}, *steps(5.0, 0, 60, 10, 1.0),
               {"kind": "resumed", "t": 79.0, "step": 50},
               *steps(82.0, 52, 70, 2, 1.0),
               {"kind": "end", "t": 100.0, "exit_code": 0, "hung": False}]
    data = goodput.compute(records, changes)
    s = data["seconds"]
    assert data["rounds"] == 2
    assert s["startup"] == pytest.approx(5 * 3)
    assert s["rendezvous"] == pytest.approx((80.0 - 70.0) * 2)  # step 52 at 82 -> step 50 at 80
    assert s["redone"] == pytest.approx((70.0 - 55.0) * 3)  # step 50 was reached at t=55
    assert s["training"] == pytest.approx((55.0 - 5.0) * 3 + (100.0 - 80.0) * 2)
    assert total(data) == pytest.approx(70 * 3 + 30 * 2)


def test_a_hang_from_last_progress_to_the_end():
    records = [{"kind": "start", "t": 0.0, "hosts": 2}, *steps(2.0, 0, 20, 5, 0.5),
               {"kind": "end", "t": 42.0, "exit_code": 124, "hung": True}]
    data = goodput.compute(records)
    assert data["seconds"]["hang"] == pytest.approx((42.0 - 12.0) * 2)
    assert data["seconds"]["training"] == pytest.approx(10.0 * 2)


def test_stragglers_from_each_ranks_own_lines():
    # 4 ranks on 2 hosts; at each logged step rank 3 arrives 0.2 s after the others.
    ranked = []
    for step in (10, 20, 30):
        for rank in range(4):
            ranked.append({"kind": "metrics", "t": step + (0.2 if rank == 3 else 0.0), "step": step, "rank": rank,
                           "values": {"loss": 1.0}, "reduced": False})
    records = [{"kind": "start", "t": 0.0, "hosts": 2}, *steps(10.2, 10, 30, 10, 1.0), *ranked,
               {"kind": "end", "t": 31.0, "exit_code": 0, "hung": False}]
    data = goodput.compute(records)
    # 3 steps x 3 ranks x 0.2 s = 1.8 rank-seconds; 2 ranks a host: 0.9 host-seconds
    assert data["seconds"]["stragglers"] == pytest.approx(0.9)
    assert total(data) == pytest.approx(62.0)


def test_no_steps_reported_all_training_with_a_note():
    data = goodput.compute([{"kind": "start", "t": 0.0, "hosts": 1}, {"kind": "end", "t": 5.0, "exit_code": 0}])
    assert data["seconds"]["training"] == pytest.approx(5.0)
    assert data["notes"] and "no steps" in data["notes"][0]


def test_from_run_dir_reads_the_records(tmp_path):
    records = [{"kind": "start", "t": 0.0, "hosts": 1}, *steps(1.0, 0, 4, 1, 1.0),
               {"kind": "end", "t": 6.0, "exit_code": 0}]
    (tmp_path / goodput.RECORD).write_text("\n".join(json.dumps(r) for r in records) + "\n{cut sho")
    data = goodput.from_run_dir(tmp_path)
    assert data["seconds"]["startup"] == pytest.approx(1.0)
    assert "goodput 83.3 %" in goodput.summary(data)
    assert goodput.from_run_dir(tmp_path / "none") is None
