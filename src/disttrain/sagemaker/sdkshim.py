"""``import sagemaker`` served by :mod:`disttrain.sagemaker`, in one process only.

A finder placed first on ``sys.meta_path`` answers for ``sagemaker`` and every
``sagemaker.<path>``: the module is ``disttrain.sagemaker.<path>`` itself (one module object
under both names, so ``isinstance`` and module state agree), SDK v2 and v3 paths alike. A path
disttrain does not mirror is a ``ModuleNotFoundError`` naming it and what is served. The real
SDK, where installed, is untouched: nothing is written outside this process, and
:func:`uninstall` gives the name back.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

PACKAGE = "sagemaker"
TARGET = "disttrain.sagemaker"
# What a notebook may import; anything else under sagemaker. is named as missing.
SERVED = ("sagemaker", "sagemaker.estimator", "sagemaker.pytorch", "sagemaker.tensorflow", "sagemaker.inputs",
          "sagemaker.session", "sagemaker.s3", "sagemaker.image_uris", "sagemaker.tuner", "sagemaker.parameter",
          "sagemaker.analytics", "sagemaker.utils", "sagemaker.exceptions", "sagemaker.modules.train",
          "sagemaker.train", "sagemaker.train.configs", "sagemaker.train.distributed", "sagemaker.train.tuner",
          "sagemaker.core.parameter", "sagemaker.core.helper.session_helper", "sagemaker.core.training.configs",
          "sagemaker.core.resources", "sagemaker.core.shapes", "sagemaker.core.s3", "sagemaker.core.image_uris")


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # The import system reads sys.modules[name] after exec_module, so the disttrain module
        # itself becomes sagemaker.<path>, with its own __spec__ and __name__ left as they are.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class SageMakerFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        target = TARGET + fullname[len(PACKAGE):]
        try:
            found = importlib.util.find_spec(target)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} in disttrain's SageMaker SDK (it serves the training parts: "
                f"{', '.join(SERVED)}); see docs/sagemaker.md", name=fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(target),
                                               is_package=found.submodule_search_locations is not None)


def installed() -> bool:
    return any(isinstance(finder, SageMakerFinder) for finder in sys.meta_path)


def install(say=None) -> None:
    """From now on in this process, ``import sagemaker`` is disttrain's. A real SDK imported before
    is dropped from ``sys.modules`` (objects made from it keep working, but are not disttrain's)."""
    if installed():
        return
    real = [name for name, module in sys.modules.items()
            if (name == PACKAGE or name.startswith(PACKAGE + ".")) and module is not None
            and not getattr(module, "__name__", "").startswith(TARGET)]
    for name in real:
        del sys.modules[name]
    sys.meta_path.insert(0, SageMakerFinder())
    if say is not None:
        note = " (the real SDK imported before was set aside: import sagemaker again)" if real else ""
        say(f"disttrain: `import sagemaker` in this process is now disttrain's SageMaker SDK; jobs run on "
            f"your own machines{note}")


def uninstall() -> None:
    """``sagemaker`` is looked up the usual way again (the real SDK, if installed)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, SageMakerFinder)]
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
