"""The in-place regroup's word from a node's agent to each of its workers (see
:mod:`disttrain.runtime.regroup`): the new membership, where the worker listens for it, and the exit
code of a worker whose new group did not form. Only the standard library: the agent and the
runtime both read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

FALLBACK_EXIT = 76  # the in-place group did not form: the agent restarts the workers (the restart path)
JOIN_TIMEOUT_S = 20.0  # the new group forms within this (DISTTRAIN_REGROUP_JOIN_S), or falls back to the restart
JOIN_ENV = "DISTTRAIN_REGROUP_JOIN_S"
STACKS_SIGNAL_OFFSET = 6  # SIGRTMIN + 6: an armed worker writes every thread's stack to its stderr


@dataclass(frozen=True)
class Plan:
    """The new membership for one worker, as its agent sends it."""

    attempt: int
    env: dict[str, str]  # RANK, WORLD_SIZE, GROUP_RANK... and the store to meet on
    lost: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        return int(self.env["RANK"])

    @property
    def world_size(self) -> int:
        return int(self.env["WORLD_SIZE"])

    def to_bytes(self) -> bytes:
        return json.dumps({"attempt": self.attempt, "env": self.env, "lost": list(self.lost)}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Plan:
        raw = json.loads(data)
        return cls(attempt=int(raw["attempt"]), env={k: str(v) for k, v in raw["env"].items()},
                   lost=tuple(raw.get("lost", ())))


def socket_path(folder: str, local_rank: int | str) -> str:
    """Where the worker of ``local_rank`` listens (the agent sends there)."""
    return os.path.join(folder, f"regroup.local{local_rank}.sock")


def join_timeout_s(environ: Mapping[str, str]) -> float:
    """How long the new group may take to form (``DISTTRAIN_REGROUP_JOIN_S``)."""
    try:
        return float(environ.get(JOIN_ENV, JOIN_TIMEOUT_S))
    except ValueError:
        return JOIN_TIMEOUT_S


def formed_path(folder: str, local_rank: int | str) -> str:
    """Where the worker of ``local_rank`` writes the number of the last in-place round it formed: its
    agent ends a worker that was told a round and never formed it (one stuck where no thread of its
    own can end it -- native code that holds the GIL)."""
    return os.path.join(folder, f"formed.local{local_rank}")


def say_formed(folder: str, local_rank: int | str, attempt: int) -> None:
    path = formed_path(folder, local_rank)
    with open(path + ".tmp", "w") as out:
        out.write(str(attempt))
    os.replace(path + ".tmp", path)


def formed(folder: str, local_rank: int | str) -> int | None:
    """The last in-place round the worker formed (None: none yet)."""
    try:
        with open(formed_path(folder, local_rank)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
