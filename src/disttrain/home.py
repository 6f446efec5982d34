"""Where disttrain keeps things on this machine: the home folder and run names."""

from __future__ import annotations

import os
import secrets
import time
import unicodedata
from pathlib import Path

from .errors import UsageError


def disttrain_home() -> Path:
    """``$DISTTRAIN_HOME``, else ``~/.disttrain``: run folders, jobs and their store."""
    given = os.environ.get("DISTTRAIN_HOME")
    if given:
        plain_path(given, "DISTTRAIN_HOME", fix="set it to a plain folder path")
    return Path(given or Path.home() / ".disttrain")


def plain_path(value: str, what: str, *, fix: str) -> str:
    """``value``, unless it holds a control character (a newline splits every line that shows
    the path, and the logs' header with it): then one line saying which and where."""
    bad = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise UsageError(f"{what} {value!r} holds a control character ({bad!r} at position "
                         f"{value.index(bad)}): {fix}")
    return value


def new_run_id(entry: str, *, is_module: bool = False) -> str:
    """``<time>-<name>-<4 hex>``: sorts by time, names the script (or a module's last part), never collides."""
    name = entry.rsplit(".", 1)[-1] if is_module else Path(entry).stem
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "run"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{secrets.token_hex(2)}"


def run_folder(entry: str, log_dir: str | None, *, is_module: bool = False) -> tuple[str, str]:
    """A run's id and its folder (absolute): ``--log-dir``, else a new one under ``runs/``."""
    run_id = new_run_id(entry, is_module=is_module)
    if log_dir:
        plain_path(log_dir, "--log-dir", fix="give a plain folder path")
    return run_id, os.path.abspath(log_dir or str(disttrain_home() / "runs" / run_id))
