"""MLflow: one MLflow run per disttrain run, through ``MlflowClient`` (no global active run, so a
tuning job and its trials, or two runs in one process, never mix). Where it goes is MLflow's own
setting: ``MLFLOW_TRACKING_URI`` (a server, or a local ``./mlruns`` without it), the experiment
``MLFLOW_EXPERIMENT_NAME`` (default ``disttrain``). A trial is a child run (``mlflow.parentRunId``).

The client is made a side effect (see :mod:`.follower`): a request fails within seconds rather than
after MLflow's minutes of retries (the follower keeps the records and tries again itself), an
experiment created by many runs at once is created once and found by the others, a run created twice
(MLflow's client sends a ``runs/create`` whose answer timed out again) is kept once, and MLflow's own
"View run ... at" line -- the URI with its password -- is not printed (disttrain says the run's id).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import UsageError
from ..private import redact_urls
from .sink import PROJECT, Sink, env, status

_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
MAX_BATCH = 1000  # metrics in one log_batch
MAX_PARAM = 6000  # MLflow's limit on a parameter's value (longer ones are refused)
# MLflow's own settings, unless the user gave them: one quick retry, a short timeout (its defaults wait
# minutes on a dead server, before any line), no URL printed to stdout.
_CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
# The stores MLflow's client has (mlflow.tracking._tracking_service.utils): a URI of another scheme
# fails inside it with a traceback; here it is one line before the run.
SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
           "uc")
EXPERIMENT_TRIES = 5
PROBE_S = 5.0  # for the server's port to accept a connection
AGAIN_S = 1.0  # before a write refused as its own twin is sent once more (see MlflowSink._again)
# What a store says of a row written twice (SQLite, PostgreSQL, MySQL through SQLAlchemy).
TWIN_WORDS = ("UNIQUE constraint", "IntegrityError", "duplicate key", "Duplicate entry")
KEY_TAG = "disttrain.key"  # the run's Sink key: the runs one open made, found at its end


class _Redacted(logging.Filter):
    """MLflow's and urllib3's log lines with a URL's password masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "@" in message:
            record.msg, record.args = redact_urls(message), None
        return True


class MlflowSink(Sink):
    tracker = "mlflow"
    client = "mlflow"

    @classmethod
    def check_setting(cls, where: str) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        scheme = urlsplit(uri).scheme.lower().split("+")[0] if "://" in uri or uri.startswith("file:") else ""
        if scheme not in SCHEMES or (uri and not uri.strip()):
            raise UsageError(f"{where} mlflow: MLFLOW_TRACKING_URI {redact_urls(uri)!r} is no MLflow tracking store "
                             "(http(s)://host:port, file:/path, sqlite:///file.db, postgresql://..., or unset for "
                             "./mlruns)")

    @classmethod
    def probe(cls) -> None:
        parts = urlsplit(os.environ.get("MLFLOW_TRACKING_URI", ""))
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            return
        where = (parts.hostname, parts.port or (443 if parts.scheme.lower() == "https" else 80))
        try:
            socket.create_connection(where, timeout=PROBE_S).close()
        except TimeoutError:  # a live server, however busy, accepts at once: nothing answers there
            raise ConnectionError(f"no answer from {where[0]}:{where[1]} within {PROBE_S:g} s") from None

    def __init__(self, name: str, *, params: Mapping[str, str], parent: str | None = None,
                 key: str | None = None) -> None:
        for setting, value in _CLIENT_DEFAULTS.items():
            os.environ.setdefault(setting, value)
        for logger in ("mlflow", "urllib3"):
            if not any(isinstance(f, _Redacted) for f in logging.getLogger(logger).filters):
                logging.getLogger(logger).addFilter(_Redacted())
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        self._experiment_id = self._experiment(env("MLFLOW_EXPERIMENT_NAME", PROJECT))
        self._key = key
        tags = {"mlflow.parentRunId": parent} if parent else {}
        if key:
            tags[KEY_TAG] = key
        self._run = self._client.create_run(self._experiment_id, run_name=name, tags=tags)
        if params:
            self._again(self._client.log_batch, self.run_id, params=[Param(k, str(v)[:MAX_PARAM])
                                                                     for k, v in params.items()])

    @staticmethod
    def _again(write, *args, **kwargs) -> None:
        """``write(*args, **kwargs)``, once more when the server refused it as a twin of itself. A write
        whose answer timed out is sent again by MLflow's client while the server may still be writing
        the first: the two race there and the second is refused (``UNIQUE constraint failed``; seen for
        the parameters and for a tag, twenty runs at once on a loaded machine). Sent once more, the
        server finds the first landed and takes it."""
        from mlflow.exceptions import RestException

        try:
            write(*args, **kwargs)
        except RestException as err:
            if not any(word in str(err) for word in TWIN_WORDS):
                raise
            time.sleep(AGAIN_S)
            write(*args, **kwargs)

    def _experiment(self, name: str) -> str:
        """The experiment's id, created when missing: runs started at once race to create it, and the
        losers find the winner's (create or get, tried again)."""
        from mlflow.exceptions import MlflowException

        for attempt in range(EXPERIMENT_TRIES):
            found = self._client.get_experiment_by_name(name)
            if found is not None:
                return found.experiment_id
            try:
                return self._client.create_experiment(name)
            except MlflowException:  # another run made it meanwhile (or the store was busy): look again
                if attempt == EXPERIMENT_TRIES - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def retryable(self, err: Exception) -> bool:
        from mlflow.exceptions import MlflowException

        if isinstance(err, MlflowException):  # the client's wrapping of a refused connection or a 5xx
            text = str(err)
            return any(word in text for word in ("API request to", "Max retries", "Connection", "TEMPORARILY",
                                                 "INTERNAL_ERROR", "timed out"))
        return super().retryable(err)

    @property
    def run_id(self) -> str:
        return self._run.info.run_id

    def metrics(self, values: Mapping[str, float], step: int | None, wall_time: float) -> None:
        self.points([(values, step, wall_time)])

    def points(self, points: Sequence[tuple[Mapping[str, float], int | None, float]]) -> None:
        from mlflow.entities import Metric

        batch = [Metric(k, v, int(wall_time * 1000), step or 0) for values, step, wall_time in points
                 for k, v in values.items()]
        for start in range(0, len(batch), MAX_BATCH):  # MLflow's limit of metrics in one call
            self._again(self._client.log_batch, self.run_id, metrics=batch[start:start + MAX_BATCH])

    def text(self, name: str, text: str) -> None:
        self._client.log_text(self.run_id, text, name)

    def artifact(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def finish(self, exit_code: int) -> None:
        self._again(self._client.set_tag, self.run_id, "exit_code", str(exit_code))
        self._again(self._client.set_terminated, self.run_id, status=_STATUS[status(exit_code)],
                    end_time=int(time.time() * 1000))
        self._drop_twins()

    def _drop_twins(self) -> None:
        """Delete the runs of this key other than this one: a ``runs/create`` (or a whole open) sent
        again after a timeout may have landed twice on a busy server. At the end, every request
        sent has landed; the twins hold no more than the parameters."""
        if not self._key:
            return
        for run in self._client.search_runs([self._experiment_id], f"tags.`{KEY_TAG}` = '{self._key}'"):
            if run.info.run_id != self.run_id:
                self._client.delete_run(run.info.run_id)


SINK = MlflowSink
