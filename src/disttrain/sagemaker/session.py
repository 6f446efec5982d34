"""``get_execution_role()`` and the rest of the SDK's session surface that notebooks touch."""

from __future__ import annotations

LOCAL_ROLE = "arn:aws:iam::000000000000:role/disttrain-local"


def get_execution_role(sagemaker_session=None, use_default: bool = False) -> str:
    """A placeholder role name: jobs run on your own machines as your own user, so no IAM role
    is assumed; estimators accept the value (and ignore it) so notebook cells run unchanged."""
    return LOCAL_ROLE
