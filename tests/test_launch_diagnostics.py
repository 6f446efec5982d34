"""Diagnostics across hosts, at the launcher (real sshd in network namespaces): a hang on the
second host is reported with both hosts' stacks and exit 124; a slowed rank is named as a
straggler once; every run ends with steps/s per host."""

from __future__ import annotations

import pytest
from test_multinode import run_on_node0

from conftest import SCRIPTS
from rig import cluster_fixture

cluster = cluster_fixture(2)
SLEEP_LINE = next(i for i, line in enumerate((SCRIPTS / "hang_rank1.py").read_text().splitlines(), 1)
                  if "time.sleep(600)" in line)


@pytest.mark.timeout(200)
def test_a_hang_on_the_second_host_is_reported_at_the_launcher_with_every_hosts_stacks(cluster, tmp_path):
    result = run_on_node0(cluster, "--hang-timeout", "5", "--env", f"DISTTRAIN_HOME={tmp_path}",
                          str(SCRIPTS / "hang_rank1.py"), timeout=180)
    err = result.stderr
    assert result.returncode == 124, err[-3000:]
    a, b = (node.ip for node in cluster.nodes)
    assert f"rank 0 ({a}): in #" in err  # waiting in the all-reduce on host a
    assert f"rank 1 ({b}): completed #" in err and f"at hang_rank1.py:{SLEEP_LINE} in <module>" in err
    assert f"which rank 0 waits in: it is at hang_rank1.py:{SLEEP_LINE} in <module> (the script's own code)" in err
    assert f"stacks on {a}: " in err and f"stacks on {b}: " in err
    assert "no rank made progress for 5 s" in err and "stopped the job on all 2 hosts (exit 124)" in err
    cluster.assert_nothing_left()


@pytest.mark.timeout(200)
def test_a_slow_rank_is_named_once_and_steps_per_second_are_summed_up(cluster):
    # 10 s of steps: each rank's rate is judged from 6 s of its beats on (diagnostics.MIN_WINDOW_S), a
    # window each rank's own run spans whenever it started; rank 1 is 3x slower, past the 1.3x rule.
    result = run_on_node0(cluster, str(SCRIPTS / "slow_rank1.py"), "10", timeout=180)
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    b = cluster.nodes[1].ip
    warnings = [line for line in err.splitlines() if "straggler" in line]
    assert len(warnings) == 1, err[-3000:]
    assert f"rank 1 on {b} is slower than the others" in warnings[0]
    summary = [line for line in err.splitlines() if line.startswith("disttrain: steps/s per host")]
    assert len(summary) == 1 and cluster.nodes[0].ip in summary[0] and b in summary[0]
    assert "disttrain-beats" not in err + result.stdout  # the agents' heartbeats are for the launcher only
    cluster.assert_nothing_left()


def test_the_summary_says_when_a_host_fell_silent_before_the_end():
    from disttrain.launch.diagnostics import Diagnostics
    from disttrain.wire import Beats

    now = [0.0]
    diag = Diagnostics(say=print, clock=lambda: now[0])
    for second in range(0, 61):
        now[0] = float(second)
        diag.consume(Beats(host="a", ranks={0: (4 * second, 0.1)}).to_line())
        if second <= 20:  # b's agent is stopped after 20 s: its beats end, its rank's rate is of those 20 s
            diag.consume(Beats(host="b", ranks={1: (4 * second, 0.1)}).to_line())
    assert diag.summary() == ("disttrain: steps/s per host (each rank's mean): a 4.00 (rank 0), "
                              "b 4.00 (rank 1; no beat in the last 40 s)")
