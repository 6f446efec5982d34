"""The launcher's state machine (disttrain.launch.supervision), in-process: fake agents, a fake clock."""

from __future__ import annotations

import math

import pytest

from disttrain.launch.policies import (
    PROBE_AFTER_S,
    PROBE_TIMEOUT_S,
    RETRY_FAST_S,
    RETRY_MAX_S,
    RETRY_S,
    Backoff,
    Elastic,
    FailFast,
    HangWatch,
    exit_cause,
    retry_phase,
)
from disttrain.launch.supervision import (
    TRANSITIONS,
    Admit,
    AgentState,
    Dump,
    Event,
    EventKind,
    IllegalTransition,
    Join,
    Probe,
    RegroupWithout,
    Slow,
    Stop,
    Supervisor,
)
from disttrain.wire import InPlace, Regroup

S = AgentState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elastic(hosts=("a", "b", "c", "d"), *, min_nnodes=2, hang_s=0.0, regroup_s=60.0, policies=None):
    clock = Clock()
    policy = Elastic(min_nnodes=min_nnodes, max_nnodes=len(hosts), regroup_s=regroup_s, store="10.0.0.9:29500")
    sup = Supervisor(hosts, policies=policies or [policy, HangWatch(hang_s)], clock=clock)
    return sup, clock


def running(sup: Supervisor, clock: Clock, attempt: int = 0) -> None:
    """Every live agent starts a round and its ranks move."""
    for row in sup.agents.live():
        sup.handle(Event(EventKind.ROUND, at=clock.now, slot=row.slot, attempt=attempt))
        sup.handle(Event(EventKind.HEARD, at=clock.now, slot=row.slot, progress=clock.now, steps={row.slot: 1}))


def beat_all(sup: Supervisor, clock: Clock, *, progress: float | None = None, but=()) -> None:
    for row in sup.agents.live():
        if row.host not in but:
            sup.handle(Event(EventKind.HEARD, at=clock.now, slot=row.slot, progress=progress))


def advance(sup: Supervisor, clock: Clock, seconds: float, *, progress=True, but=()) -> list:
    """``seconds`` of one-second ticks, every agent (but ``but``) beating; ranks moving when ``progress``."""
    out = []
    for _ in range(int(seconds)):
        clock.now += 1
        beat_all(sup, clock, progress=clock.now if progress else None, but=but)
        out += sup.tick()
    return out


def exited(sup: Supervisor, clock: Clock, slot: int, code: int, cause: str | None = None) -> list:
    return sup.handle(Event(EventKind.EXITED, at=clock.now, slot=slot, code=code, cause=cause))


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


def test_the_backoffs_bound():
    """After its first flaps, at most one admission per max_s: two regroups per max_s + period."""
    backoff = Backoff()
    now, admitted = 0.0, []
    while now < 3600:
        admitted.append(now)
        now += 10  # it stays 10 s, then is lost
        now += backoff.lost("c", joined=now - 10, now=now)
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
    assert [flaps.lost("c", joined=0, now=t) for t in (1, 2, 3)] == [2.5, 5, 10]
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


# ---------------------------------------------------------------------------------- hang watch


def test_no_progress_anywhere_for_the_timeout_asks_every_agent_to_dump():
    sup, clock = elastic(("a", "b"), hang_s=10)
    running(sup, clock)
    start, decisions = clock.now, []
    while not decisions:
        decisions = advance(sup, clock, 1, progress=False)
    assert decisions == [Dump(slots=(0, 1), reason="no rank on any host progressed for 10 s")]
    assert clock.now - start == 10  # judged on the tick that reaches the timeout, not later
    assert [r.state for r in sup.agents.rows] == [S.HUNG, S.HUNG]
    assert exited(sup, clock, 0, 124) == [] and sup.agents[0].state is S.STOPPED


def test_one_rank_moving_keeps_the_job_alive():
    sup, clock = elastic(("a", "b"), hang_s=10)
    running(sup, clock)
    for _ in range(20):
        clock.now += 1
        sup.handle(Event(EventKind.HEARD, at=clock.now, slot=0, progress=clock.now))
        sup.handle(Event(EventKind.HEARD, at=clock.now, slot=1, progress=None))
        assert sup.tick() == [] and not sup.late()
    clock.now += 3  # nobody heard for 3 s: late, no rate judged
    assert sup.late()


