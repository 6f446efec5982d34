"""What every PyTorch worker loads before the user's code, for any script.

The agent puts this file's folder first on every PyTorch worker's ``PYTHONPATH`` (it holds
nothing else but ``_disttrain_group_check.py``), so that Python's ``site`` imports it at start-up,
and a plain torchrun script (its own ``init_process_group``, no ``import disttrain``) is covered
as well as one that uses the runtime. It keeps ``python script.py`` as it is -- ``sys.argv``,
``__main__``, ``sys.path[0]``, spawned DataLoader workers -- and runs the ``sitecustomize`` it
shadows, if any. In every worker a launcher started (``WORLD_SIZE`` set), a script's own
``init_process_group`` is checked against the launcher's rank, world size and address
(``_disttrain_group_check.py``). The rest is for ``--hang-timeout`` runs only.

Nothing happens until the process imports torch (``torch.distributed.distributed_c10d``, which
``import torch`` loads): a post-import hook then, in the first process of the rank to get there
(the worker itself, not its DataLoader workers or helpers; it claims ``rank<R>.pid``),

* starts torch's own worker server (``_WorkerServer``, the one ``worker_main()`` starts) on
  ``$DISTTRAIN_HANG_SOCKETS/rank<R>.sock``: it answers from a C++ thread, so the agent gets the
  rank's Flight Recorder and Python stacks while its main thread is blocked in a collective;
* serves ``disttrain_groups`` there: every process group's name and global ranks (gloo's
  recorder dump has no membership). It is Python, so the agent asks it only at a hang: a Python
  handler takes the GIL from the server's C++ thread, and during the interpreter's exit that
  aborts the process;
* registers the rank's stack dump on a signal of its own (:data:`DUMP_SIGNAL`): :mod:`faulthandler`
  writes every thread's Python stack to ``rank<R>.stacks`` beside the socket from its C signal
  handler, without the GIL -- a rank stuck in native code that holds the GIL (where the server's
  ``dump_traceback``, Python, never answers) still shows its stack. The signal is delivered to a
  thread of its own (the main thread blocks it): a signal interrupts the blocking call of the
  thread it lands on (``sleep`` returns early, a read fails with EINTR), and looking at a stuck
  rank must never unstick it. The agent sends it only when ``/proc`` shows it is caught;
* sets torch's default process-group timeout to ``$DISTTRAIN_PG_TIMEOUT`` seconds, above the hang
  timeout, so that a collective's own timeout never beats the verdict (a script's explicit
  ``timeout=`` is its own choice and stays).

The Flight Recorder itself is torch's: ``TORCH_FR_BUFFER_SIZE``, set in the worker environment.
Only the standard library at start-up, as this runs in every Python process of the job.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

SOCKETS = "DISTTRAIN_HANG_SOCKETS"
DUMP_SIGNAL_OFFSET = 5  # SIGRTMIN + 5: no other program of the job is expected to use it (disttrain.agent.stacks)
PG_TIMEOUT = "DISTTRAIN_PG_TIMEOUT"
HOOKED = "torch.distributed.distributed_c10d"
_HERE = os.path.dirname(os.path.abspath(__file__))
_server = None  # kept for the life of the process (see _serve)
_SELF = "_disttrain_sitecustomize"  # this module's name once the one it shadows is sitecustomize


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows (the user's, a distribution's, a virtualenv's), as
    Python would have: it *becomes* ``sys.modules["sitecustomize"]``, kept for the life of the process
    as under torchrun. Run as a throwaway module, it was freed once run, and with it what it holds --
    a ``torch.library.Library`` that defines ops (a torchvision shim) unregisters them when freed."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[_SELF] = sys.modules[__name__]  # this bootstrap, under a name of its own
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` then returns, as without disttrain
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules["sitecustomize"] = sys.modules[_SELF]
        raise


class _AfterImport:
    """A meta-path finder that runs ``then(module)`` once ``name`` has been imported; torch is not
    touched before the script imports it."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; the finders after it find the module
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, then = spec.loader.exec_module, self.then

        def exec_module(module):
            run(module)
            try:
                then(module)
            except Exception as err:  # never break the script's import of torch
                print(f"disttrain: note: no hang diagnostics in this worker: {type(err).__name__}: {err}",
                      file=sys.stderr)

        spec.loader.exec_module = exec_module  # this module's own loader object: nothing else changes
        return spec


