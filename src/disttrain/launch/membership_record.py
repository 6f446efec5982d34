"""The record of an elastic job's membership: ``membership.json`` in the run folder, one
:class:`Change` per change (the start, a host that left, one that joined), and the line the
launcher says for it. The launcher writes it (:class:`~disttrain.launch.rounds.Rounds`);
jobs, the web view and the tracker follower read it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_atomic

RECORD = "membership.json"  # in the run folder: every change, as a JSON list of Change


@dataclass(frozen=True, kw_only=True)
class Change:
    """One change of the job's membership, as ``membership.json`` keeps it."""

    time: float  # seconds since the epoch, when it happened (the host lost, the host joined)
    change: str  # "start", "left", "joined"
    host: str | None
    why: str
    hosts: tuple[str, ...]  # the members after the change
    attempt: int | None = None  # the round that trained next
    world_size: int | None = None  # its world size
    resumed_from: int | None = None  # the step its workers resumed from (disttrain.resume()), if said
    seconds: float | None = None  # from the change to the round's first step (or its workers' start)
    noticed: float | None = None  # a host lost: seconds from its last word to the launcher's verdict
    regrouped: float | None = None  # seconds from the change to the next round's workers starting
    backoff: float | None = None  # a host lost soon after it joined: seconds before it may be tried again
    path: str | None = None  # how the round after it formed: "in place" (no worker process restarted) or "restart"
    path_why: str | None = None  # a restart: why the workers could not stay; no path: why no round trained
    waiting: tuple[str, ...] = ()  # hosts whose agent ran but which were not in that round (the next one takes them)



def membership_line(change: Change, *, steps: bool = True, earlier: Sequence[Change] = ()) -> str:
    """``disttrain: membership: 10.0.0.3 left (...) -> 2 hosts, world size 4, resumed from step 12, 6.1 s``;
    with ``earlier`` changes the same round answers: ``c left (...), then c joined (...) -> ...``."""
    said = [f"{c.host} {c.change} ({c.why})" for c in (*earlier, change) if c.change != "start"]
    parts = [f"{len(change.hosts)} host{'s' if len(change.hosts) != 1 else ''}"
             + (f" ({len(change.waiting)} more waiting for the next round)" if change.waiting else "")]
    if change.world_size is not None:
        parts.append(f"world size {change.world_size}")
    parts.append(f"resumed from step {change.resumed_from}" if change.resumed_from is not None
                 else "no disttrain.resume() step said")
    if change.path == "in place":
        parts.append("regrouped in place")
    elif change.path == "restart" and change.path_why:
        parts.append(f"restarted ({change.path_why})")
    if change.seconds is not None:
        parts.append(f"training again {change.seconds:.1f} s later" if steps
                     else f"workers started {change.seconds:.1f} s later (the script reports no steps)")
    return f"disttrain: membership: {', then '.join(said)} -> {', '.join(parts)}"


def load_record(run_dir: str | Path) -> list[dict]:
    """``membership.json`` of a run folder; [] when the run was not elastic."""
    try:
        return json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return []


def write_record(run_dir: str | Path, changes: Sequence[Change]) -> None:
    """Replace the run folder's record with ``changes`` whole (never half a file)."""
    entries = [dataclasses.asdict(c) for c in changes]
    try:
        write_atomic(Path(run_dir) / RECORD, json.dumps(entries, indent=1) + "\n")
    except OSError:
        pass  # the run folder went away: the lines on the terminal remain
