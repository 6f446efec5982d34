"""Regroup in place (disttrain.runtime.regroup), on one machine: three worker processes of
tests/scripts/elastic_train.py talk gloo over loopback; the test plays their agents and launcher
(the store they meet on, the new membership sent on each worker's socket) and takes one away --
SIGKILLed (its connections reset) or SIGSTOPped (silent, as a host that lost power). The survivors
must go on as the same processes, with every sample trained once and no step done again.

The launcher's and the agents' parts are tested on real hosts in tests/test_elastic_ssh.py and tests/test_elastic_slurm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import elastic_bench
from disttrain import torchcompat
from disttrain.inplace import FALLBACK_EXIT, Plan, socket_path
from disttrain.net import free_port
from disttrain.runtime import groupsockets, regroup
from disttrain.wire import InPlace
from disttrain.workerenv import PG_TIMEOUT

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "elastic_train.py"
bench = elastic_bench()


# Rank 2's pause after each logged step, in which lose_rank2 takes it out: every job has it, so that
# no test can lose rank 2 in a shorter one.
PAUSED_RANK2 = {2: ("--pause", "0.4")}


class Workers:
    """Three single-process 'hosts' of one job, on a store this test holds (the launcher's)."""

    def __init__(self, tmp: Path, *, samples: int = 120, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), world: int = 3, ckpt: Path | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.out = tmp / "out"
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.folders = [tempfile.mkdtemp(prefix="dtrg-") for _ in range(world)]
        self.procs = []
        for rank in range(world):
            worker_env = {**bench.worker_env(), **(env or {}), **self.world_env(rank, world, attempt=0),
                          "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "DISTTRAIN_REGROUP_SOCKETS": self.folders[rank]}
            self.procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--out", str(self.out), "--ckpt", str(ckpt or tmp / "ckpt"),
                 "--samples", str(samples), "--epochs", "2", "--batch-size", "2", "--every", "4", "--pause", "0.05", *args,
                 *PAUSED_RANK2.get(rank, ())],
                env=worker_env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"rank{rank}.err", "w")))
        self.errs = [tmp / f"rank{rank}.err" for rank in range(world)]

    def world_env(self, rank: int, world: int, *, attempt: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": str(world),
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "DISTTRAIN_ATTEMPT": str(attempt),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while bench.step_of(self.out) < step:
            assert all(p.poll() is None for p in self.procs), self.stderr()
            assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
            time.sleep(0.05)

    def last_step_of(self, rank: int) -> int:
        """The last step ``rank`` logged in the first attempt (-1: none yet)."""
        lines = (self.out / f"attempt0_rank{rank}.jsonl").read_text().splitlines() if self.out.is_dir() else []
        for line in reversed(lines):
            try:
                return json.loads(line)["step"]
            except (ValueError, OSError):
                continue
        return -1

    def signal_after_a_step(self, rank: int, how: signal.Signals, timeout: float = 60) -> int:
        """``how`` to ``rank`` as soon as it logs a new step (it then sleeps ``--pause``); that step."""
        before, deadline = self.last_step_of(rank), time.monotonic() + timeout
        while (step := self.last_step_of(rank)) == before:
            assert time.monotonic() < deadline, f"rank {rank} logged no step within {timeout} s"
            time.sleep(0.005)
        os.kill(self.procs[rank].pid, how)
        return step

    def tell(self, rank: int, new_rank: int, world: int, attempt: int) -> None:
        plan = Plan(attempt=attempt, env=self.world_env(new_rank, world, attempt=attempt))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(plan.to_bytes(), socket_path(self.folders[rank], 0))

    def lose_rank2(self, after_step: int, how: signal.Signals) -> list[int]:
        """Rank 2 gone (``how``) in its pause after a step it logged, once ``after_step`` ran; ranks 0
        and 1 told to go on as a world of 2; their exit codes. Not at any moment: a rank lost between
        its step's all-reduce and its log line trained samples that no log shows (under the suite's
        load, 2 samples "missing" once). Its pause must outlast the test's look at its log
        (:data:`PAUSED_RANK2`)."""
        try:
            self.wait_for_step(after_step)
            self.signal_after_a_step(2, how)
            for rank in (0, 1):
                self.tell(rank, rank, 2, attempt=1)
            return self.finish((0, 1))
        finally:
            self.stop()

    def finish(self, ranks, timeout: float = 120) -> list[int]:
        try:
            return [self.procs[r].wait(timeout=timeout) for r in ranks]
        finally:
            self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for folder in self.folders:  # the ranks' regroup sockets (an agent's would go with the agent)
            shutil.rmtree(folder, ignore_errors=True)

    def stderr(self) -> str:
        return "\n".join(err.read_text()[-3000:] for err in self.errs)

    def start_of(self, attempt: int, rank: int) -> dict:
        return json.loads((self.out / f"attempt{attempt}_rank{rank}.start").read_text())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loss", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "silent"])
def test_the_survivors_go_on_in_place_as_the_same_processes(tmp_path, loss):
    workers = Workers(tmp_path)
    assert workers.lose_rank2(8, loss) == [0, 0], workers.stderr()
    accounting = bench.account(workers.out, 120)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["redone_steps"] == 0 and accounting["epochs"] == [0, 1], accounting
    assert [a["world_size"] for a in accounting["attempts"]] == [3, 2]
    for rank in (0, 1):
        before, after = workers.start_of(0, rank), workers.start_of(1, rank)
        assert after["pid"] == before["pid"] and after["world_size"] == 2
        assert after["started"] > before["started"]  # the fallback: the script from its top
        assert after["resumed_from"] == accounting["attempts"][1]["first_step"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loop", [(), ("--trainer",)], ids=["resume", "trainer"])
def test_a_decorated_main_is_entered_again_and_the_script_is_not_run_again(tmp_path, loop):
    """@disttrain.elastic: the same processes call main() a second time in the new world; the
    module's top (its imports, its start time) does not run again, and nothing is trained twice.
    A Trainer inside it takes the regroup in its own fit(): main() is not called again."""
    workers = Workers(tmp_path, args=("--entry", *loop))
    assert workers.lose_rank2(8, signal.SIGKILL) == [0, 0], workers.stderr()
    accounting = bench.account(workers.out, 120)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["redone_steps"] <= (1 if loop else 0), accounting
    assert [a["world_size"] for a in accounting["attempts"]] == [3, 2]
    for rank in (0, 1):
        before, after = workers.start_of(0, rank), workers.start_of(1, rank)
        assert (after["pid"], after["started"], after["calls"]) == (before["pid"], before["started"], 1 if loop else 2)
    assert "Traceback" not in workers.stderr()


@pytest.mark.timeout(240)
def test_the_trainer_goes_on_in_place_inside_its_own_fit(tmp_path):
    """disttrain.Trainer without a decorated main(): fit() is the re-entry point. The same processes go
    on in the same fit() call (the script is not run again); the step in flight (its loss logged
    before the cut) is the only one done again."""
    workers = Workers(tmp_path, args=("--trainer",))
    assert workers.lose_rank2(8, signal.SIGSTOP) == [0, 0], workers.stderr()
    assert "regrouped in place: 3 -> 2 ranks" in workers.stderr()
    assert "Traceback" not in workers.stderr()
    accounting = bench.account(workers.out, 120)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["redone_steps"] <= 1 and [a["world_size"] for a in accounting["attempts"]] == [3, 2]
    for rank in (0, 1):
        before, after = workers.start_of(0, rank), workers.start_of(1, rank)
        assert (after["pid"], after["started"], after["calls"]) == (before["pid"], before["started"], 1)
        assert after["world_size"] == 2 and after["resumed_from"] is not None


@pytest.mark.timeout(300)
def test_in_place_ends_with_the_weights_of_a_restart_from_the_same_step(tmp_path):
    """The survivors go on from memory; the same step saved, and resumed by two fresh ranks from disk,
    ends with the same bits: nothing of the state is lost or changed by staying in place."""
    workers = Workers(tmp_path / "in_place", args=("--final", str(tmp_path / "in_place.pt")))
    assert workers.lose_rank2(8, signal.SIGSTOP) == [0, 0], workers.stderr()
    step = workers.start_of(1, 0)["resumed_from"]
    ckpt = tmp_path / "ckpt"
    for world, args in ((3, ("--stop-after", str(step))), (2, ("--final", str(tmp_path / "restart.pt")))):
        run = Workers(tmp_path / f"restart{world}", world=world, ckpt=ckpt, args=args)
        assert run.finish(range(world)) == [0] * world, run.stderr()
    in_place, restart = torch.load(tmp_path / "in_place.pt"), torch.load(tmp_path / "restart.pt")
    assert in_place.keys() == restart.keys()
    assert all(torch.equal(in_place[k], restart[k]) for k in in_place), (step, in_place, restart)


@pytest.mark.timeout(240)
def test_a_new_group_that_does_not_form_falls_back_to_the_restart(tmp_path):
    """Only rank 0 is told (rank 1 is lost too, meanwhile): its group never forms; it says so in one
    line naming the store and exits with the code its agent answers with the restart."""
    workers = Workers(tmp_path, env={"DISTTRAIN_REGROUP_JOIN_S": "3"})
    try:
        workers.wait_for_step(6)
        for rank in (1, 2):
            os.kill(workers.procs[rank].pid, signal.SIGKILL)
        workers.tell(0, 0, 2, attempt=1)
        code = workers.procs[0].wait(timeout=60)
        err = workers.errs[0].read_text()
    finally:
        workers.stop()
    assert code == FALLBACK_EXIT, err[-3000:]
    assert f"disttrain: rank 0: the in-place regroup (round 1) did not form (not every member came within 3 s; store " \
        f"127.0.0.1:{workers.store.port}): restarting from the newest checkpoint" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.timeout(240)
def test_a_second_loss_while_the_new_group_forms_is_a_newer_round_joined_in_place(tmp_path):
    """Rank 3 lost; of the three told to go on, rank 2 is lost too before it joins. Ranks 0 and 1, waiting
    for it in the forming group, are told again (a world of 2): they leave that group and join the
    newer one, in place -- not after the join's timeout, and not by a restart."""
    workers = Workers(tmp_path, world=4, samples=96, args=("--pause", "0.3"))
    try:
        workers.wait_for_step(4)
        # Each taken while it sleeps after a step it logged (the others then wait for rank 2 in the
        # next step's all-reduce): none has a step trained and not logged, which the count would miss.
        step = workers.signal_after_a_step(2, signal.SIGSTOP)  # lost before it acts on its word
        deadline = time.monotonic() + 60
        while workers.last_step_of(3) < step and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(workers.procs[3].pid, signal.SIGKILL)
        for rank in (0, 1, 2):
            workers.tell(rank, rank, 3, attempt=1)
        time.sleep(1)  # ranks 0 and 1 wait for rank 2 in the forming group
        for rank in (0, 1):
            workers.tell(rank, rank, 2, attempt=2)
        assert workers.finish((0, 1), timeout=60) == [0, 0], workers.stderr()
    finally:
        workers.stop()
    accounting = bench.account(workers.out, 96)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["redone_steps"] == 0 and [a["world_size"] for a in accounting["attempts"]] == [4, 2]
    assert [workers.start_of(2, r)["pid"] for r in (0, 1)] == [workers.start_of(0, r)["pid"] for r in (0, 1)]
    assert "did not form" not in workers.stderr() and "Traceback" not in workers.stderr()


@pytest.mark.timeout(60)
def test_a_newer_word_before_the_forming_group_connects_still_ends_its_wait(monkeypatch):
    """The CI's failure of the test above: ranks 0 and 1, told the newer round just before their forming
    group's store connection existed, found nothing to cut; that group waited for the lost rank 2 until
    the join's limit, and both restarted. The word comes here at that moment exactly."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port), "WORLD_SIZE": "2"}
    for name, value in {**world, "RANK": "0", "DISTTRAIN_ATTEMPT": "0"}.items():
        monkeypatch.setenv(name, value)  # the join sets them: undone after the test
    monkeypatch.setenv("DISTTRAIN_REGROUP_JOIN_S", "10")
    monkeypatch.setenv(PG_TIMEOUT, "15")  # gloo's own wait for the lost member, when nothing cuts it
    armed = regroup._Armed(sock=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), path="")
    monkeypatch.setattr(regroup, "_armed", armed)
    fell_back = []
    monkeypatch.setattr(regroup, "_fall_back", lambda plan, why: fell_back.append(why))
    store = dist.TCPStore

    def word_then_store(*args, **kwargs):
        with armed.lock:  # as the listener takes a word
            armed.plan = Plan(attempt=2, env={**world, "RANK": "0", "WORLD_SIZE": "1", "DISTTRAIN_ATTEMPT": "2"})
            armed.arrived.set()
            groupsockets.cut()
        return store(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", word_then_store)
    try:
        joined = regroup._join(Plan(attempt=1, env={**world, "RANK": "0", "DISTTRAIN_ATTEMPT": "1"}), "gloo")
    finally:
        torchcompat.abandon_process_groups()
        armed.sock.close()
    assert joined is False and fell_back == []


@pytest.mark.timeout(240)
def test_a_sharded_model_goes_on_in_place_from_the_newest_checkpoint(tmp_path):
    """FSDP: the lost rank's shard is held nowhere else; the survivors stay, and load the checkpoint."""
    workers = Workers(tmp_path, args=("--strategy", "fsdp"))
    assert workers.lose_rank2(9, signal.SIGSTOP) == [0, 0], workers.stderr()
    assert "disttrain: regrouped in place; a sharded model's lost shard is held nowhere else: loading the " \
        "newest checkpoint" in workers.stderr()
    accounting = bench.account(workers.out, 120)
    assert accounting["missing"] == {} and accounting["extra"] == accounting["expected_extra"], accounting
    assert accounting["attempts"][1]["first_step"] % 4 == 0  # a checkpoint's step
    assert [workers.start_of(1, r)["pid"] for r in (0, 1)] == [workers.start_of(0, r)["pid"] for r in (0, 1)]


IN_FLIGHT = """
import sys, time
import torch, torch.distributed as dist
from disttrain import torchcompat

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0), rank=rank,
                        world_size=2)
dist.all_reduce(torch.ones(1))
if rank == 1:
    time.sleep(60)  # never joins the next collective
work = dist.all_reduce(torch.ones(1), async_op=True)
torchcompat.abandon_process_groups()
del work
import gc; gc.collect()
print("dropped", flush=True)
"""


FAILED_JOIN = """
import os
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from disttrain import torchcompat

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
if rank == 0:  # told round 1 first, whose third member never comes
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("round1", store), rank=0, world_size=3,
                                timeout=timedelta(seconds=1))
    except Exception:
        torchcompat.abandon_process_groups()
dist.init_process_group("gloo", store=dist.PrefixStore("round2", store), rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
dist.all_reduce(torch.ones(1))
print("formed", flush=True)
# What is tested is the forming. Ended without the interpreter's teardown: a gloo group whose peer
# exited first can abort it ("terminate called without an active exception", the suite in 3 lanes).
os._exit(0)
"""


@pytest.mark.timeout(60)
def test_a_rank_that_tried_a_round_more_forms_the_next_one_with_the_others(tmp_path):
    """The CI's failure under load: rank 0 tried round 1 before the newer word came, rank 1 (slower)
    took round 2 at once. torch names a group by a count that rank 0's failed try had raised: the two
    waited for each other's keys under different names, until the join's limit, and both restarted."""
    script = tmp_path / "failed_join.py"
    script.write_text(FAILED_JOIN)
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        ends = [proc.communicate(timeout=45) for proc in ranks]
        assert [proc.returncode for proc in ranks] == [0, 0] and [out for out, _ in ends] == ["formed\n"] * 2, \
            [err[-2000:] for _, err in ends]
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_a_world_dropped_with_a_collective_in_flight_is_not_waited_for(tmp_path):
    """The cause of a survivor that never joined the new group (2 regroups in about 45 under load): a
    collective of the old group still in flight when the old world was dropped. gloo's group
    destructor waits for it, for the group's whole timeout, in whichever thread frees the group last
    (there: the garbage collector's). The groups of a world gone are kept, never destroyed."""
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT)
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(port)], stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=30)
        assert ranks[0].returncode == 0 and out == "dropped\n"
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- the launcher's and agents' parts


