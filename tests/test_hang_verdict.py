"""The hang verdict as pure functions, on Flight Recorder dumps and stacks taken from real runs
(tests/data/hangs/<case>/: ``disttrain run --hang-timeout 5 tests/scripts/plain_hang.py <case>``,
the files the agent keeps next to the logs)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from disttrain.agent import flight
from disttrain.agent.stacks import in_own_code, where
from disttrain.agent.verdict import calls_from_recorder, causes, verdict
from disttrain.wire import RankState

DATA = Path(__file__).parent / "data" / "hangs"
SCRIPT = Path(__file__).parent / "scripts" / "plain_hang.py"


def hang_line(case: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if f"# HANG: {case}" in line)


# What each rank's disttrain_groups handler says in those runs: the pair group of plain_hang.py.
GROUPS = {"0": (0, 1), "1": (0, 1)}


def states(case: str, changed: dict[int, dict] | None = None) -> list[RankState]:
    out = []
    for dump in sorted((DATA / case).glob("rank*.fr.json")):
        rank = int(dump.name[4:].split(".")[0])
        recorder = json.loads(dump.read_text())
        stacks = (DATA / case / f"rank{rank}.stacks").read_text()
        state = RankState(rank=rank, host="a" if rank % 2 == 0 else "b", pid=100 + rank, where=where(stacks),
                          own_code=in_own_code(stacks), calls=calls_from_recorder(recorder),
                          stacks=f"/runs/r/attempt_0/rank{rank}.stacks", dump=str(dump), groups={"1": GROUPS["1"]})
        out.append(replace(state, **(changed or {}).get(rank, {})))
    return out


def test_a_mismatch_names_both_ranks_both_ops_and_the_collective():
    (cause,) = causes(states("op"), world_size=2)
    assert cause.startswith("a mismatch in collective #6 of the default group: rank 0 called all_reduce [4] Float; "
                            "rank 1 called all_gather [4] Float -> [2, 4].")


def test_a_rank_stuck_in_its_own_code_is_named_with_its_line():
    (cause,) = causes(states("lock"), world_size=3)
    assert cause == (f"rank 1 never entered collective #6 of the default group (all_reduce [4] Float), which ranks "
                     f"0, 2 wait in: it is at plain_hang.py:{hang_line('lock')} in <module> (the script's own code)")


def test_two_groups_called_in_opposite_orders_name_each_rank_where_the_other_waits():
    found = causes(states("group"), world_size=2)
    assert len(found) == 2
    assert found[0].startswith("rank 0 never entered collective #6 of the default group")
    assert "it waits in collective #1 of group 1 (all_reduce [4] Float)" in found[0]
    assert found[1].startswith("rank 1 never entered collective #1 of group 1")
    assert "it waits in collective #6 of the default group" in found[1]


def test_sizes_that_differ_are_a_mismatch_by_torchs_rule():
    """gloo aborts on a size mismatch rather than hang (NCCL hangs): rank 1's sizes are changed here."""
    real = states("op")
    rank0 = real[0]
    smaller = tuple(c if c.done else replace(c, input_sizes=((2,),), output_sizes=((2,),)) for c in rank0.calls)
    renamed = [replace(rank0, rank=1, calls=smaller), rank0]
    (cause,) = causes(renamed, world_size=2)
    assert "rank 0 called all_reduce [4] Float" in cause and "rank 1 called all_reduce [2] Float" in cause


def test_the_same_call_everywhere_that_never_completes_blames_the_link():
    both = states("lock")
    rank0 = both[0]
    twins = [replace(rank0, rank=r) for r in (0, 1, 2)]
    (cause,) = causes(twins, world_size=3)
    assert cause.startswith("every rank of the default group is inside collective #6 (all_reduce [4] Float) and it "
                            "does not complete")


def test_an_exited_rank_and_a_silent_host_are_said():
    found = states("lock", {1: {"state": "exited", "exit_code": 0, "calls": ()}})
    assert causes(found, world_size=3)[0].startswith("rank 1 on b exited with code 0 while the others wait for it")
    text = verdict([s for s in found if s.rank != 2], world_size=3, timeout_s=5)
    assert "  rank 2: no report (its host did not answer)" in text


def test_without_the_groups_members_those_seen_in_a_group_are_its_members():
    blind = [replace(s, groups={}) for s in states("group")]
    found = causes(blind, world_size=2)
    assert found[0].startswith("rank 0 never entered collective #6 of the default group")


