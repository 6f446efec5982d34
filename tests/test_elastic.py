"""``--nnodes MIN:MAX`` over ``--hosts``: lose a host and go on, take it back, stop below MIN.

The multi-host tests run a real job on three hosts (network namespaces on a bridge, each with
its own sshd: tests/rig.py), launched from the first as a user would, and cut the third off as a
machine that loses power (its link drops every packet, every process in it dies). The workers
(tests/scripts/elastic_train.py) log every step's samples, so the accounting over every attempt
(bench/elastic.py's) checks that no sample was lost or trained twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import elastic_bench
from disttrain.config.launch import LaunchSpec
from disttrain.launch.elastic import Membership, starting_hosts
from disttrain.launch.membership_record import Change, membership_line
from disttrain.launch.supervision import AgentState
from disttrain.plan.launch import NodeFacts, make_plan
from disttrain.wire import AttemptStarted, Beats, HostFacts
from rig import cluster_fixture, cpu_hog
from slurm_rig import slurm_fixture

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "elastic_train.py"


bench = elastic_bench()

# --------------------------------------------------------------------------- the pieces, no hosts


def facts(address: str, **changes) -> HostFacts:
    base = dict(hostname="h", address=address, ifname="eth1", is_master=address.endswith(".1"), cpus=2,
                cuda_devices=0, versions={"python": "3.11", "torch": "2.13", "nccl": None, "disttrain": "0.1"},
                paths={"train.py": True}, cwd="/w", cwd_exists=True,
                port_free=True if address.endswith(".1") else None)
    return HostFacts(**{**base, **changes})


def test_hosts_that_fail_the_preflight_wait_while_the_others_start():
    from disttrain.config.hosts import Host
    from disttrain.errors import DisttrainError

    hosts = [Host(name=n) for n in ("a", "b", "c", "d")]
    said = [facts("10.0.0.1"), DisttrainError("c: ssh failed: Connection timed out"),
            facts("10.0.0.3"), facts("10.0.0.4", paths={"train.py": False})]
    starting, waiting = starting_hosts(hosts, said, master_port=29500, min_nnodes=2, max_nnodes=3)
    assert starting == [0, 2]
    assert waiting == {1: "c: ssh failed: Connection timed out", 3: "train.py not found in /w"}
    # MAX hosts at most: the others are spares
    all_up = [facts(f"10.0.0.{i}") for i in range(1, 5)]
    starting, waiting = starting_hosts(hosts, all_up, master_port=29500, min_nnodes=2, max_nnodes=3)
    assert starting == [0, 1, 2] and "a spare" in waiting[3]


def test_fewer_than_min_is_the_first_failure_and_no_host_is_required():
    from disttrain.config.hosts import Host
    from disttrain.errors import DisttrainError

    hosts = [Host(name=n) for n in ("a", "b", "c")]
    with pytest.raises(DisttrainError, match="Connection refused"):
        starting_hosts(hosts, [facts("10.0.0.1"), DisttrainError("b: Connection refused"), DisttrainError("c: down")],
                       master_port=29500, min_nnodes=2, max_nnodes=3)
    # the launcher holds the rendezvous: the first host may be the one that is down
    starting, waiting = starting_hosts(hosts, [DisttrainError("a: down"), facts("10.0.0.2"), facts("10.0.0.3")],
                                       master_port=29500, min_nnodes=2, max_nnodes=3)
    assert starting == [1, 2] and waiting == {0: "a: down"}


def test_an_agent_stopped_from_outside_is_a_lost_host_and_a_failure_is_not():
    m = Membership(hosts=["a", "b", "c"], running=[0, 1, 2], min_nnodes=2, max_nnodes=3, run_dir="/nonexistent",
                   own_failure=lambda i, code, last, quiet: f"ssh failed: {last}" if code == 255 else None)
    m.agent_line(1, AttemptStarted(host="b", attempt=0, nodes=3, world_size=3, ranks=(1,)).to_line())
    assert m.why_lost(2, 255, "Timeout, server c not responding.") == "ssh failed: Timeout, server c not responding."
    assert m.why_lost(1, 137, "") == "its agent was killed by SIGKILL"
    assert m.why_lost(1, 1, "disttrain: rank 1 on b exited with code 1") is None  # its workers failed
    assert "before joining a round: no route" in m.why_lost(0, 1, "no route")  # never got that far


def test_ssh_tells_a_killed_agent_from_a_lost_connection_by_the_silence_before():
    """ssh exits 255 for both; a lost connection only after its keep-alives went unanswered."""
    from disttrain.config.hosts import Host
    from disttrain.launch.probe import SshTransport

    ssh = SshTransport(Host(name="c"))
    assert ssh.own_failure(255, "", quiet_s=0.4) == "its agent was killed by a signal: ssh exit 255 with its connection up"
    assert ssh.own_failure(255, "", quiet_s=3.2) == "ssh failed: the connection was lost (exit 255)"
    assert ssh.own_failure(255, "Timeout, server c not responding.", quiet_s=0.4) == \
        "ssh failed: Timeout, server c not responding."
    assert ssh.own_failure(1, "", quiet_s=0.4) is None


def lose(m: Membership, slot: int, why: str) -> list[int]:
    """As the flow does: the supervisor moves the row (the one record of members), the membership records it."""
    m.table.move(slot, AgentState.LOST, why)
    return m.leave(slot, why)


def test_changes_one_round_answers_are_said_together_with_consistent_counts(tmp_path):
    """A host lost, then back before the next round formed: one line, each entry's count its own."""
    said = []
    m = Membership(hosts=["a", "b", "c"], running=[0, 1, 2], min_nnodes=2, max_nnodes=3, run_dir=str(tmp_path))
    m.start(said.append)
    started = lambda attempt, world: AttemptStarted(host="a", attempt=attempt, nodes=world, world_size=world,  # noqa: E731
                                                    ranks=(0,)).to_line()
    m.agent_line(0, started(0, 3))
    m.agent_line(0, Beats(host="a", ranks={0: (3, 0.0)}).to_line())
    lose(m, 2, "its agent was killed by SIGKILL")
    m._joined.put((2, object()))  # c answered again before the round formed
    assert len(m.joined()) == 1
    m.agent_line(0, started(1, 3))
    m.agent_line(0, Beats(host="a", ranks={0: (1, 0.0)}).to_line())
    m.rank_line("disttrain: resuming from step 12 in /ckpt (epoch 0, after 4 of its steps)")
    m.poll()
    assert said[-1].startswith("disttrain: membership: c left (its agent was killed by SIGKILL), then c joined "
                               "(it answered again) -> 3 hosts, world size 3, resumed from step 12"), said
    m.close()
    record = json.loads((tmp_path / "membership.json").read_text())
    assert [(c["change"], len(c["hosts"]), c["world_size"]) for c in record] == [
        ("start", 3, 3), ("left", 2, None), ("joined", 3, 3)]


