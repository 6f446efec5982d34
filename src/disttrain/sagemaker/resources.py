"""SDK v3's resource objects (``sagemaker.core.resources``) for a recorded job: what
``model_trainer._latest_training_job`` is.

``TrainingJob`` holds the DescribeTrainingJob fields in the SDK's snake_case
(``training_job_name``, ``training_job_status``, ``secondary_status``, ``failure_reason``,
``model_artifacts.s3_model_artifacts``, ``hyper_parameters``, ``final_metric_data_list``,
times as datetimes, ...), read from the job store at ``refresh()``; ``wait()`` raises
``FailedStatusError`` when the job failed, as the SDK's waiter does. ``HyperParameterTuningJob``
is DescribeHyperParameterTuningJob the same way (what the v3 tuner's ``describe()`` returns):
every field in sagemaker-core's snake_case (``hyper_parameter_tuning_job_name``,
``hyper_parameter_tuning_job_status``, ``best_training_job.training_job_name``,
``training_job_status_counters.completed``, ...), nested shapes as objects, maps as dicts.
"""

from __future__ import annotations

import datetime
import re
import time
from dataclasses import dataclass
from typing import Any

from .exceptions import FailedStatusError, TimeoutExceededError
from .trainingjob import TrainingJob as _Job


@dataclass
class ModelArtifacts:
    s3_model_artifacts: str | None = None


@dataclass
class MetricData:
    metric_name: str
    value: float
    timestamp: datetime.datetime


@dataclass
class OutputDataConfig:
    s3_output_path: str | None = None
    kms_key_id: str | None = None
    compression_type: str | None = None


@dataclass
class ResourceConfig:
    instance_type: str | None = None
    instance_count: int | None = None
    volume_size_in_gb: int | None = None


@dataclass
class StoppingCondition:
    max_runtime_in_seconds: int | None = None


@dataclass
class CheckpointConfig:
    s3_uri: str | None = None
    local_path: str | None = None


def _time(value: float | None) -> datetime.datetime | None:
    return None if value is None else datetime.datetime.fromtimestamp(value, tz=datetime.timezone.utc)


