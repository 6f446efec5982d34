"""Fake agents and a fake clock for the launcher's supervisor, in-process (test_supervision, test_liveness)."""

from __future__ import annotations

from disttrain.launch.policies import (
    Elastic,
    HangWatch,
)
from disttrain.launch.supervision import (
    Event,
    EventKind,
    Supervisor,
)


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
