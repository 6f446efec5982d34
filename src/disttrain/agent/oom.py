"""Was a worker killed for memory? What the kernel says about its out-of-memory kills.

A worker the kernel's OOM killer ends dies of SIGKILL, like one killed by hand; the kernel
says which it was in two places, read here where they are readable:

- its log (``/dev/kmsg``, root or ``kernel.dmesg_restrict=0``): ``Killed process PID (name)``,
  for that very process (the process ids of this pid namespace are the kernel's own);
- the memory cgroup of the node's processes: ``oom_kill N`` in ``memory.events`` (cgroup v2)
  or ``memory.oom_control`` (v1), counted since the workers started.

Neither is required: without both, the failure block says SIGKILL and no more.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

KMSG = "/dev/kmsg"
_KILLED = re.compile(r"Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)")
# A /dev/kmsg record: "priority,sequence,microseconds since boot,flags;message" (continuation
# lines, " KEY=value", follow it and are not matched).
_RECORD = re.compile(r"^\d+,\d+,(?P<usec>\d+),[^;\n]*;(?P<message>.*)$", re.M)
_UNLIMITED = 1 << 60  # v1's "no limit" is 2**63 rounded down to a page


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup's folder and its version (1 or 2)."""

    path: Path
    version: int

    @property
    def events_file(self) -> Path:
        return self.path / ("memory.events" if self.version == 2 else "memory.oom_control")

    def oom_kills(self) -> int | None:
        """Processes of this cgroup the OOM killer has ended (None: not readable here)."""
        try:
            return oom_kill_count(self.events_file.read_text())
        except OSError:
            return None

    def limit(self) -> int | None:
        """The cgroup's memory limit in bytes; None when unlimited or unreadable."""
        try:
            raw = (self.path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes")).read_text().strip()
        except OSError:
            return None
        if raw == "max" or not raw.isdigit() or int(raw) >= _UNLIMITED:
            return None
        return int(raw)


def oom_kill_count(text: str) -> int | None:
    """The ``oom_kill N`` line of a ``memory.events`` or ``memory.oom_control`` file."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def memory_cgroup(pid: int | str = "self", *, mountinfo: str = "/proc/self/mountinfo") -> MemoryCgroup | None:
    """The memory cgroup of ``pid``: the v2 unified one where it holds the memory controller,
    else v1's ``memory`` hierarchy; None where neither is mounted and readable."""
    try:
        membership = Path(f"/proc/{pid}/cgroup").read_text()
        mounts = Path(mountinfo).read_text()
    except OSError:
        return None
    v1 = v2 = None
    for line in membership.splitlines():
        number, controllers, where = line.split(":", 2)
        if number == "0" and controllers == "":
            v2 = where
        elif "memory" in controllers.split(","):
            v1 = where
    for line in mounts.splitlines():
        fields = line.split()
        dash = fields.index("-")
        root, point, fstype, options = fields[3], fields[4], fields[dash + 1], fields[-1]
        if fstype == "cgroup2" and v2 is not None:
            folder = _inside(point, root, v2)
            if folder is not None and (folder / "memory.events").exists():
                return MemoryCgroup(folder, 2)
        if fstype == "cgroup" and v1 is not None and "memory" in options.split(","):
            folder = _inside(point, root, v1)
            if folder is not None and (folder / "memory.oom_control").exists():
                return MemoryCgroup(folder, 1)
    return None


def _inside(mount_point: str, mount_root: str, cgroup: str) -> Path | None:
    relative = os.path.relpath(cgroup, mount_root)
    return None if relative.startswith("..") else Path(mount_point) / relative


def kernel_oom_line(pid: int, *, since: float, kmsg: str = KMSG) -> str | None:
    """The kernel's ``Killed process PID ...`` line for ``pid``, logged after ``since``
    (``time.monotonic()``, the clock of the log's timestamps); None if none or unreadable."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                data = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break  # read to the end of the buffer
            except BrokenPipeError:
                continue  # a record overwritten while we read: go on with the next
            except OSError:
                break
            if not data:
                break  # a plain file (a copy of the log) at its end
            for record in _RECORD.finditer(data):  # /dev/kmsg gives one record per read
                match = _KILLED.search(record["message"])
                if int(record["usec"]) / 1e6 >= since and match and int(match["pid"]) == pid:
                    found = record["message"].strip()
    finally:
        os.close(fd)
    return found


class OomWatch:
    """Started with the workers: afterwards, whether a dead worker was killed for memory."""

    def __init__(self, cgroup: MemoryCgroup | None = None, *, kmsg: str = KMSG) -> None:
        self.cgroup = cgroup if cgroup is not None else memory_cgroup()
        self.kills = self.cgroup.oom_kills() if self.cgroup else None
        self.since = time.monotonic()
        self.kmsg = kmsg

    def explain(self, pid: int) -> str | None:
        """The kernel's word that ``pid`` was killed for memory, in one line; None without one."""
        line = kernel_oom_line(pid, since=self.since, kmsg=self.kmsg)
        limit = self.cgroup.limit() if self.cgroup else None
        where = f" (memory cgroup limit {limit / 2**20:,.0f} MiB)" if limit else ""
        if line:
            return f"the kernel log says: {line}{where}"
        now = self.cgroup.oom_kills() if self.cgroup else None
        if now is not None and self.kills is not None and now > self.kills:
            return (f"the memory cgroup {self.cgroup.path} counted {now - self.kills} OOM kill(s) since the "
                    f"workers started ({self.cgroup.events_file.name}){where}")
        return None
