"""Why did it hang: one verdict from every rank's Flight Recorder and stack, on every host.

Pure functions. Each node's agent turns its ranks' dumps into :class:`~disttrain.wire.RankState`
values (:func:`calls_from_recorder` keeps each process group's frontier: the last collective a
rank completed and those it is inside); the launcher, which gets them from every host
(:class:`~disttrain.wire.HangReport`), calls :func:`verdict`. The causes, in the order they are looked for:

* a rank **exited** while the others wait for it;
* a rank **never entered** collective #N of a group whose other members are inside it (with
  where it is instead: its Python line, or another group's collective);
* ranks inside #N **with different calls** (op, sizes or dtypes): a mismatch, both named;
* every member inside #N with the same call, and it does not complete: the link between them;
* no rank inside any collective: the ranks **stuck in their own code**, each with its line.

Collectives are matched by their number within their process group (``collective_seq_id``),
not by the recorder's record ids: the recorder is a ring, and ranks in different subgroups
record different numbers of entries, so record ids drift apart once it wraps. Whether two
ranks' calls of #N agree is torch's own rule (``Op.match`` of ``torch.distributed.flight_recorder``:
which sizes must be equal for which op).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .. import torchcompat
from ..wire import Call, RankState

DEFAULT_GROUP = "0"


def _shape(sizes: Iterable[int]) -> str:
    return "[" + ", ".join(map(str, sizes)) + "]"


def signature(call: Call) -> str:
    """``all_reduce [4] Float``: what a user compares between two ranks' calls."""
    sizes = ", ".join(_shape(s) for s in call.input_sizes) or "no tensor"
    dtypes = ",".join(sorted(set(call.input_dtypes)))
    text = f"{call.op} {sizes}" + (f" {dtypes}" if dtypes else "")
    if call.output_sizes and call.output_sizes != call.input_sizes:
        text += f" -> {', '.join(_shape(s) for s in call.output_sizes)}"
    return text


def _group_label(group: str, desc: str) -> str:
    if group == DEFAULT_GROUP or desc == "default_pg":
        return "the default group"
    return f"group {group}" + (f" ({desc})" if desc and desc != "undefined" else "")


def calls_from_recorder(recorder: Mapping) -> tuple[Call, ...]:
    """The frontier of every process group in one rank's recorder dump (torch's JSON): the last
    call it completed there and every call it is inside, oldest first."""
    calls: dict[tuple[str, bool], list[Call]] = {}
    for entry in recorder.get("entries", ()):
        backend, _, op = str(entry.get("profiling_name", "")).partition(":")
        p2p = bool(entry.get("is_p2p"))
        group, desc = (list(entry.get("process_group") or ["?", ""]) + [""])[:2]
        call = Call(
            group=str(group), desc=str(desc), seq=int(entry["p2p_seq_id" if p2p else "collective_seq_id"]),
            op=op or backend, backend=backend if op else "",
            input_sizes=tuple(tuple(s) for s in entry.get("input_sizes", ())),
            output_sizes=tuple(tuple(s) for s in entry.get("output_sizes", ())),
            input_dtypes=tuple(entry.get("input_dtypes", ())), output_dtypes=tuple(entry.get("output_dtypes", ())),
            done=bool(entry.get("retired")) or entry.get("state") == "completed", p2p=p2p,
        )
        calls.setdefault((call.group, p2p), []).append(call)
    out: list[Call] = []
    for group_calls in calls.values():
        group_calls.sort(key=lambda c: c.seq)
        done = [c for c in group_calls if c.done]
        out += done[-1:] + [c for c in group_calls if not c.done]
    return tuple(out)


def _members(states: Sequence[RankState], world: Iterable[int]) -> dict[str, tuple[int, ...]]:
    """Every group's global ranks: as the ranks said; else those seen calling in it (the default
    group: the whole world)."""
    members: dict[str, tuple[int, ...]] = {DEFAULT_GROUP: tuple(world)}
    for s in states:
        for name, ranks in s.groups.items():
            if ranks:
                members[name] = tuple(ranks)
    for s in states:
        for c in s.calls:
            if c.group not in members:
                members[c.group] = tuple(sorted({x.rank for x in states for d in x.calls if d.group == c.group}))
    return members


