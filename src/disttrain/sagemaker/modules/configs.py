"""SDK v2's ``sagemaker.modules.configs``."""

from __future__ import annotations

from ..configs import *  # noqa: F403
from ..configs import __all__  # noqa: F401
