"""Every process a worker starts stops with its worker group (disttrain.agent.cgroup): a cgroup v2
of its own where the machine allows it, the agent as child subreaper elsewhere. Real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from conftest import assert_all_gone
from disttrain.agent import lifeline
from disttrain.agent.cgroup import Container, WorkerCgroup, cgroup2_mount, own_cgroup

MOUNTINFO = """\
24 31 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
30 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
35 30 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
36 30 0:32 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,memory
"""


def test_the_unified_hierarchy_and_this_process_place_in_it_are_read_from_proc():
    assert str(cgroup2_mount(MOUNTINFO)) == "/sys/fs/cgroup/unified"
    assert cgroup2_mount(MOUNTINFO.replace("cgroup2 cgroup2", "tmpfs tmpfs")) is None  # v1 only, or none
    assert own_cgroup("4:memory:/x\n0::/user.slice/session-3.scope\n") == "/user.slice/session-3.scope"
    assert own_cgroup("0::/\n") == "/" and own_cgroup("4:memory:/x\n") is None


SPAWNER = """
import os, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(helper.pid, flush=True)
time.sleep(600)
"""


def _start_worker(group: Container) -> tuple[subprocess.Popen, int]:
    argv = lifeline.wrap([sys.executable, "-c", SPAWNER], python=sys.executable, join=group.join_file)
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    return worker, int(worker.stdout.readline())


@pytest.mark.timeout(60)
def test_a_cgroup_holds_what_a_worker_starts_in_another_session_and_kills_it():
    group = WorkerCgroup.make(f"disttrain-test-{os.getpid()}")
    if group is None:
        pytest.skip("no writable cgroup v2 here (not mounted, or not allowed)")
    try:
        worker, helper = _start_worker(group)
        assert set(group.pids()) == {worker.pid, helper}  # joined before the exec, so its children are in
        assert psutil.Process(helper).status() != psutil.STATUS_ZOMBIE
        assert sorted(group.kill()) == sorted([worker.pid, helper])
        worker.wait(timeout=10)
        assert_all_gone([psutil.Process(helper)])
    finally:
        group.close()
    assert not group.cgroup.exists()


@pytest.mark.timeout(60)
def test_without_a_cgroup_a_subreaper_kills_the_orphans_too():
    """Run in a child, which becomes the subreaper (the test process must not)."""
    code = f"""
import subprocess, sys, time
sys.path[:0] = {sys.path!r}
from disttrain.agent import lifeline
from disttrain.agent.cgroup import Subreaper
group = Subreaper()
assert group.active
argv = lifeline.wrap([sys.executable, "-c", {SPAWNER!r}], python=sys.executable)
worker = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
helper = int(worker.stdout.readline())
worker.kill(); worker.wait()  # the worker dies; its helper, in a session of its own, lives on
time.sleep(0.2)
print(helper, helper in group.kill(), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    helper, killed = out.stdout.split()
    assert killed == "True"
    assert not psutil.pid_exists(int(helper)) or psutil.Process(int(helper)).status() == psutil.STATUS_ZOMBIE
