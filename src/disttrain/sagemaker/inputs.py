"""``TrainingInput``: one channel of ``fit``, as the SDK's ``sagemaker.inputs.TrainingInput``.

Only the location matters on your own machines (a local path, ``file://`` or any fsspec URL);
the S3-specific options are kept for ``describe()`` and otherwise unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import UsageError

DEFAULT_CHANNEL = "training"  # fit("s3://...") with a string: the SDK's channel name


class TrainingInput:
    def __init__(self, s3_data: str, distribution: str | None = None, compression: str | None = None,
                 content_type: str | None = None, record_wrapping: str | None = None,
                 s3_data_type: str = "S3Prefix", instance_groups: list | None = None,
                 input_mode: str | None = None, attribute_names: list | None = None,
                 target_attribute_name: str | None = None, shuffle_config: Any = None,
                 hub_access_config: dict | None = None, model_access_config: dict | None = None) -> None:
        if not isinstance(s3_data, str) or not s3_data:
            raise UsageError(f"TrainingInput: s3_data must be a path or URL, got {s3_data!r}")
        if compression not in (None, "None"):
            raise UsageError(f"TrainingInput: compression={compression!r} is not supported here; "
                             "give the uncompressed data")
        self.config = {
            "DataSource": {"S3DataSource": {"S3DataType": s3_data_type, "S3Uri": s3_data,
                                            "S3DataDistributionType": distribution or "FullyReplicated"}},
            **({"ContentType": content_type} if content_type else {}),
            **({"InputMode": input_mode} if input_mode else {}),
        }

    @property
    def location(self) -> str:
        return self.config["DataSource"]["S3DataSource"]["S3Uri"]

    def __repr__(self) -> str:
        return f"TrainingInput({self.location!r})"


def channels(inputs: Any) -> dict[str, str]:
    """``fit``'s ``inputs`` → {channel: location}: a string (the ``training`` channel), a
    ``TrainingInput``, or a dict of either."""
    if inputs is None:
        return {}
    if isinstance(inputs, (str, TrainingInput)):
        inputs = {DEFAULT_CHANNEL: inputs}
    if not isinstance(inputs, Mapping):
        raise UsageError(f"fit: inputs must be a path/URL, a TrainingInput or a dict of them, got {inputs!r}")
    found = {}
    for name, value in inputs.items():
        if isinstance(value, TrainingInput):
            found[name] = value.location
        elif isinstance(value, str) and value:
            found[name] = value
        else:
            raise UsageError(f"fit: inputs[{name!r}] must be a path/URL or a TrainingInput, got {value!r}")
    return found
