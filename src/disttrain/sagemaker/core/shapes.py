"""SDK v3's ``sagemaker.core.shapes``: the shapes a training notebook builds (the configs' classes)."""

from __future__ import annotations

from ..configs import *  # noqa: F403
from ..configs import __all__  # noqa: F401
