"""Warnings that point at the user's line, not at disttrain's."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent.parent)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)``, attributed to the first caller outside disttrain: the
    line shown under the message is the script's own call (``disttrain.resume(...)``)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of warn()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
