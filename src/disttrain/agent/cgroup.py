"""Everything a worker starts stops with its worker group: a cgroup, or this agent as subreaper.

torch stops a worker by signalling its process group, and the lifeline (``lifeline.py``) ties
the worker to the agent; a process the worker starts in a session of its own
(``start_new_session=True``, a daemon that double-forks) escapes both and outlives the run.

Where the machine has cgroup v2 and this process may create a cgroup under its own (root on
most machines, a delegated subtree under systemd), each worker group gets one: every worker
joins it in its lifeline wrapper before it execs the script, so all it ever starts, in any
session, is in it; ``cgroup.kill`` ends them all at once. Elsewhere (no cgroup2 mounted, as
inside ``ip netns exec``; not allowed), the agent becomes the workers' *child subreaper*
(``PR_SET_CHILD_SUBREAPER``): an orphaned descendant is re-parented to it rather than to init,
so it is still a descendant, and is killed with the rest. Either way the leftovers of an
attempt are killed before the next one starts, and at the end.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import psutil

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
KILL_WAIT_S = 5.0


def cgroup2_mount(mountinfo: str) -> Path | None:
    """Where the unified (v2) hierarchy is mounted, from ``/proc/self/mountinfo``'s text."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype == "cgroup2":
            return Path(fields[4])
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path (``0::/a/b`` in ``/proc/self/cgroup``), or None."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


class Container:
    """One worker group's processes, killed together. :meth:`create` picks the mechanism."""

    cgroup: Path | None = None

    @classmethod
    def create(cls, name: str, *, joinable: bool = True) -> Container:
        """``joinable``: the workers start through the lifeline wrapper, which joins them (a
        function entry started by multiprocessing does not)."""
        group = WorkerCgroup.make(name) if joinable else None
        return group if group is not None else Subreaper()

    @property
    def join_file(self) -> str | None:
        """What a worker writes its pid to before it execs (None: nothing to join)."""
        return None

    def kill(self) -> list[int]:
        """Kill every process of the group still running; the pids killed."""
        raise NotImplementedError

    def close(self) -> None:
        self.kill()


class WorkerCgroup(Container):
    def __init__(self, path: Path) -> None:
        self.cgroup = path

    @classmethod
    def make(cls, name: str) -> WorkerCgroup | None:
        """A new cgroup under this process's own, or None where the machine does not allow it."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
            own = own_cgroup(Path("/proc/self/cgroup").read_text())
        except OSError:
            return None
        if mount is None or own is None:
            return None
        path = mount / own.lstrip("/") / name
        try:
            path.mkdir()
        except OSError:  # not mounted where /proc says, read-only, not ours (systemd without delegation)
            return None
        if not os.access(path / "cgroup.procs", os.W_OK):
            path.rmdir()
            return None
        _live.append(path)
        return cls(path)

    @property
    def join_file(self) -> str:
        return str(self.cgroup / "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> list[int]:
        pids = self.pids()
        if pids:
            _kill_cgroup(self.cgroup, pids)
        return pids

    def close(self) -> None:
        self.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self.cgroup.rmdir()
            _live.remove(self.cgroup)
        except (OSError, ValueError):
            pass


def _kill_cgroup(path: Path, pids: list[int]) -> None:
    try:
        (path / "cgroup.kill").write_text("1")  # Linux 5.14+: every member, atomically
        return
    except OSError:
        pass
    for pid in pids:  # older kernels: one by one (a fork meanwhile joins the cgroup too: looped by close)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Subreaper(Container):
    """No cgroup: orphaned descendants come back to this process, which kills them with the group."""

    def __init__(self) -> None:
        self.active = False
        # What this process had started before (a program running a node in its own process may
        # have children of its own): never the group's.
        self._before = {p.pid for p in _descendants()}
        if sys.platform.startswith("linux"):
            try:
                self.active = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
            except (OSError, AttributeError):
                pass

    def kill(self) -> list[int]:
        """Every descendant started since: between attempts and at the end, all are leftovers
        (but multiprocessing's resource tracker, which this process's own spawns share)."""
        tracker = _resource_tracker()
        procs = [p for p in _descendants() if p.pid != tracker and p.pid not in self._before]
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=KILL_WAIT_S)  # reaps those re-parented to us
        return [p.pid for p in procs]


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _resource_tracker() -> int | None:
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    return getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)


_live: list[Path] = []


def kill_all_now() -> None:
    """Before a forced exit (``os._exit``): no cleanup code runs after it, so kill every live group."""
    for path in list(_live):
        WorkerCgroup(path).kill()
