"""The record of an elastic job is always true: ``membership.json``'s ``path`` says whether worker
processes restarted (a fallback after an in-place attempt included), its ``why`` is a cause and
never an ssh notice, its ``hosts`` and world size are the round's, and ``goodput.json`` says no
share for a run that failed or showed no steps. In-process: the launcher's Membership fed the
agents' own wire lines, the supervisor driven with a fake clock."""

from __future__ import annotations

import io
import json
import threading
import time
import types
from pathlib import Path

import pytest

from disttrain import goodput
from disttrain.config.hosts import Host
from disttrain.launch import elastic, rounds
from disttrain.launch.elastic import Membership
from disttrain.launch.policies import Elastic
from disttrain.launch.relay import Relay
from disttrain.launch.supervision import AgentState, Event, EventKind, Stop, Supervisor
from disttrain.launch.transport import SshTransport
from disttrain.wire import AttemptStarted, Beats

BANNER = "Warning: Permanently added '10.0.0.3' (ED25519) to the list of known hosts."


def membership(tmp_path: Path, hosts=("a", "b", "c"), running=(0, 1, 2)) -> tuple[Membership, list]:
    said: list[str] = []
    m = Membership(hosts=list(hosts), running=list(running),
                   run_dir=str(tmp_path))
    m.start(said.append)
    return m, said


def started(host: str, attempt: int, ranks: tuple[int, ...], *, nodes: int, in_place: bool = False,
            why: str = "") -> str:
    return AttemptStarted(host=host, attempt=attempt, nodes=nodes, world_size=nodes, ranks=ranks,
                          in_place=in_place, why=why).to_line()


def round_of(m: Membership, attempt: int, nodes: dict[int, tuple[str, bool, str]]) -> None:
    """Every node of round ``attempt`` says its world: slot -> (host, kept its workers, why not)."""
    for rank, (slot, (host, kept, why)) in enumerate(nodes.items()):
        m.agent_line(slot, started(host, attempt, (rank,), nodes=len(nodes), in_place=kept, why=why))


def trains(m: Membership, slot: int, host: str, step: int = 12) -> None:
    """The round's first step is seen, and rank 0's resume line: its changes are said."""
    m.agent_line(slot, Beats(host=host, ranks={0: (1, 0.0)}).to_line())
    m.rank_line(f"disttrain: resuming from step {step} in memory")
    m.poll()


def c_joins_in_place(m: Membership) -> None:
    """a and b train; c is let in, and round 1 forms with a's and b's workers kept, c's new."""
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    trains(m, 0, "a")
    m._joined.put((2, object()))
    assert len(m.joined()) == 1
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", True, ""), 2: ("c", False, "")})


def lose(m: Membership, slot: int, why: str) -> None:
    m.table.move(slot, AgentState.LOST, why)
    m.leave(slot, why)


def record(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "membership.json").read_text())


def test_a_round_where_one_survivor_restarted_its_workers_is_a_restart(tmp_path):
    m, said = membership(tmp_path)
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, ""), 2: ("c", False, "")})
    trains(m, 0, "a")
    lose(m, 2, "ssh failed: the connection was lost (exit 255)")
    # a kept its workers; b's were not armed: b's processes are new, so the round is no in-place one
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", False, "its workers on b are not armed")})
    trains(m, 0, "a")
    m.close()
    left = record(tmp_path)[1]
    assert (left["path"], left["path_why"]) == ("restart", "its workers on b are not armed")
    assert "restarted (its workers on b are not armed)" in said[-1] and "in place" not in said[-1]


def test_an_in_place_round_that_falls_back_is_recorded_as_the_restart_it_was(tmp_path):
    m, said = membership(tmp_path)
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, ""), 2: ("c", False, "")})
    trains(m, 0, "a")
    lose(m, 2, "its agent was killed by SIGKILL")
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", True, "")})  # told in place: no step yet...
    assert record(tmp_path)[-1]["path"] == "in place"  # as far as the record knows so far
    # ...its group never formed: both agents started their workers again, in round 2
    round_of(m, 2, {0: ("a", False, "the in-place group did not form"), 1: ("b", False, "the in-place group did not form")})
    trains(m, 0, "a", step=10)
    m.close()
    left = record(tmp_path)[1]
    assert left["path"] == "restart" and left["attempt"] == 2 and left["world_size"] == 2
    assert left["path_why"] == "the in-place round 1 fell back: the in-place group did not form"
    assert left["resumed_from"] == 10 and left["hosts"] == ["a", "b"]
    assert "restarted (the in-place round 1 fell back" in said[-1]


