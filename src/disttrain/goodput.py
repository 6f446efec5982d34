"""Goodput: where a run's time went, in host-seconds, from what the launcher recorded.

Classes (each second of each host in exactly one):

- ``training``: steps that counted;
- ``startup``: from the launch to the first step (processes, imports, the first rendezvous, data);
- ``rendezvous``: from a membership change (a host lost or joined) to the next round's first step;
- ``checkpoint``: steps blocked by a checkpoint's save (an async save: its staging copy);
- ``redone``: work lost to a failure -- from the step the next round resumed from to the change;
- ``hang``: from the last progress to the end of a run stopped by the hang verdict;
- ``stragglers``: ranks waiting at a logged step for the slowest one (with ``--track-ranks``).

The records (:func:`compute` takes them as lists, so that tests construct them): the launcher's
``track.jsonl`` in the run folder -- ``start`` (time, hosts), the workers' track lines stamped
with the launcher's clock (``metrics`` at a step, ``checkpoint`` with its seconds), ``resumed``
(rank 0's resume line), ``end`` (time, exit code, whether the hang verdict stopped it) -- and
``membership.json`` (:mod:`disttrain.launch.membership_record`). Steps are known where the script reports
them (``disttrain.log``, ``disttrain.resume``'s checkpoints, the Trainer's epochs); between two
reported steps the rate is taken as even, which places a round's first step before its first
report. Pure computation: no clock, no files but in :func:`from_run_dir`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CLASSES = ("training", "startup", "rendezvous", "checkpoint", "redone", "hang", "stragglers")
RECORD = "track.jsonl"  # in the run folder: the launcher's records, one JSON object a line
FILE = "goodput.json"  # in the run folder: what compute() made of them


def compute(records: Sequence[Mapping[str, Any]], changes: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The goodput of one run from its records (see the module); every record has ``t``."""
    start = next((r for r in records if r.get("kind") == "start"), None)
    end = next((r for r in reversed(records) if r.get("kind") == "end"), None)
    if start is None or end is None:
        raise ValueError("goodput needs the run's start and end records")
    t0, t1 = float(start["t"]), float(end["t"])
    notes: list[str] = []
    rounds = _rounds(t0, t1, int(start.get("hosts") or 1), changes)
    steps = [r for r in records if r.get("kind") in ("metrics", "checkpoint") and r.get("step") is not None
             and r.get("reduced", True)]
    if not steps:
        notes.append("no steps reported (disttrain.log, disttrain.resume or the Trainer): start-up and "
                     "hangs cannot be told from training")
    seconds = dict.fromkeys(CLASSES, 0.0)
    rate = _rate(steps)
    previous: dict[str, Any] | None = None
    for number, rnd in enumerate(rounds):
        begin, finish, hosts = rnd["begin"], rnd["end"], rnd["hosts"]
        mine = sorted(((float(r["t"]), int(r["step"])) for r in steps if begin <= float(r["t"]) < finish or (
            rnd is rounds[-1] and float(r["t"]) == finish)))
        resumed = _resumed(records, rnd)
        round_rate = _rate_of(mine) or rate
        base = resumed if resumed is not None else (0 if number == 0 else None)
        if mine:
            first_t, first_step = mine[0]
            back = (first_step - base) * round_rate if (base is not None and round_rate) else 0.0
            trains_from = min(first_t, max(begin, first_t - max(0.0, back)))
        elif rnd["change"] is not None and rnd["change"].get("seconds") is not None:
            trains_from = min(finish, begin + float(rnd["change"]["seconds"]))
        else:
            trains_from = begin if not steps else finish
        waiting = "startup" if number == 0 else "rendezvous"
        seconds[waiting] += (trains_from - begin) * hosts
        span = finish - trains_from
        lost = dict.fromkeys(("checkpoint", "redone", "hang", "stragglers"), 0.0)
        lost["checkpoint"] = sum(float(r.get("seconds") or 0) for r in records if r.get("kind") == "checkpoint"
                                 and begin <= float(r["t"]) <= finish)
        if number == len(rounds) - 1 and end.get("hung"):
            last = mine[-1][0] if mine else trains_from
            lost["hang"] = max(0.0, finish - last)
        # Rank-seconds over the ranks: the wall seconds of the round's hosts (multiplied back below).
        lost["stragglers"] = _waiting(records, begin, finish) / max(1, _ranks(records))
        if previous is not None and resumed is not None and previous["steps"]:
            # The previous round's work after the step this one resumed from was done again.
            p_rate = _rate_of(previous["steps"]) or rate
            last_t, last_step = previous["steps"][-1]
            if p_rate:
                reached = last_t - max(0, last_step - resumed) * p_rate
                redone = max(0.0, min(previous["span"], rnd["begin"] - max(previous["trains_from"],
                                                                                            reached)))
                seconds["redone"] += redone * previous["hosts"]
                seconds["training"] -= redone * previous["hosts"]
        total_lost = sum(lost.values())
        if total_lost > span:  # records that overlap (a save while hung): never more than the span
            scale = span / total_lost if total_lost else 0.0
            lost = {k: v * scale for k, v in lost.items()}
        for name, value in lost.items():
            seconds[name] += value * hosts
        seconds["training"] += (span - sum(lost.values())) * hosts
        previous = {"steps": mine, "hosts": hosts, "trains_from": trains_from, "span": span}
    seconds = {k: round(max(0.0, v), 3) for k, v in seconds.items()}
    total = sum(seconds.values())
    # A share is said only of a run that finished and showed its steps: a failed run's time, or one
    # whose training cannot be told from its start-up, is no 1.0 (the seconds stay, as recorded).
    said = bool(steps) and end.get("exit_code") in (0, None)
    if end.get("exit_code") not in (0, None):
        notes.append(f"the run did not finish (exit {end.get('exit_code')}): no goodput is said")
    return {
        "wall_s": round(t1 - t0, 3),
        "host_seconds": round(total, 3),
        "seconds": seconds,
        "goodput": round(seconds["training"] / total, 4) if total and said else None,
        "rounds": len(rounds),
        "exit_code": end.get("exit_code"),
        "notes": notes,
    }


