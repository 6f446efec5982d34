"""torchrun's options, as ``disttrain run`` takes them: the table, and torchrun's value formats.

The table mirrors ``torch.distributed.run.get_args_parser()`` option for option (spellings,
flag or value, choices, value type) for the newest supported torch; ``tests/test_torchrun_options.py``
walks the installed torch's parser and fails on any difference, so a torch release that adds an
option is caught there, not by a user. An option an older torch of the range lacks is refused on
that torch in one line naming the release that brought it (:mod:`disttrain.torchcompat`). It is a copy rather than a call because importing ``torch.distributed.run`` costs
seconds, and every ``disttrain`` command (``jobs ls`` too) builds this parser.

Each option is also read from ``PET_<DEST>`` in the launching shell, the command line
winning, as torchrun's own ``env``/``check_env`` argparse actions do.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

STATIC_DEFAULT_PORT = 29500  # torchrun's --master-port default
C10D_DEFAULT_PORT = 29400  # torch's c10d rendezvous port when the endpoint names none
START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode
COMPLETION_SHELLS = ("bash", "zsh", "tcsh")  # shtab's shells, as torchrun offers them
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")  # torch.distributed.elastic.events.handlers
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
RDZV_CONF_DISTTRAIN = ("is_host", "join_timeout", "last_call_timeout", "close_timeout", "read_timeout",
                       "timeout", "rank")  # what torch's rendezvous handlers read; others are passed on as is
_STD_VALUE = re.compile(r"^[0123]$")
_STD_MAPPING = re.compile(r"^(\d+:[0123],)*(\d+:[0123])$")
_HOST = re.compile(r"^[\w.:-]+$")


def env_name(dest: str) -> str:
    """torchrun's variable for an option: ``PET_`` + its dest in capitals (``PET_NPROC_PER_NODE``)."""
    return f"PET_{dest.upper()}"


def parse_nnodes(raw: str, *, where: str = "--nnodes") -> tuple[int, int]:
    """``N`` → (N, N); ``MIN:MAX`` → (MIN, MAX), as torchrun takes it."""
    parts = str(raw).split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise UsageError(f"{where} takes a node count N or a range MIN:MAX, got {raw!r}") from None
    if not 0 < low <= high:
        raise UsageError(f"{where} {raw}: need 1 <= MIN <= MAX")
    return low, high


