"""SDK v3's ``sagemaker.train.configs`` (the SDK moved them to ``sagemaker.core.training.configs``)."""

from __future__ import annotations

from ..configs import *  # noqa: F403
from ..configs import __all__  # noqa: F401
