"""The supervisor's liveness rules (disttrain.launch.policies: the hang watch, slow or lost, a stopped
rank), in-process: fake agents, a fake clock."""

from __future__ import annotations

import pytest
from supervised import Clock, advance, beat_all, elastic, exited, running

from disttrain.launch.policies import (
    PROBE_AFTER_S,
    PROBE_TIMEOUT_S,
    Elastic,
    FailFast,
    HangWatch,
)
from disttrain.launch.supervision import (
    AgentState,
    Dump,
    Event,
    EventKind,
    Probe,
    RegroupWithout,
    Slow,
    Supervisor,
)

S = AgentState


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
