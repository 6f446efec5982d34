"""``estimator.training_job_analytics``: the job's metric series (``dataframe()`` with pandas)."""

from __future__ import annotations

from ..errors import UsageError


class TrainingJobAnalytics:
    def __init__(self, training_job_name: str, metric_names: list[str] | None = None) -> None:
        self.name = training_job_name
        self.metric_names = metric_names

    def series(self) -> dict[str, list[tuple[float, float]]]:
        """{metric: [(time, value), ...]} from the job store."""
        from ..store import JobStore

        with JobStore() as store:
            series = store.metric_series(store.get(self.name).id)
        return {k: v for k, v in series.items() if not self.metric_names or k in self.metric_names}

    def dataframe(self, force_refresh: bool = False):
        """Columns ``timestamp`` (seconds since the first point), ``metric_name``, ``value``, as the SDK's."""
        try:
            import pandas as pd
        except ImportError:
            raise UsageError("training_job_analytics.dataframe() needs pandas: pip install pandas "
                             "(or use .series())") from None
        series = self.series()
        start = min((points[0][0] for points in series.values()), default=0.0)
        rows = [{"timestamp": t - start, "metric_name": name, "value": v}
                for name, points in sorted(series.items()) for t, v in points]
        return pd.DataFrame(rows, columns=["timestamp", "metric_name", "value"])
