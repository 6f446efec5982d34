"""A job's container, as the planner's input: what it adds to each instance of the plan.

A SageMaker-style job runs its script inside a container's contract: each instance has its
own ``SM_*`` variables and config files, its folder shown at ``/opt/ml``, the job's own
interpreter (when ``requirements.txt`` made one) and, for ``parameter_server``, a wrapper that
starts a ps task beside the script. The job side (:mod:`disttrain.jobs.planner`) turns the job
spec and the facts the launcher found into a :class:`ContainerSetup` (its
:class:`~disttrain.plan.launch.ContainerPlanner`); :func:`~disttrain.plan.launch.make_plan` applies
it, so the plan a launcher places is the plan that runs: ``--dry-run`` prints it, ``plan.json``
keeps it, and nothing changes it afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class InstanceSetup:
    """One instance (node) of the job: its variables (applied over the launcher's own, under the
    user's ``env``), and the folder its processes see at /opt/ml (None: none)."""

    env: Mapping[str, str] = field(default_factory=dict)
    opt_ml: str | None = None
    opt_ml_required: bool = False  # no mount namespace on that machine: an error, not a note


@dataclass(frozen=True, kw_only=True)
class ContainerSetup:
    """What the container adds to a plan: one :class:`InstanceSetup` per node, in node order."""

    instances: tuple[InstanceSetup, ...]
    python: str | None = None  # the workers' interpreter (the job's own venv); None: the launch's
    wrapper: str | None = None  # a module run first: ``python -u -m WRAPPER SCRIPT ARGS`` (the ps shim)
