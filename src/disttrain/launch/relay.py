"""An agent's streams, relayed: to the terminal, to per-rank logs in the run folder and to an optional
transcript; each agent's own lines kept for its root-cause block (see :mod:`.flow`)."""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from pathlib import Path
from typing import TextIO

from ..private import private_opener
from ..ssh import last_word
from ..wire import for_people

AGENT_LINES_KEPT = 200
_PREFIX = re.compile(r"^\[(?P<host>[^\]\s]+) rank(?P<rank>\d+)\] ")
# A C++ stack dump, as torch's c10 errors and warnings print them: kept in the logs, not shown.
_CPP_FRAME = re.compile(r"^(frame #\d+: |Exception raised from .*\(most recent call first\):$|<omitting python frames>$)")
# torch's own C++ log lines (glog style: "[W1124 03:33:59.078 TCPStore.cpp:138] ...") from an agent's
# internals -- a store that lost its server once another node failed: disttrain says what happened.
_C10_LOG = re.compile(r"^\[[WEIF]\d{4} [\d:.]+ (\d+ )?\S+:\d+\] ")


def srun_cut(line: str) -> tuple[str, str]:
    """``("", line)``; or, for an agent's wire line that srun cut in two with its own word, the line's
    first part (to be joined to the next line, its rest) and srun's line. srun relays a task's output
    in pieces of 1,024 bytes, and what it says itself as the task exits ("srun: error: node1: task 0:
    Exited with exit code 124") can land between two of them: seen under load, inside the hang report
    an agent writes just before it exits, whose rank then had "no report"."""
    cut = line.find("srun: ")
    if cut <= 0 or for_people(line):
        return "", line
    try:
        json.loads(line[line.index("{"):])
        return "", line  # whole: the words are inside the message
    except ValueError:
        return line[:cut], line[cut:]


class Relay:
    """Copies one stream of one agent to the terminal, to per-rank log files and to an
    optional transcript; keeps the agent's own lines (its root-cause block) and writes them to
    ``node<k>.log``. C++ stack dumps go to the logs only."""

    def __init__(self, run_dir: Path, lock: threading.Lock, transcript: TextIO | None = None,
                 on_agent_line=None, on_rank_line=None) -> None:
        self._run_dir = run_dir
        self._lock = lock
        self._transcript = transcript
        self._files: dict[str, TextIO] = {}
        self._on_agent_line = on_agent_line
        self._on_rank_line = on_rank_line
        # Per agent: its own (unprefixed) stderr lines; the root-cause block is at the end.
        self.agent_lines: dict[int, deque[str]] = {}
        self.drained: dict[int, threading.Thread] = {}  # per agent: the thread reading its stderr

    def pump(self, stream, out: TextIO, agent: int | None = None) -> None:
        in_dump = False
        head = ""  # the first part of an agent's wire line that srun cut in two
        for line in iter(stream.readline, ""):
            if head:
                line, head = head + line, ""
            elif agent is not None:
                head, line = srun_cut(line)
            match = _PREFIX.match(line)
            if not match and agent is not None and self._on_agent_line is not None:
                if self._on_agent_line(agent, line):  # the launcher consumed it (a heartbeat)
                    continue
            if match and self._on_rank_line is not None:
                self._on_rank_line(line[match.end():])
            text = line[match.end():] if match else line
            if _CPP_FRAME.match(text) or (not match and agent is not None and _C10_LOG.match(text)):
                in_dump = True
            elif text.strip():
                in_dump = False
            with self._lock:
                if not in_dump:
                    if for_people(line):  # a wire message (a track line): for the launcher, the tracker only
                        out.write(line)
                        out.flush()
                    if self._transcript is not None:
                        self._transcript.write(line)
                        self._transcript.flush()
                if match:
                    self._write(f"rank{match['rank']}.log", text)
                elif agent is not None:
                    self._write(f"node{agent}.log", text)
                    if not in_dump:
                        self.agent_lines.setdefault(agent, deque(maxlen=AGENT_LINES_KEPT)).append(line.rstrip("\n"))

    def _write(self, name: str, text: str) -> None:
        if name not in self._files:
            self._files[name] = open(self._run_dir / name, "a", opener=private_opener)  # a rank printed it: 0600
        self._files[name].write(text)
        self._files[name].flush()

    def report(self, agent: int) -> str:
        """The agent's own message about the failure: from its first ``disttrain:`` line on."""
        lines = list(self.agent_lines.get(agent, ()))
        start = next((i for i, line in enumerate(lines) if line.startswith("disttrain:")), len(lines))
        return "\n".join(lines[start:])

    def last_line(self, agent: int) -> str:
        """Agent ``agent``'s last own line that says something (it exited: its stream is read to the
        end first); ssh's notices are skipped -- a host key's warning is no cause of an end."""
        pump = self.drained.get(agent)
        if pump is not None:
            pump.join(timeout=2)
        return last_word(list(self.agent_lines.get(agent, ())))

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
