"""TensorBoard event files without TensorFlow: one writer for the job metrics and the Trainer.

tensorboard's own record writer over a plain file. Its ``EventFileWriter`` (and
``torch.utils.tensorboard``, built on it) open files through ``tf.io.gfile``, which imports
TensorFlow where it is installed: seconds of CPU and TensorFlow's start-up log lines in
the middle of a run.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class EventFile:
    """A TensorBoard event file in ``logdir``, appended and flushed as values arrive."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        logdir.mkdir(parents=True, exist_ok=True)
        # TensorBoard's own naming: it reads every file whose name holds "tfevents".
        path = logdir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = path
        self._writer = RecordWriter(open(path, "ab"))
        self._steps: dict[str, int] = {}
        self._write(Event(wall_time=time.time(), step=0, file_version="brain.Event:2"))

    @classmethod
    def open(cls, logdir: Path) -> EventFile | None:
        """None without TensorBoard (``pip install 'disttrain[tensorboard]'``)."""
        try:
            return cls(logdir)
        except ImportError:
            return None

    def _write(self, event) -> None:
        self._writer.write(event.SerializeToString())

    def scalars(self, values: Mapping[str, float], step: int, wall_time: float | None = None) -> None:
        """One point of each series in ``values`` at ``step``; flushed, so a reader sees it now."""
        when = time.time() if wall_time is None else wall_time
        for name, value in values.items():
            self._write(self._event(wall_time=when, step=step, summary=self._summary(
                value=[self._summary.Value(tag=name, simple_value=float(value))])))
        self._writer.flush()

    def add(self, rows: Sequence[tuple[str, float, float]]) -> None:
        """``(series, wall time, value)`` rows, each at the next step of its series."""
        for name, when, value in rows:
            step = self._steps.get(name, 0)
            self._steps[name] = step + 1
            self._write(self._event(wall_time=when, step=step, summary=self._summary(
                value=[self._summary.Value(tag=name, simple_value=value)])))
        self._writer.flush()  # a reader (tensorboard) sees every point as soon as it is matched

    def close(self) -> None:
        self._writer.close()
