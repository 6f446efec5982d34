"""Every SDK module path disttrain serves imports, from the one table (sagemaker/sdkpaths.py), under
``disttrain.sagemaker.`` and, in a process that asked for it, under ``sagemaker.``; the package holds
real modules only (no file that just re-exports another)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import disttrain.sagemaker
from disttrain.sagemaker.sdkpaths import PATHS


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_sdk_path_imports(path):
    module = importlib.import_module(f"disttrain.sagemaker.{path}")
    row = PATHS[path]
    if isinstance(row, str):  # the real module itself, under both names
        assert module is importlib.import_module(f"disttrain.sagemaker.{row}")
    else:
        for source, names in row.items():
            real = importlib.import_module(f"disttrain.sagemaker.{source}")
            assert all(getattr(module, name) is getattr(real, name) for name in names)


def test_served_paths_import_as_sagemaker_in_one_process():
    from disttrain.sagemaker.sdkshim import SERVED

    code = ("import importlib\nfrom disttrain.sagemaker.sdkshim import install, SERVED\ninstall()\n"
            "for name in SERVED: importlib.import_module(name)\n"
            "from sagemaker.train.configs import Compute\nimport disttrain.sagemaker.configs as c\n"
            "assert Compute is c.Compute\nprint('ok', len(SERVED))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"ok {len(SERVED)}", done.stderr[-2000:]


def test_no_mirror_files_among_the_real_modules():
    folder = Path(disttrain.sagemaker.__file__).parent
    small = [p.name for p in folder.rglob("*.py") if len(p.read_text().splitlines()) < 10]
    assert small == [] and not [p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"]
