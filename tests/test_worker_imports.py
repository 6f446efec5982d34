"""A worker's import environment is torchrun's (issue 46 point 5): the user's own ``sitecustomize`` on
``PYTHONPATH`` -- one that imports torch and defines an op schema, as the torchvision shim of AWS's HPO
notebook does -- and the ``.pth`` files it adds act in a ``disttrain run`` worker a job's worker and a tuner
trial's worker as in a torchrun worker.

The cause it guards: disttrain's worker bootstrap (``disttrain/_worker_site``) ran the ``sitecustomize``
it shadows as a throwaway module, freed once run -- and a ``torch.library.Library`` unregisters its ops
when freed, so ``torch.ops.<ns>.<op>`` did not exist in the worker ("operator torchvision::nms does not
exist"). The shadowed module now becomes ``sys.modules["sitecustomize"]``, as without disttrain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import cli_env, write

pytestmark = pytest.mark.timeout(400)

SITECUSTOMIZE = """
import os, site
import torch
_lib = torch.library.Library("shimop", "DEF")  # freed: the op is gone
_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
site.addsitedir(os.path.join(os.path.dirname(__file__), "extra"))  # its .pth files, as Python reads them
os.environ["SHIM_RAN"] = "1"
"""

PROBE = """
import json, os, sys
import torch
import sitecustomize
try:
    torch.ops.shimop.nms.default
    op = "defined"
except (AttributeError, RuntimeError) as err:
    op = f"missing: {err}"
bootstrap = os.path.join("disttrain", "_worker_site")
facts = {
    "op": op,
    "shim_ran": os.environ.get("SHIM_RAN"),
    "sitecustomize": getattr(sitecustomize, "__file__", None),
    "pth_ran": os.environ.get("PTH_RAN"),
    "pth_path": any(p.endswith("from_pth") for p in sys.path),
    "torch_first": list(sys.modules).index("torch") < list(sys.modules).index("__main__")
                   if "__main__" in sys.modules else None,
    # the user's part of the path: the bootstrap's folder is disttrain's one addition
    "user_path": [p for p in sys.path if bootstrap not in p and "site-packages" not in p and "lib/python" not in p],
}
out = os.environ.get("PROBE_OUT") or sys.argv[1]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump(facts, fh)
"""


@pytest.fixture
def user_site(tmp_path: Path) -> Path:
    site = tmp_path / "usersite"
    write(site / "sitecustomize.py", SITECUSTOMIZE)
    write(site / "extra" / "shim.pth", f"{site / 'from_pth'}\nimport os; os.environ['PTH_RAN'] = '1'\n")
    (site / "from_pth").mkdir()
    return site


def _env(tmp_path: Path, site: Path, **extra: str) -> dict[str, str]:
    outer = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return cli_env(PYTHONPATH=os.pathsep.join([str(site), *outer]),
                   DISTTRAIN_HOME=str(tmp_path / "home"), **extra)


def _facts(out: Path) -> dict:
    found = json.loads((out / "rank0.json").read_text())
    found["user_path"] = [p for p in found["user_path"] if not p.startswith(str(out.parent / "work"))]
    return found


def test_a_user_sitecustomize_acts_under_disttrain_as_under_torchrun(tmp_path, user_site):
    """The four programs (torchrun, ``disttrain run``, ``disttrain job run``, a tuner's trial) run at once: each
    writes its own folder, and each is waited for (and its exit code checked) before any fact is compared."""
    work = tmp_path / "work"
    probe = write(work / "probe.py", PROBE)
    outs = {name: tmp_path / name for name in ("torchrun", "run", "job")}
    for out in outs.values():
        out.mkdir()
    env = _env(tmp_path, user_site)
    spec = write(tmp_path / "job.yaml", yaml.safe_dump({"name": "imports", "entry_point": "probe.py",
                                                        "source_dir": str(work),
                                                        "env": {"PROBE_OUT": str(outs["job"])}}))
    cli = [sys.executable, "-m", "disttrain"]
    started = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(probe),
                     str(outs["torchrun"])],
        "run": [*cli, "run", "-n", "1", str(probe), str(outs["run"])],
        "job": [*cli, "job", "run", str(spec)],
    }
    procs = {name: subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv in started.items()}
    try:
        trial = tuner_trial(tmp_path, work, env)
        ended = {name: proc.communicate(timeout=300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():  # none left behind, whatever failed
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {ended[name][1]}"
    expected = _facts(outs["torchrun"])
    assert expected["op"] == "defined" and expected["pth_ran"] == "1"  # the program the comparison stands on
    assert expected["sitecustomize"] == str(user_site / "sitecustomize.py")
    assert _facts(outs["run"]) == expected
    job_facts = _facts(outs["job"])
    # a job runs from a copy of its source folder, which the toolkit puts on PYTHONPATH: the rest is the same
    job_facts["user_path"] = [p for p in job_facts["user_path"]
                              if "imports" not in p and str(tmp_path / "home") not in p]
    expected["user_path"] = [p for p in expected["user_path"] if p != str(work)]
    job_facts["user_path"] = [p for p in job_facts["user_path"] if p != str(work)]
    assert job_facts == expected
    trial["user_path"] = [p for p in trial["user_path"] if p != str(work) and str(tmp_path / "home") not in p]
    assert trial == expected


TUNER = """
import sys
from disttrain.sagemaker.estimator import Estimator
from disttrain.sagemaker.tuner import CategoricalParameter, HyperparameterTuner

work, out = sys.argv[1], sys.argv[2]
est = Estimator(entry_point="probe.py", source_dir=work, environment={"PROBE_OUT": out},
                disttrain={"private_opt_ml": "off"})
tuner = HyperparameterTuner(est, "loss", {"q": CategoricalParameter([1])}, strategy="Grid",
                            metric_definitions=[{"Name": "loss", "Regex": "loss=([0-9.]+)"}],
                            objective_type="Minimize", max_parallel_jobs=1)
tuner.fit()
"""


def tuner_trial(tmp_path: Path, work: Path, env: dict[str, str]) -> dict:
    """The facts of one trial of a HyperparameterTuner started in a program with the user's PYTHONPATH,
    as AWS's HPO notebook starts its trials."""
    out = tmp_path / "trial"
    out.mkdir()
    driver = write(tmp_path / "tune.py", TUNER)
    tuned = subprocess.run([sys.executable, str(driver), str(work), str(out)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert (out / "rank0.json").exists(), tuned.stderr[-3000:]
    return _facts(out)
