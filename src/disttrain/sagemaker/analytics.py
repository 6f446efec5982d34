"""``estimator.training_job_analytics``: the job's metric series, as the SDK's ``TrainingJobAnalytics``.

``dataframe()`` has the SDK's shape: columns ``timestamp`` (seconds since that metric's first
point), ``metric_name`` and ``value``, one metric after the other in the order of the job's
``metric_definitions``, each sorted by time. The SDK reads CloudWatch's per-minute averages;
here every matched point is a row (the job store keeps them all). pandas is optional, as in
the SDK: without it ``dataframe()`` says how to get it, and ``series()`` needs nothing.
"""

from __future__ import annotations

from ..errors import UsageError

PANDAS_MISSING = ("training_job_analytics.dataframe() needs pandas: pip install pandas "
                  "(or use training_job_analytics.series(), which needs nothing)")


class TrainingJobAnalytics:
    """``TrainingJobAnalytics(training_job_name, metric_names=None)``; ``sagemaker_session`` is accepted
    and unused, as everywhere in :mod:`disttrain.sagemaker`."""

    def __init__(self, training_job_name: str, metric_names: list[str] | None = None,
                 sagemaker_session=None) -> None:
        self.name = training_job_name
        self.metric_names = list(metric_names) if metric_names else None
        self._dataframe = None

    def __repr__(self) -> str:
        return f"<disttrain.sagemaker.TrainingJobAnalytics for {self.name}>"

    def series(self) -> dict[str, list[tuple[float, float]]]:
        """{metric: [(time, value), ...]} from the job store, in the order of the job's metric_definitions."""
        from ..store import JobStore

        with JobStore() as store:
            record = store.get(self.name)
            series = store.metric_series(record.id)
        defined = [d["Name"] for d in record.spec.get("metric_definitions") or []]
        names = self.metric_names or [*defined, *sorted(set(series) - set(defined))]
        return {name: series[name] for name in names if name in series}  # the store keeps time order

    def clear_cache(self) -> None:
        self._dataframe = None

    def dataframe(self, force_refresh: bool = False):
        """The SDK's frame (cached, as there; ``force_refresh=True`` reads the store again)."""
        try:
            import pandas as pd
        except ImportError:
            raise UsageError(PANDAS_MISSING) from None
        if force_refresh:
            self.clear_cache()
        if self._dataframe is None:
            rows = [(t - points[0][0], name, value) for name, points in self.series().items() for t, value in points]
            self._dataframe = pd.DataFrame(rows, columns=["timestamp", "metric_name", "value"])
        return self._dataframe

    def export_csv(self, filename: str) -> None:
        self.dataframe().to_csv(filename)


class HyperparameterTuningJobAnalytics:
    """``tuner.analytics()``: the trials of a tuning job, as the SDK's frame.

    ``dataframe()`` has one row per trial and the SDK's columns: each tuned hyperparameter
    (a number where it is one), ``TrainingJobName``, ``TrainingJobStatus``, ``FinalObjectiveValue``
    (the objective's last point), ``TrainingStartTime``, ``TrainingEndTime`` (datetimes) and
    ``TrainingElapsedTimeSeconds``.
    """

    def __init__(self, hyperparameter_tuning_job_name: str, sagemaker_session=None) -> None:
        self._tuning_job_name = hyperparameter_tuning_job_name
        self.clear_cache()

    @property
    def name(self) -> str:
        return self._tuning_job_name

    def __repr__(self) -> str:
        return f"<disttrain.sagemaker.HyperparameterTuningJobAnalytics for {self.name}>"

    def clear_cache(self) -> None:
        self._description = None
        self._dataframe = None

    def description(self, force_refresh: bool = False) -> dict:
        from .tuning import describe

        if force_refresh:
            self.clear_cache()
        if self._description is None:
            self._description = describe(self.name)
        return self._description

    def training_job_summaries(self, force_refresh: bool = False) -> list[dict]:
        return self.description(force_refresh)["TrainingJobSummaries"]

    @property
    def tuning_ranges(self) -> dict:
        ranges = self.description()["HyperParameterTuningJobConfig"]["ParameterRanges"]
        return {param["Name"]: param for group in ranges.values() for param in group}

    def dataframe(self, force_refresh: bool = False):
        try:
            import pandas as pd
        except ImportError:
            raise UsageError(PANDAS_MISSING.replace("training_job_analytics", "tuner.analytics()")) from None
        import datetime

        def when(value):
            return None if value is None else datetime.datetime.fromtimestamp(value, tz=datetime.timezone.utc)

        if force_refresh:
            self.clear_cache()
        if self._dataframe is None:
            rows = []
            for summary in self.training_job_summaries():
                row = {}
                for key, value in summary["TunedHyperParameters"].items():
                    try:
                        value = float(value)
                    except (TypeError, ValueError):
                        pass
                    row[key] = value
                row["TrainingJobName"] = summary["TrainingJobName"]
                row["TrainingJobStatus"] = summary["TrainingJobStatus"]
                row["FinalObjectiveValue"] = summary.get("FinalHyperParameterTuningJobObjectiveMetric", {}).get("Value")
                start, end = summary["TrainingStartTime"], summary["TrainingEndTime"]
                row["TrainingStartTime"], row["TrainingEndTime"] = when(start), when(end)
                if start and end:
                    row["TrainingElapsedTimeSeconds"] = end - start
                rows.append(row)
            self._dataframe = pd.DataFrame(rows)
        return self._dataframe

    def export_csv(self, filename: str) -> None:
        self.dataframe().to_csv(filename)
