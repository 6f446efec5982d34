"""The rendezvous wait's thread ends when the workers start or the block ends, without waiting for its
next look: nothing is left for it to do, and a node's end must not wait on it."""

from __future__ import annotations

import io
import threading

import pytest

from disttrain.agent.rendezvous_wait import RendezvousWait


def _watch_thread(wait: RendezvousWait) -> threading.Thread:
    assert wait._thread is not None
    return wait._thread


@pytest.mark.timeout(30)
def test_the_watch_ends_once_the_workers_started():
    out = io.StringIO()
    with RendezvousWait("starting the rendezvous", timeout_s=120, report_to=out) as wait:
        thread = _watch_thread(wait)
        wait.workers_started()
        thread.join(timeout=20)  # the old watch looked again every 0.5 s until the block ended: never here
        assert not thread.is_alive()
    assert out.getvalue() == ""


@pytest.mark.timeout(30)
def test_the_block_ends_its_watch_from_another_thread():
    """Off the main thread there is no signal pipe: the end still wakes the watch (no lost wake-up)."""
    seen: list[bool] = []

    def node() -> None:
        with RendezvousWait("starting the rendezvous", timeout_s=120, report_to=io.StringIO()) as wait:
            thread = _watch_thread(wait)
        seen.append(thread.is_alive())

    runner = threading.Thread(target=node)
    runner.start()
    runner.join(timeout=20)
    assert seen == [False]
