"""The package's layering, as written in pyproject.toml's import-linter contracts: clients
(cli, jobs) on the launchers on the agent on the probes on the messages (wire) on the planner,
the launch side and the runtime apart, no import cycle between sibling modules (imports
inside functions count: grimp sees them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_import_linter_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