def test_workers_restarted_after_a_round_said_in_place_correct_the_record(tmp_path):
    """The in-place round trained a step, then a worker of the old group failed and torch's agents
    started every worker again: the change is not left saying "in place"."""
    m, said = membership(tmp_path)
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, ""), 2: ("c", False, "")})
    trains(m, 0, "a")
    lose(m, 2, "its agent was killed by SIGKILL")
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", True, "")})
    trains(m, 0, "a")
    assert "regrouped in place" in said[-1]
    round_of(m, 2, {0: ("a", False, ""), 1: ("b", False, "")})
    m.close()
    left = record(tmp_path)[1]
    assert left["path"] == "restart" and left["path_why"].startswith("the in-place round 1 fell back")
    assert "was not in place" in said[-1]


def test_a_join_where_every_running_node_kept_its_workers_is_in_place(tmp_path):
    m, said = membership(tmp_path, running=(0, 1))
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    trains(m, 0, "a")
    m._joined.put((2, object()))  # c answered the preflight
    assert len(m.joined()) == 1
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", True, ""), 2: ("c", False, "")})  # c's workers are its first
    trains(m, 0, "a")
    m.close()
    joined = record(tmp_path)[-1]
    assert (joined["change"], joined["path"], joined["hosts"], joined["world_size"]) == (
        "joined", "in place", ["a", "b", "c"], 3)


def test_a_join_no_round_trained_with_has_no_path_and_says_what_came_first(tmp_path):
    """c is let in, and lost before the round with it trains: its join is said with the loss, and
    recorded without a path or a world (none trained), never as "in place"."""
    m, said = membership(tmp_path, running=(0, 1))
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    trains(m, 0, "a")
    m._joined.put((2, object()))
    assert len(m.joined()) == 1
    lose(m, 2, "ssh failed: the connection was lost (exit 255)")
    round_of(m, 2, {0: ("a", True, ""), 1: ("b", True, "")})
    trains(m, 0, "a")
    m.close()
    joined, left = record(tmp_path)[1:]
    assert (joined["change"], joined["path"], joined["world_size"]) == ("joined", None, None)
    assert joined["path_why"] == "c left before a round trained with this change"
    assert (left["change"], left["path"], left["world_size"]) == ("left", "in place", 2)
    assert "c joined" in said[-1] and "c left" in said[-1], said


def test_hosts_let_in_together_are_each_the_rounds_and_said_in_one_line(tmp_path):
    """c and d, one batch, join one round: each entry has that round's world and path (both held in
    it); the line says both."""
    m, said = membership(tmp_path, hosts=("a", "b", "c", "d"), running=(0, 1))
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    trains(m, 0, "a")
    for index in (2, 3):
        m._joined.put((index, object()))
    assert len(m.joined()) == 2
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", True, ""), 2: ("c", False, ""), 3: ("d", False, "")})
    trains(m, 0, "a")
    m.close()
    c, d = record(tmp_path)[1:]
    for entry, host in ((c, "c"), (d, "d")):
        assert (entry["change"], entry["host"], entry["path"], entry["world_size"], entry["attempt"], entry["hosts"]) == (
            "joined", host, "in place", 4, 1, ["a", "b", "c", "d"]), entry
    assert said[-1].startswith("disttrain: membership: c joined (it answered the preflight), then d joined "), said


def test_hosts_are_the_rounds_and_the_others_wait(tmp_path):
    """4 agents run (-n 1 each) but the round that trained has 2 nodes: "2 hosts, world size 2",
    the other two named as waiting, never "4 hosts, world size 2"."""
    m, said = membership(tmp_path, hosts=("a", "b", "c", "d"), running=(0, 1))
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    trains(m, 0, "a")
    for host in (2, 3):
        m._joined.put((host, object()))
    assert len(m.joined()) == 2
    round_of(m, 1, {0: ("a", True, ""), 1: ("b", True, "")})  # c and d not in this round yet
    trains(m, 0, "a")
    assert "-> 2 hosts (2 more waiting for the next round), world size 2" in said[-1], said
    m.close()
    entries = record(tmp_path)
    assert entries[0]["change"] == "start" and entries[0]["world_size"] == 2 and entries[0]["hosts"] == ["a", "b"]
    last = entries[-1]
    assert last["hosts"] == ["a", "b"] and last["waiting"] == ["c", "d"] and last["world_size"] == 2


