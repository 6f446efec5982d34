"""Where disttrain keeps things on this machine: the home folder and run names."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path


def disttrain_home() -> Path:
    """``$DISTTRAIN_HOME``, else ``~/.disttrain``: run folders, jobs and their store."""
    return Path(os.environ.get("DISTTRAIN_HOME") or Path.home() / ".disttrain")


def new_run_id(entry: str, *, is_module: bool = False) -> str:
    """``<time>-<name>-<4 hex>``: sorts by time, names the script (or a module's last part), never collides."""
    name = entry.rsplit(".", 1)[-1] if is_module else Path(entry).stem
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "run"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{secrets.token_hex(2)}"
