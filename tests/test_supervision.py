"""The launcher's state machine (disttrain.launch.supervision) and its elastic policy's regroups and
admission (disttrain.launch.policies), in-process: fake agents, a fake clock. Liveness (the hang watch,
slow or lost, a stopped rank): test_liveness.py."""

from __future__ import annotations

import math

import pytest
from supervised import Clock, advance, beat_all, elastic, exited, running

from disttrain.launch.policies import (
    BACKOFF_FIRST_S,
    PROBE_TIMEOUT_S,
    RETRY_FAST_S,
    RETRY_MAX_S,
    RETRY_S,
    Backoff,
    Elastic,
    FailFast,
    exit_cause,
    retry_phase,
)
from disttrain.launch.supervision import (
    TRANSITIONS,
    Admit,
    AgentState,
    Event,
    EventKind,
    IllegalTransition,
    Join,
    RegroupWithout,
    Stop,
    Supervisor,
)
from disttrain.wire import InPlace, Regroup

S = AgentState


# ---------------------------------------------------------------------------------- the table


def test_every_transition_of_the_table_and_no_other():
    for start in AgentState:
        for end in AgentState:
            sup, _ = elastic(("a",))
            sup.agents[0].state = start
            if end in TRANSITIONS[start]:
                sup.agents.move(0, end)
                assert sup.agents[0].state is end
            else:
                with pytest.raises(IllegalTransition, match=f"agent 0 \\(a\\): {start} -> {end}"):
                    sup.agents.move(0, end)
    assert all(not TRANSITIONS[s] for s in AgentState if s.final)
    assert str(S.LOST) == "lost" and S.DONE.final and not S.HUNG.final


def test_a_round_runs_and_the_job_finishes():
    sup, clock = elastic(("a", "b"))
    assert [r.state for r in sup.agents.rows] == [S.STARTING, S.STARTING]
    running(sup, clock)
    assert [r.state for r in sup.agents.rows] == [S.RUNNING, S.RUNNING]
    assert advance(sup, clock, 10) == []
    assert exited(sup, clock, 0, 0) == [] and exited(sup, clock, 1, 0) == []
    assert [r.state for r in sup.agents.rows] == [S.DONE, S.DONE] and sup.finished


def test_fail_fast_stops_at_the_first_failure_and_says_a_lost_host_as_it_was():
    clock = Clock()
    sup = Supervisor(("a", "b", "c"), policies=[FailFast()], clock=clock)
    running(sup, clock)
    (stop,) = exited(sup, clock, 1, 255, cause="ssh failed: connection lost")
    assert stop == Stop(code=255, reason="ssh failed: connection lost", slot=1)
    assert [r.state for r in sup.agents.rows] == [S.STOPPED, S.LOST, S.STOPPED]
    assert sup.late()  # the job ended: no rank's rate says anything any more
    assert sup.agents[0].why == "stopped by the launcher: the job ended elsewhere"
    assert sup.agents[1].why == "ssh failed: connection lost"


def test_exit_causes_name_the_signal():
    assert exit_cause(-9) == exit_cause(137) == "its agent was killed by SIGKILL"
    assert exit_cause(143) == "its agent was killed by SIGTERM"
    assert exit_cause(1) is None and exit_cause(255) is None and exit_cause(128 + 11) is None


# ---------------------------------------------------------------------------------- elastic


def test_the_store_host_lost_is_a_loss_like_any_other():
    """The first host held the rendezvous once; now the launcher does: its loss is one more regroup."""
    sup, clock = elastic()
    running(sup, clock)
    (regroup,) = exited(sup, clock, 0, 255, cause="ssh failed: connection lost")
    assert regroup == RegroupWithout(lost=("a",), members=("b", "c", "d"), slots=(1, 2, 3),
                                     reason="a: ssh failed: connection lost", restart_why="DISTTRAIN_REGROUP=restart")
    assert [r.state for r in sup.agents.rows] == [S.LOST, S.REGROUPING, S.REGROUPING, S.REGROUPING]
    running(sup, clock, attempt=1)
    assert [r.state for r in sup.agents.rows[1:]] == [S.RUNNING] * 3 and sup.policies[0].regroup_since is None