def test_a_hang_during_a_regroup_is_no_hang_verdict():
    sup, clock = elastic(hang_s=5, regroup_s=30)
    running(sup, clock)
    exited(sup, clock, 3, 255, cause="ssh failed")
    assert advance(sup, clock, 20, progress=False) == []  # the regroup forms: no rank can move meanwhile
    running(sup, clock, attempt=1)
    (dump,) = advance(sup, clock, 7, progress=False)  # the new round hangs: judged as usual
    assert isinstance(dump, Dump) and dump.slots == (0, 1, 2)


def test_a_hang_and_a_loss_at_once_is_the_loss():
    """A silent host stalls everyone: the loss is the cause, the others regroup, no verdict."""
    sup, clock = elastic(hang_s=5)
    running(sup, clock)
    decisions = advance(sup, clock, 6, progress=False, but=("d",))
    assert [type(d) for d in decisions] == [RegroupWithout] and decisions[0].lost == ("d",)


# ---------------------------------------------------------------------------------- slow is not lost


def kept_alive(hosts=("a", "b", "c"), slow_s=60.0):
    clock = Clock()
    policy = Elastic(min_nnodes=2, max_nnodes=len(hosts), regroup_s=60.0, store="10.0.0.9:29500", slow_s=slow_s,
                     probe_s=PROBE_TIMEOUT_S)
    sup = Supervisor(hosts, policies=[policy], clock=clock)
    return sup, clock


def test_a_late_agent_whose_connection_is_up_is_slow_not_lost():
    """ssh keeps its connection alive (it ends within seconds of the host going away): an agent
    late under load, its ssh still running, is said slow once and waited for."""
    sup, clock = kept_alive()
    running(sup, clock)
    decisions = advance(sup, clock, 20, but=("c",))  # c's words late by 20 s (a load of 44)
    slow = [d for d in decisions if isinstance(d, Slow)]
    assert [(d.host, d.limit_s) for d in slow] == [("c", 60.0)] and slow[0].silent_s > 5
    assert not [d for d in decisions if isinstance(d, RegroupWithout)]
    assert sup.agents[2].state is S.RUNNING
    advance(sup, clock, 3)  # c speaks again: nothing happened
    assert sup.agents[2].state is S.RUNNING


def ticks(sup: Supervisor, clock: Clock, seconds: float, *, step: float = 0.1, but=()) -> list:
    """``seconds`` of the flow's 0.1 s ticks, the others beating each second."""
    out = []
    for i in range(round(seconds / step)):
        clock.now = round(clock.now + step, 6)
        if i % round(1 / step) == 0:
            beat_all(sup, clock, progress=clock.now, but=but)
        out += sup.tick()
    return out


def test_a_silent_agents_host_is_asked_for_a_connection_once_and_lost_when_it_takes_none():
    """A machine that lost power: its agent's words stop; 1.3 s later the launcher asks its host for a
    TCP connection (once per silence), and a host that takes none is lost -- before ssh's keep-alives."""
    sup, clock = kept_alive()
    running(sup, clock)
    ticks(sup, clock, 5)
    decisions = ticks(sup, clock, 3, but=("c",))
    probes = [d for d in decisions if isinstance(d, Probe)]
    assert probes == [Probe(slot=2, host="c", timeout_s=PROBE_TIMEOUT_S)] and not [d for d in decisions if isinstance(d, RegroupWithout)]
    (regroup,) = sup.handle(Event(EventKind.UNREACHABLE, at=clock.now, slot=2))
    assert isinstance(regroup, RegroupWithout) and regroup.lost == ("c",) and regroup.members == ("a", "b")
    assert sup.agents[2].state is S.LOST
    assert Probe(slot=1, host="b", timeout_s=PROBE_TIMEOUT_S) in ticks(sup, clock, 2, but=("b",))  # b too, while they regroup
    (stop,) = sup.handle(Event(EventKind.UNREACHABLE, at=clock.now, slot=1))  # below the minimum
    assert (stop.code, stop.reason) == (255, "below the minimum")  # a lost connection, as ssh's exit says
    assert sup.agents[2].why.startswith("its agent said nothing for ") and sup.agents[2].why.endswith(
        f"s and its host took no connection within {PROBE_TIMEOUT_S:g} s (power or network lost)")


def test_a_host_that_spoke_after_it_was_asked_is_not_lost_by_the_answer():
    sup, clock = kept_alive()
    running(sup, clock)
    ticks(sup, clock, 5)
    assert Probe(slot=2, host="c", timeout_s=PROBE_TIMEOUT_S) in ticks(sup, clock, 2, but=("c",))
    beat_all(sup, clock, progress=clock.now)  # c's word came (a loaded host), then the probe's late answer
    assert sup.handle(Event(EventKind.UNREACHABLE, at=clock.now, slot=2)) == []
    assert sup.agents[2].state is S.RUNNING