def test_an_agent_whose_workers_are_not_armed_restarts_them(tmp_path):
    """No worker listens (a plain torchrun script, or one not at resume() yet): the agent cannot tell it."""
    from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup

    from disttrain.agent.elastic_agent import ElasticNodeAgent

    agent = object.__new__(ElasticNodeAgent)
    agent._sockets, agent._host, agent._logs_specs = str(tmp_path), "a", None
    said = []
    agent._on_attempt = lambda attempt, group, in_place, why: said.append((attempt, in_place))
    group = WorkerGroup.__new__(WorkerGroup)
    worker = Worker(local_rank=0, global_rank=4, role_rank=4, world_size=6, role_world_size=6)
    group.workers, group.group_rank, group.group_world_size = [worker], 2, 3
    plan = InPlace(attempt=1, ranks={0: 0, 4: 1}, group_ranks={"b": 0, "a": 1}, world_size=2, store="h:1")
    assert not agent._told_in_place(group, plan) and said == []
    assert agent._not_kept(group) == "its workers on a are not armed (no disttrain.resume() yet, or a script without it)"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listening.bind(socket_path(str(tmp_path), 0))
    try:
        assert agent._told_in_place(group, plan)
        told = Plan.from_bytes(listening.recv(1 << 16))
    finally:
        listening.close()
    assert (told.rank, told.world_size, told.env["GROUP_RANK"], told.env["MASTER_PORT"]) == (1, 2, "1", "1")
    assert (worker.global_rank, worker.world_size, group.group_rank, group.group_world_size) == (1, 2, 1, 2)
    assert said == [(1, True)]


