"""What every tracker is told, one small interface; each tracker's client lives in its own module
and is imported only when its sink is opened (the clients are the optional extra ``track``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from ..errors import UsageError, one_line
from ..private import MASK, is_secret_key, mask_argv, redact_urls

TRACKERS = ("mlflow", "trackio", "wandb")
_MODULES = {"mlflow": "mlflow_sink", "trackio": "trackio_sink", "wandb": "wandb_sink"}
PROJECT = "disttrain"  # the experiment / project when the tracker's own variable names none
# A tuning job's tracker run, for the runners of its trials (Sink.child_key): their runs are its children.
PARENT_ENV = "DISTTRAIN_TRACK_PARENT"
# What a client's error says when the server is there but overloaded (timeouts, 5xx answers).
BUSY_WORDS = ("timed out", "timeout", " 500", " 502", " 503", " 504", "internal_error", "temporarily")


def check_tracker(name: str | None, *, where: str = "--track") -> str | None:
    """``name`` when it is a tracker (None: none asked); a usage error naming the choices (an empty
    name too: ``--track ''`` is a mistake, not a wish for no tracker)."""
    if name is None:
        return None
    if name not in TRACKERS:
        raise UsageError(f"{where} {name!r}: choose one of {', '.join(TRACKERS)}")
    return name


class Sink(ABC):
    """One tracker run. ``parent``: the :attr:`child_key` of the run it belongs to (a tuning job's
    trial belongs to the tuning job's run). ``key``: the disttrain run's own token, the same on every
    try to open it, so that a tracker whose run-creating request may land twice (a timeout, then a
    retry) keeps one run (MLflow tags it)."""

    tracker: ClassVar[str]
    client: ClassVar[str]  # the module whose absence means the extra is missing

    @abstractmethod
    def __init__(self, name: str, *, params: Mapping[str, str], parent: str | None = None,
                 key: str | None = None) -> None:
        """Start the run named ``name`` with its parameters."""

    @property
    @abstractmethod
    def run_id(self) -> str:
        """The tracker's id of this run (said to the user)."""

    @property
    def child_key(self) -> str:
        """What a child run names its parent by (MLflow: the run id; W&B and Trackio: the group)."""
        return self.run_id

    @abstractmethod
    def metrics(self, values: Mapping[str, float], step: int | None, wall_time: float) -> None:
        """A point of each series at ``step`` (None: the tracker's next)."""

    def points(self, points: Sequence[tuple[Mapping[str, float], int | None, float]]) -> None:
        """Several ``(values, step, wall_time)`` at once (trackers with a batch call override it)."""
        for values, step, wall_time in points:
            self.metrics(values, step, wall_time)

    @abstractmethod
    def text(self, name: str, text: str) -> None:
        """A text file of the run (the hang verdict, the membership record, goodput)."""

    @abstractmethod
    def artifact(self, path: Path) -> None:
        """A file of the run (model.tar.gz, a plot)."""

    @abstractmethod
    def finish(self, exit_code: int) -> None:
        """The exit: 0 finished, else failed (128 + a signal: killed); the run is closed."""

    def retryable(self, err: Exception) -> bool:
        """Whether ``err`` says the tracker is out of reach now (its records are kept and sent again),
        not that it refused the record itself."""
        return isinstance(err, (OSError, TimeoutError))

    @classmethod
    def probe(cls) -> None:
        """Raise OSError when the tracker's server cannot be reached at all, before its client is
        imported (seconds on a loaded machine): an unreachable tracker is said at once."""
        return None

    @classmethod
    def check_setting(cls, where: str) -> None:
        """Refuse, before a run starts, a setting of the tracker's own that can never work (none by default)."""
        return None


def sink_class(tracker: str, *, where: str = "--track") -> type[Sink]:
    """The sink of ``tracker`` (checked), its client imported now; without it, one line naming
    the extra (a UsageError: exit 2) -- said before a job starts, not at its end."""
    check_tracker(tracker, where=where)
    module = importlib.import_module(f".{_MODULES[tracker]}", __package__)
    cls: type[Sink] = module.SINK
    if importlib.util.find_spec(cls.client) is None:  # found, not imported: the launch is not kept waiting
        raise UsageError(f"{where} {tracker}: the {tracker} client is not installed; "
                         "pip install 'disttrain[track]'")
    cls.check_setting(where)
    return cls


def open_sink(tracker: str, name: str, *, params: Mapping[str, str], parent: str | None = None,
              key: str | None = None) -> Sink:
    """A new run of ``tracker`` (see :func:`sink_class`), its parameters masked by the job records'
    rule: a secret-looking name's value, an option's value on a command line, a URL's password."""
    cls = sink_class(tracker)
    cls.probe()
    return cls(name, params=mask_params(params), parent=parent, key=key)


def open_or_say(tracker: str, name: str, *, params: Mapping[str, str], say,
                parent: str | None = None) -> Sink | None:
    """:func:`open_sink`, or None after one line when the tracker cannot be opened (unreachable, refused):
    a tracker never stops what it tracks. A missing client or an impossible setting is still a UsageError."""
    sink_class(tracker)
    try:
        return open_sink(tracker, name, params=params, parent=parent)
    except Exception as err:
        say(redact_urls(f"disttrain: warning: the {tracker} tracker could not be opened ({one_line(err)}); "
                        "going on untracked"))
        return None


def busy(err: Exception) -> bool:
    """Whether ``err`` says the tracker is there but slow or overloaded (a timeout, a 5xx answer):
    opening its run is worth trying again, unlike a refused connection or a wrong setting."""
    text = str(err).lower()
    return isinstance(err, TimeoutError) or any(word in text for word in BUSY_WORDS)


def mask_params(params: Mapping[str, str]) -> dict:
    """``params`` masked by the job records' rule: a secret-looking name's value, a URL's password."""
    return {k: MASK if is_secret_key(k.rpartition(".")[2]) else redact_urls(v) if isinstance(v, str) else v
            for k, v in params.items()}


def status(exit_code: int) -> str:
    """finished | failed | killed: what a tracker's run status says of an exit code."""
    if exit_code == 0:
        return "finished"
    return "killed" if exit_code in (130, 143) else "failed"


def text_file(folder: Path, name: str, text: str) -> Path:
    """``text`` as the file ``name`` in ``folder`` (for trackers that keep files, not strings)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def script_params(argv: Sequence[str], script_args: Sequence[str]) -> dict[str, str]:
    """A run's parameters: its command line whole, and the script's ``--name value`` (or
    ``--name=value``; a flag alone is ``true``) as hyperparameters ``hp.name``."""
    params = {"argv": shlex.join(mask_argv(argv))}
    args = list(script_args)
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg == "--":
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "true"
        if name:
            params[f"hp.{name}"] = MASK if is_secret_key(name) else value
    return params
