"""The launcher's supervisor at scale, simulated: fake agents, a fake clock, the real state machine.

    python bench/elastic_sim.py [--hosts 256] [--start 16] [--spread 60] [--losses 8] [--seed 1] [--runs 20] [--no-window] [--at-boot]

``--start`` hosts answer at t=0 and start the job; the others answer the preflight at random
times spread over ``--spread`` seconds (a late boot); ``--losses`` hosts are lost at random
times. Each round takes a random 2-8 s to form (the rendezvous under load). Every host speaks
each second. Counts the rounds (those that let late hosts in, those that let lost hosts back,
those after a loss) and the supervisor's decisions by kind, over ``--runs`` seeds, and prints JSON.
No process, no network: what is measured is the protocol -- how many rounds N staggered arrivals cost.

Hosts are found by the supervisor's own tries: its ``Admit`` decisions, each answered 1-3 s later
by a host that has booted (its preflight) or 5 s later by one that has not (ssh's connect timeout),
on the retry schedule of :class:`~disttrain.launch.policies.Backoff`. A lost host, up again, is
tried and comes back too. ``--at-boot``: a host answers the moment it boots instead, as if it were
tried without pause (the protocol without its tries, for comparison).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from disttrain.launch.policies import Elastic, JoinWindow  # noqa: E402
from disttrain.launch.supervision import (  # noqa: E402
    Admit,
    AgentState,
    Event,
    EventKind,
    Join,
    RegroupWithout,
    Stop,
    Supervisor,
)

TICK_S = 0.5
FORM_S = (2.0, 8.0)  # a round forms this long after it is asked for
STEP_S = 3.0  # and its ranks step this long after it formed (workers arming: imports, init, resume)


def simulate(*, hosts: int = 256, start: int = 16, spread_s: float = 60.0, losses: int = 8, seed: int = 1,
             min_nnodes: int = 2, horizon_s: float = 240.0, window: bool = True, at_boot: bool = False) -> dict:
    """One run (see the module); ``window`` False: each ready host let in as soon as no round forms
    (no join window), for comparison; ``at_boot``: hosts answer when they boot, untried (see the module)."""
    rng = random.Random(seed)
    names = [f"h{i:03d}" for i in range(hosts)]
    now = [0.0]
    joins = JoinWindow() if window else JoinWindow(quiet_s=0.0, pace_max_s=0.0, hold_s=0.0)
    policy = Elastic(min_nnodes=min_nnodes, max_nnodes=hosts, regroup_s=120.0, store="sim:0", joins=joins,
                     hosts=() if at_boot else names)
    sup = Supervisor(names[:start], policies=[policy], clock=lambda: now[0], silent_s=30.0)
    queue: list[tuple[float, int, str, str | None]] = []  # (time, order, what, host)
    order = iter(range(10**9))

    def at(t: float, what: str, host: str | None = None) -> None:
        heapq.heappush(queue, (t, next(order), what, host))

    arrivals = {host: rng.uniform(0.0, spread_s) for host in names[start:]}
    for host, t in arrivals.items():
        if at_boot:
            at(t, "ready", host)
    for _ in range(losses):
        at(rng.uniform(5.0, spread_s + 30.0), "lose")
    at(rng.uniform(*FORM_S), "round")  # the first round, of the hosts that started
    t = 0.0
    while t <= horizon_s:
        at(t, "tick")
        t += TICK_S
    rounds = Counter()
    decisions = Counter()
    attempt = 0
    forming: str | None = "start"  # what the round being formed answers
    last_arrival_in: float | None = None
    lost = 0
    lost_hosts: set[str] = set()
    members_once = set(names[:start])  # hosts that were members: a Join of only these lets lost hosts back
    while queue:
        t, _, what, host = heapq.heappop(queue)
        now[0] = t
        out = []
        if what == "ready":
            out = sup.handle(Event(EventKind.READY, at=t, host=host))
        elif what == "missed":
            out = sup.handle(Event(EventKind.MISSED, at=t, host=host))
        elif what == "lose":
            live = [row for row in sup.agents.live() if row.state is AgentState.RUNNING]
            if len(live) > min_nnodes:
                row = rng.choice(live)
                lost += 1
                lost_hosts.add(row.host)
                out = sup.handle(Event(EventKind.EXITED, at=t, slot=row.slot, code=255, cause="simulated loss"))
        elif what == "round":
            for row in sup.agents.live():
                sup.handle(Event(EventKind.ROUND, at=t, slot=row.slot, attempt=attempt))
            rounds[forming or "other"] += 1
            attempt += 1
            forming = None
        else:  # tick: every live agent spoke this second, with its ranks' steps once its round stepped
            for row in sup.agents.live():
                stepped = row.round_at is not None and t - row.round_at >= STEP_S
                sup.handle(Event(EventKind.HEARD, at=t, slot=row.slot, progress=t if stepped else None))
            out = sup.tick()
        for decision in out:
            decisions[type(decision).__name__] += 1
            if isinstance(decision, Admit):
                for name in decision.hosts:
                    up = arrivals.get(name, 0.0) <= t
                    at(t + (rng.uniform(1.0, 3.0) if up else 5.0), "ready" if up else "missed", name)
            if isinstance(decision, Stop):
                return {"stopped": decision.reason}
            if isinstance(decision, Join):
                late = not members_once.issuperset(decision.hosts)
                members_once.update(decision.hosts)
                for name in decision.hosts:
                    sup.handle(Event(EventKind.JOINED, at=t, host=name))
                if late:
                    last_arrival_in = t
            if isinstance(decision, (Join, RegroupWithout)):
                # One round answers whatever is asked while it forms (torch's rendezvous takes
                # every node waiting): it is counted once, for its first cause.
                if forming is None:
                    forming = "loss" if isinstance(decision, RegroupWithout) else "arrivals" if late else "returns"
                    at(t + rng.uniform(*FORM_S), "round")
    live = {row.host for row in sup.agents.live()}
    return {
        "hosts": hosts, "started": start, "arrived": len(arrivals), "spread_s": spread_s, "losses": losses,
        "rounds": dict(rounds), "arrival_rounds": rounds["arrivals"], "decisions": dict(decisions),
        "return_rounds": rounds["returns"], "members_at_end": len(live), "lost": lost,
        "every_arrival_let_in": all(host in live or host in lost_hosts for host in arrivals),
        "last_arrival": round(max(arrivals.values(), default=0.0), 1), "last_let_in": last_arrival_in,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=256)
    parser.add_argument("--start", type=int, default=16)
    parser.add_argument("--spread", type=float, default=60.0)
    parser.add_argument("--losses", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-window", action="store_true", help="let each host in as soon as no round forms")
    parser.add_argument("--at-boot", action="store_true", help="hosts answer when they boot, not the supervisor's tries")
    args = parser.parse_args(argv)
    runs = [simulate(hosts=args.hosts, start=args.start, spread_s=args.spread, losses=args.losses, seed=args.seed + i,
                     window=not args.no_window, at_boot=args.at_boot) for i in range(args.runs)]
    arrival_rounds = [r["arrival_rounds"] for r in runs]
    print(json.dumps({
        "hosts": args.hosts, "started": args.start, "spread_s": args.spread, "losses": args.losses, "runs": args.runs,
        "join_window": not args.no_window, "at_boot": args.at_boot,
        "arrival_rounds": {"max": max(arrival_rounds), "mean": round(sum(arrival_rounds) / len(runs), 2)},
        "return_rounds": {"max": max(r["return_rounds"] for r in runs)},
        "loss_rounds": {"max": max(r["rounds"].get("loss", 0) for r in runs)},
        "every_arrival_let_in": all(r["every_arrival_let_in"] for r in runs),
        "decisions": dict(sum((Counter(r["decisions"]) for r in runs), Counter())),
        "first": runs[0],
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
