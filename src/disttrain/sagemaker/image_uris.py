"""``sagemaker.image_uris.retrieve(...)``: the name of the SageMaker container image, nothing pulled.

Jobs here run your script with this machine's Python, so the image is only a name: notebooks
that pass it to an estimator (``image_uri=``) or a ModelTrainer (``training_image=``) run as
written, and the argument is named once as ignored.
"""

from __future__ import annotations

from typing import Any

from . import buckets

REGISTRY = "763104351884"  # AWS's Deep Learning Containers account


def retrieve(framework: str, region: str | None = None, version: str | None = None, py_version: str | None = None,
             instance_type: str | None = None, accelerator_type: str | None = None, image_scope: str | None = None,
             container_version: str | None = None, **kwargs: Any) -> str:
    """``<account>.dkr.ecr.<region>.amazonaws.com/<framework>-<scope>:<version>-<cpu|gpu>-<py>``."""
    scope = image_scope or "training"
    device = "gpu" if instance_type and any(instance_type.startswith(f"ml.{f}") for f in ("p", "g")) else "cpu"
    tag = "-".join(str(part) for part in (version or "latest", device, py_version) if part)
    return f"{REGISTRY}.dkr.ecr.{region or buckets.region()}.amazonaws.com/{framework}-{scope}:{tag}"


__all__ = ["retrieve"]