def test_membership_says_each_change_when_the_next_round_trains(tmp_path):
    said = []
    m = Membership(hosts=["a", "b", "c"], running=[0, 1, 2], min_nnodes=2, max_nnodes=3, run_dir=str(tmp_path))
    m.start(said.append)
    started = lambda attempt, world: AttemptStarted(host="a", attempt=attempt, nodes=world, world_size=world,  # noqa: E731
                                                    ranks=(0,)).to_line()
    assert m.agent_line(0, started(0, 3))
    m.agent_line(0, Beats(host="a", ranks={0: (3, 0.0)}).to_line())  # round 0 trains: the start is settled
    assert said == []
    assert lose(m, 2, "ssh failed: Timeout") == [0, 1]
    assert said[-1].startswith("disttrain: lost c (ssh failed: Timeout): the other 2 host(s) regroup")
    m.agent_line(0, Beats(host="a", ranks={0: (9, 0.0)}).to_line())  # the old round still beating: not yet
    assert len(said) == 1
    m.agent_line(0, started(1, 2))
    m.agent_line(0, Beats(host="a", ranks={0: (1, 0.0)}).to_line())
    m.poll()
    assert len(said) == 1  # the round trains: its line waits (a few seconds at most) for rank 0's resume line
    m.rank_line("disttrain: resuming from step 12 in /ckpt (epoch 0, after 4 of its steps)")
    m.poll()
    assert said[-1].startswith("disttrain: membership: c left (ssh failed: Timeout) -> 2 hosts, world size 2, "
                               "resumed from step 12, training again ")
    m.close()
    record = json.loads((tmp_path / "membership.json").read_text())
    assert [(c["change"], c["host"], c["world_size"], c["resumed_from"], c["hosts"]) for c in record] == [
        ("start", None, 3, None, ["a", "b", "c"]), ("left", "c", 2, 12, ["a", "b"])]
    assert record[1]["seconds"] >= record[1]["regrouped"] >= 0


