"""Metric patterns matched within a bound: a line's last ``TAIL`` characters, ``BUDGET_S`` of CPU each.

Python's ``re`` backtracks and has no timeout, and it holds the GIL while it matches: one
``(a+)+b=([0-9])`` over a long line of ``a`` (or even ``.*loss=([0-9.]+)`` over 1 MB, a quadratic
10^11 steps) froze the whole job runner -- no outcome recorded, no output relayed, SIGTERM never
handled. So the patterns run in a child process of their own (stdlib only, started with ``-I``):

- **What is matched: the last ``TAIL`` characters of each line.** A metric line is short; the cap
  leaves room for a long progress-bar line whose newest value is at its end, and bounds a
  quadratic pattern to ~10^7 steps (milliseconds) per line.
- **How long: ``BUDGET_S`` seconds of the child's CPU per line and pattern**, CPU and not wall
  time so that a loaded machine does not count against a pattern. The parent waits on a pipe
  (no GIL held), so the runner answers signals and relays output meanwhile. A pattern over its
  budget (nested repetition that backtracks exponentially, which no length cap bounds) is killed
  with its child, named once, and not matched again in this job; the others go on.

The ``regex`` package's timeout would do the second part in-process, but it is not a dependency.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
from collections.abc import Callable, Sequence

TAIL = 4096  # characters of a line that patterns see (its end: where a progress bar's newest value is)
BUDGET_S = 1.0  # CPU seconds one pattern may spend on one line before it is dropped


class PatternMatcher:
    """``match(lines)`` → per line, ``[(pattern index, value), ...]``; patterns over budget dropped.

    ``blown(index)`` is called once for each pattern dropped. Use as a context manager (the child
    process lives between ``__enter__`` and ``__exit__``).
    """

    def __init__(self, regexes: Sequence[str], blown: Callable[[int], None], budget_s: float = BUDGET_S) -> None:
        self.regexes, self.blown, self.budget_s = list(regexes), blown, budget_s
        self.active = list(range(len(self.regexes)))
        self._child: subprocess.Popen | None = None
        self._buffer = b""

    def __enter__(self) -> PatternMatcher:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def match(self, lines: Sequence[str]) -> list[list[tuple[int, float]]]:
        found: list[list[tuple[int, float]]] = [[] for _ in lines]
        todo = [(k, i) for k in range(len(lines)) for i in self.active]
        while todo and self.active:
            todo = [(k, i) for k, i in todo if i in self.active]  # after a pattern is dropped
            if not todo:
                break
            child = self._start()
            request = {"lines": {k: lines[k][-TAIL:] for k in sorted({k for k, _ in todo})}, "todo": todo}
            try:
                child.stdin.write(json.dumps(request).encode() + b"\n")
                child.stdin.flush()
            except OSError:  # it died: started again below, once; a second death is an error
                self._stop()
                child = self._start()
                child.stdin.write(json.dumps(request).encode() + b"\n")
                child.stdin.flush()
            while todo:
                values = self._answer(child)
                k, i = todo[0]
                if values is None:  # over budget: named, dropped, the rest of this batch goes on
                    self._stop()
                    self.active.remove(i)
                    self.blown(i)
                    todo.pop(0)
                    break
                found[k].extend((i, v) for v in values)
                todo.pop(0)
        return found

    def _answer(self, child: subprocess.Popen) -> list[float] | None:
        """The next answer's values, or None when the child spent its budget on it."""
        import psutil

        proc = psutil.Process(child.pid)
        spent = _cpu(proc)
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([child.stdout], [], [], 0.05)
            if ready:
                chunk = os.read(child.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"the metric pattern process ended (exit code {child.wait()})")
                self._buffer += chunk
            elif _cpu(proc) - spent > self.budget_s:
                return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _start(self) -> subprocess.Popen:
        if self._child is None:
            self._child = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, start_new_session=True)
            self._child.stdin.write(json.dumps(self.regexes).encode() + b"\n")
            self._child.stdin.flush()
            self._buffer = b""
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()  # mid-match it would not read its stdin's end
            child.wait()
            for pipe in (child.stdin, child.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


def _cpu(proc) -> float:
    import psutil

    try:
        times = proc.cpu_times()
    except psutil.Error:
        return float("inf")  # gone: the read sees its end
    return times.user + times.system


def _serve() -> None:
    """The child: patterns on the first line; each request after, one answer per (line, pattern)."""
    _die_with_parent()
    patterns = [re.compile(r) for r in json.loads(sys.stdin.readline())]
    out = sys.stdout
    for request in sys.stdin:
        request = json.loads(request)
        lines = request["lines"]
        for k, i in request["todo"]:
            values = []
            for found in patterns[i].finditer(lines[str(k)]):
                try:
                    values.append(float(found.group(1)))
                except (TypeError, ValueError):
                    continue  # a match that is not a number (e.g. "nan" parses; "n/a" does not)
            out.write(json.dumps(values) + "\n")
            out.flush()  # each answer as it is made: the parent times the pattern after it


def _die_with_parent() -> None:
    """Killed with the runner, even mid-match (a match holds the GIL: no Python code could react)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (Linux)
    except (OSError, AttributeError):
        pass  # elsewhere: the end of stdin ends it once the match in hand is done
    if os.getppid() == 1:
        sys.exit(0)


if __name__ == "__main__":
    _serve()
