"""Metric patterns over long lines: matched within a bound, the job runner never wedged (issue 35 item 2)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import yaml

from conftest import assert_all_gone, cli_env, descendants, disttrain
from disttrain.jobs.patterns import TAIL, PatternMatcher
from disttrain.store import JobStore

NESTED = r"(a+)+b=([0-9])"  # exponential backtracking over a run of a's: no length cap bounds it
GREEDY = r".*loss=([0-9.]+)"  # quadratic: 10^11 steps over a 1 MB line, milliseconds over its tail


def test_a_pattern_over_budget_is_dropped_once_and_the_others_go_on():
    blown = []
    with PatternMatcher([NESTED, GREEDY, r"step (\d+)"], blown.append) as matcher:
        found = matcher.match(["step 3 loss=1.5", "a" * 1_000_000, "a" * 1_000_000 + " loss=0.5 step 4"])
        assert found == [[(1, 1.5), (2, 3.0)], [], [(1, 0.5), (2, 4.0)]]
        assert blown == [0]
        assert matcher.match(["a" * 5000 + "b=7 loss=2"]) == [[(1, 2.0)]]  # the dropped one is not tried again
        assert blown == [0]


def test_only_a_lines_tail_is_matched():
    with PatternMatcher([r"loss=([0-9.]+)"], lambda i: None) as matcher:
        head_only = "loss=9 " + "x" * TAIL
        assert matcher.match([head_only, "x" * 10 * TAIL + " loss=2"]) == [[], [(0, 2.0)]]


LONG_LINE_SCRIPT = """\
import time

print("step 0 loss=1.0", flush=True)
print("a" * 1_000_000, flush=True)
print("after the long line loss=0.5", flush=True)
print("a" * 1_000_000, flush=True)
print("ready to stop", flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(120)
def test_a_job_printing_a_1mb_line_keeps_its_output_metrics_and_stop(tmp_path):
    """Before, the runner matched in its own process: the 1 MB line froze it (GIL held by ``re``),
    no output after the line, SIGTERM never handled, no outcome recorded."""
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "long.py").write_text(LONG_LINE_SCRIPT)
    spec = tmp_path / "long.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "long", "entry_point": "long.py", "source_dir": str(tmp_path / "src"), "processes_per_instance": 1,
        "private_opt_ml": "off",
        "metric_definitions": [{"Name": "nested", "Regex": NESTED}, {"Name": "loss", "Regex": GREEDY}]}))
    runner = subprocess.Popen([sys.executable, "-m", "disttrain", "job", "run", str(spec)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        for line in runner.stdout:
            seen.append(line[:200])
            if "ready to stop" in line:
                break
        assert any("after the long line" in line for line in seen), seen
        family = descendants(runner.pid)
        runner.send_signal(signal.SIGTERM)
        out, err = runner.communicate(timeout=60)
        assert runner.returncode == 143, err[-2000:]
        assert_all_gone(family)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
    said = "".join(seen) + out + err
    assert said.count("metric_definitions 'nested'") == 1, said[-3000:]
    assert f"Regex {NESTED!r} spent over 1 s of CPU on one line" in said
    with JobStore(tmp_path / "jobs.db") as store:
        record = store.get(1)
        series = store.metric_series(1)
    assert record.state.value == "Stopped"
    assert [v for _, v in series["loss"]] == [1.0, 0.5] and "nested" not in series
    result = disttrain("jobs", "show", "1", env=env)
    assert result.returncode == 0 and "Stopped" in result.stdout