def _claim(folder: str, rank: str) -> bool:
    """Whether this process is the rank's worker: the first of its processes to import torch.

    A claim whose process is gone (a helper that imported torch and exited first) is taken over.
    """
    pid_file = os.path.join(folder, f"rank{rank}.pid")
    for _ in range(2):
        try:
            fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                with open(pid_file) as fh:
                    owner = int(fh.read().strip() or 0)
                os.kill(owner, 0)
                return False
            except (OSError, ValueError):  # its process is gone (or it is unreadable): take it over
                try:
                    os.unlink(pid_file)
                except OSError:
                    return False
                continue
        except OSError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def _quietly(call):
    """torch's worker server logs its start at WARNING on stderr: keep that off the user's terminal."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        return call()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _groups(_request, response) -> None:
    """``disttrain_groups``: ``{name: {"ranks": [global ranks], "desc": ...}}`` of every live group."""
    import json

    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    groups = {name: {"ranks": sorted(world.pg_group_ranks.get(pg, {})), "desc": getattr(pg, "group_desc", "")}
              for pg, name in list(world.pg_names.items())}
    response.set_content(json.dumps(groups), "application/json")
    response.set_status(200)


def _serve(c10d) -> None:
    global _server
    folder, rank = os.environ.get(SOCKETS), os.environ.get("RANK")
    if not folder or rank is None:
        return
    timeout = os.environ.get(PG_TIMEOUT)
    if not _claim(folder, rank):
        return
    if timeout:
        from datetime import timedelta

        c10d.default_pg_timeout = timedelta(seconds=float(timeout))
        if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
            c10d.default_pg_nccl_timeout = timedelta(seconds=float(timeout))
    _stack_dump(os.path.join(folder, f"rank{rank}.stacks"))
    from disttrain.torchcompat import worker_server

    served = worker_server()
    if served is None:  # a torch without it: the verdict goes by the stacks alone
        return
    server_class, register = served
    if register is not None:  # torch 2.6 serves the recorder without handlers of ours
        register("disttrain_groups", _groups)
    sock = os.path.join(folder, f"rank{rank}.sock")
    try:
        os.unlink(sock)  # a previous attempt's
    except OSError:
        pass
    _server = _quietly(lambda: server_class(sock))
    # Never destroyed: at exit its destructor would log three lines on the user's terminal, and a
    # shutdown from an atexit handler can deadlock on the GIL. The process's end closes it.
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_server))


def _exit_cleanly() -> None:
    """torch's abort at exit (agent/exit_abort.py): prevented where it can be, told apart where not.

    From an ``atexit`` handler registered now, before the script's own (so it runs after theirs,
    just before the interpreter's finalization), unless the script ended by an unhandled exception
    or a non-zero ``sys.exit``: first the mark that the script returned; then, in a process that
    used torch.distributed and still has threads torch started (:func:`_torch_threads`), a
    ``gc.collect()`` and, if they outlive it, a short sleep. gloo's worker threads free each
    finished collective's work on their own, and freeing one takes the GIL: a thread that asks for
    it once finalization has begun is unwound inside a C++ destructor, and the process dies by
    SIGABRT ("terminate called without an active exception") -- the DDP model the script still
    holds keeps its process group's threads alive past ``destroy_process_group()``. Collected and
    given the GIL while the interpreter is whole, they finish first (the runtime's own shutdown
    does the same for scripts that call ``disttrain.init()``). A bare ``raise SystemExit(N)`` is
    not seen: were it followed by such an abort, the rank would count as finished. An unhandled
    exception is also marked when it is raised (``rank<R>.raised``, :func:`disttrain.workerenv.mark_raised`):
    the agent's root cause is the rank that raised first.
    """
    folder, local_rank = os.environ.get("DISTTRAIN_EXIT_MARKS"), os.environ.get("LOCAL_RANK")
    if not folder or local_rank is None:
        return
    import atexit

    failed = []
    hook, exit_ = sys.excepthook, sys.exit

    def excepthook(*args):
        failed.append(True)
        try:  # when the rank raised, for its agent's root cause; disttrain is imported only now
            from disttrain.workerenv import mark_raised

            mark_raised()
        except Exception:  # noqa: BLE001 -- never in the way of the script's own error
            pass
        hook(*args)

    def exit(code=None):
        if code not in (None, 0):
            failed.append(True)
        exit_(code)

    def at_exit():
        if failed or getattr(sys, "last_value", None) is not None:  # last_value: an unhandled exception
            return
        try:
            with open(os.path.join(folder, f"local{local_rank}.{os.getpid()}"), "w") as fh:
                fh.write("returned\n")
        except OSError:  # no mark: an abort after this is a failure, as without disttrain
            pass
        if "torch.distributed" in sys.modules and _torch_threads():
            import gc
            import time

            gc.collect()
            if _torch_threads():  # a process group outlived the collection: its threads may still free work
                time.sleep(0.1)  # long enough for a descheduled gloo thread to run (the runtime's _DRAIN_S)

    sys.excepthook, sys.exit = excepthook, exit
    atexit.register(at_exit)


# The names torch gives the threads it starts (gloo's ``pt_gloo_runloop``, NCCL's watchdog, autograd's
# device threads: ``pt_...``) and gloo's own I/O thread (``gloo_tcp_loop``).
_TORCH_THREADS = ("pt_", "gloo")


def _torch_threads() -> bool:
    """Whether a thread torch started is still alive in this process (True where it cannot be told).

    A process group's threads end with it: once ``destroy_process_group()`` has freed the last
    reference to the group (no DDP model holds it), none is left to take the GIL during the
    interpreter's finalization, and the exit's drain has nothing to wait for.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                name = fh.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(_TORCH_THREADS):
            return True
    return False