def test_the_start_entry_has_its_world_size_when_a_change_comes_before_the_first_step(tmp_path):
    m, said = membership(tmp_path, running=(0, 1))
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    m._joined.put((2, object()))  # c answers before round 0 showed a step
    assert len(m.joined()) == 1
    round_of(m, 1, {0: ("a", False, ""), 1: ("b", False, ""), 2: ("c", False, "")})
    trains(m, 0, "a")
    m.close()
    start = record(tmp_path)[0]
    assert start["change"] == "start" and start["world_size"] is not None and start["hosts"]


def test_below_the_minimum_the_loss_names_the_hosts_that_still_ran(tmp_path):
    """The supervisor stops the job (and moves every row) before the loss is recorded: the entry
    still has the host that ran when it happened, never "hosts": []."""
    clock = [0.0]
    m, _ = membership(tmp_path, hosts=("a", "b"), running=(0, 1))
    sup = Supervisor(("a", "b"), policies=[Elastic(min_nnodes=2, max_nnodes=2, regroup_s=60, store="x:1")],
                     clock=lambda: clock[0], agents=m.table)
    decisions = sup.handle(Event(EventKind.EXITED, at=0.5, slot=1, code=255, cause="ssh failed: Timeout"))
    assert isinstance(decisions[0], Stop)
    m.leave(1, "ssh failed: Timeout")
    m.close()
    left = record(tmp_path)[-1]
    assert left["change"] == "left" and left["hosts"] == ["a"]


def test_an_ssh_notice_is_never_the_why(tmp_path):
    ssh = SshTransport(Host(name="c"))
    assert ssh.own_failure(255, BANNER, quiet_s=4.0) == "ssh failed: the connection was lost (exit 255)"
    assert ssh.own_failure(255, "** WARNING: connection is not using a post-quantum key exchange algorithm.",
                           quiet_s=0.3) == "its agent was killed by a signal: ssh exit 255 with its connection up"
    # The relay's last word of an agent skips the notice that came after its own lines.
    relay = Relay(tmp_path, threading.Lock())
    relay.pump(io.StringIO(f"disttrain: node c starts\n{BANNER}\n\n"), io.StringIO(), agent=0)
    assert relay.last_line(0) == "disttrain: node c starts"
    relay.pump(io.StringIO(f"{BANNER}\n"), io.StringIO(), agent=1)
    assert relay.last_line(1) == ""
    relay.close()
    m = Membership(hosts=["a", "b", "c"], running=[0, 1, 2], run_dir=str(tmp_path),
                   own_failure=lambda i, code, last, quiet: ssh.own_failure(code, last, quiet))
    assert m.transport_cause(2, 255, relay.last_line(1), 4.0) == "ssh failed: the connection was lost (exit 255)"
    sup = Supervisor(("a", "b", "c"), policies=[Elastic(min_nnodes=1, max_nnodes=3, regroup_s=60, store="x:1")])
    sup.handle(Event(EventKind.EXITED, at=0.0, slot=2, code=1, last=relay.last_line(1)))
    assert sup.agents[2].why == "its agent ended (exit 1) before joining a round: no message"


def _steps(first_t: float, n: int) -> list[dict]:
    return [{"kind": "metrics", "t": first_t + s, "step": s, "values": {"loss": 1.0}} for s in range(n)]


@pytest.mark.parametrize("exit_code", [1, 255, 124])
def test_goodput_says_no_share_for_a_run_that_did_not_finish(exit_code):
    data = goodput.compute([{"kind": "start", "t": 0.0, "hosts": 2}, *_steps(2.0, 5),
                            {"kind": "end", "t": 10.0, "exit_code": exit_code}])
    assert data["goodput"] is None and data["exit_code"] == exit_code
    assert any(f"did not finish (exit {exit_code})" in note for note in data["notes"])
    assert "goodput - of" in goodput.summary(data)


def test_goodput_says_no_share_for_a_run_that_trained_nothing_it_showed():
    failed = goodput.compute([{"kind": "start", "t": 0.0, "hosts": 1}, {"kind": "end", "t": 5.0, "exit_code": 1}])
    quiet = goodput.compute([{"kind": "start", "t": 0.0, "hosts": 1}, {"kind": "end", "t": 5.0, "exit_code": 0}])
    assert failed["goodput"] is None and quiet["goodput"] is None
    finished = goodput.compute([{"kind": "start", "t": 0.0, "hosts": 1}, *_steps(1.0, 5),
                                {"kind": "end", "t": 6.0, "exit_code": 0}])
    assert 0 < finished["goodput"] < 1


