"""``launcher: ssh``: a job's instances on real hosts (network namespaces + sshd), through the
same ssh path as ``disttrain run --hosts``. The runner runs inside node0, as a user logged
in there would; the job directory is on the filesystem the nodes share.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import SCRIPTS, cli_env
from disttrain.agent.optml import namespace_tool
from disttrain.store import JobStore
from rig import cluster_fixture

cluster = cluster_fixture(2)


@pytest.mark.timeout(180)
def test_sagemaker_script_on_two_ssh_hosts(cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "all.csv").write_text("".join(f"{x / 40},{2 * x / 40 + 1}\n" for x in range(40)))
    spec = {
        "name": "over-ssh", "entry_point": "sm_train.py", "source_dir": str(SCRIPTS),
        "launcher": "ssh", "hosts": [f"root@{node.ip}" for node in cluster.nodes],
        "ssh_options": cluster.client_ssh_options,
        "processes_per_instance": 1, "inputs": {"training": str(data)},
        "output_path": str(tmp_path / "artifacts"), "hyperparameters": {"epochs": 4, "lr": 0.5},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = cluster.run_in("node0", [sys.executable, "-m", "disttrain", "job", "run", str(tmp_path / "job.yaml")],
                            timeout=150, env=env)
    assert result.returncode == 0, result.stderr
    with JobStore(tmp_path / "jobs.db") as store:
        (record,) = store.list()
    assert record.state == "Completed" and record.metrics["world"] == 2
    assert [h["host"] for h in record.hosts] == [node.ip for node in cluster.nodes]
    assert f'[{cluster.nodes[0].ip} rank0] {{"loss"' in (Path(record.log_dir) / "job.log").read_text()
    for rank, host in enumerate(["algo-1", "algo-2"]):
        facts = json.loads((Path(record.job_dir) / host / "output" / "data" / "facts.json").read_text())
        assert facts["rank"] == rank and facts["samples"] == 20
        assert facts["resourceconfig"]["network_interface_name"] == "eth1"  # the route to the master
    assert Path(record.artifacts["model"]).is_file()
    deadline = time.monotonic() + 15
    while any(cluster.processes_in(n) for n in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(cluster.processes_in(n) for n in cluster.nodes)


LITERAL_OPT_ML = """\
    import json, os
    data = open("/opt/ml/input/data/training/a.txt").read().strip()   # literal SageMaker paths
    with open("/opt/ml/model/who.txt", "w") as fh:
        fh.write(f"{os.environ['SM_CURRENT_HOST']} {data}")
    with open("/opt/ml/output/data/seen.json", "w") as fh:
        json.dump({"opt": sorted(os.listdir("/opt")), "opt_ml": sorted(os.listdir("/opt/ml"))}, fh)
"""


def opt_listing() -> tuple[bool, list[str]]:
    return os.path.exists("/opt/ml"), sorted(os.listdir("/opt")) if os.path.isdir("/opt") else []


def literal_opt_ml_job(tmp_path: Path) -> dict:
    """The job keys of a script with literal /opt/ml paths and its training channel; skips
    where this machine can make no mount namespace."""
    if namespace_tool()[0] is None:
        pytest.skip(f"no mount namespace here: {namespace_tool()[1]}")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "literal.py").write_text(textwrap.dedent(LITERAL_OPT_ML))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("hello\n")
    return {"entry_point": "literal.py", "source_dir": str(tmp_path / "src"), "private_opt_ml": "required",
            "inputs": {"training": str(tmp_path / "data")}, "output_path": str(tmp_path / "artifacts")}


@pytest.mark.timeout(180)
def test_literal_opt_ml_is_private_to_each_ssh_instance(cluster, tmp_path):
    """Two instances over ssh on one machine (the rig's hosts share its filesystem): each one's
    script writes the literal /opt/ml/model and reads /opt/ml/input/data, and sees its own folder
    there (the agent on each host makes the mount namespace); the machine's /opt is untouched."""
    spec = {"name": "optml-ssh", **literal_opt_ml_job(tmp_path), "launcher": "ssh",
            "hosts": [f"root@{node.ip}" for node in cluster.nodes], "ssh_options": cluster.client_ssh_options}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    before = opt_listing()
    result = cluster.run_in("node0", [sys.executable, "-m", "disttrain", "job", "run", str(tmp_path / "job.yaml")],
                            timeout=150, env=env)
    assert result.returncode == 0, result.stderr
    assert opt_listing() == before  # the machine's /opt (and the absence of /opt/ml) untouched
    with JobStore(tmp_path / "jobs.db") as store:
        (record,) = store.list()
    assert record.state == "Completed"
    job_dir = Path(record.job_dir)
    for host in ("algo-1", "algo-2"):  # no collision: each instance's file in its own folder
        assert (job_dir / host / "model" / "who.txt").read_text() == f"{host} hello"
        seen = json.loads((job_dir / host / "output" / "data" / "seen.json").read_text())
        assert set(before[1]) | {"ml"} == set(seen["opt"])  # the machine's /opt entries, plus ml
        assert {"input", "model", "output"} <= set(seen["opt_ml"])
    with tarfile.open(record.artifacts["model"]) as tar:  # the model artifact: algo-1's /opt/ml/model
        assert tar.extractfile("who.txt").read().decode() == "algo-1 hello"
    deadline = time.monotonic() + 15
    while any(cluster.processes_in(n) for n in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(cluster.processes_in(n) for n in cluster.nodes)
