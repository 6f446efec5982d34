"""torchrun's ``--run-path``: the script run by ``runpy.run_path`` in a worker that torch's agent
starts as a function (``multiprocessing`` with ``--start-method``), not as ``python SCRIPT``.

A module-level function, so that ``spawn`` and ``forkserver`` can pickle it by name.
"""

from __future__ import annotations

import runpy
import signal
import sys

from .lifeline import follow_parent


def run_path(script: str, *args: str) -> None:
    """Dies with its parent (the agent; with forkserver, the server the agent owns), as a script
    worker does (see lifeline.py), then runs the script as ``__main__`` with its arguments, as
    torch's own ``run_script_path`` does."""
    follow_parent(signal.SIGKILL)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