def warm() -> None:
    """Import torch's matching rule ahead of a verdict. The launcher does not import torch to run a
    job; imported only once the hang is judged, it cost the verdict across hosts 6 to 8 s (a loaded
    2-core machine) -- the launcher calls this in a thread of its own when --hang-timeout is set."""
    torchcompat.flight_recorder_matcher()  # None on a torch without it: the fallback rule of _agree


def _agree(a: Call, b: Call, group_size: int) -> str | None:
    """None when two ranks' calls of the same collective agree; else what differs (torch's rule)."""
    if a.op != b.op:
        return "op"
    matcher = torchcompat.flight_recorder_matcher()
    if matcher is not None:
        MatchState, Op = matcher  # noqa: N806

        def event(c: Call) -> dict:
            return {"profiling_name": f"{c.backend}:{c.op}", "state": "scheduled", "process_group": (c.group, c.desc),
                    "input_sizes": [list(s) for s in c.input_sizes], "output_sizes": [list(s) for s in c.output_sizes],
                    "input_dtypes": list(c.input_dtypes), "output_dtypes": list(c.output_dtypes),
                    "collective_seq_id": c.seq, "p2p_seq_id": 0, "time_created_ns": 0}

        members = {a.group: set(range(group_size))}
        try:
            match = Op(event(a), members, a.group).match(Op(event(b), members, b.group))
        except (AssertionError, KeyError, ValueError, IndexError, TypeError):
            match = None  # an op torch's analyser does not know
        if match is not None:
            if match.state == MatchState.FULLY_MATCHED:
                return None
            return "dtypes" if match.state == MatchState.COLLECTIVE_DTYPE_MISMATCH else "sizes"
    # No matcher in this torch, or an op it does not know: the same sizes and dtypes, or not.
    if (a.input_sizes, a.output_sizes) != (b.input_sizes, b.output_sizes):
        return "sizes"
    return None if (a.input_dtypes, a.output_dtypes) == (b.input_dtypes, b.output_dtypes) else "dtypes"


def _inside(state: RankState) -> Call | None:
    """The collective a rank waits in (its oldest unfinished one), if any."""
    pending = [c for c in state.calls if not c.done and not c.p2p]
    return min(pending, key=lambda c: c.seq) if pending else None


def _last_done(state: RankState, group: str) -> Call | None:
    done = [c for c in state.calls if c.group == group and c.done and not c.p2p]
    return max(done, key=lambda c: c.seq) if done else None


def _elsewhere(state: RankState) -> str:
    """Where a rank is, when it is not where the others wait for it."""
    if state.state == "stopped":
        return f"it is stopped by a signal (SIGSTOP/SIGTSTP, pid {state.pid}) and runs on only after SIGCONT"
    if state.state == "silent":
        return "its worker did not answer (no stack, no recorder)"
    inside = _inside(state)
    if inside is not None:
        return (f"it waits in collective #{inside.seq} of {_group_label(inside.group, inside.desc)} "
                f"({signature(inside)}) {_at(state)}")
    return f"it is {_at(state)}" + (" (the script's own code)" if state.own_code else "")


def _at(state: RankState) -> str:
    """``at file:line in func``, or what stood in for the stack (none could be had: it says so)."""
    if state.where.startswith("no Python stack"):
        return f"({state.where})"
    return f"at {state.where or 'an unknown line'}"


