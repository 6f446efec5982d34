"""The SageMaker container contract a job's script sees, as an interface with two implementations.

A contract says what each instance of a job gets around the script: the script's arguments
from the hyperparameters, ``hyperparameters.json`` and the other config files, every ``SM_*``
variable, and how the script is started. SageMaker has two, and a job spec names one
(``contract:``):

- ``toolkit``: the SageMaker training toolkit's, inside the framework images that SDK v1/v2's
  estimators run (:class:`~disttrain.jobs.sagemaker.ToolkitContract`);
- ``model_trainer``: SDK v3's own drivers, which ``ModelTrainer`` ships
  (:class:`~disttrain.jobs.sagemaker_v3.ModelTrainerContract`).

The planner, the SDK surface and the job spec ask the contract object (:func:`contract_for`),
never its name. To add one: implement :class:`ContainerContract` (pure methods; only
``write_files`` writes), register it in :data:`CONTRACTS`, and tests/test_container_contract.py
runs it through what every contract must do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ..config.text import shown
from ..errors import UsageError
from .layout import InstancePaths
from .sagemaker import TOOLKIT, Instance, RunFacts
from .sagemaker_v3 import MODEL_TRAINER


@runtime_checkable
class ContainerContract(Protocol):
    """What a SageMaker container does around the script, for one job's instances."""

    name: str  # the job spec's ``contract:`` value
    entry_name: str  # the SDK's own name for the script, in messages (entry_point, SourceCode.entry_script)
    runs_commands: bool  # whether a job may give a shell command instead of a script

    def encoded_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> dict[str, str]:
        """``hyperparameters.json`` as this contract writes it (and DescribeTrainingJob shows it)."""

    def worker_command(self, facts: RunFacts, hyperparameters: Mapping[str, Any]
                       ) -> tuple[str, bool, tuple[str, ...]]:
        """(entry, is_module, args) every instance starts."""

    def instance_env(self, inst: Instance, paths: InstancePaths, facts: RunFacts) -> dict[str, str]:
        """One instance's variables (pure: the plan holds them)."""

    def write_files(self, inst: Instance, paths: InstancePaths, facts: RunFacts) -> None:
        """One instance's ``input/config`` files (and whatever else the contract leaves there)."""


CONTRACTS: dict[str, ContainerContract] = {c.name: c for c in (TOOLKIT, MODEL_TRAINER)}


def contract_for(name: str) -> ContainerContract:
    """The contract a job spec names; one line for an unknown name."""
    try:
        return CONTRACTS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value from a YAML file
        raise UsageError(f"contract must be one of {', '.join(CONTRACTS)}, got {shown(name)}") from None


__all__ = ["CONTRACTS", "ContainerContract", "RunFacts", "contract_for"]