def test_two_hosts_lost_at_once_by_their_silence_are_one_regroup():
    sup, clock = elastic()
    running(sup, clock)
    decisions = advance(sup, clock, 7, but=("b", "c"))
    assert decisions == [RegroupWithout(lost=("b", "c"), members=("a", "d"), slots=(0, 3),
                                        reason="b: its agent said nothing for 5 s; c: its agent said nothing for 5 s",
                                        restart_why="DISTTRAIN_REGROUP=restart")]
    # their agents' exits come later (the flow killed them): already judged, nothing more
    assert exited(sup, clock, 1, -9) == [] and sup.agents[1].state is S.LOST


def test_a_loss_during_a_regroup_regroups_again_without_both():
    sup, clock = elastic()
    running(sup, clock)
    exited(sup, clock, 3, 255, cause="ssh failed")
    (again,) = exited(sup, clock, 2, -9, cause=exit_cause(-9))
    assert again.lost == ("c",) and again.members == ("a", "b") and again.reason == "c: its agent was killed by SIGKILL"
    assert [r.state for r in sup.agents.rows] == [S.REGROUPING, S.REGROUPING, S.LOST, S.LOST]


def numbered(hosts, ranks, *, next_round=None):
    """An elastic job whose agents run round 0 with these global ranks; ``next_round``: the store's."""
    clock = Clock()
    policy = Elastic(min_nnodes=1, max_nnodes=len(hosts), regroup_s=60.0, store="10.0.0.9:29500",
                     next_round=next_round)
    sup = Supervisor(hosts, policies=[policy], clock=clock)
    for row, own in zip(sup.agents.live(), ranks):
        sup.handle(Event(EventKind.ROUND, at=clock.now, slot=row.slot, attempt=0, ranks=own))
    return sup, clock


def test_the_supervisor_numbers_the_survivors_in_place_in_their_order():
    rounds = iter(range(1, 10))
    sup, clock = numbered(("a", "b", "c"), ((0, 1), (2, 3), (4, 5)), next_round=lambda: next(rounds))
    (decision,) = exited(sup, clock, 1, 255, cause="its connection dropped")
    assert decision.in_place == InPlace(attempt=1, ranks={0: 0, 1: 1, 4: 2, 5: 3}, group_ranks={"a": 0, "c": 1},
                                        world_size=4, store="10.0.0.9:29500")
    assert decision.restart_why is None
    line = Regroup(lost=("b",), in_place=decision.in_place).to_line()
    assert Regroup.from_line(line) == Regroup(lost=("b",), in_place=decision.in_place)


@pytest.mark.parametrize("next_round, why", [
    (None, "DISTTRAIN_REGROUP=restart"),
    (lambda: (_ for _ in ()).throw(OSError("refused")), "the store at 10.0.0.9:29500 did not answer"),
])
def test_a_regroup_the_supervisor_cannot_number_restarts_and_says_why(next_round, why):
    sup, clock = numbered(("a", "b", "c"), ((0,), (1,), (2,)), next_round=next_round)
    (decision,) = exited(sup, clock, 0, 255, cause="its connection dropped")
    assert (decision.in_place, decision.restart_why) == (None, why)


def test_survivors_in_different_rounds_restart():
    sup, clock = numbered(("a", "b", "c"), ((0,), (1,), (2,)), next_round=lambda: 1)
    sup.handle(Event(EventKind.ROUND, at=clock.now, slot=1, attempt=2, ranks=(1,)))
    (decision,) = exited(sup, clock, 2, 255, cause="its connection dropped")
    assert (decision.in_place, decision.restart_why) == (None, "a host was not in the current round yet")


