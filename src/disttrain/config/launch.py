"""The launch spec: what ``disttrain run`` was asked to do, validated once."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import bounds
from ..errors import UsageError
from ..placement import DIST_BACKENDS
from .torchrun import (
    DEFAULT_SIGNALS,
    EVENT_LOG_HANDLERS,
    NUMA_MODES,
    START_METHODS,
    check_signals,
    check_std,
)

# static: node ranks fixed by host order, the launcher's choice; c10d: torch's dynamic
# rendezvous, where nodes take ranks in the order they join; etcd, etcd-v2: torch's, with an
# etcd server (python-etcd on every node). Plugins registered under torch's
# ``torchrun.handlers`` entry points are accepted too (see :func:`rdzv_backends`).
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
# pytorch: the script is started as is; tensorflow: each worker also gets its TF_CONFIG.
FRAMEWORKS = ("pytorch", "tensorflow")

# Each default once: the CLI's flags, the job runner and the sbatch step read them from here.
DEFAULT_RDZV_TIMEOUT_S = 120
DEFAULT_STOP_GRACE_S = 15

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # matched whole (fullmatch): no trailing newline


def parse_nproc(raw: str) -> int | str:
    """``-n`` accepts a positive integer or ``auto``."""
    if raw == "auto":
        return raw
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(
            f"-n/--nproc-per-node must be a positive integer or 'auto', got {raw!r}"
        ) from None
    if value < 1:
        raise UsageError(f"-n/--nproc-per-node must be at least 1, got {value}")
    return bounds.within("-n/--nproc-per-node", value, 1, bounds.MAX_PROCS, unit="processes (or 'auto')")


def parse_ranks(raw: str) -> tuple[int, ...] | None:
    """``--ranks 0,2-3`` → (0, 2, 3); ``all`` → None (show every rank)."""
    if raw == "all":
        return None
    ranks: set[int] = set()
    for part in raw.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first = int(lo)
            last = int(hi) if hi else first
        except ValueError:
            raise UsageError(
                f"--ranks takes rank numbers like '0' or '0,2-3' or 'all', got {raw!r}"
            ) from None
        if first < 0 or last < first:
            raise UsageError(f"--ranks: bad range {part!r} in {raw!r}")
        bounds.within("--ranks", last, 0, bounds.MAX_RANK)
        ranks.update(range(first, last + 1))
    return tuple(sorted(ranks))


def parse_env(items: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``--env KEY=VALUE``, or ``--env KEY`` for KEY's value in ``environ`` (the launcher's
    environment), so that a secret need not be typed where shell history and ``ps`` keep it."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not _ENV_NAME.fullmatch(key):
            raise UsageError(f"--env takes KEY=VALUE or KEY with a valid variable name, got {item!r}")
        if not sep:
            if environ is None or key not in environ:
                raise UsageError(f"--env {key}: {key} is not set in this environment; "
                                 f"export it first or give --env {key}=VALUE")
            value = environ[key]
        env[key] = value
    return env


def new_keys(data: dict, old_names: Mapping[str, str], *, where: str) -> dict:
    """``data`` with the keys an older disttrain wrote under their new names (``old_names``: old -> new),
    for what it left behind: a queued Slurm job's batch step, a kept ``plan.json``."""
    data = dict(data)
    for old, new in old_names.items():
        if old in data:
            if new in data and data[new] != data[old]:
                raise UsageError(f"{where}: {old!r} (the old name of {new!r}) and {new!r} disagree")
            data.setdefault(new, data.pop(old))
            data.pop(old, None)
    return data


def rdzv_backends() -> tuple[str, ...]:
    """torch's built-in rendezvous backends and those installed packages register with it."""
    from importlib.metadata import entry_points  # only when a name is not a built-in one

    return (*RDZV_BACKENDS, *sorted(ep.name for ep in entry_points(group="torchrun.handlers")))


