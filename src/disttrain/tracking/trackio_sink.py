"""Trackio (local-first): one Trackio run per disttrain run in the project ``TRACKIO_PROJECT``
(default ``disttrain``), kept where Trackio keeps it (``TRACKIO_DIR``; a Space or server when
Trackio's own settings say so). A trial is in its tuning job's group."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .sink import PROJECT, Sink, env, text_file


class TrackioSink(Sink):
    tracker = "trackio"
    client = "trackio"

    def __init__(self, name: str, *, params: Mapping[str, str], parent: str | None = None,
                 key: str | None = None) -> None:
        import trackio

        self._name = name
        with _quiet():  # its banner on stdout would land in the middle of the run's output
            self._run = trackio.init(project=env("TRACKIO_PROJECT", PROJECT), name=name, config=dict(params),
                                     group=parent or None, embed=False,
                                     auto_log_cpu=False, auto_log_gpu=False)
        self._files = Path(tempfile.mkdtemp(prefix="disttrain-trackio-"))

    @property
    def run_id(self) -> str:
        return self._name

    def metrics(self, values: Mapping[str, float], step: int | None, wall_time: float) -> None:
        self._run.log(dict(values), step=step)

    def text(self, name: str, text: str) -> None:
        self.artifact(text_file(self._files, name, text))

    def artifact(self, path: Path) -> None:
        with _quiet():
            self._run.log_artifact(str(path), name=path.name.replace(".", "-"))

    def finish(self, exit_code: int) -> None:
        self._run.log({"exit_code": float(exit_code)})
        with _quiet():
            self._run.finish()
        shutil.rmtree(self._files, ignore_errors=True)  # the text files, stored by Trackio by now


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(sys.stderr):
        yield


SINK = TrackioSink
