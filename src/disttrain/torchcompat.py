"""What differs between the torch releases disttrain supports, in one place.

Each feature is detected by the thing itself -- a ``LaunchConfig`` field, an option of torchrun's
own parser, an importable name -- never by reading a version string: a vendor's build or a nightly
carries what it carries. The versions below serve only the messages ("needs torch 2.9"), and
``bench/compat.py`` (``make compat``) runs the smoke set on every torch of the range to keep them
true. Torch is imported only inside the functions, where the caller needs torch anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from .errors import UsageError

# torch's LaunchConfig fields that arrived inside the supported range, the torch that brought each,
# the option that sets it, and whether a value means "as torch does without the field" (then it is
# dropped on an older torch; any other value is a feature the user asked for, refused in one line).
_FIELD_SINCE: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "event_log_handler": ("2.8", "--event-log-handler", lambda v: v in (None, "null")),
    "numa_options": ("2.9", "--numa-binding", lambda v: v is None),
    "signals_to_handle": ("2.10", "--signals-to-handle", lambda v: v in (None, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")),
    "duplicate_stdout_filters": ("2.10", "--duplicate-stdout-filters", lambda v: not v),
    "duplicate_stderr_filters": ("2.10", "--duplicate-stderr-filters", lambda v: not v),
    "virtual_local_rank": ("2.10", "--virtual-local-rank", lambda v: not v),
    # disttrain's own stop grace is always set; an older agent keeps torch's (30 s), and the launcher still
    # escalates to SIGKILL on its own clock. --shutdown-timeout given by hand is refused by its option (below).
    "shutdown_timeout": ("2.12", "--shutdown-timeout", lambda v: True),
}

# torchrun options that arrived inside the supported range (dest -> the torch that brought it).
OPTION_SINCE = {
    "event_log_handler": "2.8", "numa_binding": "2.9", "signals_to_handle": "2.10",
    "duplicate_stdout_filters": "2.10", "duplicate_stderr_filters": "2.10", "virtual_local_rank": "2.10",
    "shutdown_timeout": "2.12", "log_line_prefix_template": "2.14", "print_completion": "2.14",
}


def torch_version() -> str:
    """The installed torch's version, for messages (importlib's metadata: no ``import torch``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def _needs(what: str, since: str) -> UsageError:
    return UsageError(f"{what} needs torch {since} or newer; this machine has torch {torch_version()} "
                      f"(upgrade torch, or drop {what.split()[0]})")


def launch_config(**fields: Any):
    """torch's ``LaunchConfig`` for the installed torch: a field it does not have is dropped where
    its value is what torch does without it, and refused in one line where the user asked for it."""
    from torch.distributed.launcher.api import LaunchConfig

    have = {f.name for f in dataclasses.fields(LaunchConfig)}
    for name in sorted(set(fields) - have):
        since, option, neutral = _FIELD_SINCE.get(name, ("a newer release", name, lambda v: False))
        if not neutral(fields[name]):
            raise _needs(option, since)
        del fields[name]
    return LaunchConfig(**fields)


@functools.lru_cache(maxsize=1)
def torchrun_dests() -> frozenset[str]:
    """Every option of the installed torch's own torchrun parser, by dest (imports torch.distributed.run)."""
    from torch.distributed.run import get_args_parser

    return frozenset(action.dest for action in get_args_parser()._actions)


def refuse_missing_options(given: Mapping[str, Any]) -> None:
    """A torchrun option the installed torch does not have yet, given on the command line or in its
    ``PET_`` variable: one line naming the torch it needs. torch is imported only when such an option
    was given."""
    asked = [dest for dest in given if dest in OPTION_SINCE and given[dest] is not None]
    if not asked:
        return
    missing = [dest for dest in asked if dest not in torchrun_dests()]
    if missing:
        dest = missing[0]
        raise _needs(f"--{dest.replace('_', '-')}", OPTION_SINCE[dest])


def fsspec_storage() -> tuple[type, type]:
    """DCP's fsspec writer and reader (a private module in every torch of the range)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def logs_specs_class(name: str) -> type:
    """torchrun's ``--logs-specs NAME`` lookup (torch's own, so the same entry points work)."""
    from torch.distributed.run import _get_logs_specs_class

    return _get_logs_specs_class(name)


def flight_recorder_matcher() -> tuple[type, type] | None:
    """torch's Flight Recorder matcher (``MatchState``, ``Op``), shipped in the wheels from about
    torch 2.10; None before, and the hang verdict judges by disttrain's own rule."""
    try:
        import torch.distributed.flight_recorder.components.types as types
    except ImportError:
        return None
    return types.MatchState, types.Op


def worker_server() -> tuple[Callable, Callable | None] | None:
    """torch's worker debug server (``_WorkerServer``), which answers a rank's Flight Recorder and
    stacks from a C++ thread, and its ``_register_handler`` for disttrain's own handler (the process
    groups; torch 2.7 or so); None on a torch without the server."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    server = getattr(c10d, "_WorkerServer", None)
    return None if server is None else (server, getattr(c10d, "_register_handler", None))


def worker_handlers() -> frozenset[str]:
    """The handlers torch's worker server answers (``fr_trace_json``: gloo's recorder, from torch 2.8 or so)."""
    try:
        from torch._C import _distributed_c10d as c10d

        return frozenset(c10d._get_handler_names())
    except (ImportError, AttributeError):
        return frozenset()


def takes(method: Callable, name: str) -> bool:
    """Whether torch's ``method`` has a parameter ``name`` (``_shutdown``'s ``timeout`` arrived in 2.12)."""
    import inspect

    return name in inspect.signature(method).parameters


def require_fsdp(device_type: str) -> None:
    """FSDP2 on ``device_type``: torch's ``fully_shard`` records events on the device's streams, which
    CPU streams can do from torch 2.7 (CUDA's always could). One line instead of torch's AttributeError."""
    import torch

    module = getattr(torch, device_type, None)
    stream = getattr(module, "Stream", None)
    if stream is not None and not hasattr(stream, "record_event"):
        raise _needs(f'strategy="fsdp" on {device_type}', "2.7")


def abandon_process_groups() -> None:
    """Drop every process group of a world that lost a member, without waiting on it: torch's
    ``_abort_process_group``, which on an older torch (2.6) aborts NCCL's groups only and leaves the
    others registered -- those are then destroyed (their sockets were already shut down).

    The groups themselves are never freed (one reference each is leaked): gloo's destructor waits for
    every collective in flight, and one that waits for the member gone would hold whichever thread
    drops the last reference -- the garbage collector's anywhere in the script, or the interpreter's
    at exit -- for the group's whole timeout."""
    import ctypes

    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    for group in list(getattr(world, "pg_names", None) or ()):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    with contextlib.suppress(Exception):
        dist.distributed_c10d._abort_process_group()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    # torch names an unnamed group by a count, and its keys on the store by that name; a join that
    # failed counted one it never made. A rank that tried one round more than another would wait
    # for the other under a name that rank never writes, for the group's whole timeout.
    if world is not None:
        world.group_count = 0