def test_a_loaded_agent_is_asked_about_only_past_its_own_pace_and_a_bare_transport_never():
    sup, clock = kept_alive()
    running(sup, clock)
    for _ in range(5):  # every word 3 s apart: asked after 4.5 s of silence, not 1.3
        clock.now += 3
        beat_all(sup, clock, progress=clock.now)
    asked = []
    for _ in range(60):
        asked += [(round(clock.now - sup.agents[2].heard, 1), d) for d in ticks(sup, clock, 0.1, but=("c",))]
    assert asked == [(4.6, Probe(slot=2, host="c", timeout_s=PROBE_TIMEOUT_S))] and PROBE_AFTER_S < 4.5
    sup, clock = elastic(("a", "b", "c"))  # no kept-alive transport (silence is loss): never asked
    running(sup, clock)
    assert not [d for d in ticks(sup, clock, 4, but=("c",)) if isinstance(d, Probe)]


def test_a_stuck_agent_whose_connection_is_up_is_lost_after_the_slow_limit():
    """c's agent and its ranks are stuck: the others' ranks wait for them, nobody steps."""
    sup, clock = kept_alive()
    running(sup, clock)
    decisions = advance(sup, clock, 62, progress=False, but=("c",))
    (regroup,) = [d for d in decisions if isinstance(d, RegroupWithout)]
    assert regroup.lost == ("c",) and "said nothing for 60 s, its connection up (stuck)" in regroup.reason


def test_a_stuck_agent_whose_round_steps_stays_until_the_others_end():
    """c's agent alone is stopped: the others' ranks keep stepping in c's round, which they could not
    without c's ranks. c stays (said once) while they step; once they are done, it is lost."""
    sup, clock = kept_alive()
    running(sup, clock, attempt=3)
    decisions = advance(sup, clock, 120, but=("c",))
    assert not [d for d in decisions if isinstance(d, RegroupWithout)], decisions
    carried = [d for d in decisions if isinstance(d, Slow) and d.training]
    assert [(d.host, d.limit_s) for d in carried] == [("c", 60.0)] and carried[0].silent_s > 60
    assert sup.agents[2].state is S.RUNNING
    exited(sup, clock, 0, 0)
    exited(sup, clock, 1, 0)
    advance(sup, clock, 1, but=("c",))
    assert sup.agents[2].state is S.LOST and "said nothing for 60 s" in sup.agents[2].why


def test_a_host_let_in_whose_agent_stopped_before_its_first_word_of_a_step_is_not_taken_for_untrained():
    """d joined the others' round; its agent was stopped before it said its ranks stepped. The
    others' steps in that round were its ranks' too: at the end d is lost (its silence), not stopped
    as a host whose round never trained."""
    sup, clock = kept_alive()
    running(sup, clock, attempt=3)
    advance(sup, clock, 5)
    sup.handle(Event(EventKind.JOINED, at=clock.now, host="d"))
    for slot in (0, 1, 2, 3):
        sup.handle(Event(EventKind.ROUND, at=clock.now, slot=slot, attempt=4))
    advance(sup, clock, 30, but=("d",))
    exited(sup, clock, 0, 0)
    assert sup.agents[3].state is S.RUNNING
    for slot in (1, 2):
        exited(sup, clock, slot, 0)
    advance(sup, clock, 31, but=("d",))
    assert (sup.agents[3].state, sup.agents[3].why) == (S.LOST, "its agent said nothing for 60 s, its connection up (stuck)")


def test_a_stuck_agent_is_not_carried_by_a_round_it_is_not_in():
    """The others step in a round c's workers never started (c was let in, its round not begun)."""
    sup, clock = kept_alive()
    running(sup, clock, attempt=3)
    for slot in (0, 1):
        sup.handle(Event(EventKind.ROUND, at=clock.now, slot=slot, attempt=4))
    decisions = advance(sup, clock, 62, but=("c",))
    (regroup,) = [d for d in decisions if isinstance(d, RegroupWithout)]
    assert regroup.lost == ("c",)


def test_the_silence_limit_follows_the_measured_jitter():
    """Every agent's words come 3 s apart (a loaded machine): 7 s of silence is no loss, 10 s is."""
    sup, clock = elastic(("a", "b", "c"))
    running(sup, clock)
    for _ in range(10):
        clock.now += 3
        beat_all(sup, clock, progress=clock.now)
        assert not sup.tick()
    assert sup.silence_limit() == pytest.approx(9.0)
    decisions = advance(sup, clock, 7, but=("c",))
    assert not decisions and sup.agents[2].state is S.RUNNING
    decisions = advance(sup, clock, 3, but=("c",))
    (regroup,) = [d for d in decisions if isinstance(d, RegroupWithout)]
    assert regroup.lost == ("c",) and "said nothing for 9 s" in regroup.reason


