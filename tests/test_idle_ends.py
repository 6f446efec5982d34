"""A run's end waits for nothing that is already over (issue 39): the workers' output tails end at
the stop with every line, a worker's exit drain waits only while torch's threads live, and the
launcher's process ends without its interpreter's teardown once nothing is left -- keeping its
``atexit`` work, its output and its exit code, and exiting the normal way while a thread or a
child still runs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from disttrain.agent import flight
from disttrain.agent.log_tail import tail_until_finished, tails_end_at_once

HOUR = 3600.0  # a look interval no test waits out: an end that came, came from the stop


def _tail(path, finished: threading.Event) -> tuple[threading.Thread, io.StringIO]:
    out = io.StringIO()
    thread = threading.Thread(target=tail_until_finished,
                              kwargs=dict(header="[rank0]:", file=str(path), dst=out, finished=finished,
                                          interval_sec=HOUR, log_line_filter=lambda line: "skip" not in line))
    thread.start()
    return thread, out


@pytest.mark.timeout(30)
def test_a_tail_ends_at_the_stop_with_every_line(tmp_path):
    log = tmp_path / "rank0.stdout"
    log.write_text("one\nskip me\n")
    finished = threading.Event()
    thread, out = _tail(log, finished)
    with log.open("a") as fh:  # written while the tail waits for its next look
        fh.write("two\n")
    finished.set()
    thread.join(timeout=20)  # torch's tail slept out its interval first: an hour here
    assert not thread.is_alive()
    assert out.getvalue() == "[rank0]:one\n[rank0]:two\n"


class _Looks(threading.Event):
    """The stop event, which also tells when the tail has read all there was and waits for more."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(0.05)


@pytest.mark.timeout(30)
def test_a_line_read_before_its_end_was_written_is_copied_whole_with_one_header(tmp_path):
    """A suite under load: `saved ...step_00000020[rank0] ` -- the tail read a line that a rank's print
    had written in two pieces, and gave each piece a header (torch's own tail does)."""
    log = tmp_path / "rank0.stdout"
    log.write_text("saved step_20")
    looks = _Looks()
    thread, out = _tail(log, looks)
    assert looks.waiting.wait(10)  # the piece is read: the tail waits for the rest
    with log.open("a") as fh:
        fh.write("\nsaved step_25\nno end")
    looks.set()
    thread.join(timeout=20)
    assert out.getvalue() == "[rank0]:saved step_20\n[rank0]:saved step_25\n[rank0]:no end"


@pytest.mark.timeout(30)
def test_a_tail_of_a_file_never_written_ends_at_the_stop(tmp_path):
    finished = threading.Event()
    thread, out = _tail(tmp_path / "never", finished)
    finished.set()
    thread.join(timeout=20)
    assert not thread.is_alive() and out.getvalue() == ""


def test_torch_tails_with_it_for_the_block_only():
    from torch.distributed.elastic.multiprocessing import tail_log

    original = tail_log.tail_logfile
    with tails_end_at_once():
        assert tail_log.tail_logfile is tail_until_finished
    assert tail_log.tail_logfile is original


THREADS_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, socket, sys
    import torch, torch.distributed as dist

    spec = importlib.util.spec_from_file_location("worker_site", sys.argv[1])
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)  # no DISTTRAIN_* variables: it only defines its functions

    def group():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    seen = {"before": site._torch_threads()}
    group()
    dist.barrier()
    seen["joined"] = site._torch_threads()
    dist.destroy_process_group()
    seen["destroyed"] = site._torch_threads()
    group()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    dist.destroy_process_group()
    seen["destroyed, a DDP model kept"] = site._torch_threads()
    print(json.dumps(seen))
""")


@pytest.mark.timeout(120)
def test_the_exit_drain_waits_only_while_a_process_groups_threads_live(tmp_path):
    """The worker bootstrap's drain (``gc.collect()`` and 0.1 s) is for gloo's threads: once the group
    is destroyed and nothing holds it they are gone, and the exit has nothing to wait for."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(flight.SITE_DIR / "sitecustomize.py")],
                            capture_output=True, text=True, timeout=100, env={**_env(), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "before": False, "joined": True, "destroyed": False, "destroyed, a DDP model kept": True}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DISTTRAIN_", "WORLD_SIZE", "RANK"))}


def _ends(body: str) -> subprocess.CompletedProcess:
    script = "import atexit, ctypes, subprocess, sys, threading\nfrom disttrain.cli import quick_exit\n" + \
        textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=_env())


@pytest.mark.timeout(90)
def test_the_quick_exit_keeps_atexit_work_output_and_code():
    result = _ends("""
        atexit.register(lambda: print("atexit ran"))
        sys.stdout.write("python's buffer, ")
        ctypes.CDLL(None).printf(b"C's buffer\\n")  # a pipe: fully buffered in C's stdio
        quick_exit.exit_now(3)
        print("not reached")
    """)
    assert result.returncode == 3, result.stderr
    assert "atexit ran" in result.stdout and "python's buffer" in result.stdout and "C's buffer" in result.stdout
    assert "not reached" not in result.stdout


@pytest.mark.timeout(90)
def test_a_running_thread_or_child_keeps_the_normal_exit():
    result = _ends("""
        release = threading.Event()
        waiter = threading.Thread(target=release.wait)
        waiter.start()
        print("with a thread:", quick_exit.exit_now(3))
        release.set()
        waiter.join()
        child = subprocess.Popen(["sleep", "30"])
        print("with a child:", quick_exit.exit_now(4))
        child.kill()
        child.wait()
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["with a thread: 3", "with a child: 4"]