def causes(states: Sequence[RankState], *, world_size: int) -> list[str]:
    """The causes found, most telling first (an empty list: nothing explains it)."""
    by_rank = {s.rank: s for s in states}
    found: list[str] = []
    for s in sorted(states, key=lambda s: s.rank):
        if s.state == "exited":
            code = "" if s.exit_code is None else f" with code {s.exit_code}"
            found.append(f"rank {s.rank} on {s.host} exited{code} while the others wait for it: every rank must "
                         "make the same collective calls (the same number of steps)")
    members = _members(states, range(world_size))
    for group, ranks in sorted(members.items()):
        inside = {r: c for r in ranks if r in by_rank and (c := _inside(by_rank[r])) is not None and c.group == group}
        if not inside:
            continue
        seq = min(c.seq for c in inside.values())
        first = next(c for c in inside.values() if c.seq == seq)
        label = _group_label(group, first.desc)
        waiting = sorted(r for r, c in inside.items() if c.seq == seq)
        missing = [r for r in ranks if r in by_rank and r not in waiting and by_rank[r].state != "exited"
                   and ((d := _last_done(by_rank[r], group)) is None or d.seq < seq)]
        for r in missing:
            found.append(f"rank {r} never entered collective #{seq} of {label} ({signature(first)}), which "
                         f"rank{'s' if len(waiting) > 1 else ''} {_list(waiting)} wait{'' if len(waiting) > 1 else 's'} "
                         f"in: {_elsewhere(by_rank[r])}")
        calls = {r: inside[r] for r in waiting}
        kinds: dict[str, list[int]] = {}
        reference = calls[waiting[0]]
        for r in waiting:
            differs = _agree(reference, calls[r], len(ranks))
            kinds.setdefault(signature(calls[r]) if differs else signature(reference), []).append(r)
        if len(kinds) > 1:
            parts = [f"rank{'s' if len(rs) > 1 else ''} {_list(rs)} called {sig}" for sig, rs in kinds.items()]
            found.append(f"a mismatch in collective #{seq} of {label}: {'; '.join(parts)}. Every rank of a group "
                         "must make the same calls, in the same order, with the same sizes")
        elif not missing and len(waiting) == len([r for r in ranks if r in by_rank]) and set(ranks) <= set(by_rank):
            found.append(f"every rank of {label} is inside collective #{seq} ({signature(reference)}) and it does "
                         "not complete: the connection between them (a host cut off, a firewall, a dead link) is "
                         "the suspect")
    if not found:
        stuck = [s for s in sorted(states, key=lambda s: s.rank) if s.state in ("running", "stopped")]
        for s in stuck:
            inside = _inside(s) is not None and s.state == "running"
            found.append(f"rank {s.rank} on {s.host} " + (_elsewhere(s).removeprefix("it ") if inside
                                                          else f"is in no collective: {_elsewhere(s)}"))
    return found


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def rank_line(s: RankState) -> str:
    """One rank's place: its last completed and current collective per group, its Python line."""
    if s.state == "exited":
        return f"rank {s.rank} ({s.host}): exited" + ("" if s.exit_code is None else f" with code {s.exit_code}")
    if s.state == "silent":
        return f"rank {s.rank} ({s.host}): did not answer"
    parts = []
    for group in sorted({c.group for c in s.calls if not c.p2p}):
        label = "" if group == DEFAULT_GROUP else f" of group {group}"
        inside = [c for c in s.calls if c.group == group and not c.done and not c.p2p]
        done = _last_done(s, group)
        if inside:
            parts.append(f"in #{inside[0].seq}{label} {signature(inside[0])}")
        if done is not None:
            parts.append(f"completed #{done.seq}{label} {done.op}")
    parts += [f"in {c.op} (#{c.seq} of group {c.group})" for c in s.calls if c.p2p and not c.done]
    state = "stopped (SIGSTOP); " if s.state == "stopped" else ""
    return f"rank {s.rank} ({s.host}): {state}{'; '.join(parts) or 'no collective recorded'}; {_at(s)}"


def verdict(states: Sequence[RankState], *, world_size: int, timeout_s: float) -> str:
    """The block the launcher prints: the cause(s), each rank's place, where the stacks and dumps are."""
    lines = [f"disttrain: no rank made progress for {timeout_s:g} s (--hang-timeout); the verdict, from every "
             "rank's flight recorder and stack:"]
    found = causes(states, world_size=world_size)
    lines += [f"  cause: {c}" for c in found] or ["  cause: not found in the recorders (see each rank's line)"]
    answered = {s.rank for s in states}
    lines += [f"  {rank_line(s)}" for s in sorted(states, key=lambda s: s.rank)]
    lines += [f"  rank {r}: no report (its host did not answer)" for r in range(world_size) if r not in answered]
    by_host: dict[str, list[RankState]] = {}
    for s in states:
        by_host.setdefault(s.host, []).append(s)
    for host, ranks in sorted(by_host.items()):
        stacks = sorted({_pattern(s.stacks, s.rank) for s in ranks if s.stacks})
        dumps = sorted({_pattern(s.dump, s.rank) for s in ranks if s.dump})
        if stacks:
            lines.append(f"  stacks on {host}: {', '.join(stacks)}")
        if dumps:
            lines.append(f"  flight recorder dumps on {host}: {', '.join(dumps)}")
    return "\n".join(lines)


def _pattern(path: str, rank: int) -> str:
    """``.../rank3.stacks`` -> ``.../rank<N>.stacks``: one line for all the ranks of a host."""
    return path.replace(f"rank{rank}.", "rank<N>.")
