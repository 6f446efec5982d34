"""The in-place regroup's word from a node's agent to each of its workers (see
:mod:`disttrain.runtime.regroup`): the new membership, where the worker listens for it, and the exit
code of a worker whose new group did not form. Only the standard library: the agent and the
runtime both read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

FALLBACK_EXIT = 76  # the in-place group did not form: the agent restarts the workers (the restart path)


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
