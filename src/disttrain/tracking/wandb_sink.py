"""Weights & Biases: one W&B run per disttrain run, configured W&B's way (``WANDB_MODE``,
``WANDB_PROJECT`` -- default ``disttrain`` --, ``WANDB_DIR``, ``WANDB_API_KEY``); offline mode
keeps it in files for ``wandb sync``. A trial is in its tuning job's group. The launcher's
console is not captured: the run's output is in its run folder already."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .sink import PROJECT, Sink, env, text_file


class WandbSink(Sink):
    tracker = "wandb"
    client = "wandb"

    def __init__(self, name: str, *, params: Mapping[str, str], parent: str | None = None,
                 key: str | None = None) -> None:
        import wandb

        self._run = wandb.init(project=env("WANDB_PROJECT", PROJECT), name=name, config=dict(params),
                               group=parent or None, reinit="create_new",
                               settings=wandb.Settings(console="off", silent=True))
        self._files = Path(tempfile.mkdtemp(prefix="disttrain-wandb-"))
        self._step = 0

    @property
    def run_id(self) -> str:
        return self._run.id

    @property
    def child_key(self) -> str:
        return self._run.name  # the group of a tuning job's trials is named for it

    def metrics(self, values: Mapping[str, float], step: int | None, wall_time: float) -> None:
        # W&B's step only grows: a point at an earlier step (a resumed run redoing steps, the
        # Trainer's epochs beside a loop's steps) would be dropped; it goes under the current one.
        self._step = max(self._step, step or 0)
        self._run.log(dict(values), step=self._step)

    def text(self, name: str, text: str) -> None:
        self.artifact(text_file(self._files, name, text))

    def artifact(self, path: Path) -> None:
        self._run.save(str(path), base_path=str(path.parent), policy="now")

    def finish(self, exit_code: int) -> None:
        self._run.summary["exit_code"] = exit_code
        self._run.finish(exit_code=exit_code)
        shutil.rmtree(self._files, ignore_errors=True)  # the text files, in the run's own folder by now


SINK = WandbSink