def test_a_loss_before_the_agents_word_of_an_in_place_round_regroups_from_that_round():
    """The supervisor numbered the round itself: a second loss while its agents tell their workers is
    a newer in-place round, not a restart for a host 'not in the current round yet'."""
    rounds = iter(range(1, 10))
    sup, clock = numbered(("a", "b", "c"), ((0,), (1,), (2,)), next_round=lambda: next(rounds))
    (first,) = exited(sup, clock, 0, 255, cause="its connection dropped")
    assert first.in_place.ranks == {1: 0, 2: 1}
    # c lost too, before b's agent said it started round 1: b's worker is round 1's rank 0
    (second,) = exited(sup, clock, 2, 255, cause="its connection dropped")
    assert second.in_place == InPlace(attempt=2, ranks={0: 0}, group_ranks={"b": 0}, world_size=1,
                                      store="10.0.0.9:29500")


def test_below_min_the_job_stops_naming_every_host_lost():
    sup, clock = elastic(("a", "b", "c"))
    running(sup, clock)
    exited(sup, clock, 2, 255, cause="ssh failed")
    (stop,) = exited(sup, clock, 1, 255, cause="ssh failed")
    assert isinstance(stop, Stop) and stop.code == 255 and stop.slot == 1
    assert stop.report.splitlines() == [
        "disttrain: 1 host(s) left, below the minimum of --nnodes 2:3: stopped the job",
        "  hosts lost: b: ssh failed; c: ssh failed", "  still running: a"]
    assert sup.agents[0].state is S.STOPPED


def test_a_failure_of_the_workers_ends_an_elastic_job_too():
    sup, clock = elastic()
    running(sup, clock)
    (stop,) = exited(sup, clock, 1, 1)
    assert stop == Stop(code=1, reason="its workers failed", slot=1) and sup.agents[1].state is S.FAILED


def test_a_regroup_that_never_forms_ends_in_one_line_naming_the_store():
    sup, clock = elastic(regroup_s=30)
    running(sup, clock)
    exited(sup, clock, 0, 255, cause="ssh failed")
    decisions = advance(sup, clock, 40, progress=False)
    (stop,) = decisions
    assert stop.reason == "regroup timed out" and "\n" not in stop.report
    assert stop.report == ("disttrain: the regroup did not form within 30 s (rendezvous 10.0.0.9:29500; "
                           "waiting: b, c, d): stopped the job")


def retry(host: str, seconds: float = RETRY_S) -> int:
    """A wait of ``seconds`` times ``host``'s own factor, in the one-second ticks that see it over."""
    return math.ceil(seconds * retry_phase(host))


def until_tried(sup: Supervisor, clock: Clock, host: str, limit: int = 300) -> float:
    """Seconds of one-second ticks (every agent beating, its ranks moving) until ``host`` is tried."""
    start = clock.now
    while clock.now - start < limit:
        clock.now += 1
        beat_all(sup, clock, progress=clock.now)
        if any(isinstance(d, Admit) and host in d.hosts for d in sup.tick()):
            return clock.now - start
    raise AssertionError(f"{host} not tried within {limit} s")


def ranged(running_hosts, hosts, *, max_nnodes=None):
    """An elastic job over the range ``hosts`` whose ``running_hosts`` run: the supervisor tries the others."""
    clock = Clock()
    policy = Elastic(min_nnodes=2, max_nnodes=max_nnodes or len(hosts), regroup_s=60.0, store="s:1", hosts=hosts)
    sup = Supervisor(running_hosts, policies=[policy], clock=clock)
    running(sup, clock)
    return sup, clock


def test_a_host_lost_is_tried_again_and_let_in_when_there_is_room():
    sup, clock = ranged(("a", "b", "c"), ("a", "b", "c"))
    advance(sup, clock, 100)
    exited(sup, clock, 2, 255, cause="ssh failed")  # lost long after it joined: no backoff
    running(sup, clock, attempt=1)
    assert until_tried(sup, clock, "c") == 1 + retry("c")  # seen out at the next tick, tried RETRY_S later
    assert not any(isinstance(d, Admit) for d in advance(sup, clock, 10))  # being tried: never twice
    sup.handle(Event(EventKind.READY, at=clock.now, host="c"))
    assert sup.tick() == [Join(hosts=("c",), reason="it fills the job to its maximum: nobody else to wait for")]
    sup.handle(Event(EventKind.JOINED, at=clock.now, host="c"))
    assert sup.agents[3].host == "c" and sup.agents[3].state is S.STARTING
    assert not any(isinstance(d, Admit) for d in advance(sup, clock, 60))  # running again: no room, no copy


