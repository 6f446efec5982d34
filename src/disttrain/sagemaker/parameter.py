"""Hyperparameter ranges (``sagemaker.parameter``, v3's ``sagemaker.core.parameter``).

As the SDK's: ``ContinuousParameter(min, max, scaling_type)``, ``IntegerParameter(min, max,
scaling_type)`` (``Auto``, ``Linear``, ``Logarithmic``, ``ReverseLogarithmic``) and
``CategoricalParameter(values)`` (values kept as strings). ``as_tuning_range(name)`` gives the
API's dict; :meth:`ParameterRange.to_dict` is how a tuning job stores it.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError

SCALING_TYPES = ("Auto", "Linear", "Logarithmic", "ReverseLogarithmic")


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class ParameterRange:
    """Base of the ranges: ``min_value``, ``max_value``, ``scaling_type``."""

    __all_types__ = ("Continuous", "Categorical", "Integer")
    kind = ""

    def __init__(self, min_value: float, max_value: float, scaling_type: str = "Auto") -> None:
        self.min_value, self.max_value, self.scaling_type = min_value, max_value, scaling_type

    def is_valid(self, value: Any) -> bool:
        return self.min_value <= value <= self.max_value

    @classmethod
    def cast_to_type(cls, value: Any) -> Any:
        return float(value)

    def as_tuning_range(self, name: str) -> dict[str, Any]:
        return {"Name": name, "MinValue": _text(self.min_value), "MaxValue": _text(self.max_value),
                "ScalingType": self.scaling_type}

    def check(self, name: str) -> None:
        """One line naming the hyperparameter when the range cannot be searched."""
        for key in ("min_value", "max_value"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"hyperparameter_ranges[{name!r}].{key} must be a number, got {value!r}")
        if self.min_value > self.max_value:
            raise UsageError(f"hyperparameter_ranges[{name!r}]: min_value {self.min_value} is above max_value "
                             f"{self.max_value}")
        if self.min_value == self.max_value:  # every trial would run the same value
            raise UsageError(f"hyperparameter_ranges[{name!r}]: {type(self).__name__}({self.min_value}, "
                             f"{self.max_value}) has nothing to search; give a wider range, or put {name} in "
                             f"the hyperparameters as a static value")
        if self.scaling_type not in SCALING_TYPES:
            raise UsageError(f"hyperparameter_ranges[{name!r}].scaling_type must be one of "
                             f"{', '.join(SCALING_TYPES)}, got {self.scaling_type!r}")
        if self.scaling_type == "Logarithmic" and self.min_value <= 0:
            raise UsageError(f"hyperparameter_ranges[{name!r}]: Logarithmic scaling needs min_value > 0, "
                             f"got {self.min_value}")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "min": self.min_value, "max": self.max_value, "scaling": self.scaling_type}


class ContinuousParameter(ParameterRange):
    kind = "Continuous"
    __name__ = "Continuous"


class IntegerParameter(ParameterRange):
    kind = "Integer"
    __name__ = "Integer"

    @classmethod
    def cast_to_type(cls, value: Any) -> int:
        return int(value)

    def check(self, name: str) -> None:
        super().check(name)
        for key in ("min_value", "max_value"):
            if not float(getattr(self, key)).is_integer():
                raise UsageError(f"hyperparameter_ranges[{name!r}].{key} must be a whole number, "
                                 f"got {getattr(self, key)!r}")


class CategoricalParameter(ParameterRange):
    kind = "Categorical"
    __name__ = "Categorical"

    def __init__(self, values: Any) -> None:
        values = values if isinstance(values, list) else [values]
        self.values = [_text(v) for v in values]

    def is_valid(self, value: Any) -> bool:
        return value in self.values

    @classmethod
    def cast_to_type(cls, value: Any) -> str:
        return str(value)

    def as_tuning_range(self, name: str) -> dict[str, Any]:
        return {"Name": name, "Values": list(self.values)}

    def as_json_range(self, name: str) -> dict[str, Any]:
        import json

        return {"Name": name, "Values": [json.dumps(v) for v in self.values]}

    def check(self, name: str) -> None:
        if not self.values:
            raise UsageError(f"hyperparameter_ranges[{name!r}]: CategoricalParameter needs at least one value")
        if len(set(self.values)) != len(self.values):
            raise UsageError(f"hyperparameter_ranges[{name!r}]: CategoricalParameter values repeat: {self.values}")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "values": list(self.values)}


def from_dict(data: dict[str, Any]) -> ParameterRange:
    """The inverse of :meth:`ParameterRange.to_dict` (a stored tuning job's ranges)."""
    if data["type"] == "Categorical":
        return CategoricalParameter(list(data["values"]))
    cls = ContinuousParameter if data["type"] == "Continuous" else IntegerParameter
    return cls(data["min"], data["max"], data["scaling"])


__all__ = ["CategoricalParameter", "ContinuousParameter", "IntegerParameter", "ParameterRange"]
