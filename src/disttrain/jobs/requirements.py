"""``requirements.txt`` in ``source_dir``: installed first, into the job's own environment.

As SageMaker's toolkit installs it before the script runs, but never into the user's own
environment: a venv in the job folder that also sees every installed package (a ``.pth``
that adds this interpreter's site-packages after the venv's own; ``--system-site-packages``
would show the *system* Python's packages, not those of the venv disttrain runs in). pip
runs with every installed distribution pinned as a constraint (plus ``PIP_CONSTRAINT`` when
set), so a requirement can add packages but never replace torch or TensorFlow; one that
would is refused by pip, and the job fails naming the file.
"""

from __future__ import annotations

import importlib.metadata
import os
import site
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError

FILENAME = "requirements.txt"
PIP_TIMEOUT_S = 900


def installed_pins() -> list[str]:
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        if name and dist.version:
            pins[name.lower()] = f"{name}=={dist.version}"
    return sorted(pins.values())


def _venv_site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


def isolated_python(source_dir: Path, venv: Path, say: Callable[[str], None]) -> str | None:
    """The job's interpreter when ``source_dir`` has a requirements.txt (installed), else None."""
    requirements = source_dir / FILENAME
    if not requirements.is_file():
        return None
    say(f"disttrain: installing {requirements} into {venv} (sees the installed packages; none is replaced)")
    log = venv.parent / "logs" / "pip.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                       capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        raise UsageError(f"{FILENAME}: cannot create the job's environment {venv}: {err}") from None
    outer = [p for p in (*site.getsitepackages(), sysconfig.get_paths()["purelib"]) if os.path.isdir(p)]
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(outer)]
    sp = _venv_site_packages(venv)
    sp.mkdir(parents=True, exist_ok=True)
    (sp / "zz_disttrain_outer.pth").write_text("\n".join(lines) + "\n")
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(installed_pins()) + "\n")
    python = str(venv / "bin" / "python")
    argv = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
            "-r", str(requirements), "-c", str(constraints)]
    try:
        with open(log, "w") as out:
            done = subprocess.run(argv, cwd=source_dir, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UsageError(f"{FILENAME}: pip did not finish in {PIP_TIMEOUT_S} s (see {log})") from None
    if done.returncode:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in tail if "ERROR" in line] or tail[-1:]
        raise UsageError(f"{FILENAME} in {source_dir} failed to install: {errors[0].strip() if errors else '?'} "
                         f"(pip exit {done.returncode}, full output {log}); fix or remove the requirement, "
                         "or install it into the environment disttrain runs in")
    return python