def test_a_host_that_does_not_answer_is_tried_less_often_up_to_a_cap():
    sup, clock = ranged(("a", "b"), ("a", "b", "c"))
    gaps = []
    for _ in range(30):
        gaps.append(until_tried(sup, clock, "c"))
        sup.handle(Event(EventKind.MISSED, at=clock.now, host="c"))
    assert retry_phase("c") == pytest.approx(1.155) and retry("c") == 4  # c's wait: 3.465 s, seen at the 4th tick
    # Seen out at the first tick, tried at 5 s, then every 4 s while it may be booting (its misses up to
    # RETRY_FAST_S: at 89 s, the 22nd), then twice as long after each miss (6.9, 13.9, 27.7 s), up to the cap.
    assert RETRY_FAST_S == 90
    assert gaps == [5] + [4] * 22 + [7, 14, 28] + [RETRY_MAX_S] * 4, gaps
    sup.handle(Event(EventKind.JOINED, at=clock.now, host="c"))
    running(sup, clock, attempt=1)
    advance(sup, clock, 61)  # past the flapping window
    exited(sup, clock, 2, 255, cause="ssh failed")
    running(sup, clock, attempt=2)
    assert until_tried(sup, clock, "c") == 1 + retry("c")  # it answered once: its misses are forgotten


def test_hosts_being_tried_or_ready_take_the_room_left():
    sup, clock = ranged(("a", "b"), ("a", "b", "c", "d"), max_nnodes=3)
    assert retry("d") < retry("c") and until_tried(sup, clock, "d") == 1 + retry("d")  # d's own wait is shorter
    assert not any(isinstance(d, Admit) for d in advance(sup, clock, 10))  # c waits: d takes the last place
    sup.handle(Event(EventKind.MISSED, at=clock.now, host="d"))
    assert until_tried(sup, clock, "c") == 1  # the place is free again; d's next try is its retry wait away
    sup.handle(Event(EventKind.READY, at=clock.now, host="c"))
    assert sup.policies[0].joins.ready and not sup.policies[0].trying
    assert sup.tick() == [Join(hosts=("c",), reason="it fills the job to its maximum: nobody else to wait for")]


def test_hosts_seen_out_together_are_tried_spread_not_in_a_wave():
    hosts = [f"h{i:03d}" for i in range(200)]
    backoff = Backoff()
    for host in hosts:
        backoff.out(host, 0.0)
    firsts = sorted(backoff.retry_at.values())
    assert firsts[0] >= RETRY_S / 2 and firsts[-1] < RETRY_S * 1.5
    # about uniform over those 3 s: no half second holds more than a quarter of them
    assert max(sum(t <= at < t + 0.5 for at in firsts) for t in firsts) < len(hosts) / 4


def test_nobody_is_tried_once_the_job_finished():
    sup, clock = ranged(("a", "b"), ("a", "b", "c"))
    exited(sup, clock, 0, 0)
    assert sup.finished and not any(isinstance(d, Admit) for d in advance(sup, clock, 60, but=("a",)))


def test_a_flapping_host_waits_longer_each_time_up_to_the_cap():
    sup, clock = ranged(("a", "b", "c"), ("a", "b", "c"))
    waits, tried = [], []
    for attempt in range(1, 7):  # down and up every 10 s: lost 10 s after each join
        slot = sup.agents.rows[-1].slot
        advance(sup, clock, 10)
        exited(sup, clock, slot, 255, cause="ssh failed")
        running(sup, clock, attempt=attempt)
        waits.append(sup.policies[0].backoff.wait("c", clock.now))
        tried.append(until_tried(sup, clock, "c"))
        sup.handle(Event(EventKind.JOINED, at=clock.now, host="c"))
        running(sup, clock, attempt=attempt)
    assert waits == tried == [10, 20, 40, 80, 120, 120]
    # a host that stays up past the window starts again from no backoff
    advance(sup, clock, 61)
    exited(sup, clock, sup.agents.rows[-1].slot, 255, cause="ssh failed")
    assert sup.policies[0].backoff.wait("c", clock.now) == 0