def _rounds(t0: float, t1: float, hosts: int, changes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run cut at each membership change: each round's span, hosts, and the change that began it."""
    first = next((c for c in changes if c.get("change") == "start"), None)
    if first is not None and first.get("hosts"):
        hosts = len(first["hosts"])
    cuts = sorted((c for c in changes if c.get("change") != "start" and t0 < float(c["time"]) < t1),
                  key=lambda c: float(c["time"]))
    rounds, begin, change = [], t0, None
    for cut in cuts:
        rounds.append({"begin": begin, "end": float(cut["time"]), "hosts": hosts, "change": change})
        begin, change, hosts = float(cut["time"]), cut, len(cut.get("hosts") or ()) or hosts
    rounds.append({"begin": begin, "end": t1, "hosts": hosts, "change": change})
    return rounds


def _resumed(records: Sequence[Mapping[str, Any]], rnd: Mapping[str, Any]) -> int | None:
    """The step this round resumed from: rank 0's resume line in it, else its membership change's."""
    said = [int(r["step"]) for r in records
            if r.get("kind") == "resumed" and rnd["begin"] <= float(r["t"]) < rnd["end"]]
    if said:
        return said[0]
    change = rnd["change"]
    return int(change["resumed_from"]) if change is not None and change.get("resumed_from") is not None else None


def _rate_of(steps: Sequence[tuple[float, int]]) -> float | None:
    """Seconds per step between the first and last report (None: fewer than two steps apart)."""
    if len(steps) < 2 or steps[-1][1] <= steps[0][1]:
        return None
    return (steps[-1][0] - steps[0][0]) / (steps[-1][1] - steps[0][1])


def _rate(steps: Sequence[Mapping[str, Any]]) -> float | None:
    return _rate_of(sorted((float(r["t"]), int(r["step"])) for r in steps))


def _ranks(records: Sequence[Mapping[str, Any]]) -> int:
    return len({r.get("rank") for r in records if r.get("kind") == "metrics" and r.get("reduced") is False})


def _waiting(records: Sequence[Mapping[str, Any]], begin: float, end: float) -> float:
    """Rank-seconds spent waiting for the slowest rank at each logged step: each rank's own line
    comes before the mean's collective, so the last one to arrive held the others that long."""
    at: dict[int, list[float]] = {}
    for r in records:
        if r.get("kind") == "metrics" and r.get("reduced") is False and r.get("step") is not None \
                and begin <= float(r["t"]) <= end:
            at.setdefault(int(r["step"]), []).append(float(r["t"]))
    return sum(max(times) - t for times in at.values() if len(times) > 1 for t in times)


def load_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """``track.jsonl`` of a run folder (lines that do not parse are skipped: a run cut short)."""
    out = []
    try:
        lines = (Path(run_dir) / RECORD).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "t" in record:
            out.append(record)
    return out


def from_run_dir(run_dir: str | Path) -> dict[str, Any] | None:
    """The goodput of the run recorded in ``run_dir``; None without its start and end."""
    try:
        changes = json.loads((Path(run_dir) / "membership.json").read_text())
    except (OSError, ValueError):
        changes = []
    try:
        return compute(load_records(run_dir), changes if isinstance(changes, list) else [])
    except ValueError:
        return None


def summary(data: Mapping[str, Any]) -> str:
    """``goodput 91.2 % of 412.0 host-s: training 375.7, startup 20.1, ...`` (classes above 0)."""
    parts = [f"{name} {value:.1f}" for name, value in data["seconds"].items() if value > 0]
    share = f"{100 * data['goodput']:.1f} %" if data.get("goodput") is not None else "-"
    return f"goodput {share} of {data['host_seconds']:.1f} host-s: {', '.join(parts) or 'nothing recorded'}"
