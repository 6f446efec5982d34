"""Where each rank's output goes: one file per rank and stream, named by global rank, and what
reaches the terminal.

torch's elastic agent redirects each worker's stdout/stderr to the files named here and
tails them to the agent's terminal with a ``[rankN]`` prefix (its ``TailLog``); this class
decides the layout, so the launcher can point a user at the exact file, and which streams
are shown (torchrun's ``--tee``, ``--redirects``, ``--local-ranks-filter``, disttrain's
``--ranks``). Every stream is always written.

With torchrun's ``--log-dir`` (or ``--logs-specs``), torchrun's own layout is written too,
``<log-dir>/<rdzv id>_<suffix>/attempt_<k>/<local rank>/stdout.log``: the same files under a
second name (hard links), so tools that read torchrun's layout find them, at no cost.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, LogsSpecs, Std

from ..config.launch import AgentOptions
from ..config.torchrun import std_of
from ..private import private_dirs, private_file
from ..workerenv import ATTEMPT, rank_file

_STREAMS = (("stdout", Std.OUT), ("stderr", Std.ERR))


def filtered_log(run_dir: str | os.PathLike, stream: str, attempt: int = 0) -> Path:
    """``--duplicate-stdout-filters``' file: ``<run_dir>/attempt_<k>/filtered_stdout.log``."""
    return Path(run_dir) / f"attempt_{attempt}" / f"filtered_{stream}.log"


def load_logs_specs(name: str) -> type[LogsSpecs]:
    """torchrun's ``--logs-specs NAME``: the class an installed package registers under the
    ``torchrun.logs_specs`` entry points (torch's own lookup, so the same names work)."""
    from torch.distributed.run import _get_logs_specs_class

    return _get_logs_specs_class(name)


def _second_name(path: str, existing: Path) -> None:
    """Give ``existing`` the name ``path`` too: a hard link (one file, written once), else a symlink."""
    if not path or path == os.devnull or Path(path) == existing:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        os.link(existing, path)
    except OSError:  # another filesystem (a --logs-specs class's choice), or no hard links there
        os.symlink(existing, path)


class RankLogs(LogsSpecs):
    """``shown_ranks``: global ranks shown on the terminal (None: all), with ``options``' torchrun
    settings on top."""

    def __init__(self, run_dir: str, shown_ranks: tuple[int, ...] | None = None,
                 options: AgentOptions | None = None) -> None:
        super().__init__(log_dir=run_dir, redirects=Std.ALL, tee=Std.ALL, local_ranks_filter=None)
        self._run_dir = run_dir
        self._shown = None if shown_ranks is None else set(shown_ranks)
        self._options = options or AgentOptions()
        self._layout = self._torchrun_layout(self._options)
        # Called when the agent is about to start workers (the rendezvous is over).
        self.on_start: Callable[[], None] | None = None
        # Called with each attempt's worker environments, which it may change (a fresh store).
        self.on_envs: Callable[[dict[int, dict[str, str]], int], None] | None = None
        # The job-wide number of the attempt about to start, when the agent numbers rendezvous
        # rounds (an elastic job: see disttrain.agent.elastic_agent); None: torch's restart count.
        self.attempt: int | None = None

    @staticmethod
    def _torchrun_layout(options: AgentOptions) -> LogsSpecs | None:
        """torchrun's own LogsSpecs for the second names: ``--logs-specs``' class, or torch's default
        one under ``--log-dir`` (every stream, as disttrain keeps every stream)."""
        filt = set(options.local_ranks_filter) if options.local_ranks_filter else None
        if options.logs_specs:
            return load_logs_specs(options.logs_specs)(
                log_dir=options.torchrun_log_dir, redirects=Std.from_str(options.redirects),
                tee=Std.from_str(options.tee), local_ranks_filter=filt)
        if options.torchrun_log_dir:
            return DefaultLogsSpecs(log_dir=options.torchrun_log_dir, redirects=Std.ALL, tee=Std.NONE,
                                    local_ranks_filter=None)
        return None

    @property
    def root_log_dir(self) -> str:
        return self._run_dir

    def shown(self, local_rank: int, rank: int, stream: Std) -> bool:
        """Whether a worker's stream reaches the terminal: its global rank passes ``--ranks``, its
        local rank ``--local-ranks-filter``, and the stream is not redirected without a tee."""
        opts = self._options
        if self._shown is not None and rank not in self._shown:
            return False
        if opts.local_ranks_filter is not None and local_rank not in opts.local_ranks_filter:
            return False
        redirected = std_of(opts.redirects, local_rank) & stream.value
        teed = std_of(opts.tee, local_rank) & stream.value
        return not redirected or bool(teed)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        if self.on_start is not None:
            self.on_start()
        attempt = self.attempt
        if attempt is None:
            attempt = int(next(iter(envs.values())).get("TORCHELASTIC_RESTART_COUNT", "0")) if envs else 0
        for env in envs.values():
            env[ATTEMPT] = str(attempt)
        if self.on_envs is not None and envs:
            self.on_envs(envs, attempt)
        theirs = self._layout.reify(envs) if self._layout is not None and envs else None
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            for stream, bit in _STREAMS:
                path = rank_file(self._run_dir, rank, attempt, stream)
                private_dirs(path.parent)
                private_file(path)  # the worker's redirect truncates it again: same inode, both names
                getattr(dest, f"{stream}s")[local_rank] = str(path)
                if self.shown(local_rank, rank, bit):
                    getattr(dest, f"tee_{stream}s")[local_rank] = str(path)
                if theirs is not None:
                    _second_name(getattr(theirs, f"{stream}s").get(local_rank, ""), path)
            error_file = rank_file(self._run_dir, rank, attempt, "error.json")
            dest.error_files[local_rank] = str(error_file)
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            if theirs is not None and theirs.error_files.get(local_rank) not in (None, "", os.devnull):
                _symlink_ahead(theirs.error_files[local_rank], error_file)
        for stream, filters in (("stdout", self._options.duplicate_stdout_filters),
                                ("stderr", self._options.duplicate_stderr_filters)):
            path = filtered_log(self._run_dir, stream, attempt)
            setattr(dest, f"filtered_{stream}", str(path))
            if filters:
                private_dirs(path.parent)
                private_file(path)
                if theirs is not None:
                    _second_name(getattr(theirs, f"filtered_{stream}", ""), path)
        return dest


def _symlink_ahead(path: str, target: Path) -> None:
    """An error file exists only once a worker fails: torchrun's name points at disttrain's ahead of it
    (a hard link needs the file; an empty one would read as a failure without its error)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.symlink(os.path.relpath(target, Path(path).parent), path)
