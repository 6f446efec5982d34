"""Where each rank's output goes: one file per rank and stream, named by global rank.

torch's elastic agent redirects each worker's stdout/stderr to the files named here and
tails them to the agent's terminal with a ``[rankN]`` prefix (its ``TailLog``); this
class only decides the layout, so the launcher can point a user at the exact file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std


def rank_log(run_dir: str | os.PathLike, rank: int, stream: str, attempt: int = 0) -> Path:
    """``<run_dir>/attempt_<k>/rank<R>.<stream>`` with stream ``stdout`` or ``stderr``."""
    return Path(run_dir) / f"attempt_{attempt}" / f"rank{rank}.{stream}"


class RankLogs(LogsSpecs):
    def __init__(self, run_dir: str, shown_local_ranks: set[int] | None = None) -> None:
        super().__init__(
            log_dir=run_dir, redirects=Std.ALL, tee=Std.ALL, local_ranks_filter=shown_local_ranks
        )
        self._run_dir = run_dir
        self._shown = shown_local_ranks
        # Called when the agent is about to start workers (the rendezvous is over).
        self.on_start: Callable[[], None] | None = None

    @property
    def root_log_dir(self) -> str:
        return self._run_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        if self.on_start is not None:
            self.on_start()
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
            out = rank_log(self._run_dir, rank, "stdout", attempt)
            out.parent.mkdir(parents=True, exist_ok=True)
            err = rank_log(self._run_dir, rank, "stderr", attempt)
            error_file = out.with_name(f"rank{rank}.error.json")
            dest.stdouts[local_rank] = str(out)
            dest.stderrs[local_rank] = str(err)
            dest.error_files[local_rank] = str(error_file)
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            if self._shown is None or local_rank in self._shown:
                dest.tee_stdouts[local_rank] = str(out)
                dest.tee_stderrs[local_rank] = str(err)
        return dest