def test_an_in_place_round_is_said_to_train_only_once_its_workers_say_they_went_on(tmp_path):
    """Kept workers' steps count on from their old world: a step seen after the round's start is
    theirs until rank 0's resume line says the regroup took effect. A job that ends first does not
    claim the round trained, nor a world of 3 that never stepped."""
    m, said = membership(tmp_path, running=(0, 1))
    c_joins_in_place(m)
    m.agent_line(0, Beats(host="a", ranks={0: (40, 0.0)}).to_line())  # an old-world step
    m.rounds._trained = (m.rounds._trained[0], m.rounds._trained[1] - 10)  # long past the resume line's usual wait
    m.poll()
    assert not any("membership:" in line for line in said)
    m.table.move(0, AgentState.DONE, "it finished")  # the job ended before the regroup took effect
    m.close()
    joined = record(tmp_path)[-1]
    assert joined["change"] == "joined" and joined["seconds"] is None and joined["resumed_from"] is None
    assert (joined["attempt"], joined["path"], joined["world_size"]) == (1, None, None)
    assert joined["path_why"] == "the job ended before a round trained"
    assert not any("membership:" in line for line in said)


def test_a_new_hosts_word_first_is_not_its_round_training(tmp_path):
    """The field case (a flapping host, under load): c is let in and its agent says round 1 first; a and
    b, told to keep their workers, say so later, and meanwhile step on in their old world of 2. Those
    steps are not round 1 training with 3, however long they go on. c loses power before the round
    forms; the in-place round after it falls back, which the record says once."""
    m, said = membership(tmp_path, running=(0, 1))
    round_of(m, 0, {0: ("a", False, ""), 1: ("b", False, "")})
    trains(m, 0, "a")
    m._joined.put((2, object()))
    assert len(m.joined()) == 1
    m.agent_line(2, started("c", 1, (2,), nodes=3))  # c's first workers: its word comes first
    m.agent_line(0, Beats(host="a", ranks={0: (40, 0.0)}).to_line())  # an old-world step
    m.rounds._trained = (m.rounds._trained[0], m.rounds._trained[1] - 10)  # long past the resume line's usual wait
    m.poll()
    assert not any("membership:" in line for line in said), said
    m.agent_line(0, started("a", 1, (0,), nodes=3, in_place=True))
    m.agent_line(1, started("b", 1, (1,), nodes=3, in_place=True))
    m.poll()
    assert not any("membership:" in line for line in said), said
    lose(m, 2, "its agent said nothing for 2.4 s and its host took no connection within 0.8 s")
    round_of(m, 2, {0: ("a", True, ""), 1: ("b", True, "")})  # told in place; its group never forms
    round_of(m, 3, {0: ("a", False, "the in-place round 2 fell back"), 1: ("b", False, "")})
    trains(m, 0, "a", step=36)
    m.close()
    joined, left = record(tmp_path)[1:]
    assert (joined["change"], joined["path"], joined["world_size"]) == ("joined", None, None), joined
    assert joined["path_why"] == "c left before a round trained with this change"
    assert (left["change"], left["attempt"], left["world_size"], left["path"]) == ("left", 3, 2, "restart"), left
    assert left["path_why"] == "the in-place round 2 fell back", left


def test_a_join_whose_new_workers_start_slowly_is_said_with_the_step_it_resumed_from(tmp_path, monkeypatch):
    """The field case (a host down at the start comes back, under load): the kept workers wait in the
    forming group while the new host's start Python and torch, longer than a script without steps is
    given. The script reported steps before, so the round waits for its own and rank 0's resume line."""
    clock = [1000.0]
    for module in (elastic, rounds):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    m, said = membership(tmp_path, running=(0, 1))
    c_joins_in_place(m)
    clock[0] += rounds.FIRST_STEP_WAIT_S + 1  # no step for longer than that
    m.poll()
    assert not any("membership:" in line for line in said), said
    m.agent_line(0, Beats(host="a", ranks={0: (1, 0.0)}).to_line())
    m.rank_line("disttrain: resuming from step 24 in memory")
    m.poll()
    line = next(line for line in said if "membership:" in line)
    assert "c joined" in line and "world size 3, resumed from step 24" in line, line
    assert record(tmp_path)[-1]["resumed_from"] == 24
