"""SDK v3's configuration classes (``sagemaker.train.configs``, ``sagemaker.core.training.configs``,
``sagemaker.modules.configs``), with the SDK's field names and defaults.

The SDK's are pydantic models that refuse unknown fields; these are keyword-only dataclasses,
which refuse them too (``TypeError: SourceCode.__init__() got an unexpected keyword argument
'entry_scirpt'``), and offer ``model_dump()`` as the SDK's do. Which fields a job here uses is
decided by :class:`~disttrain.sagemaker.modeltrainer.ModelTrainer`; the rest are kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEFAULT_IGNORE_PATTERNS = [".env", ".git", "__pycache__", ".DS_Store", ".cache", ".ipynb_checkpoints"]


class BaseConfig:
    """What the SDK's pydantic models offer and notebooks call."""

    def model_dump(self, exclude_none: bool = False) -> dict[str, Any]:
        data = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, BaseConfig):
                value = value.model_dump(exclude_none=exclude_none)
            elif isinstance(value, list):
                value = [v.model_dump(exclude_none=exclude_none) if isinstance(v, BaseConfig) else v for v in value]
            if exclude_none and value is None:
                continue
            data[f.name] = value
        return data


def config(cls):
    return dataclass(kw_only=True)(cls)


@config
class SourceCode(BaseConfig):
    source_dir: str | None = None
    requirements: str | None = None
    entry_script: str | None = None
    command: str | None = None
    ignore_patterns: list[str] | None = field(default_factory=lambda: list(DEFAULT_IGNORE_PATTERNS))


@config
class InstanceGroup(BaseConfig):
    instance_type: str | None = None
    instance_count: int | None = None
    instance_group_name: str | None = None


@config
class Compute(BaseConfig):
    instance_type: str | None = None
    instance_count: int | None = None
    volume_size_in_gb: int | None = 30
    volume_kms_key_id: str | None = None
    keep_alive_period_in_seconds: int | None = None
    instance_groups: list[InstanceGroup] | None = None
    training_plan_arn: str | None = None
    enable_managed_spot_training: bool | None = None
    capacity_reservation_ids: list[str] | None = None
    instance_placement_config: Any = None


@config
class Networking(BaseConfig):
    security_group_ids: list[str] | None = None
    subnets: list[str] | None = None
    enable_network_isolation: bool | None = None
    enable_inter_container_traffic_encryption: bool | None = None


@config
class StoppingCondition(BaseConfig):
    max_runtime_in_seconds: int | None = None
    max_wait_time_in_seconds: int | None = None
    max_pending_time_in_seconds: int | None = None


@config
class RetryStrategy(BaseConfig):
    maximum_retry_attempts: int | None = None


@config
class OutputDataConfig(BaseConfig):
    s3_output_path: str | None = None
    kms_key_id: str | None = None
    compression_type: str | None = None


@config
class CheckpointConfig(BaseConfig):
    s3_uri: str | None = None
    local_path: str | None = "/opt/ml/checkpoints"


@config
class TensorBoardOutputConfig(BaseConfig):
    s3_output_path: str | None = None
    local_path: str | None = "/opt/ml/output/tensorboard"


@config
class MetricDefinition(BaseConfig):
    name: str | None = None
    regex: str | None = None


@config
class S3DataSource(BaseConfig):
    s3_data_type: str | None = "S3Prefix"
    s3_uri: str | None = None
    s3_data_distribution_type: str | None = None
    attribute_names: list[str] | None = None
    instance_group_names: list[str] | None = None
    model_access_config: Any = None
    hub_access_config: Any = None


@config
class FileSystemDataSource(BaseConfig):
    file_system_id: str | None = None
    file_system_access_mode: str | None = None
    file_system_type: str | None = None
    directory_path: str | None = None


@config
class DatasetSource(BaseConfig):
    dataset_arn: str | None = None


@config
class DataSource(BaseConfig):
    s3_data_source: S3DataSource | None = None
    file_system_data_source: FileSystemDataSource | None = None
    dataset_source: DatasetSource | None = None


@config
class ShuffleConfig(BaseConfig):
    seed: int | None = None


@config
class Channel(BaseConfig):
    channel_name: str | None = None
    data_source: DataSource | None = None
    content_type: str | None = None
    compression_type: str | None = None
    record_wrapper_type: str | None = None
    input_mode: str | None = None
    shuffle_config: ShuffleConfig | None = None


@config
class InputData(BaseConfig):
    channel_name: str | None = None
    data_source: Any = None  # a path or URL, an S3DataSource, a FileSystemDataSource
    content_type: str | None = None


@config
class Tag(BaseConfig):
    key: str | None = None
    value: str | None = None


@config
class TrainingImageConfig(BaseConfig):
    training_repository_access_mode: str | None = None
    training_repository_auth_config: Any = None


@config
class TrainingRepositoryAuthConfig(BaseConfig):
    training_repository_credentials_provider_arn: str | None = None


@config
class InfraCheckConfig(BaseConfig):
    enable_infra_check: bool | None = None


@config
class RemoteDebugConfig(BaseConfig):
    enable_remote_debug: bool | None = None


@config
class SessionChainingConfig(BaseConfig):
    enable_session_tag_chaining: bool | None = None


@config
class HubAccessConfig(BaseConfig):
    hub_content_arn: str | None = None


@config
class ModelAccessConfig(BaseConfig):
    accept_eula: bool | None = None


TrainingJobCompute = Compute

__all__ = [
    "BaseConfig", "SourceCode", "StoppingCondition", "RetryStrategy", "OutputDataConfig", "Channel",
    "ShuffleConfig", "DataSource", "S3DataSource", "FileSystemDataSource", "TrainingImageConfig",
    "TrainingRepositoryAuthConfig", "Tag", "InfraCheckConfig", "RemoteDebugConfig", "SessionChainingConfig",
    "InstanceGroup", "TensorBoardOutputConfig", "CheckpointConfig", "HubAccessConfig", "ModelAccessConfig",
    "Compute", "Networking", "InputData", "MetricDefinition", "DatasetSource", "TrainingJobCompute",
]
