"""The SDK's module paths that hold nothing of their own, in one table.

The SDK spreads the same classes over many paths (v2's ``sagemaker.pytorch`` and
``sagemaker.modules.train``, v3's ``sagemaker.train.configs``, ``sagemaker.core.training.configs``,
``sagemaker.core.shapes``, ...). Here each such path is a row of :data:`PATHS`, under
``disttrain.sagemaker.`` (and so, through :mod:`.sdkshim`, under ``sagemaker.``): either the real
module itself (one module object under both names, so ``isinstance`` and module state agree), or
a module gathering the names it lists from real modules. The real modules stand alone beside it.

A finder on ``sys.meta_path`` (installed by ``import disttrain.sagemaker``) answers for exactly
these paths; a path with rows below it is a package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

BASE = "disttrain.sagemaker"
# SDK path -> the real module it is ("name"), or {real module: [names]} it gathers ({}: a package only).
PATHS: dict[str, str | dict[str, list[str]]] = {
    # SDK v2
    "pytorch": {"frameworks": ["PyTorch"]},
    "pytorch.estimator": {"frameworks": ["PyTorch"]},
    "tensorflow": {"frameworks": ["LOCAL_MODEL_DIR", "TensorFlow"]},
    "tensorflow.estimator": {"frameworks": ["LOCAL_MODEL_DIR", "TensorFlow"]},
    "modules": {},  # 2.23x's ModelTrainer, the same classes as v3's sagemaker.train
    "modules.configs": "configs",
    "modules.distributed": "distributed",
    "modules.train": {"modeltrainer": ["Mode", "ModelTrainer"]},
    "modules.train.model_trainer": "modeltrainer",
    # SDK v3
    "train": {"configs": ["Compute"], "modeltrainer": ["Mode", "ModelTrainer"],
              "session": ["Session", "get_execution_role"]},
    "train.configs": "configs",
    "train.distributed": "distributed",
    "train.model_trainer": "modeltrainer",
    "train.tuner": "trainertuner",
    "core": {},
    "core.helper": {},
    "core.helper.session_helper": {"session": ["Session", "get_execution_role"]},
    "core.image_uris": "image_uris",
    "core.parameter": "parameter",
    "core.resources": "resources",
    "core.s3": "s3",
    "core.shapes": "configs",
    "core.training": {},
    "core.training.configs": "configs",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, row: str | dict[str, list[str]]) -> None:
        self.row = row

    def create_module(self, spec):
        return None  # the default module; exec_module fills it (or puts the real one in its place)

    def exec_module(self, module) -> None:
        if isinstance(self.row, str):  # the real module itself becomes this path (its own name kept)
            sys.modules[module.__name__] = importlib.import_module(f"{BASE}.{self.row}")
            return
        names = []
        for source, picked in self.row.items():
            real = importlib.import_module(f"{BASE}.{source}")
            for name in picked:
                setattr(module, name, getattr(real, name))
            names += picked
        module.__all__ = names
        module.__doc__ = f"The SDK's ``{module.__name__.removeprefix('disttrain.')}`` (see disttrain.sagemaker.sdkpaths)."


class SdkPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(BASE + "."):
            return None
        key = fullname[len(BASE) + 1:]
        if key not in PATHS:
            return None
        package = any(other.startswith(key + ".") for other in PATHS)
        return importlib.util.spec_from_loader(fullname, _Loader(PATHS[key]), is_package=package)


def install() -> None:
    """Once per process (``import disttrain.sagemaker`` calls it)."""
    if not any(isinstance(finder, SdkPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, SdkPathFinder())


__all__ = ["PATHS", "SdkPathFinder", "install"]