# ---------------------------------------------------------------------------------- a stopped rank


def beat_held(sup: Supervisor, clock: Clock, seconds: int, held: dict[str, tuple[int, ...]]) -> list:
    """``seconds`` of ticks: every agent beats; the ranks of ``held`` (host -> ranks) are stopped
    by a signal, so no rank anywhere progresses."""
    out = []
    for _ in range(seconds):
        clock.now += 1
        for row in sup.agents.live():
            sup.handle(Event(EventKind.HEARD, at=clock.now, slot=row.slot, held=held.get(row.host, ())))
        out += sup.tick()
    return out


def test_a_rank_stopped_by_a_signal_takes_its_host_out_of_an_elastic_job():
    """SIGSTOP: the agent lives and speaks, its rank neither runs nor ends. Its host leaves after
    HELD_S, named with the rank, and the others regroup."""
    sup, clock = elastic(("a", "b", "c"))
    running(sup, clock)
    assert not beat_held(sup, clock, 9, {"c": (2,)})
    decisions = beat_held(sup, clock, 2, {"c": (2,)})
    (regroup,) = [d for d in decisions if isinstance(d, RegroupWithout)]
    assert regroup.lost == ("c",) and regroup.members == ("a", "b")
    assert "c: its rank 2 stopped by a signal (SIGSTOP) for 10 s" == regroup.reason
    assert sup.agents[2].state is S.LOST


def test_a_rank_that_runs_again_in_time_keeps_its_host():
    sup, clock = elastic(("a", "b", "c"))
    running(sup, clock)
    beat_held(sup, clock, 8, {"c": (2,)})
    assert not beat_held(sup, clock, 30, {})  # kill -CONT: its host stays, and the clock starts again
    assert not beat_held(sup, clock, 9, {"c": (2,)})
    assert sup.agents[2].state is S.RUNNING


def test_a_whole_job_suspended_waits_as_one_and_says_so_once():
    """Every host's ranks stopped (a suspend of the whole job): nobody is left behind."""
    sup, clock = elastic(("a", "b"))
    running(sup, clock)
    decisions = beat_held(sup, clock, 40, {"a": (0,), "b": (1,)})
    assert [type(d).__name__ for d in decisions] == ["Held"]
    assert [row.state for row in sup.agents.rows] == [S.RUNNING, S.RUNNING]


def test_without_a_range_a_stopped_rank_is_said_once_and_waited_for():
    clock = Clock()
    sup = Supervisor(("a", "b"), policies=[FailFast(), HangWatch(0.0)], clock=clock)
    running(sup, clock)
    decisions = beat_held(sup, clock, 60, {"b": (3, 1)})
    (held,) = decisions
    assert (held.host, held.ranks, held.held_s) == ("b", (3, 1), 10.0)
    assert [row.state for row in sup.agents.rows] == [S.RUNNING, S.RUNNING]


def test_a_host_let_in_whose_round_never_stepped_is_stopped_when_the_job_finishes():
    """d came back as the others trained their last steps: its workers wait for ranks that are done.
    The job's end stops it; its later failure to connect is not the job's."""
    sup, clock = elastic(("a", "b", "c"))
    running(sup, clock)
    advance(sup, clock, 5)
    sup.handle(Event(EventKind.JOINED, at=clock.now, host="d"))
    sup.handle(Event(EventKind.ROUND, at=clock.now, slot=3, attempt=1))
    clock.now += 1
    assert exited(sup, clock, 0, 0) == []
    assert (sup.agents[3].state, sup.agents[3].why) == (S.STOPPED, "the job finished before its round trained")
    assert [sup.agents[slot].state for slot in (1, 2)] == [S.RUNNING, S.RUNNING]  # they end on their own
    assert exited(sup, clock, 3, 1) == []
    for slot in (1, 2):
        assert exited(sup, clock, slot, 0) == []
    assert all(row.state.final for row in sup.agents.rows) and sup.ended is None


def test_hosts_whose_ranks_report_no_step_are_left_to_end_on_their_own():
    sup, clock = elastic(("a", "b"))
    for row in sup.agents.live():
        sup.handle(Event(EventKind.ROUND, at=clock.now, slot=row.slot, attempt=0))
    clock.now += 5
    assert exited(sup, clock, 0, 0) == [] and sup.agents[1].state is S.RUNNING
