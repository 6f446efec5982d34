"""No wire message reaches a user's terminal (issue 46 point 3): every failure kind of a run, and a
tracked run, leave stdout and stderr free of the lines disttrain's processes send each other."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest

from conftest import SCRIPTS, cli_env, disttrain, write
from disttrain import trackline, wire
from disttrain.launch.relay import Relay

pytestmark = pytest.mark.timeout(240)

# A wire line, whatever prints it: a marker, or a message's JSON envelope.
_ENVELOPE = re.compile(r'\{\s*"kind"\s*:')


def wire_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if any(marker in line for marker in wire.WIRE_MARKERS) or _ENVELOPE.search(line)]


KILLED = """
import os, signal
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
"""


@pytest.mark.parametrize("case", ["exit_code", "exception", "killed", "hang", "tracked_failure"])
def test_no_wire_line_on_the_terminal_for_any_failure(case, tmp_path):
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"))
    args: list[str]
    if case == "exit_code":
        args = ["-n", "2", str(SCRIPTS / "fail_rank1.py")]
    elif case == "exception":
        args = ["-n", "2", str(SCRIPTS / "init_then_raise.py")]
    elif case == "killed":
        args = ["-n", "2", str(write(tmp_path / "killed.py", KILLED))]
    elif case == "hang":
        args = ["-n", "2", "--hang-timeout", "5", str(SCRIPTS / "hang_rank1.py")]
    else:
        env.update(TRACKIO_DIR=str(tmp_path / "trackio"), TRACKIO_PROJECT="wire", EXIT_CODE="3")
        args = ["-n", "2", "--track", "trackio", "--track-ranks", str(SCRIPTS / "tracked.py")]
    proc = disttrain("run", *args, env=env, timeout=200)
    assert proc.returncode != 0, proc.stderr
    assert "disttrain:" in proc.stderr  # the failure is said, for people
    assert wire_lines(proc.stdout) == [] and wire_lines(proc.stderr) == [], proc.stdout + proc.stderr


def test_a_tracked_failing_job_shows_no_wire_line(tmp_path):
    """A job's instances are agents under the job's launcher: their lines travel through the relay."""
    import yaml

    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"),
                  TRACKIO_DIR=str(tmp_path / "trackio"), TRACKIO_PROJECT="wire")
    spec = write(tmp_path / "job.yaml", yaml.safe_dump({
        "name": "wire", "entry_point": "tracked.py", "source_dir": str(SCRIPTS), "processes_per_instance": 2,
        "track": "trackio", "track_ranks": True, "env": {"EXIT_CODE": "3"}}))
    proc = disttrain("job", "run", str(spec), env=env, timeout=200)
    assert proc.returncode != 0 and "disttrain:" in proc.stderr, proc.stderr
    assert wire_lines(proc.stdout) == [] and wire_lines(proc.stderr) == [], proc.stdout + proc.stderr


def test_a_tracked_run_shows_its_output_and_none_of_its_track_lines(tmp_path):
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), TRACKIO_DIR=str(tmp_path / "trackio"),
                  TRACKIO_PROJECT="wire")
    script = write(tmp_path / "talk.py", "import disttrain\nctx = disttrain.init()\n"
                   "for step in range(3):\n    print('step', step, flush=True)\n"
                   "    disttrain.log({'loss': 1.0 / (step + 1)}, step=step)\ndisttrain.shutdown()\n")
    proc = disttrain("run", "-n", "2", "--track", "trackio", str(script), env=env, timeout=200)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("step 2") == 2  # every rank's own lines are shown
    assert wire_lines(proc.stdout) == [] and wire_lines(proc.stderr) == []
    logged = list((tmp_path / "home").glob("runs/*/attempt_0/rank0.stdout"))
    assert logged and trackline.MARKER in logged[0].read_text()  # the tracker's channel still has them


def test_the_relay_keeps_every_wire_line_off_the_terminal(tmp_path):
    """The launcher's relay of an agent over ssh: a wire line its reader did not take (another
    version's, a damaged one) goes to the logs, never to the terminal."""
    failed = wire.RankFailed(host="node1", rank=3, exit_code=1, at=1.0).to_line()
    beats = wire.Beats(host="node1", ranks={3: (4, 0.5)}).to_line()
    lines = ["[node1 rank3] hello\n", f"[node1 rank3] {trackline.encode('metrics', rank=3, step=1, values={})}\n",
             f"{failed}\n", f"{beats[:-5]}\n", "disttrain: rank 3 on node1 exited with code 1\n"]
    shown = io.StringIO()
    relay = Relay(tmp_path, threading.Lock(), on_agent_line=lambda _agent, _line: False)
    relay.pump(io.StringIO("".join(lines)), shown, agent=1)
    relay.close()
    assert shown.getvalue().splitlines() == ["[node1 rank3] hello", "disttrain: rank 3 on node1 exited with code 1"]
    assert json.loads(failed.split(" ", 1)[1])["kind"] == "agent.failed"
    assert failed in (tmp_path / "node1.log").read_text()


def test_a_wire_line_srun_cut_with_its_own_word_is_read_whole(tmp_path):
    """srun relays a task's output in 1,024-byte pieces, and its word at the task's exit landed between
    two of them, inside an agent's hang report (seen in a suite under load: that rank had "no report").
    The agent's line is read whole and srun's line on its own; a whole line quoting srun is left as it is."""
    report = wire.HangReport(host="node1-" + "n" * 1100, ranks=()).to_line()
    quoting = wire.RankFailed(host="srun: node1", rank=1, exit_code=1, at=1.0).to_line()
    srun = "srun: error: node1: task 0: Exited with exit code 124\n"
    heard: list[str] = []
    relay = Relay(tmp_path, threading.Lock(), on_agent_line=lambda _agent, line: heard.append(line) or True)
    relay.pump(io.StringIO(report[:1024] + srun + report[1024:] + "\n" + quoting + "\n"), io.StringIO(), agent=1)
    relay.close()
    assert heard == [srun, report + "\n", quoting + "\n"]
    assert wire.HangReport.from_line(heard[1]).host == "node1-" + "n" * 1100


def test_for_people_tells_wire_lines_from_a_scripts_own():
    assert not wire.for_people("disttrain-failed {}\n")
    assert not wire.for_people("[rank0] disttrain-track: {}\n")
    assert not wire.for_people("[node0 rank12] disttrain-track: {}")
    assert wire.for_people("[rank0] loss disttrain-track: is a word here\n")
    assert wire.for_people("disttrain: rank 1 failed\n")
