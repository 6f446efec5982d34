"""Where disttrain keeps things on this machine: the home folder and run names."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path


def disttrain_home() -> Path:
    """``$DISTTRAIN_HOME``, else ``~/.disttrain``: run folders, jobs and their store."""
    return Path(os.environ.get("DISTTRAIN_HOME") or Path.home() / ".disttrain")


def new_run_id(entry: str) -> str:
    """``<time>-<script stem>-<4 hex>``: sorts by time, names the script, never collides."""
    stem = Path(entry).stem if not entry.startswith(".") else entry
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem.split(".")[-1] or stem)
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-{secrets.token_hex(2)}"


def run_folder(entry: str, log_dir: str | None) -> tuple[str, str]:
    """A run's id and its folder (absolute): ``--log-dir``, else a new one under ``runs/``."""
    run_id = new_run_id(entry)
    return run_id, os.path.abspath(log_dir or str(disttrain_home() / "runs" / run_id))
