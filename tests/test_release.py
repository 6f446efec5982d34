"""The release a user installs: a wheel and an sdist that twine accepts, and a wheel that works in a
fresh venv (torch held to the pin) -- `disttrain --version` and a real 2-process job from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import SCRIPTS, read_ranks
from disttrain.version import __version__

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"


def _run(argv, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib_missing("build"):
        pytest.skip("python -m build needs the `build` package (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("dist")
    # A copy of the tracked tree: building in place would leave build/ and *.egg-info behind.
    src = out / "src"
    files = _run(["git", "ls-files", "-z"], cwd=ROOT, timeout=60).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = {**os.environ, "PIP_CONSTRAINT": str(CONSTRAINTS)}
    r = _run([sys.executable, "-m", "build", "--sdist", "--wheel", "-o", str(out), str(src)], env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


@pytest.mark.timeout(360)
def test_wheel_and_sdist_are_named_for_the_one_version_and_pass_twine(dist_dir: Path):
    wheel = dist_dir / f"disttrain-{__version__}-py3-none-any.whl"
    sdist = dist_dir / f"disttrain-{__version__}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist_dir.iterdir())
    if importlib_missing("twine"):
        pytest.skip("twine is not installed (pip install -e '.[test]')")
    r = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(f"disttrain-{__version__}.dist-info/METADATA").decode()
    assert "disttrain/py.typed" in names
    assert "disttrain/_worker_site/sitecustomize.py" in names  # --hang-timeout's worker bootstrap
    assert f"Version: {__version__}" in metadata
    assert "Requires-Dist: torch" in metadata
    assert any(n.endswith("entry_points.txt") for n in names)
    with tarfile.open(sdist) as tf:
        members = tf.getnames()
    assert f"disttrain-{__version__}/CHANGELOG.md" in members
    assert f"## {__version__}" in (ROOT / "CHANGELOG.md").read_text(), "CHANGELOG.md has no entry for this version"


@pytest.mark.timeout(900)
def test_the_wheel_installs_in_a_fresh_venv_and_runs_a_two_process_job(dist_dir: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    r = _run([_base_python(), "-m", "venv", str(venv)], timeout=120)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    wheel = dist_dir / f"disttrain-{__version__}-py3-none-any.whl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)  # torch held to the pinned CPU build
    # --no-compile: no .pyc written for torch's thousands of modules at install time (the most of the install's
    # time); Python compiles what the job imports as it imports it, and pip does not fail an install on them
    r = _run([str(py), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", str(wheel)],
             env=env, timeout=840)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = _run([str(venv / "bin" / "disttrain"), "--version"], env=env, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"disttrain {__version__}", r.stdout + r.stderr
    check = _run([str(py), str(ROOT / "tests" / "install_check.py")], env=env, timeout=120)
    assert check.returncode == 0, check.stderr
    out = tmp_path / "out"
    out.mkdir()
    env.update(OMP_NUM_THREADS="1", DISTTRAIN_HOME=str(tmp_path / "home"))
    r = _run([str(venv / "bin" / "disttrain"), "run", "-n", "2", str(SCRIPTS / "ranks_report.py"), str(out)],
             env=env, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ranks = read_ranks(out)
    assert sorted(ranks) == [0, 1]
    assert {rep["sum"] for rep in ranks.values()} == {3.0}  # 1 + 2, all-reduced over gloo
    # The job ran the installed package, not this checkout.
    r = _run([str(py), "-c", "import disttrain; print(disttrain.__file__)"], env=env, timeout=60, cwd=tmp_path)
    assert str(venv) in r.stdout, r.stdout


def _base_python() -> str:
    """The interpreter this venv was made from: a venv of a venv would not be fresh."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else sys.executable


def _stand_in_torch(folder: Path, version: str) -> Path:
    """A wheel that installs as torch ``version`` (its metadata only): what pip's resolver sees of a
    user's CUDA torch, without its 5 GB."""
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: disttrain-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(name, text)
    return wheel


@pytest.mark.timeout(600)
@pytest.mark.parametrize("torch_version", ["2.11.0", "2.6.0"])
def test_installing_the_wheel_keeps_the_torch_the_environment_has(dist_dir: Path, tmp_path: Path, torch_version):
    """A GPU user's torch comes with the CUDA image: pip must take it as it is, not swap it."""
    venv = tmp_path / "venv"
    assert _run([_base_python(), "-m", "venv", str(venv)], timeout=120).returncode == 0
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_CONSTRAINT")}
    env["PIP_CONSTRAINT"] = ""  # the user's machine: no pin of this repo's
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    r = _run([*pip, "install", "-q", "--no-deps", str(_stand_in_torch(tmp_path, torch_version))], env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    wheel = dist_dir / f"disttrain-{__version__}-py3-none-any.whl"
    report = tmp_path / "report.json"
    r = _run([*pip, "install", "--dry-run", "--report", str(report), str(wheel)], env=env, timeout=540)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert "disttrain" in chosen and "torch" not in chosen, chosen  # the torch there is kept
