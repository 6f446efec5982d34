"""The launch spec: what ``disttrain run`` was asked to do, validated once."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import UsageError
from ..placement import BACKENDS

# static: node ranks fixed by host order, the launcher's choice; c10d: torch's dynamic
# rendezvous, where nodes take ranks in the order they join.
RDZV_BACKENDS = ("static", "c10d")
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
    return value


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
    backend: str | None = None
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
    framework: str = "pytorch"
    # --grad-compression / --bucket-mb: prepare()'s defaults in every worker (runtime.comm checks them).
    grad_compression: str | None = None
    bucket_mb: float | None = None
    # The launching shell's environment goes to every rank (minus host- and session-specific
    # variables, see workerenv.forwarded_env); False: only the communication settings.
    forward_env: bool = True

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
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"launch spec: unknown key {unknown[0]!r} (written by another disttrain version?)")
        for name in ("script_args", "ranks"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
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
        if self.nnodes > 1 and not self.master_addr:
            raise UsageError("--nnodes > 1 needs --master-addr (the address of node rank 0)")
        if self.nnodes > 1 and self.master_port is None:
            raise UsageError("--nnodes > 1 needs --master-port (the same on every node)")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts cannot be negative, got {self.max_restarts}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise UsageError(
                f"--rdzv-backend must be one of {', '.join(RDZV_BACKENDS)}, got {self.rdzv_backend!r}")
        if self.rdzv_timeout_s < 1:
            raise UsageError(f"--rdzv-timeout must be at least 1 second, got {self.rdzv_timeout_s}")
        if self.hang_timeout_s < 0:
            raise UsageError(f"--hang-timeout cannot be negative (0 turns it off), got {self.hang_timeout_s}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise UsageError(
                f"--checkpoint-every cannot be negative (0: at the end of each epoch), got {self.checkpoint_every}")
        if self.stop_grace_s < 0:
            raise UsageError(f"--stop-grace cannot be negative, got {self.stop_grace_s}")
        if self.framework not in FRAMEWORKS:
            raise UsageError(f"--framework must be one of {', '.join(FRAMEWORKS)}, got {self.framework!r}")
