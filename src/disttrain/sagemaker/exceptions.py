"""``sagemaker.exceptions`` (v2) and the waiter errors of ``sagemaker.core`` (v3)."""

from __future__ import annotations

from ..errors import DisttrainError
from .trainingjob import UnexpectedStatusException


class WaiterError(DisttrainError):
    """Base of the v3 resource waiters' errors."""


class FailedStatusError(WaiterError):
    """``_latest_training_job.wait()`` (and ``ModelTrainer.train(wait=True)``) on a job that failed."""

    def __init__(self, resource_type: str = "TrainingJob", status: str = "Failed", reason: str | None = None) -> None:
        super().__init__(f"Encountered unexpected failed state while waiting for {resource_type}. "
                         f"Final Resource State: {status}. Failure Reason: {reason}")


class TimeoutExceededError(WaiterError):
    def __init__(self, resource_type: str = "TrainingJob", status: str = "InProgress",
                 message: str = "Increase the timeout and try again.") -> None:
        super().__init__(f"Timeout exceeded while waiting for {resource_type}. Final Resource State: {status}. "
                         f"{message}")


__all__ = ["FailedStatusError", "TimeoutExceededError", "UnexpectedStatusException", "WaiterError"]
