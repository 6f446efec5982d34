"""Ending a process at once, once what it registered to run at exit has run.

For a process whose remaining life would only be the interpreter's finalization -- torch's modules
torn down one object at a time, and gloo threads that may abort it by asking for the GIL meanwhile:
a launcher whose run is over (``cli/quick_exit.py``), a worker whose script ran again after an
in-place regroup (``runtime/regroup.py``). Only the standard library.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
from typing import NoReturn


def exit_after_atexit(code: int) -> NoReturn:
    """``atexit`` handlers (each one's exception is printed and the others still run), Python's and
    C's output buffers flushed (what ``exit()`` would flush and ``os._exit`` does not), then ``code``."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: the normal exit could not write it either
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)