def parse_rdzv_conf(raw: str, *, where: str = "--rdzv-conf") -> dict[str, str]:
    """``key1=value1,key2=value2`` (torch's format: every key has a non-empty value)."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in str(raw).split(","))):
        key, sep, value = item.partition("=")
        if not key.strip() or not sep or not value.strip():
            raise UsageError(f"{where} takes key=value pairs separated by commas, e.g. "
                             f"join_timeout=300,last_call_timeout=5; got {raw!r}")
        conf[key.strip()] = value.strip()
    return conf


# What torch's rendezvous handlers read from --rdzv-conf (DynamicRendezvousHandler with the c10d backend;
# the static TCP rendezvous), and which of those are whole numbers. Other keys are ignored by torch.
RDZV_INT_KEYS = {
    "c10d": ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
             "keep_alive_max_attempt", "read_timeout"),
    "static": ("timeout", "rank"),
}
RDZV_OTHER_KEYS = {"c10d": ("is_host", "store_type", "timeout"), "static": ()}  # timeout: torch's launcher's own


def check_rdzv_conf(conf: Mapping[str, str], rdzv_backend: str, *, where: str = "--rdzv-conf") -> list[str]:
    """Before anything starts: a value torch would fail on after the start is one line (exit 2), a key
    torch ignores is a note (returned). Backends other than c10d and static are left to torch."""
    ints = RDZV_INT_KEYS.get(rdzv_backend)
    if ints is None:
        return []
    for key in ints:
        if key in conf:
            try:
                number = int(conf[key])
            except ValueError:
                raise UsageError(f"{where} {key}={conf[key]}: {key} is a whole number of "
                                 f"{'seconds' if key.endswith(('timeout', 'interval')) else 'times'}, "
                                 f"e.g. {key}=300") from None
            if number < 0:
                raise UsageError(f"{where} {key}={conf[key]}: {key} cannot be negative")
    if rdzv_backend == "c10d" and "is_host" in conf and conf["is_host"].lower() not in BOOL_WORDS:
        raise UsageError(f"{where} is_host={conf['is_host']}: give 1 or 0 (true/false, yes/no)")
    known = (*ints, *RDZV_OTHER_KEYS[rdzv_backend])
    if rdzv_backend == "c10d" and "timeout" in conf:
        return [f"{where} timeout is not read by the c10d rendezvous (torch ignores it): "
                f"join_timeout (or --rdzv-timeout) is how long nodes wait to join"]
    unknown = sorted(set(conf) - set(known))
    if unknown:
        return [f"{where} {', '.join(unknown)}: not a {rdzv_backend} rendezvous key (torch ignores it); "
                f"its keys are {', '.join(k for k in known if k != 'timeout' or rdzv_backend == 'static')}"]
    return []


BOOL_WORDS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")  # torch's get_as_bool


def local_ranks_note(shown: tuple[int, ...] | None, nproc: int, *, where: str = "--local-ranks-filter") -> str | None:
    """A note when the filter names local ranks that ``nproc`` workers a node do not have."""
    if shown is None:
        return None
    missing = [r for r in shown if r >= nproc]
    if not missing:
        return None
    have = f"local ranks 0..{nproc - 1}" if nproc > 1 else "local rank 0"
    if len(missing) == len(shown):
        return (f"{where} {','.join(map(str, shown))} names no local rank of {nproc} worker(s) a node ({have}): "
                "no worker's output reaches the terminal (the rank logs keep all of it)")
    return f"{where}: local rank(s) {','.join(map(str, missing))} do not exist with {nproc} worker(s) a node ({have})"


def parse_endpoint(raw: str, *, default_port: int, where: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT`` too) → (host, port), ``default_port`` when none is given."""
    text = str(raw).strip()
    if text.startswith("[") and "]" in text:
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise UsageError(f"{where} takes HOST:PORT, got {raw!r}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, None
    if not host or not _HOST.match(host):
        raise UsageError(f"{where} takes HOST:PORT with HOST an address or a host name, got {raw!r}")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UsageError(f"{where}: the port must be in 1..65535, got {raw!r}")
    return host, int(port_text)


def check_std(raw: str, *, where: str) -> str:
    """``--redirects``/``--tee``: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank ``0:1,1:3``."""
    text = str(raw).strip()
    if not (_STD_VALUE.match(text) or _STD_MAPPING.match(text)):
        raise UsageError(f"{where} takes 0 (none), 1 (stdout), 2 (stderr), 3 (both) or per local rank "
                         f"like 0:3,1:1; got {raw!r}")
    return text


def std_of(spec: str, local_rank: int) -> int:
    """The streams (1 stdout, 2 stderr, 3 both) a checked ``--redirects``/``--tee`` value names for a local rank."""
    if _STD_VALUE.match(spec):
        return int(spec)
    return dict((int(r), int(v)) for r, v in (pair.split(":") for pair in spec.split(","))).get(local_rank, 0)


def parse_local_ranks(raw: str, *, where: str = "--local-ranks-filter") -> tuple[int, ...] | None:
    """``0,2`` → (0, 2); empty → None (every local rank is shown)."""
    text = str(raw).strip()
    if not text:
        return None
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise UsageError(f"{where} takes local ranks separated by commas, e.g. 0,1; got {raw!r}") from None
    if ranks[0] < 0:
        raise UsageError(f"{where}: local ranks are 0 or more, got {raw!r}")
    return tuple(ranks)


def split_filters(raw: str) -> list[str]:
    """torchrun's list format for ``--duplicate-*-filters``: commas separate, ``,,`` is a comma."""
    marker = "\0"
    return [item.replace(marker, ",") for item in str(raw).replace(",,", marker).split(",")]


def check_signals(raw: str, *, where: str = "--signals-to-handle") -> str:
    """``SIGTERM,SIGUSR1``: names of signals this platform has."""
    names = [name.strip() for name in str(raw).split(",") if name.strip()]
    unknown = [name for name in names if not isinstance(getattr(signal, name, None), signal.Signals)]
    if unknown or not names:
        raise UsageError(f"{where} takes signal names separated by commas, e.g. SIGTERM,SIGUSR1; "
                         f"{(unknown or [raw])[0]!r} is not one")
    return ",".join(names)


def _flag_value(raw: str, name: str) -> bool:
    """A ``PET_`` value of a flag: torchrun reads it as an integer (0 off, else on)."""
    try:
        return bool(int(raw))
    except ValueError:
        raise UsageError(f"{name} must be 0 or 1 (as torchrun reads it), got {raw!r}") from None


@dataclass(frozen=True)
class TorchrunOption:
    """One option of torchrun's parser: its spellings, its kind and what it means here."""

    dest: str
    flags: tuple[str, ...]
    meaning: str  # torchrun's meaning, in a line
    here: str = ""  # what disttrain adds or does differently (empty: exactly torchrun's)
    flag: bool = False  # a switch (no value)
    convert: Callable[[str], Any] = str  # torchrun's value type
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def env(self) -> str:
        return env_name(self.dest)


def _opt(dest: str, flags: tuple[str, ...], meaning: str, here: str = "", **kw: Any) -> TorchrunOption:
    return TorchrunOption(dest=dest, flags=flags, meaning=meaning, here=here, **kw)


def _both(name: str) -> tuple[str, ...]:
    """``--a-b`` and torchrun's older ``--a_b``."""
    return (f"--{name}", f"--{name.replace('-', '_')}") if "-" in name else (f"--{name}",)


OPTIONS: tuple[TorchrunOption, ...] = (
    _opt("nnodes", ("--nnodes",), "number of nodes, or a range MIN:MAX (elastic)",
         "MIN:MAX uses the c10d rendezvous (static needs a fixed count); the job starts once MIN nodes "
         "joined and the rendezvous' last call (last_call_timeout, 30 s) passed", metavar="N|MIN:MAX"),
    _opt("nproc_per_node", _both("nproc-per-node"), "workers per node: a number, auto, cpu, gpu or xpu",
         "also -n; the default is auto, which is one per GPU and, on CPU, one per two cores (torchrun: 1, "
         "and auto is one per core)", metavar="N|auto|cpu|gpu"),
    _opt("rdzv_backend", _both("rdzv-backend"), "rendezvous backend: static, c10d, etcd, etcd-v2",
         "default static on one node as across --hosts; etcd needs python-etcd on every node",
         metavar="static|c10d|etcd|etcd-v2"),
    _opt("rdzv_endpoint", _both("rdzv-endpoint"), "rendezvous endpoint HOST[:PORT] (c10d: port 29400 if none)",
         "each node finds its own address and interface toward HOST (GLOO/NCCL_SOCKET_IFNAME, --local-addr) and "
         "whether it hosts the c10d store", metavar="HOST[:PORT]"),
    _opt("rdzv_id", _both("rdzv-id"), "the job's id: nodes with the same id form one job",
         "default: the run id (one plan for every node) or one derived from the endpoint (nodes started by hand)",
         metavar="ID"),
    _opt("rdzv_conf", _both("rdzv-conf"), "extra rendezvous settings key=value,...",
         "is_host and join_timeout are set for you (join_timeout from --rdzv-timeout) unless given here",
         metavar="K=V,..."),
    _opt("standalone", ("--standalone",), "one node, a c10d rendezvous on a free local port",
         "one node is the default anyway; --rdzv-* values are ignored, as by torchrun", flag=True),
    _opt("max_restarts", _both("max-restarts"), "restart the worker group up to N times on a failure",
         convert=int, metavar="N"),
    _opt("monitor_interval", _both("monitor-interval"), "seconds between checks of the workers' state",
         convert=float, metavar="S"),
    _opt("start_method", _both("start-method"), "multiprocessing start method for function entrypoints",
         "used with --run-path (the only function entrypoint); a script runs as a subprocess either way, as "
         "under torchrun", choices=START_METHODS),
    _opt("event_log_handler", _both("event-log-handler"), "where torch elastic's events are logged",
         metavar="|".join(EVENT_LOG_HANDLERS)),
    _opt("role", ("--role",), "the workers' role name (ROLE_NAME)", metavar="NAME"),
    _opt("module", ("-m", "--module"), "run the script as a Python module, like python -m", flag=True),
    _opt("no_python", _both("no-python"), "run the script as a program, without python in front",
         "looked up on PATH like torchrun does; each worker still dies with its agent", flag=True),
    _opt("run_path", _both("run-path"), "run the script with runpy.run_path in a worker started by "
         "multiprocessing (--start-method)", flag=True),
    _opt("log_dir", _both("log-dir"), "base folder for the workers' log files",
         "also disttrain's run folder (plan.json, attempt_K/rankR.stdout); torchrun's own layout "
         "<log-dir>/<rdzv id>_<suffix>/attempt_K/<local rank>/{stdout,stderr}.log is written there too",
         metavar="DIR"),
    _opt("redirects", ("-r", "--redirects"), "send these streams to the log files only (0-3, or per local "
         "rank 0:1,1:2)", "the files are always written; a redirected stream that is not teed leaves the "
         "terminal", metavar="STD"),
    _opt("tee", ("-t", "--tee"), "send these streams to the log files and the terminal",
         "disttrain always keeps every stream in its files and, unless --redirects says otherwise, shows it",
         metavar="STD"),
    _opt("local_ranks_filter", _both("local-ranks-filter"), "show only these local ranks on the terminal",
         "combines with --ranks (global ranks); the files keep every rank", metavar="R,R"),
    _opt("duplicate_stdout_filters", _both("duplicate-stdout-filters"),
         "also copy the stdout lines containing any of these strings to filtered_stdout.log",
         "the file is <run folder>/attempt_K/filtered_stdout.log", convert=split_filters, metavar="S,S"),
    _opt("duplicate_stderr_filters", _both("duplicate-stderr-filters"),
         "also copy the stderr lines containing any of these strings to filtered_stderr.log",
         "the file is <run folder>/attempt_K/filtered_stderr.log", convert=split_filters, metavar="S,S"),
    _opt("node_rank", _both("node-rank"), "this node's rank (static rendezvous)", convert=int, metavar="K"),
    _opt("master_addr", _both("master-addr"), "address of node rank 0 (static rendezvous)",
         "checked before the start: a name that does not resolve, or on node 0 an address that is not this "
         "machine's, is one line and exit 2", metavar="ADDR"),
    _opt("master_port", _both("master-port"), "rendezvous port on node rank 0 (static; default 29500)",
         "default on one node: a free port", convert=int, metavar="PORT"),
    _opt("local_addr", _both("local-addr"), "this node's address for the rendezvous",
         "default: the address of the interface that routes to the endpoint (never the host name's)",
         metavar="ADDR"),
    _opt("logs_specs", _both("logs-specs"), "a LogsSpecs class from the torchrun.logs_specs entry points",
         "its files are written; disttrain's own names are hard links to them", metavar="NAME"),
    _opt("numa_binding", _both("numa-binding"), "bind each worker to the CPUs near its GPU",
         "on a node without CUDA GPUs or without numactl: said in one line, and the workers run unbound",
         choices=NUMA_MODES),
    _opt("signals_to_handle", _both("signals-to-handle"), "signals the agent forwards to the workers",
         metavar="SIG,SIG"),
    _opt("shutdown_timeout", _both("shutdown-timeout"), "seconds workers get after SIGTERM before SIGKILL",
         "the same setting as --stop-grace (default 15 s; torchrun: 30 s or TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
         convert=int, metavar="S"),
    _opt("virtual_local_rank", _both("virtual-local-rank"),
         "LOCAL_RANK=0 in every worker, each seeing only its own GPU as device 0", flag=True),
    _opt("log_line_prefix_template", _both("log-line-prefix-template"),
         "the prefix of each worker line on the terminal; ${role_name}, ${local_rank}, ${rank}, ${hostname}",
         "default [rank${rank}] (one node) or [HOST rank${rank}]", metavar="TEMPLATE"),
    _opt("print_completion", _both("print-completion"), "print a shell completion script and exit",
         "completes disttrain's own commands; needs the shtab package", choices=COMPLETION_SHELLS),
)
# Options of a newer torch than some of the supported range: disttrain run refuses each in one line where the
# installed torch lacks it (disttrain.torchcompat.OPTION_SINCE says which torch brought it).

BY_DEST = {option.dest: option for option in OPTIONS}


def from_environ(dest: str, environ: Mapping[str, str]) -> Any:
    """An option's value from its ``PET_`` variable, converted as torchrun would; None if unset."""
    option = BY_DEST[dest]
    raw = environ.get(option.env)
    if raw is None or (raw == "" and not option.flag):
        return None
    if option.flag:
        return _flag_value(raw, option.env)
    if option.choices and raw not in option.choices:
        raise UsageError(f"{option.env} must be one of {', '.join(option.choices)}, got {raw!r}")
    try:
        return option.convert(raw)
    except ValueError:
        raise UsageError(f"{option.env}={raw!r} is not a valid value for {option.flags[0]}") from None


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the nodes meet, as torchrun decides it from its options."""

    rdzv_backend: str
    master_addr: str | None  # None: 127.0.0.1 (one node)
    master_port: int | None  # None: a free port (one node)
    notes: tuple[str, ...] = ()  # what was ignored or assumed, one line each


def _default_port(rdzv_backend: str) -> int:
    return STATIC_DEFAULT_PORT if rdzv_backend == "static" else C10D_DEFAULT_PORT


def resolve_rendezvous(*, rdzv_backend: str | None, endpoint: str | None, master_addr: str | None,
                       master_port: int | None, nnodes: tuple[int, int], node_rank: int,
                       standalone: bool, placed: bool = False) -> Rendezvous:
    """torchrun's rules: ``--standalone`` is one node on a local port and overrides the ``--rdzv-*``
    values; ``--rdzv-endpoint`` wins over ``--master-addr/--master-port``; ``--node-rank`` is for
    the static rendezvous only. disttrain adds: ``MIN:MAX`` picks c10d unless --rdzv-backend is given;
    ``placed``: a launcher places every node (``--hosts``) and finds the master itself, so no
    address is assumed when none is given."""
    low, high = nnodes
    notes: list[str] = []
    if standalone:
        if high > 1:
            raise UsageError(f"--standalone is one node: drop it or --nnodes {low if low == high else f'{low}:{high}'}")
        given = [flag for flag, value in (("--rdzv-backend", rdzv_backend), ("--rdzv-endpoint", endpoint)) if value]
        if given:
            notes.append(f"--standalone: {' and '.join(given)} ignored (one node, a free local port), as by torchrun")
        return Rendezvous(rdzv_backend="static", master_addr=None, master_port=None, notes=tuple(notes))
    chosen = rdzv_backend or ("c10d" if low < high else "static")
    if node_rank and chosen != "static":
        notes.append(f"--node-rank {node_rank} ignored: the {chosen} rendezvous numbers the nodes as they join")
    if endpoint:
        host, port = parse_endpoint(endpoint, default_port=master_port or _default_port(chosen))
        ignored = [flag for flag, value in (("--master-addr", master_addr), ("--master-port", master_port))
                   if value is not None and str(value) != str(host if flag == "--master-addr" else port)]
        if ignored:
            notes.append(f"{' and '.join(ignored)} ignored: --rdzv-endpoint {endpoint} names the rendezvous")
        return Rendezvous(rdzv_backend=chosen, master_addr=host, master_port=port, notes=tuple(notes))
    if high == 1 or placed:
        return Rendezvous(rdzv_backend=chosen, master_addr=master_addr, master_port=master_port, notes=tuple(notes))
    port = master_port if master_port is not None else _default_port(chosen)
    if not master_addr:
        notes.append(f"no --master-addr or --rdzv-endpoint: the rendezvous is 127.0.0.1:{port} (torchrun's "
                     "default), so every node must be this machine; give node 0's address to join other machines")
    return Rendezvous(rdzv_backend=chosen, master_addr=master_addr or "127.0.0.1", master_port=port, notes=tuple(notes))


def check_logs_specs(name: str) -> str:
    """``--logs-specs NAME`` names a class an installed package registers with torchrun."""
    from importlib.metadata import entry_points

    names = sorted(ep.name for ep in entry_points(group="torchrun.logs_specs"))
    if name not in names:
        have = f"installed: {', '.join(names)}" if names else "no installed package registers one"
        raise UsageError(f"--logs-specs {name}: no such entry point in the torchrun.logs_specs group ({have})")
    return name