@dataclass(frozen=True, kw_only=True)
class AgentOptions:
    """How each node's torch elastic agent starts, shows and stops its workers: torchrun's
    options that the agent reads as torchrun passes them (``LaunchConfig`` and ``LogsSpecs``).
    Defaults are torchrun's."""

    role: str = "default"
    monitor_interval_s: float = 0.1
    start_method: str = "spawn"
    event_log_handler: str = "null"
    redirects: str = "0"  # streams kept from the terminal (files are always written)
    tee: str = "0"
    local_ranks_filter: tuple[int, ...] | None = None  # None: every local rank on the terminal
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    logs_specs: str | None = None  # a torchrun.logs_specs entry point's name
    numa_binding: str | None = None
    signals_to_handle: str = DEFAULT_SIGNALS
    virtual_local_rank: bool = False
    log_line_prefix_template: str | None = None  # None: disttrain's [rank${rank}] / [HOST rank${rank}]
    # --log-dir given: torchrun's own file layout is written under it as well (absolute).
    torchrun_log_dir: str | None = None

    @classmethod
    def from_dict(cls, data: dict) -> AgentOptions:
        """The inverse of ``dataclasses.asdict``; unknown keys refused by name."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"launch spec: unknown agent option {unknown[0]!r} (written by another disttrain version?)")
        data = dict(data)
        for name in ("local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        return cls(**data)

    def __post_init__(self) -> None:
        if not self.role or not self.role.strip():
            raise UsageError("--role must not be empty")
        if not self.monitor_interval_s > 0:
            raise UsageError(f"--monitor-interval must be more than 0 seconds, got {self.monitor_interval_s}")
        if self.start_method not in START_METHODS:
            raise UsageError(f"--start-method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}")
        if self.event_log_handler not in EVENT_LOG_HANDLERS:
            raise UsageError(f"--event-log-handler must be one of {', '.join(EVENT_LOG_HANDLERS)}, "
                             f"got {self.event_log_handler!r}")
        check_std(self.redirects, where="--redirects")
        check_std(self.tee, where="--tee")
        if self.numa_binding is not None and self.numa_binding not in NUMA_MODES:
            raise UsageError(f"--numa-binding must be one of {', '.join(NUMA_MODES)}, got {self.numa_binding!r}")
        check_signals(self.signals_to_handle)
        if self.local_ranks_filter is not None and (not self.local_ranks_filter or min(self.local_ranks_filter) < 0):
            raise UsageError(f"--local-ranks-filter takes local ranks 0 or more, got {self.local_ranks_filter}")
        if self.local_ranks_filter:
            bounds.within("--local-ranks-filter", max(self.local_ranks_filter), 0, bounds.MAX_PROCS - 1)


_OLD_KEYS = {"backend": "dist_backend"}  # what an older disttrain's spec JSON calls them


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One ``disttrain run``; every field is validated here, naming its flag."""

    entry: str
    is_module: bool = False
    script_args: tuple[str, ...] = ()
    nproc_per_node: int | str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    dist_backend: str | None = None
    max_restarts: int = 0
    ranks: tuple[int, ...] | None = None
    log_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    rdzv_backend: str = "static"
    rdzv_timeout_s: int = DEFAULT_RDZV_TIMEOUT_S
    stop_grace_s: int = DEFAULT_STOP_GRACE_S
    hang_timeout_s: int = 0  # 0: no watchdog; the process group's timeout still bounds collectives
    checkpoint_dir: str | None = None  # absolute: workers on other hosts start elsewhere
    checkpoint_every: int | None = None
    # --checkpoint-retry-s: how long a checkpoint store may be unreachable before a save fails (None: the
    # runtime's default, 60 s).
    checkpoint_retry_s: float | None = None
    framework: str = "pytorch"
    # --grad-compression / --bucket-mb: prepare()'s defaults in every worker (runtime.comm checks them).
    grad_compression: str | None = None
    bucket_mb: float | None = None
    # --track: the workers' track lines, "reduced" or "ranks" (workerenv.TRACK); None: not asked.
    track: str | None = None
    # The launching shell's environment goes to every rank (minus host- and session-specific
    # variables, see workerenv.forwarded_env); False: only the communication settings.
    forward_env: bool = True
    # torchrun's --nnodes MIN:MAX: the job may start with MIN nodes (None: nnodes, a fixed count).
    min_nnodes: int | None = None
    rdzv_id: str | None = None  # None: disttrain's (see LaunchPlan.rendezvous_id)
    rdzv_conf: dict[str, str] = field(default_factory=dict)  # --rdzv-conf, over disttrain's settings
    local_addr: str | None = None  # this node's address (one node's part only); None: found from the routes
    no_python: bool = False  # the script is a program (--no-python)
    run_path: bool = False  # runpy.run_path in a multiprocessing worker (--run-path)
    agent: AgentOptions = field(default_factory=AgentOptions)

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: the node count is decided by the rendezvous."""
        return self.min_nnodes is not None and self.min_nnodes < self.nnodes

    def to_json(self) -> str:
        """The one serialised form of a spec: how it travels (a Slurm batch job's step,
        ``disttrain bench``'s counts).

        It holds ``env`` values: it travels through stdin or a job's environment, never printed
        or written to a file (:meth:`public_json` is the printable form).
        """
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def public_json(self) -> str:
        """:meth:`to_json` with ``env`` by name only: what ``--dry-run`` may print."""
        data = dataclasses.asdict(self)
        data["env"] = sorted(self.env)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        """The inverse of :meth:`to_json`; unknown keys are refused by name, values validated again."""
        data = new_keys(json.loads(text), _OLD_KEYS, where="launch spec")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"launch spec: unknown key {unknown[0]!r} (written by another disttrain version?)")
        for name in ("script_args", "ranks"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        if "agent" in data:
            data["agent"] = AgentOptions.from_dict(data["agent"])
        return cls(**data)

    def __post_init__(self) -> None:
        if not self.entry:
            raise UsageError("no script given: disttrain run [options] train.py [script args]")
        if isinstance(self.nproc_per_node, int) and self.nproc_per_node < 1:
            raise UsageError(f"-n/--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if isinstance(self.nproc_per_node, str) and self.nproc_per_node != "auto":
            raise UsageError(f"-n/--nproc-per-node must be a number or 'auto', got {self.nproc_per_node!r}")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, got {self.node_rank}"
            )
        # Nodes started by hand must be told where node 0 is; an elastic range over --hosts (or
        # Slurm, a job's instances) is placed by the launcher, which finds the master itself.
        if self.nnodes > 1 and not self.elastic and not self.master_addr:
            raise UsageError("--nnodes > 1 needs --master-addr (the address of node rank 0)")
        if self.nnodes > 1 and not self.elastic and self.master_port is None:
            raise UsageError("--nnodes > 1 needs --master-port (the same on every node)")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.dist_backend is not None and self.dist_backend not in DIST_BACKENDS:
            raise UsageError(f"unknown backend {self.dist_backend!r}: choose one of {', '.join(DIST_BACKENDS)}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts cannot be negative, got {self.max_restarts}")
        if self.rdzv_backend not in RDZV_BACKENDS and self.rdzv_backend not in rdzv_backends():
            raise UsageError(
                f"--rdzv-backend must be one of {', '.join(rdzv_backends())}, got {self.rdzv_backend!r}")
        if self.min_nnodes is not None and not 1 <= self.min_nnodes <= self.nnodes:
            raise UsageError(f"--nnodes {self.min_nnodes}:{self.nnodes}: need 1 <= MIN <= MAX")
        if self.elastic and self.rdzv_backend == "static":
            raise UsageError(f"--nnodes {self.min_nnodes}:{self.nnodes} needs a dynamic rendezvous (the static one "
                             "waits for a fixed count): add --rdzv-backend c10d")
        if self.rdzv_id is not None and not self.rdzv_id.strip():
            raise UsageError("--rdzv-id must not be empty")
        if self.no_python and self.is_module:
            raise UsageError("--no-python runs SCRIPT as a program, -m as a Python module: give one of them")
        if self.run_path and self.framework == "tensorflow":
            raise UsageError("--run-path cannot carry --framework tensorflow's TF_CONFIG: leave out --run-path")
        if self.no_python and self.framework == "tensorflow":
            raise UsageError("--framework tensorflow starts Python workers: leave out --no-python")
        if self.rdzv_timeout_s < 1:
            raise UsageError(f"--rdzv-timeout must be at least 1 second, got {self.rdzv_timeout_s}")
        if self.hang_timeout_s < 0:
            raise UsageError(f"--hang-timeout cannot be negative (0 turns it off), got {self.hang_timeout_s}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise UsageError(
                f"--checkpoint-every cannot be negative (0: at the end of each epoch), got {self.checkpoint_every}")
        if self.checkpoint_retry_s is not None:
            bounds.option("--checkpoint-retry-s", "checkpoint_retry_s", self.checkpoint_retry_s)
        if self.stop_grace_s < 0:
            raise UsageError(f"--stop-grace cannot be negative, got {self.stop_grace_s}")
        if self.framework not in FRAMEWORKS:
            raise UsageError(f"--framework must be one of {', '.join(FRAMEWORKS)}, got {self.framework!r}")
        self._check_bounds()

    def _check_bounds(self) -> None:
        """Each number in its range (a spec from a job file or ``PET_*`` too, not only the CLI's)."""
        if isinstance(self.nproc_per_node, int):
            bounds.within("-n/--nproc-per-node", self.nproc_per_node, 1, bounds.MAX_PROCS, unit="processes")
        for flag, value in (("--nnodes", self.nnodes), ("--nnodes MIN", self.min_nnodes)):
            if value is not None:
                bounds.within(flag, value, 1, bounds.MAX_NODES, unit="nodes")
        bounds.within("--max-restarts", self.max_restarts, *bounds.OPTIONS["max_restarts"][:2])
        for flag, seconds, low in (("--rdzv-timeout", self.rdzv_timeout_s, 1),
                                   ("--hang-timeout", self.hang_timeout_s, 0), ("--stop-grace", self.stop_grace_s, 0)):
            bounds.within(flag, seconds, low, bounds.MAX_SECONDS, unit="seconds")
        if self.checkpoint_every is not None:
            bounds.within("--checkpoint-every", self.checkpoint_every, 0, bounds.MAX_STEPS, unit="steps")