def _stack_dump(path: str) -> None:
    """faulthandler on ``SIGRTMIN + DUMP_SIGNAL_OFFSET``, received by a waiting thread (see the top)."""
    import faulthandler
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGRTMIN"):
        return  # the main thread could not be spared the signal: no dump on it, none sent
    sig = signal.SIGRTMIN + DUMP_SIGNAL_OFFSET
    global _stacks
    _stacks = open(path, "w")  # kept open: faulthandler writes to its descriptor from the handler
    started = threading.Event()

    def receive() -> None:  # blocks in C (no GIL held), signals for the dump land here
        started.set()
        threading.Event().wait()

    threading.Thread(target=receive, name="disttrain-stacks", daemon=True).start()
    started.wait()
    faulthandler.register(sig, file=_stacks, all_threads=True, chain=False)
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})  # the main thread's, and its later threads'


_stacks = None


def _check_group(c10d) -> None:
    """A script's own init_process_group checked against the launcher's (_disttrain_group_check.py)."""
    import _disttrain_group_check

    _disttrain_group_check.install(c10d)


def _install() -> None:
    # torch imported already (by the sitecustomize chained above): hooked now rather than never
    c10d = sys.modules.get(HOOKED)
    for wanted, then in ((os.environ.get(SOCKETS), _serve), (os.environ.get("WORLD_SIZE"), _check_group)):
        if wanted and c10d is None:
            sys.meta_path.insert(0, _AfterImport(HOOKED, then))
        elif wanted:
            then(c10d)


try:
    _chain()
finally:
    _install()
    _exit_cleanly()