def test_an_agent_meeting_a_waiting_node_after_the_job_finished_elsewhere_keeps_its_workers(tmp_path):
    """torch closes the rendezvous when a node's agent ends (its workers done): an agent meeting a late
    node then has nobody to meet. Its armed workers stay, untold, and their own end decides the node's
    (a suite under load once failed a finished job here: 'RendezvousClosedError' from the survivor)."""
    from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup, WorkerState
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from disttrain.agent.elastic_agent import ElasticNodeAgent

    agent = object.__new__(ElasticNodeAgent)
    agent._sockets, agent._host, agent._meet_at = str(tmp_path), "a", "h:1"
    agent._peer_lost = agent._closed = agent._in_place_round = False
    met = []

    def closed(group, expected=0):
        met.append((group, expected))
        raise RendezvousClosedError()

    agent._rendezvous = closed
    group = WorkerGroup.__new__(WorkerGroup)
    worker = Worker(local_rank=0, global_rank=1, role_rank=1, world_size=2, role_world_size=2)
    worker.id = 4242
    group.workers, group.state, group.group_world_size = [worker], WorkerState.HEALTHY, 2
    group.spec = types.SimpleNamespace(rdzv_handler=types.SimpleNamespace(num_nodes_waiting=lambda: 1))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listening.bind(socket_path(str(tmp_path), 0))  # armed
    try:
        agent._restart_workers(group)
        agent._restart_workers(group)  # torch's loop sees the node still waiting: nobody to meet, not tried again
    finally:
        listening.close()
    assert [expected for _, expected in met] == [3] and group.state is WorkerState.HEALTHY  # its 2 and the one waiting
    assert (worker.id, worker.global_rank, worker.world_size) == (4242, 1, 2)


def test_the_state_carried_is_a_steps_own(tmp_path, monkeypatch):
    """Inside an epoch's steps the objects hold the last step's state (or the one in flight's, once its
    optimizer stepped); after them the script's own code may have moved them (a scheduler's epoch step):
    with a checkpoint folder, the newest checkpoint is taken instead."""
    from torch.utils.data import DataLoader, TensorDataset

    import disttrain

    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "DISTTRAIN_RUN_DIR"):
        monkeypatch.delenv(key, raising=False)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2)
    state = disttrain.resume(tmp_path / "ckpt", model=model, optimizer=optimizer)
    try:
        for batch, (x,) in enumerate(state.steps(loader)):
            model(x).sum().backward()
            optimizer.step()
            carry = state._carry()  # the optimizer stepped: this step counts
            assert carry.adoptable and carry.step == batch + 1 and carry.progress["epoch_samples"] == 2 * (batch + 1)
            state.step, state.epoch_step, state._epoch_samples = batch, batch, 2 * batch  # as before the carry
        carry = state._carry()
        assert not carry.adoptable and carry.why_not == "it came between two epochs' steps"
    finally:
        state.close()
        disttrain.shutdown()