def test_agents_are_slots_and_hosts_keep_their_place(tmp_path):
    """Host 1 down at the start: agent slots 0 and 1 run hosts 0 and 2; host 1 joins as slot 2."""
    joins = []

    class Proc:
        pass

    m = Membership(hosts=["a", "b", "c"], running=[0, 2], min_nnodes=2, max_nnodes=3, run_dir=str(tmp_path),
                   join=lambda index: joins.append(index) or Proc(), retry_s=0.05)
    assert m.member_hosts() == ("a", "c") and m.host_of(1) == "c"
    said = []
    m.start(said.append)
    deadline = time.monotonic() + 10
    while not (joined := m.joined()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(joined) == 1 and joins[0] == 1 and m.host_of(2) == "b" and m.member_hosts() == ("a", "c", "b")
    assert lose(m, 1, "gone") == [0, 2]  # c lost: it is tried again, as host 2
    while 2 not in joins[1:] and time.monotonic() < deadline:
        time.sleep(0.05)
    m.close()
    assert 2 in joins[1:]


def test_membership_line_without_disttrain_resume():
    change = Change(time=0, change="joined", host="c", why="it answered the preflight", hosts=("a", "b", "c"),
                    world_size=6, seconds=4.26)
    assert membership_line(change, steps=False) == (
        "disttrain: membership: c joined (it answered the preflight) -> 3 hosts, world size 6, no disttrain.resume() "
        "step said, workers started 4.3 s later (the script reports no steps)")


def test_an_elastic_plan_keeps_its_range_and_each_host_its_place():
    spec = LaunchSpec(entry="train.py", nproc_per_node=2, nnodes=3, min_nnodes=2, rdzv_backend="c10d",
                      master_addr="10.0.0.1", master_port=29500)
    nodes = (NodeFacts(name="a", cpus=2, address="10.0.0.1"), NodeFacts(name="c", cpus=2, address="10.0.0.3"))
    plan = make_plan(spec, nodes, python="/py", master_port=29500, run_id="r", run_dir="/r", inherited_env={},
                     node_ranks=(0, 2))
    assert plan.elastic and not plan.by_hand and plan.nnodes == 3 and plan.min_nnodes == 2
    assert [(n.name, n.node_rank) for n in plan.nodes] == [("a", 0), ("c", 2)]
    assert plan.nodes[1].env["DISTTRAIN_HEARTBEAT_DIR"] == "/r/heartbeat/node2"
    from disttrain.agent.elastic_config import ELASTIC_RDZV_CONF, rdzv_configs

    # the launcher holds the store: no node hosts it, node 0 included
    assert rdzv_configs(plan, plan.nodes[0]) == {"join_timeout": 120, "is_host": False, **ELASTIC_RDZV_CONF}
    assert rdzv_configs(plan, plan.nodes[1])["is_host"] is False
    user = make_plan(spec.__class__(**{**spec.__dict__, "rdzv_conf": {"last_call_timeout": "7"}}), nodes,
                     python="/py", master_port=29500, run_id="r", run_dir="/r", inherited_env={}, node_ranks=(0, 2))
    assert rdzv_configs(user, user.nodes[0])["last_call_timeout"] == "7"  # the user's word wins
    by_hand = make_plan(spec, nodes[0], python="/py", master_port=29500, run_id="r", run_dir="/r", inherited_env={})
    assert by_hand.by_hand and "keep_alive_interval" not in rdzv_configs(by_hand, by_hand.nodes[0])


def test_every_round_has_one_number_on_every_node():
    """Group rank 0 counts the rounds in the store they share; the others read its number."""
    import torch.distributed as dist

    from disttrain.agent.elastic_agent import job_attempt
    from disttrain.net import free_port

    port = free_port("127.0.0.1")
    host = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    other = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    for round_ in range(3):
        prefix = f"torch.rendezvous.job.{round_}"
        assert job_attempt(dist.PrefixStore(prefix, host), 0) == round_
        assert job_attempt(dist.PrefixStore(prefix, other), 1) == round_


def test_torch_builds_its_agent_where_disttrain_replaces_it():
    """disttrain has torch's launch_agent build its agent (elastic_agent.installed): a torch that
    renames what it builds, or the methods overridden, fails here rather than in a user's job."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    assert api.LocalElasticAgent is LocalElasticAgent
    assert "LocalElasticAgent(" in inspect.getsource(api.launch_agent)
    for name in ("_monitor_workers", "_stop_workers", "_rendezvous", "_restart_workers", "_shutdown"):
        assert callable(getattr(LocalElasticAgent, name))


@pytest.fixture(autouse=True)
def field_load():
    """``DISTTRAIN_TEST_HOG=N``: every test here runs beside N busy loops, as on a loaded machine
    (issue 48's field runs; the default run has none)."""
    with cpu_hog(int(os.environ.get("DISTTRAIN_TEST_HOG") or 0)):
        yield


# --------------------------------------------------------------------------- three hosts

cluster3 = cluster_fixture(3, name="cluster3", bridge=True)
slurm3 = slurm_fixture(3, scope="function", name="slurm3")
JOB = ["--samples", "120", "--epochs", "2", "--batch-size", "2", "--every", "4", "--pause", "0.2"]


def start_job(cluster, tmp_path: Path, *extra: str, nnodes: str = "2:3", hosts=None,
              job=JOB, env=None) -> tuple[subprocess.Popen, Path, Path]:
    """The job, launched from node0; on every node of the cluster, or on ``hosts`` (node0 then runs
    only the launcher, as a login host does)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    hosts = ",".join(f"root@{node.ip}" for node in (hosts or cluster.nodes))
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "--nnodes", nnodes, "-n", "1",
            "--log-dir", str(tmp_path / "run"), *cluster.cli_ssh_args(), *extra, str(WORKER), "--out", str(out), "--ckpt", str(ckpt),
            *job]
    proc = cluster.popen_in("node0", argv, cwd=ROOT, env={**bench.worker_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    return proc, out, ckpt


def wait_for(proc: subprocess.Popen, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early (exit {proc.returncode}):\n{proc.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"not ready within {timeout} s:\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.1)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{err[-4000:]}") from None
    return proc.returncode, err


def record_of(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "run" / "membership.json").read_text())


def record_so_far(tmp_path: Path) -> list[dict]:
    """The record while the job runs: [] before its first write."""
    try:
        return record_of(tmp_path)
    except (OSError, ValueError):
        return []


@pytest.mark.timeout(400)
def test_a_host_that_loses_power_is_left_behind_and_every_sample_is_trained_once(cluster3, tmp_path):
    proc, out, ckpt = start_job(cluster3, tmp_path)
    wait_for(proc, lambda: bench.complete_checkpoints(ckpt) and bench.step_of(out) >= 6, timeout=240)
    cluster3.power_off("node2")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    lost = cluster3.nodes[2].ip
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith(f"disttrain: membership: {lost} left (ssh failed: ") and "-> 2 hosts, world size 2, " \
        "resumed from step " in line and " s later" in line, line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][0]["world_size"] == 3 and accounting["attempts"][-1]["world_size"] == 2
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"] == 0, accounting
    assert accounting["epochs"] == [0, 1]
    record = record_of(tmp_path)
    assert [(c["change"], c["host"], len(c["hosts"]), c["world_size"], c["path"]) for c in record] == [
        ("start", None, 3, 3, None), ("left", lost, 2, 2, "in place")]
    assert record[1]["resumed_from"] == accounting["attempts"][-1]["first_step"]
    # in place: the survivors' workers are the processes they were, and no step was done again
    assert "regrouped in place" in line and accounting["redone_steps"] == 0, accounting
    starts = {(a, r): json.loads((out / f"attempt{a}_rank{r}.start").read_text()) for a, r in
              ((0, 0), (0, 1), (record[1]["attempt"], 0), (record[1]["attempt"], 1))}
    assert [starts[record[1]["attempt"], r]["pid"] for r in (0, 1)] == [starts[0, r]["pid"] for r in (0, 1)]
    cluster3.assert_nothing_left()


@pytest.mark.timeout(400)
def test_a_host_down_at_the_start_joins_when_it_comes_back(cluster3, tmp_path):
    # Twice the others' samples: at a load of 8-12 the host's boot, preflight and torch import took
    # 25 s, longer than 120 samples' training -- the job ended before the round with it trained.
    # main() is @disttrain.elastic's here: the survivors call it again (the loss above runs the script again).
    cluster3.power_off("node2")
    proc, out, ckpt = start_job(cluster3, tmp_path, job=[*JOB[:1], "240", *JOB[2:], "--entry"])
    wait_for(proc, lambda: bench.step_of(out) >= 4, timeout=240)
    cluster3.power_on("node2")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    back = cluster3.nodes[2].ip
    assert f"disttrain: note: {back} does not start ({back}: ssh failed: " in err
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith(f"disttrain: membership: {back} joined (it answered the preflight) -> 3 hosts, "
                           "world size 3, resumed from step "), line
    accounting = bench.account(out, 240)
    assert accounting["attempts"][0]["world_size"] == 2 and accounting["attempts"][-1]["world_size"] == 3
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["redone_steps"] == 0, accounting
    record = record_of(tmp_path)
    assert [(c["change"], c["path"]) for c in record] == [("start", None), ("joined", "in place")], record
    assert "regrouped in place" in line, line
    # the two hosts that ran on are the processes they were; the new one took the state from them
    first, last = accounting["attempts"][0]["attempt"], record[1]["attempt"]
    starts = {(a, r): json.loads((out / f"attempt{a}_rank{r}.start").read_text()) for a, r in
              ((first, 0), (first, 1), (last, 0), (last, 1), (last, 2))}
    for r in (0, 1):
        after, before = starts[last, r], starts[first, r]
        assert (after["pid"], after["started"], after["calls"]) == (before["pid"], before["started"], 2)
    assert starts[last, 2]["resumed_from"] == record[1]["resumed_from"] and starts[last, 2]["calls"] == 1
    cluster3.assert_nothing_left()


@pytest.mark.timeout(400)
def test_a_plain_torchrun_script_restarts_the_same_way(cluster3, tmp_path):
    """No disttrain in the script: env://, its own checkpoint. The lost host's peers restart it on the
    new world, and it goes on from its own checkpoint; the line says no disttrain.resume() step."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt.pt"
    out.mkdir()
    hosts = ",".join(f"root@{node.ip}" for node in cluster3.nodes)
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "--nnodes", "2:3", "-n", "1",
            "--log-dir", str(tmp_path / "run"), *cluster3.cli_ssh_args(),
            str(ROOT / "tests" / "scripts" / "plain_elastic.py"), str(out), str(ckpt), "40"]
    proc = cluster3.popen_in("node0", argv, cwd=ROOT, env=bench.worker_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    wait_for(proc, lambda: ckpt.exists(), timeout=240)
    cluster3.power_off("node2")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("disttrain: membership:")]
    assert lines, err[-4000:]
    assert f"{cluster3.nodes[2].ip} left" in lines[0], lines
    assert "-> 2 hosts, world size 2, no disttrain.resume() step said, restarted (its workers on " in lines[0] \
        and "are not armed (no disttrain.resume() yet, or a script without it))" in lines[0], lines
    assert record_of(tmp_path)[1]["path"] == "restart"
    assert (out / "done").read_text() == "2\n"
    rows = [tuple(map(int, ln.split())) for ln in (out / "rank0.log").read_text().splitlines()]
    worlds = [world for _, world, _, _ in rows]
    assert worlds[0] == 3 and worlds[-1] == 2 and sorted({step for *_, step in rows}) == list(range(40))
    cluster3.assert_nothing_left()


cluster4 = cluster_fixture(4, name="cluster4", bridge=True)


def agent_of(cluster, node) -> int:
    """The pid of the disttrain agent on ``node`` (its python process whose parent is not one)."""
    import psutil

    for pid in cluster.processes_in(node):
        try:
            proc = psutil.Process(pid)
            if "run_module('disttrain'" in " ".join(proc.cmdline()) and "python" not in proc.parent().name():
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no agent on {node}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loss", ["power_off", "agent_killed"])
def test_the_first_host_lost_is_a_loss_like_any_other(cluster4, tmp_path, loss):
    """node0 runs only the launcher, which holds the rendezvous store; the first host, once the
    store's, goes (powered off, or its agent SIGKILLed): the other two go on, no sample lost."""
    import os
    import signal

    hosts = cluster4.nodes[1:]
    proc, out, ckpt = start_job(cluster4, tmp_path, hosts=hosts)
    wait_for(proc, lambda: bench.complete_checkpoints(ckpt) and bench.step_of(out) >= 6, timeout=240)
    if loss == "power_off":
        cluster4.power_off(hosts[0])
    else:
        os.kill(agent_of(cluster4, hosts[0]), signal.SIGKILL)
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    why = "ssh failed: " if loss == "power_off" else "its agent was killed by a signal: ssh exit 255 with its connection up"
    assert line.startswith(f"disttrain: membership: {hosts[0].ip} left ({why}"), line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][0]["world_size"] == 3
    # none lost; trained twice only the consumed % W a part-way epoch on a new world size repeats
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    record = record_of(tmp_path)
    assert [(c["change"], c["host"], len(c["hosts"]), c["path"]) for c in record[:2]] == [
        ("start", None, 3, None), ("left", hosts[0].ip, 2, "in place")]
    # the counts agree: each round's world is its hosts (one worker each); the last is the last round's
    worlds = [(c["world_size"], len(c["hosts"])) for c in record if c["world_size"] is not None]
    assert all(world == count for world, count in worlds) and worlds[-1][0] == accounting["attempts"][-1]["world_size"]
    if loss == "power_off":  # it stays down: the job ends on the other two
        assert len(record) == 2 and record[1]["world_size"] == 2
    else:  # its host still answers: it is admitted again, if the job still runs once its backoff is over
        assert all(c["change"] == "joined" and c["host"] == hosts[0].ip for c in record[2:]), record
    print(f"recovery ({loss}): {record[1]['seconds']} s (noticed {record[1]['noticed']} s, "
          f"regrouped {record[1]['regrouped']} s); {line}")
    cluster4.assert_nothing_left()


