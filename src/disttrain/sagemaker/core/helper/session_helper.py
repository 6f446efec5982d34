"""SDK v3's ``sagemaker.core.helper.session_helper``: ``Session``, ``get_execution_role``."""

from __future__ import annotations

from ...session import Session, get_execution_role

__all__ = ["Session", "get_execution_role"]