def test_no_rank_in_a_collective_names_each_ones_line():
    idle = [RankState(rank=r, host="a", where="train.py:12 in <module>", own_code=True) for r in (0, 1)]
    assert causes(idle, world_size=2) == [f"rank {r} on a is in no collective: it is at train.py:12 in <module> "
                                         "(the script's own code)" for r in (0, 1)]


def test_the_block_lists_every_rank_and_where_its_files_are():
    text = verdict(states("op"), world_size=2, timeout_s=15)
    lines = text.splitlines()
    assert lines[0] == ("disttrain: no rank made progress for 15 s (--hang-timeout); the verdict, from every rank's "
                        "flight recorder and stack:")
    assert lines[2].startswith("  rank 0 (a): in #6 all_reduce [4] Float; completed #5 all_reduce; at ")
    assert f"called from plain_hang.py:{hang_line('others')} in <module>" in lines[2]
    assert f"called from plain_hang.py:{hang_line('op')} in <module>" in lines[3]
    assert "  stacks on a: /runs/r/attempt_0/rank<N>.stacks" in lines


def test_the_frontier_keeps_the_last_completed_call_and_the_ones_inside():
    recorder = json.loads((DATA / "op" / "rank1.fr.json").read_text())
    calls = calls_from_recorder(recorder)
    default = [c for c in calls if c.group == "0"]
    assert [(c.seq, c.op, c.done) for c in default] == [(5, "all_reduce", True), (6, "all_gather", False)]
    assert flight.progress_of(recorder["pg_status"]) == flight.Progress(entered=6, completed=5)


@pytest.mark.parametrize("backend, handler", [("gloo", "fr_trace_json"), ("nccl", "dump_nccl_trace_json")])
def test_the_recorder_of_the_backend_in_use_is_dumped(backend, handler):
    assert flight.fr_handler(backend) == handler


def test_the_bootstrap_goes_first_on_the_workers_path():
    env = flight.worker_env(sockets="/tmp/s", inherited={"PYTHONPATH": "/mine"})
    assert env["PYTHONPATH"] == f"{flight.SITE_DIR}:/mine" and env["DISTTRAIN_HANG_SOCKETS"] == "/tmp/s"
    # nothing else there: every module in it is importable in the workers, beside the user's own
    assert sorted(p.name for p in flight.SITE_DIR.iterdir() if p.suffix == ".py") == ["_disttrain_group_check.py",
                                                                                      "sitecustomize.py"]
    assert "DISTTRAIN_HANG_SOCKETS" in (flight.SITE_DIR / "sitecustomize.py").read_text()


def test_a_script_timeout_below_the_hang_timeout_is_warned_once(tmp_path):
    said = []
    recorders = flight.Recorders(str(tmp_path), "gloo", hang_timeout_s=120, say=said.append)
    recorder = json.loads((DATA / "op" / "rank0.fr.json").read_text())
    recorders._check_timeout(0, recorder)  # the bootstrap's default: 300 s
    assert said == []
    for entry in recorder["entries"]:
        entry["timeout_ms"] = 60000
    recorders._check_timeout(0, recorder)
    recorders._check_timeout(1, recorder)
    assert said == ["disttrain: warning: rank 0's process group 0 times out after 60 s (the script's own "
                    "timeout=), before --hang-timeout 120 s: a hang there ends in torch's timeout error, without "
                    "the verdict"]


def test_a_rank_without_a_stack_says_so_and_its_collective_comes_from_the_recorder():
    from disttrain.agent.stacks import NO_STACK

    found = states("op", {0: {"where": NO_STACK, "own_code": False}})
    lines = verdict(found, world_size=2, timeout_s=10).splitlines()
    assert f"  rank 0 (a): in #6 all_reduce [4] Float; completed #5 all_reduce; ({NO_STACK})" in lines


def test_a_rank_inside_a_collective_is_not_said_to_be_in_none():
    # nothing explains the hang (rank 1's host did not answer; rank 0 inside a collective): where it waits
    (only,) = [s for s in states("lock") if s.rank == 0]
    (cause,) = causes([only], world_size=2)
    assert cause.startswith("rank 0 on a waits in collective #6 of the default group (all_reduce [4] Float) at ")
