"""What SDK local mode (``Mode.LOCAL_CONTAINER``) leaves under ``local_container_root`` after a job.

The SDK's local container gathers every instance's ``/opt/ml/model`` and ``/opt/ml/output`` into
``artifacts/model`` and ``artifacts/output`` (a later instance's file of the same name wins, as
there), packs them to ``compressed_artifacts/model.tar.gz`` and ``output.tar.gz``, leaves an empty
``output/data`` and removes its per-instance folders; notebooks check that tree. Here the job ran
in its own folder (``disttrain jobs show``), so the tree is written from it, and nothing else is
left under the root.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..jobs.layout import JobLayout, instance_names
from ..jobs.tarballs import pack_dir


def leave_local_layout(root: str | Path, job_dir: str | Path, instance_count: int) -> Path:
    """The SDK's tree under ``root`` from the job in ``job_dir``; the path of its ``model.tar.gz``."""
    root = Path(root)
    layout = JobLayout(Path(job_dir), instance_names(instance_count))
    artifacts, compressed = root / "artifacts", root / "compressed_artifacts"
    for kind in ("model", "output"):
        target = artifacts / kind
        target.mkdir(parents=True, exist_ok=True)
        for inst in layout.instances:
            source = inst.model if kind == "model" else inst.output
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        pack_dir(target, compressed / f"{kind}.tar.gz")
    (root / "output" / "data").mkdir(parents=True, exist_ok=True)
    return compressed / "model.tar.gz"