@pytest.mark.timeout(300)
def test_below_min_the_job_stops_naming_the_hosts_lost(cluster3, tmp_path):
    proc, out, ckpt = start_job(cluster3, tmp_path)
    wait_for(proc, lambda: bench.step_of(out) >= 2, timeout=240)
    cluster3.power_off("node1")
    cluster3.power_off("node2")
    code, err = finish(proc, timeout=120)
    assert code == 255, err[-4000:]
    first, second = cluster3.nodes[1].ip, cluster3.nodes[2].ip
    block = err[err.index("disttrain: 1 host(s) left, below the minimum of --nnodes 2:3: stopped the job"):]
    assert f"{first}: ssh failed: " in block and f"{second}: ssh failed: " in block
    assert f"still running: {cluster3.nodes[0].ip}" in block
    assert "disttrain: membership:" not in err and "lost the ssh connection to" not in err  # said once, above
    cluster3.assert_nothing_left()


@pytest.mark.timeout(500)
def test_a_slurm_node_that_loses_power_is_left_behind(slurm3, tmp_path):
    """``--launcher slurm --nnodes 2:3``: sbatch --nodes=2-3 --no-kill; the node cut off is noticed by its
    agent's silence (srun says nothing), the allocation goes on with the other two."""
    out, ckpt, run = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    argv = [sys.executable, "-m", "disttrain", "run", "--launcher", "slurm", "--nnodes", "2:3", "-n", "1",
            "--log-dir", str(run), str(WORKER), "--out", str(out), "--ckpt", str(ckpt), *JOB]
    proc = slurm3.popen_in("node0", argv, cwd=ROOT, env=slurm3.env(PYTHONPATH=bench.worker_env()["PYTHONPATH"]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    wait_for(proc, lambda: bench.complete_checkpoints(ckpt) and bench.step_of(out) >= 6, timeout=300)
    assert "#SBATCH --nodes=2-3\n#SBATCH --no-kill\n" in (run / "job.sbatch").read_text()
    slurm3.rig.power_off("node2")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith("disttrain: membership: node2 left (its agent said nothing for 5 s) -> 2 hosts, "
                           "world size 2, resumed from step "), line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][0]["world_size"] == 3 and accounting["attempts"][-1]["world_size"] == 2
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"] == 0, accounting
    assert [c["change"] for c in record_of(tmp_path)] == ["start", "left"]
    _nothing_of_the_job_left(slurm3)


slurm4 = slurm_fixture(4, scope="function", name="slurm4")


@pytest.mark.timeout(500)
def test_the_allocations_first_node_lost_under_salloc_is_a_loss_like_any_other(slurm4, tmp_path):
    """``salloc --no-kill`` on a login host (node0, outside the allocation): the launcher runs there and
    holds the store; the allocation's first node (node1, once the store's host) is powered off: the
    other two go on, no sample lost. (Under sbatch the launcher is the batch step, on the first node:
    its loss is the launcher's -- Slurm's batch host -- and ends the job, as any launcher's does.)"""
    out, ckpt, run = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    argv = ["salloc", "--nodes=3", "--exclude=node0", "--no-kill", sys.executable, "-m", "disttrain", "run",
            "--nnodes", "2:3", "-n", "1", "--log-dir", str(run), str(WORKER), "--out", str(out), "--ckpt", str(ckpt),
            *JOB]
    proc = slurm4.popen_in("node0", argv, cwd=ROOT, env=slurm4.env(PYTHONPATH=bench.worker_env()["PYTHONPATH"]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    wait_for(proc, lambda: bench.complete_checkpoints(ckpt) and bench.step_of(out) >= 6, timeout=300)
    slurm4.rig.power_off("node1")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith("disttrain: membership: node1 left (") and "-> 2 hosts, world size 2, resumed from step " \
        in line, line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][0]["world_size"] == 3 and accounting["attempts"][-1]["world_size"] == 2
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert [c["change"] for c in record_of(tmp_path)] == ["start", "left"]
    print(f"recovery (the allocation's first node): {record_of(tmp_path)[1]['seconds']} s; {line}")
    _nothing_of_the_job_left(slurm4)


def _nothing_of_the_job_left(slurm) -> None:
    """Slurm's daemons stay on its nodes; within 20 s no process of the job does."""
    deadline = time.monotonic() + 20
    while True:
        left = [_cmdline(pid) for node in slurm.rig.nodes for pid in slurm.rig.processes_in(node)
                if "disttrain" in _cmdline(pid) or "elastic_train" in _cmdline(pid)]
        if not left:
            return
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------- a job's instances


@pytest.mark.timeout(400)
def test_a_job_goes_on_without_an_instance_whose_agent_is_killed(tmp_path):
    """A SageMaker-style job, ``instance_count: "2:3"``: one instance's agent SIGKILLed (its worker dies
    with it, the others' collectives fail at once) -- the job completes on two, its record says so."""
    import signal

    import psutil
    import yaml

    from conftest import cli_env

    out = tmp_path / "out"
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"),
                  PYTHONPATH=bench.worker_env()["PYTHONPATH"])
    hps = dict(zip(JOB[::2], JOB[1::2]))
    spec = {"name": "elastic", "entry_point": WORKER.name, "source_dir": str(WORKER.parent), "instance_count": "2:3",
            "processes_per_instance": 1, "hyperparameters": {"out": str(out), **{k[2:]: v for k, v in hps.items()}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "job", "run", str(tmp_path / "job.yaml")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

    def third_instance_agent() -> psutil.Process | None:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if p.environ().get("SM_CURRENT_HOST") == "algo-3" and p.parent().name().startswith("python"):
                    return p.parent()  # the worker's agent
            except psutil.Error:
                continue
        return None

    ckpts = tmp_path / "home" / "jobs"
    wait_for(proc, lambda: list(ckpts.glob("*/checkpoints/step_*/COMPLETE")) and bench.step_of(out) >= 6
             and third_instance_agent() is not None, timeout=240)
    third_instance_agent().send_signal(signal.SIGKILL)
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("disttrain: membership:"))
    assert line.startswith("disttrain: membership: algo-3 left (its agent was killed by SIGKILL) -> 2 hosts, "
                           "world size 2, resumed from step "), line
    accounting = bench.account(out, 120)
    assert accounting["attempts"][-1]["world_size"] == 2
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"] == 0, accounting
    record = json.loads(subprocess.run([sys.executable, "-m", "disttrain", "jobs", "show", "1", "--json"], env=env,
                                       capture_output=True, text=True, timeout=60).stdout)
    assert record["state"] == "Completed"
    assert [(c["change"], c["host"], c["world_size"]) for c in record["membership"]] == [
        ("start", None, 3), ("left", "algo-3", 2)]
    shown = subprocess.run([sys.executable, "-m", "disttrain", "jobs", "show", "1"], env=env, capture_output=True,
                           text=True, timeout=60).stdout
    assert "membership:" in shown and "algo-3 left (its agent was killed by SIGKILL): 2 instance(s)" in shown
    assert not [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("SM_CURRENT_HOST")
                and str(tmp_path) in (p.info["environ"] or {}).get("SM_MODEL_DIR", "")]


def test_a_job_spec_takes_the_range_as_instance_count_or_a_minimum(tmp_path):
    from disttrain.errors import UsageError
    from disttrain.jobs.spec import spec_from_mapping

    def spec(**fields):
        return spec_from_mapping({"name": "j", "entry_point": "train.py", "source_dir": str(tmp_path), **fields},
                                 base_dir=tmp_path, source="job.yaml")

    assert (spec(instance_count="2:3").placement.min_instance_count, spec(instance_count="2:3").placement.instance_count) \
        == (2, 3)
    assert spec(instance_count=3, min_instance_count=2).placement.min_instance_count == 2
    for fields, words in (({"instance_count": "2:x"}, "MIN:MAX like '2:3'"),
                          ({"instance_count": 2, "min_instance_count": 3}, "min_instance_count 3 is more than"),
                          ({"instance_count": "2:3", "min_instance_count": 2}, "leave out min_instance_count"),
                          ({"instance_count": "2:3", "distribution": {"parameter_server": {"enabled": True}},
                            "framework": "tensorflow"}, "needs every instance")):
        with pytest.raises(UsageError, match=words):
            spec(**fields)


@pytest.mark.timeout(500)
def test_a_flapping_host_leaves_and_joins_again_twice_and_every_sample_is_trained_once(cluster3, tmp_path):
    """node2 loses power, comes back, loses it again and comes back again, while the job trains (each
    time once the round with it trained: a loss while its join is pending is said with that join)."""
    # 900 samples: with 600 the job ended before the first return, once in 3 runs beside another lane
    # (each return waits out a backoff of 10 s, then 20 s, and a Python and torch start on node2).
    proc, out, ckpt = start_job(cluster3, tmp_path, job=[*JOB[:1], "900", *JOB[2:]])
    flapping = cluster3.nodes[2].ip
    wait_for(proc, lambda: bench.step_of(out) >= 6, timeout=240)
    for cycle in range(2):
        cluster3.power_off("node2")
        left = 1 + 2 * cycle
        wait_for(proc, lambda n=left: len(record_so_far(tmp_path)) > n, timeout=120)
        cluster3.power_on("node2")
        wait_for(proc, lambda n=left + 1: len(record_so_far(tmp_path)) > n and record_so_far(tmp_path)[n]["world_size"] == 3,
                 timeout=180)
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    record = record_so_far(tmp_path)
    assert [(c["change"], c["host"], c["world_size"]) for c in record] == [
        ("start", None, 3), ("left", flapping, 2), ("joined", flapping, 3), ("left", flapping, 2),
        ("joined", flapping, 3)], record
    accounting = bench.account(out, 900)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert [a["world_size"] for a in accounting["attempts"]][-1] == 3
    cluster3.assert_nothing_left()


@pytest.mark.timeout(500)
def test_a_host_lost_while_it_joins_leaves_the_others_training(cluster3, tmp_path):
    """node2, down at the start, comes back; the moment it is let in (its join recorded, its round not
    trained yet) it loses power again. The others go on; nothing is trained twice or lost."""
    cluster3.power_off("node2")
    proc, out, ckpt = start_job(cluster3, tmp_path, job=[*JOB[:1], "360", *JOB[2:]])
    wait_for(proc, lambda: bench.step_of(out) >= 4, timeout=240)
    cluster3.power_on("node2")
    wait_for(proc, lambda: any(c["change"] == "joined" for c in record_so_far(tmp_path)), timeout=180)
    cluster3.power_off("node2")
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    record = record_so_far(tmp_path)
    back = cluster3.nodes[2].ip
    assert [(c["change"], c["host"]) for c in record] == [("start", None), ("joined", back), ("left", back)], record
    assert record[-1]["world_size"] == 2 and record[-1]["hosts"] == [n.ip for n in cluster3.nodes[:2]], record
    if record[1]["world_size"] is None:  # lost before its round trained (as it was in every run seen)
        assert (record[1]["path"], record[1]["path_why"]) == (
            None, f"{back} left before a round trained with this change"), record
    accounting = bench.account(out, 360)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["attempts"][-1]["world_size"] == 2
    cluster3.assert_nothing_left()


def worker_of(cluster, node) -> int:
    """The pid of the training worker on ``node``: the process running the script (its agent's
    command line names the script too)."""
    import psutil

    for pid in cluster.processes_in(node):
        try:
            if str(WORKER) in psutil.Process(pid).cmdline()[1:3]:
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker on {node}")


@pytest.mark.timeout(500)
def test_a_stopped_worker_takes_its_host_out_and_a_stopped_agent_does_not_hold_the_end(cluster3, tmp_path):
    """SIGSTOP of node2's worker: its agent lives and beats, its rank neither steps nor ends, and every
    other rank waits in a collective for it. The host leaves (its rank named), the two others go on in
    place; the host is tried again and joins. Then node2's new agent is SIGSTOPped: its worker trains on
    to the end with the others, whose nodes end without waiting for it (torch's exit barrier would
    have held them until the launcher, the silence limit on, took the end for a regroup that never
    formed). The training left (about 30 s) outlasts the silence limit (10 s here): the host is not
    lost while its round steps (it was, under load, and tried again while its worker trained).
    Nothing is trained twice or lost, and the job ends 0; the stopped agent, continued, ends too."""
    proc, out, ckpt = start_job(cluster3, tmp_path, job=[*JOB[:1], "720", *JOB[2:]], env={"DISTTRAIN_SLOW_S": "10"})
    wait_for(proc, lambda: bench.step_of(out) >= 6, timeout=240)
    os.kill(worker_of(cluster3, "node2"), signal.SIGSTOP)
    stopped = cluster3.nodes[2].ip
    wait_for(proc, lambda: len(record_so_far(tmp_path)) > 2 and record_so_far(tmp_path)[2]["world_size"] == 3,
             timeout=240)
    agent = agent_of(cluster3, "node2")
    os.kill(agent, signal.SIGSTOP)
    code, err = finish(proc, timeout=300)
    os.kill(agent, signal.SIGCONT)  # its connection is gone: once it runs, it ends by itself
    assert code == 0, err[-4000:]
    record = record_so_far(tmp_path)
    assert [(c["change"], c["host"], c["world_size"], c["path"]) for c in record] == [
        ("start", None, 3, None), ("left", stopped, 2, "in place"), ("joined", stopped, 3, "in place"),
        ("left", stopped, None, None)], (record, err[-4000:])
    assert record[1]["why"].startswith("its rank 2 stopped by a signal (SIGSTOP) for "), record[1]
    assert record[3]["why"] == "its agent said nothing for 10 s, its connection up (stuck)", record[3]
    assert f"disttrain: {stopped}: no word from its agent for " in err and "its round steps, so its ranks do" in err, \
        err[-4000:]
    accounting = bench.account(out, 720)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    cluster3.assert_nothing_left()


@pytest.mark.timeout(500)
def test_a_second_loss_during_a_regroup_is_one_more_round_in_place(cluster4, tmp_path):
    """node3 loses power while node2's worker is stopped: the regroup without node3 cannot form (node2's
    worker never comes), and node2 is taken out 10 s later. node0's and node1's workers, waiting in the
    forming group, leave it for the newer round and go on in place: the same processes, nothing lost."""
    proc, out, ckpt = start_job(cluster4, tmp_path, "--env", "DISTTRAIN_REGROUP_JOIN_S=60", nnodes="2:4",
                                job=[*JOB[:1], "240", *JOB[2:]])
    wait_for(proc, lambda: bench.step_of(out) >= 6, timeout=240)
    stopped = worker_of(cluster4, "node2")
    os.kill(stopped, signal.SIGSTOP)
    cluster4.power_off("node3")
    code, err = finish(proc, timeout=300)
    with contextlib.suppress(ProcessLookupError):  # its agent, told its host was lost, kills it
        os.kill(stopped, signal.SIGKILL)
    assert code == 0, err[-4000:]
    assert "did not form" not in err, err[-4000:]
    record = record_so_far(tmp_path)
    print("second loss:", *record, sep="\n")
    lost = [cluster4.nodes[3].ip, cluster4.nodes[2].ip]
    assert [(c["change"], c["host"]) for c in record[1:3]] == [("left", lost[0]), ("left", lost[1])], record
    assert (record[2]["world_size"], record[2]["path"]) == (2, "in place"), record
    # node2's agent still answers: it may be let in again, in place, if the job still runs
    assert all((c["change"], c["host"], c["path"]) == ("joined", lost[1], "in place") for c in record[3:]), record
    accounting = bench.account(out, 240)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["redone_steps"] == 0 and accounting["attempts"][1]["world_size"] == 2, accounting
    for attempt in accounting["attempts"]:  # node0's and node1's workers: the processes they were
        pids = [json.loads((out / f"attempt{attempt['attempt']}_rank{r}.start").read_text())["pid"] for r in (0, 1)]
        assert pids == [json.loads((out / f"attempt0_rank{r}.start").read_text())["pid"] for r in (0, 1)], attempt
    cluster4.assert_nothing_left()


cluster5 = cluster_fixture(5, name="cluster5", bridge=True)


def partition(cluster, side) -> None:
    """The hosts of ``side`` reach each other and nobody else, the launcher's node0 included: their
    traffic with every other node is dropped both ways (no FIN, no RST), as when a switch splits."""
    others = [node.ip for node in cluster.nodes if node not in side]
    for node in side:
        for ip in others:
            for rule in (["INPUT", "1", "-s", ip], ["OUTPUT", "1", "-d", ip]):
                subprocess.run(cluster.ns_exec(node, ["iptables", "-w", "-I", *rule, "-j", "DROP"]), check=True)


@pytest.mark.timeout(500)
def test_a_2_2_partition_leaves_one_side_training_and_nothing_trained_twice(cluster5, tmp_path):
    """4 hosts (node0 runs only the launcher) split 2|2, the launcher on the side of node1 and node2:
    the other side loses the launcher and stops on its own; the launcher's side goes on in place as a
    world of 2. At most one side trains: every sample once, none lost."""
    hosts = cluster5.nodes[1:]
    proc, out, ckpt = start_job(cluster5, tmp_path, nnodes="2:4", hosts=hosts, job=[*JOB[:1], "240", *JOB[2:]])
    wait_for(proc, lambda: bench.step_of(out) >= 6, timeout=240)
    partition(cluster5, hosts[2:])
    code, err = finish(proc, timeout=300)
    assert code == 0, err[-4000:]
    record = record_so_far(tmp_path)
    away = {node.ip for node in hosts[2:]}
    assert record[0]["world_size"] == 4 and {c["host"] for c in record[1:]} == away, record
    assert [c["change"] for c in record[1:]] == ["left", "left"] and record[-1]["world_size"] == 2, record
    assert record[-1]["path"] == "in place" and record[-1]["hosts"] == [n.ip for n in hosts[:2]], record
    accounting = bench.account(out, 240)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["attempts"][-1]["world_size"] == 2
    cluster5.assert_nothing_left(timeout=60, cut_off=hosts[2:])  # the far side's agents stop by themselves
