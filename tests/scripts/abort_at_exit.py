"""Rank 1 dies by SIGABRT, as torch's teardown sometimes makes a worker die: ``after`` the script has
returned (libc's ``abort`` registered with ``__cxa_atexit``, as a C++ static destructor is: it runs
in ``exit()``, after Python's finalization), or ``during`` the script (before its last line).
Every rank writes ``rank<R>.done`` in ``$OUT`` once its work is done."""

import ctypes
import os
import sys

rank, out = int(os.environ["RANK"]), os.environ["OUT"]
when = os.environ.get("WHEN") or sys.argv[1]
libc = ctypes.CDLL(None)
if rank == 1 and when == "during":
    libc.abort()
with open(os.path.join(out, f"rank{rank}.done"), "w") as fh:
    fh.write("done\n")
print(f"rank {rank} done", flush=True)
if rank == 1 and when == "after":
    # after every Python atexit handler and the interpreter's finalization, as torch's destructors
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
