"""The root cause first, whichever failure the launcher hears of first (issue 35 item 3)."""

from __future__ import annotations

import os

import pytest
import yaml

from conftest import cli_env, disttrain
from disttrain.agent.report import rank_failure, root_cause
from disttrain.launch.rootcause import first_in_time
from disttrain.wire import RankFailed
from disttrain.workerenv import rank_file


def failed(rank: int, code: int, at: float, lost_peer: bool = False) -> RankFailed:
    return RankFailed(host=f"algo-{rank + 1}", rank=rank, exit_code=code, at=at, lost_peer=lost_peer)


def test_the_earliest_failure_on_the_workers_clocks_wins_not_the_first_heard():
    # agent 0 (heard first) aborted at 12.0 after losing its peer; agent 1's rank exited 5 at 11.5
    assert first_in_time(0, 134, {0: failed(0, 134, 12.0, lost_peer=True), 1: failed(1, 5, 11.5)}) == (1, 5)
    # a consequence never wins over a cause, even when its clock says earlier (skew between hosts)
    assert first_in_time(0, 134, {0: failed(0, 134, 11.0, lost_peer=True), 1: failed(1, 5, 11.5)}) == (1, 5)
    assert first_in_time(1, 7, {0: failed(0, 3, 10.0), 1: failed(1, 7, 10.5)}) == (0, 3)
    assert first_in_time(1, 7, {}) == (1, 7)  # no agent could say: the one heard of first


def on_node(tmp_path, raw_codes: dict[int, int], raised: dict[int, float]):
    """The node's failures as torch's agent saw them, all noticed in the same second, and the
    markers of the ranks whose excepthook ran (at the given times)."""
    (tmp_path / "attempt_0").mkdir(exist_ok=True)
    for rank, at in raised.items():
        marker = rank_file(tmp_path, rank, 0, "raised")
        open(marker, "w").close()
        os.utime(marker, (at, at))
    return [rank_failure(rank=rank, host="vm", raw_code=code, pid=100 + rank, timestamp=1000, attempt=0,
                         run_dir=str(tmp_path)) for rank, code in raw_codes.items()]


def test_the_rank_that_raised_first_is_the_root_cause_though_its_peer_exited_first(tmp_path):
    # rank 0 raised; its atexit closed the group, rank 1 raised of the lost peer and exited, and the
    # agent, seeing rank 1 first, stopped rank 0 (SIGTERM) while it was still exiting
    failures = on_node(tmp_path, {1: 1, 0: -15}, raised={0: 1000.25, 1: 1000.5})
    first = root_cause(failures, str(tmp_path))
    assert (first.rank, first.exit_code, first.signal_name, first.stopped_by_agent) == (0, 1, None, False)


def test_a_rank_stopped_before_it_raised_is_a_consequence(tmp_path):
    failures = on_node(tmp_path, {1: 1, 0: -15}, raised={1: 1000.5})
    first = root_cause(failures, str(tmp_path))
    assert first.rank == 1
    stopped = next(f for f in failures if f.rank == 0)
    assert (stopped.exit_code, stopped.signal_name, stopped.stopped_by_agent) == (143, "SIGTERM", True)


# Rank 1 fails first, but freezes its own agent (SIGSTOP) so the launcher hears of rank 0's
# consequence first; a helper lets rank 1's agent go on only once the launcher has reaped rank 0's
# agent (its pid is gone): the launcher then is stopping the job, and rank 1's agent reports late.
SCRIPT = """
import os, signal, subprocess, sys
import psutil, torch, torch.distributed as dist

RESUME = '''
import os, signal, sys, time
import psutil
agent0, agent1 = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 60
while psutil.pid_exists(agent0) and time.monotonic() < deadline:  # a zombie exists until reaped
    time.sleep(0.05)
os.kill(agent1, signal.SIGCONT)
'''

dist.init_process_group("gloo")
rank = dist.get_rank()
chains = [None, None]
dist.all_gather_object(chains, [p.pid for p in psutil.Process().parents()])
if rank == 1:
    launcher = next(pid for pid in chains[1] if pid in chains[0])
    agent0 = chains[0][chains[0].index(launcher) - 1]  # the launcher's own child on rank 0's side
    subprocess.Popen([sys.executable, "-c", RESUME, str(agent0), str(os.getppid())], start_new_session=True)
    print("rank 1 fails first", flush=True)
    os.kill(os.getppid(), signal.SIGSTOP)
    os._exit(5)
print("rank 0 goes on", flush=True)
tensor = torch.zeros(1)
while True:
    dist.all_reduce(tensor)  # fails once rank 1 is gone: the consequence
"""


@pytest.mark.timeout(180)
def test_the_root_cause_is_reported_when_its_agent_reports_last(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "late.py").write_text(SCRIPT)
    spec = tmp_path / "late.yaml"
    spec.write_text(yaml.safe_dump({"name": "late", "entry_point": "late.py", "source_dir": str(tmp_path / "src"),
                                    "instance_count": 2, "processes_per_instance": 1, "private_opt_ml": "off"}))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = disttrain("job", "run", str(spec), env=env, timeout=150)
    assert result.returncode == 5, result.stderr[-3000:]
    show = disttrain("jobs", "show", "1", env=env)
    failure = show.stdout[show.stdout.index("failure:"):]
    assert "rank 1 on algo-2 exited with code 5" in failure, show.stdout
