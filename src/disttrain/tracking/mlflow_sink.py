"""MLflow: one MLflow run per disttrain run, through ``MlflowClient`` (no global active run, so a
tuning job and its trials, or two runs in one process, never mix). Where it goes is MLflow's own
setting: ``MLFLOW_TRACKING_URI`` (a server, or a local ``./mlruns`` without it), the experiment
``MLFLOW_EXPERIMENT_NAME`` (default ``disttrain``). A trial is a child run (``mlflow.parentRunId``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .sink import PROJECT, Sink, env, status

_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
MAX_BATCH = 1000  # metrics in one log_batch
MAX_PARAM = 6000  # MLflow's limit on a parameter's value (longer ones are refused)


class MlflowSink(Sink):
    tracker = "mlflow"
    client = "mlflow"

    def __init__(self, name: str, *, params: Mapping[str, str], parent: str | None = None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        experiment = env("MLFLOW_EXPERIMENT_NAME", PROJECT)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        tags = {"mlflow.parentRunId": parent} if parent else {}
        self._run = self._client.create_run(experiment_id, run_name=name, tags=tags)
        if params:
            self._client.log_batch(self.run_id, params=[Param(k, str(v)[:MAX_PARAM]) for k, v in params.items()])

    @property
    def run_id(self) -> str:
        return self._run.info.run_id

    def metrics(self, values: Mapping[str, float], step: int | None, wall_time: float) -> None:
        from mlflow.entities import Metric

        stamp = int(wall_time * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step or 0) for k, v in values.items()])

    def points(self, points: Sequence[tuple[Mapping[str, float], int | None, float]]) -> None:
        from mlflow.entities import Metric

        batch = [Metric(k, v, int(wall_time * 1000), step or 0) for values, step, wall_time in points
                 for k, v in values.items()]
        for start in range(0, len(batch), MAX_BATCH):  # MLflow's limit of metrics in one call
            self._client.log_batch(self.run_id, metrics=batch[start:start + MAX_BATCH])

    def text(self, name: str, text: str) -> None:
        self._client.log_text(self.run_id, text, name)

    def artifact(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def finish(self, exit_code: int) -> None:
        self._client.set_tag(self.run_id, "exit_code", str(exit_code))
        self._client.set_terminated(self.run_id, status=_STATUS[status(exit_code)], end_time=int(time.time() * 1000))


SINK = MlflowSink
