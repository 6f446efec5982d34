"""The track line: what a worker tells the launcher's tracker, one line on stdout.

``disttrain-track: {"kind": "metrics", "rank": 0, "step": 12, "values": {"loss": 0.41}}``

The workers stay free of tracker clients: they print these lines (only when the launcher asked
for them, ``DISTTRAIN_TRACK`` set by ``--track``), the lines reach the launcher from any host as
every rank's output does, and the launcher's one writer sends them on (:mod:`disttrain.tracking`).
Stdlib only: both sides import it (the runtime writes, the launcher reads).

Kinds: ``metrics`` (``values`` at ``step``; ``reduced``: the mean over ranks, else this rank's
own), ``checkpoint`` (a save blocked training ``seconds`` at ``step``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

MARKER = "disttrain-track:"
KINDS = ("metrics", "checkpoint")


def encode(kind: str, **fields: Any) -> str:
    """The line for one record (without its newline)."""
    return f"{MARKER} {json.dumps({'kind': kind, **fields}, separators=(',', ':'))}"


def decode(text: str) -> dict[str, Any] | None:
    """The record in ``text`` (a line, with or without the launcher's ``[host rankN]`` prefix);
    None when it holds none, or one this version does not know."""
    at = text.find(MARKER)
    if at < 0:
        return None
    try:
        record = json.loads(text[at + len(MARKER):])
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return None
    if record["kind"] == "metrics":
        values = record.get("values")
        if not isinstance(values, Mapping):
            return None
        record["values"] = {str(k): float(v) for k, v in values.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return record