def test_a_host_lost_just_after_a_slow_join_trained_is_flapping():
    """Under load a host's start and its round's forming took over a minute: the window counts from its
    ranks' first step, so a loss right after it is a flap, and one before any step is one too."""
    for steps in (True, False):
        sup, clock = ranged(("a", "b", "c"), ("a", "b", "c"))
        advance(sup, clock, 100)
        exited(sup, clock, 2, 255, cause="ssh failed")  # long after its first step: no backoff
        assert sup.policies[0].backoff.wait("c", clock.now) == 0
        running(sup, clock, attempt=1)
        until_tried(sup, clock, "c")
        sup.handle(Event(EventKind.JOINED, at=clock.now, host="c"))
        row = sup.agents.rows[-1]
        for _ in range(90):  # admitted 90 s ago; its ranks have not stepped yet
            clock.now += 1
            beat_all(sup, clock, progress=clock.now, but=("c",))
            sup.handle(Event(EventKind.HEARD, at=clock.now, slot=row.slot, progress=None))
            sup.tick()
        if steps:
            sup.handle(Event(EventKind.HEARD, at=clock.now, slot=row.slot, progress=clock.now))
        clock.now += 1
        exited(sup, clock, row.slot, 255, cause="ssh failed")
        assert sup.policies[0].backoff.wait("c", clock.now) == BACKOFF_FIRST_S, steps


def test_the_backoffs_bound():
    """After its first flaps, at most one admission per max_s: two regroups per max_s + period."""
    backoff = Backoff()
    now, admitted = 0.0, []
    while now < 3600:
        admitted.append(now)
        now += 10  # it stays 10 s, then is lost
        now += backoff.lost("c", stepped=now - 10, now=now)
    gaps = [b - a for a, b in zip(admitted, admitted[1:])]
    assert max(gaps) == backoff.max_s + 10 and gaps[4:] == [backoff.max_s + 10] * len(gaps[4:])
    assert len(admitted) <= 3600 / (backoff.max_s + 10) + 5


def test_the_launchers_knobs_of_seconds_are_read_whole_or_refused_in_one_line(monkeypatch):
    from disttrain.errors import UsageError
    from disttrain.launch.knobs import backoff, probe_limit, slow_limit

    monkeypatch.delenv("DISTTRAIN_BACKOFF_S", raising=False)
    assert (backoff().first_s, backoff().max_s) == (10, 120)
    monkeypatch.setenv("DISTTRAIN_BACKOFF_S", "2.5")
    flaps = backoff()
    assert [flaps.lost("c", stepped=0, now=t) for t in (1, 2, 3)] == [2.5, 5, 10]
    monkeypatch.setenv("DISTTRAIN_BACKOFF_S", "300")  # above the usual cap: the cap is the first wait
    assert (backoff().first_s, backoff().max_s) == (300, 300)
    monkeypatch.delenv("DISTTRAIN_PROBE_S", raising=False)
    assert probe_limit() == PROBE_TIMEOUT_S
    monkeypatch.setenv("DISTTRAIN_PROBE_S", "2")
    assert probe_limit() == 2
    for name, knob in (("DISTTRAIN_BACKOFF_S", backoff), ("DISTTRAIN_SLOW_S", slow_limit),
                       ("DISTTRAIN_PROBE_S", probe_limit)):
        for bad in ("", "x", "0", "-1", "inf", "nan", "1e400"):
            monkeypatch.setenv(name, bad)
            with pytest.raises(UsageError, match=f"^{name}='.*' is not a number of seconds above 0 "):
                knob()
