"""Reading a reduced value on one rank only never hangs a job: 2 real ranks over gloo.

``MeanMeter.avg`` is an all-reduce. Before: read inside ``if ctx.is_main:`` it waited for
ranks that never came (or met their next collective), and the job hung for the process
group's timeout, then failed with gloo's error.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from _launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "rank_only_reads.py"


@pytest.mark.timeout(120)
def test_read_on_every_rank_then_used_on_one_works():
    result = run_ranks(SCRIPT, 2, ["every-rank"], timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank0] avg 1.5" in result.stdout and "[rank0] print0 1.5" in result.stdout
    assert "[rank0] done 1.0" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "test", "line", "slow_exit"), [
    ("inside-if", "ctx.is_main", 37, "0"),
    # rank 0 ends 2 s after closing its group: rank 1, failing at once of the lost peer, is seen
    # first, and rank 0 is stopped by the agent while it exits -- it is still the one named (CI's race)
    ("early-return", "not (ctx.rank != 0)", 27, "2"),
])
def test_read_inside_a_rank_test_fails_at_once_in_one_line(mode, test, line, slow_exit):
    result = run_ranks(SCRIPT, 2, [mode], timeout=110, env={"DISTTRAIN_PG_TIMEOUT": "600", "SLOW_EXIT": slow_exit})
    assert result.returncode == 1, result.stderr[-3000:]  # rank 0's, at once: not after 600 s
    told = [x for x in result.stderr.splitlines() if x.startswith("[rank0]") and "MeanMeter.avg" in x]
    assert told == [f"[rank0] disttrain: error: MeanMeter.avg at {SCRIPT}:{line} runs only where `{test}` "
                    "holds, but it is a collective: every rank must call it at the same point (read it before "
                    "`if ctx.is_main:`, and use the value inside; MeanMeter.local_avg is this rank's own, "
                    "without a collective)"], result.stderr[-3000:]
    # Rank 0 is the failure the launcher names; rank 1, left in its next collective, dies of
    # the lost peer (its error is torch's own, in its log).
    assert "[rank0] Traceback" not in result.stderr
    assert f"rank 0 on {socket.gethostname()} exited with code 1" in result.stderr


@pytest.mark.timeout(120)
def test_a_read_the_source_does_not_show_ends_within_the_timeout_in_one_line():
    result = run_ranks(SCRIPT, 2, ["hidden"], timeout=110, env={"DISTTRAIN_PG_TIMEOUT": "8"})
    assert result.returncode == 1, result.stderr[-3000:]
    told = [x for x in result.stderr.splitlines() if x.startswith("[rank") and "did not call it within 8 s" in x]
    assert told == ["[rank0] disttrain: error: MeanMeter.avg on rank 0: the other ranks did not call it within "
                    "8 s; it is a collective: every rank must call it at the same point (read it before "
                    "`if ctx.is_main:`, and use the value inside; MeanMeter.local_avg is this rank's own, "
                    "without a collective)"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "avg " not in result.stdout


PROBE = """\
import sys
from disttrain.runtime.rankonly import rank_condition

class Meter:
    @property
    def avg(self):
        FOUND.append(rank_condition(sys._getframe(1)))
        return 1.0

class Ctx:
    is_main, rank = True, 0

meter, ctx = Meter(), Ctx()
"""


@pytest.mark.parametrize(("code", "test"), [
    ("if ctx.is_main:\n    x = meter.avg\n", "ctx.is_main"),
    ("x = meter.avg\nif ctx.is_main:\n    print(x)\n", None),
    ("print(meter.avg)\n", None),
    ("if ctx.is_main:\n    a = meter.avg\nelse:\n    b = meter.avg\n", None),  # every rank reads it
    ("ok = ctx.is_main and meter.avg\n", "ctx.is_main"),
    ("x = meter.avg if ctx.rank == 0 else 0.0\n", "ctx.rank == 0"),
    ("def f():\n    if ctx.rank != 0:\n        return\n    return meter.avg\n\nf()\n", "not (ctx.rank != 0)"),
    ("def log():\n    print(meter.avg)\n\nif ctx.is_main:\n    log()\n", "ctx.is_main"),  # through a call
    ("import os\nif os.environ.get('RANK', '0') == '0':\n    y = meter.avg\n", "os.environ.get('RANK', '0') == '0'"),
])
def test_the_source_tells_a_rank_only_read(tmp_path, code, test):
    import runpy

    script = tmp_path / "train.py"
    script.write_text(PROBE + code)
    found = []
    runpy.run_path(str(script), init_globals={"FOUND": found})
    assert [None if f is None else f[2] for f in found] == [test] * len(found) and found