class TrainingJob:
    """A training job in ``sagemaker.core.resources``' shape."""

    def __init__(self, training_job_name: str, job: _Job | None = None) -> None:
        self.training_job_name = training_job_name
        self._job = job or _Job(training_job_name)
        self.training_job_status: str | None = None
        self.refresh()

    @classmethod
    def get(cls, training_job_name: str, session=None, region: str | None = None) -> TrainingJob:
        return cls(training_job_name)

    def get_name(self) -> str:
        return self.training_job_name

    def __repr__(self) -> str:
        return f"TrainingJob(training_job_name={self.training_job_name!r}, training_job_status={self.training_job_status!r})"

    def refresh(self) -> TrainingJob:
        """Read the record again (every attribute follows the job)."""
        described: dict[str, Any] = self._job.describe()
        self.training_job_arn = f"arn:aws:sagemaker:local:000000000000:training-job/{self.training_job_name}"
        self.training_job_status = described["TrainingJobStatus"]
        self.secondary_status = described["SecondaryStatus"]
        self.failure_reason = described.get("FailureReason")
        self.hyper_parameters = described["HyperParameters"]
        self.environment = described.get("Environment", {})
        artifacts = described.get("ModelArtifacts", {}).get("S3ModelArtifacts")
        self.model_artifacts = ModelArtifacts(s3_model_artifacts=artifacts)
        self.output_data_config = OutputDataConfig(s3_output_path=described["OutputDataConfig"]["S3OutputPath"])
        resources = described["ResourceConfig"]
        self.resource_config = ResourceConfig(instance_type=resources["InstanceType"],
                                              instance_count=resources["InstanceCount"])
        self.stopping_condition = StoppingCondition(described["StoppingCondition"]["MaxRuntimeInSeconds"])
        checkpoint = described["CheckpointConfig"]
        self.checkpoint_config = CheckpointConfig(s3_uri=checkpoint["S3Uri"], local_path=checkpoint["LocalPath"])
        self.creation_time = _time(described["CreationTime"])
        self.training_start_time = _time(described["TrainingStartTime"])
        self.training_end_time = _time(described["TrainingEndTime"])
        self.last_modified_time = self.training_end_time or self.training_start_time or self.creation_time
        self.final_metric_data_list = [MetricData(m["MetricName"], m["Value"], _time(m["Timestamp"]))
                                       for m in described["FinalMetricDataList"]]
        start, end = described["TrainingStartTime"], described["TrainingEndTime"]
        self.training_time_in_seconds = int(end - start) if start and end else None
        self.billable_time_in_seconds = 0  # your own machines
        return self

    def wait(self, poll: int = 5, timeout: int | None = None, logs: bool | None = False) -> None:
        """Until the job ends: returns when Completed or Stopped, raises FailedStatusError when Failed,
        TimeoutExceededError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if logs:
            self._job.logs(follow=True)
        while self._job.wait_done(timeout_s=None if deadline is None else
                                  max(0.0, min(poll, deadline - time.monotonic()))) is None:
            if deadline is not None and time.monotonic() >= deadline:
                self.refresh()
                raise TimeoutExceededError(status=self.training_job_status or "InProgress",
                                           message="Your training job is still running. Call .refresh() to check "
                                                   "its current status.")
        self.refresh()
        if self.training_job_status == "Failed":
            reason = (self.failure_reason or "").strip().splitlines()
            raise FailedStatusError(status="Failed", reason=f"{reason[0] if reason else '?'} "
                                                             f"(disttrain jobs show {self.training_job_name})")

    def stop(self) -> None:
        self._job.stop()
        self.refresh()

    def logs(self, follow: bool = False) -> None:
        self._job.logs(follow=follow)


# Fields whose values are maps of the user's own keys (hyperparameter names), kept as dicts.
_MAPS = {"TunedHyperParameters", "StaticHyperParameters", "HyperParameters", "Environment"}


def snake(name: str) -> str:
    """The API's field name as sagemaker-core spells it: ``HyperParameterTuningJobName`` →
    ``hyper_parameter_tuning_job_name``, ``S3Uri`` → ``s3_uri``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class Shape:
    """A response structure: its fields as attributes (``model_dump()`` gives them back as a dict)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        for key, value in fields.items():
            setattr(self, snake(key), _shaped(key, value))

    def model_dump(self) -> dict[str, Any]:
        return {k: v.model_dump() if isinstance(v, Shape) else
                [x.model_dump() if isinstance(x, Shape) else x for x in v] if isinstance(v, list) else v
                for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _shaped(key: str, value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value) if key in _MAPS else Shape(value)
    if isinstance(value, list):
        return [Shape(v) if isinstance(v, dict) else v for v in value]
    if key.endswith("Time") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _time(value)
    return value


class HyperParameterTuningJob(Shape):
    """A tuning job in ``sagemaker.core.resources``' shape, read from its study at ``refresh()``."""

    def __init__(self, hyper_parameter_tuning_job_name: str) -> None:
        self.hyper_parameter_tuning_job_name = hyper_parameter_tuning_job_name
        self.refresh()

    @classmethod
    def get(cls, hyper_parameter_tuning_job_name: str, session=None, region: str | None = None
            ) -> HyperParameterTuningJob:
        return cls(hyper_parameter_tuning_job_name)

    def get_name(self) -> str:
        return self.hyper_parameter_tuning_job_name

    def refresh(self) -> HyperParameterTuningJob:
        from .tuning import describe

        name = self.hyper_parameter_tuning_job_name
        described = describe(name)
        described.setdefault("BestTrainingJob", None)
        described["HyperParameterTuningJobArn"] = \
            f"arn:aws:sagemaker:local:000000000000:hyper-parameter-tuning-job/{name}"
        Shape.__init__(self, described)
        return self

    def wait(self, poll: int = 5, timeout: int | None = None) -> None:
        """Until the tuning job ends (Completed or Stopped returns; Failed raises FailedStatusError)."""
        from .tunerbase import TuningJob

        deadline = None if timeout is None else time.monotonic() + timeout
        job = TuningJob(self.hyper_parameter_tuning_job_name)
        while not job._done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutExceededError(status=self.refresh().hyper_parameter_tuning_job_status,
                                           message="Your tuning job is still running.")
            time.sleep(min(poll, 0.5))
        if self.refresh().hyper_parameter_tuning_job_status == "Failed":
            raise FailedStatusError(status="Failed", reason=f"(disttrain tune show "
                                                             f"{self.hyper_parameter_tuning_job_name})")

    def stop(self) -> None:
        from .tunerbase import TuningJob

        TuningJob(self.hyper_parameter_tuning_job_name).stop()
        self.refresh()


__all__ = ["CheckpointConfig", "HyperParameterTuningJob", "Shape", "MetricData", "ModelArtifacts", "OutputDataConfig", "ResourceConfig",
           "StoppingCondition", "TrainingJob"]
