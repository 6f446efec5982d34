"""``launcher: slurm`` jobs on a real Slurm (two nodes in network namespaces).

The runner runs in node0 (the "login node"), as a user would run ``disttrain job run`` there;
its instances are the Slurm job's nodes, algo-1 on node0 and algo-2 on node1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_jobs import data, show, spec_file, tar_members  # noqa: F401  (data: a fixture)
from test_jobs_ssh import literal_opt_ml_job, opt_listing

from conftest import cli_env, disttrain
from slurm_rig import slurm_fixture

ROOT = Path(__file__).resolve().parent.parent

slurm = slurm_fixture(2)


@pytest.fixture
def env(slurm, tmp_path: Path) -> dict[str, str]:
    return slurm.env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))


def job_run(slurm, spec: Path, env: dict, **kwargs):
    return slurm.popen_in("node0", [sys.executable, "-m", "disttrain", "job", "run", str(spec)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.timeout(240)
def test_sagemaker_job_on_two_slurm_nodes_end_to_end(slurm, tmp_path, env, data):  # noqa: F811
    spec = spec_file(tmp_path, "slurmjob", launcher="slurm", instance_count=2, inputs={"training": str(data)},
                     output_path=str(tmp_path / "artifacts"), hyperparameters={"epochs": 4, "lr": 0.5},
                     slurm={"time": "10", "sbatch_args": ["--comment=disttrain job"]})
    runner = job_run(slurm, spec, env)
    out, err = runner.communicate(timeout=200)
    assert runner.returncode == 0, err
    assert "[node0 rank0] {\"loss\"" in out

    record = show(env, 1)
    job_id = record["slurm_job_id"]
    assert record["state"] == "Completed" and record["exit_code"] == 0 and job_id.isdigit()
    assert [s["state"] for s in record["events"]] == ["Pending", "Staging", "Running", "Uploading", "Completed"]
    assert record["hosts"] == [{"instance": "algo-1", "host": "node0"}, {"instance": "algo-2", "host": "node1"}]
    assert slurm.job_state(job_id) == "COMPLETED"
    metrics = record["metrics"]
    assert metrics["world"] == 2 and abs(metrics["w"] - 2) < 0.01 and abs(metrics["b"] - 1) < 0.01

    model_tar = tmp_path / "artifacts" / record["name"] / "model.tar.gz"
    assert record["artifacts"]["model"] == str(model_tar)
    members = tar_members(model_tar)
    assert list(members) == ["model.pth"]
    (tmp_path / "model.pth").write_bytes(members["model.pth"])
    assert torch.load(tmp_path / "model.pth", weights_only=True)["w"].item() == pytest.approx(metrics["w"])

    job_dir = Path(record["job_dir"])
    for rank, host in enumerate(["algo-1", "algo-2"]):
        facts = json.loads((job_dir / host / "output" / "data" / "facts.json").read_text())
        assert facts["rank"] == rank and facts["samples"] == 20
        resources = facts["resourceconfig"]
        assert (resources["current_host"], resources["hosts"], resources["network_interface_name"]) == \
            (host, ["algo-1", "algo-2"], "eth1")  # the node's route to the master
    script = (job_dir / "logs" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --time=10" in script
    assert '#SBATCH "--comment=disttrain job"' in script

    listing = disttrain("jobs", "ls", env=env).stdout.splitlines()
    assert listing[1].split()[2] == "Completed" and f"2 on node0,node1 (Slurm job {job_id})" in listing[1]
    assert f"slurm job:        {job_id}" in disttrain("jobs", "show", "1", env=env).stdout
    logs = disttrain("jobs", "logs", "1", env=env).stdout
    assert f"submitted Slurm job {job_id}" in logs and "[node1 rank1]" in logs and "Completed in" in logs
    slurm.assert_nothing_left()


@pytest.mark.timeout(200)
def test_jobs_stop_cancels_a_running_slurm_job(slurm, tmp_path, env, data):  # noqa: F811
    spec = spec_file(tmp_path, "sleepy", launcher="slurm", instance_count=2, inputs={"training": str(data)},
                     hyperparameters={"sleep": 300})
    runner = job_run(slurm, spec, env)
    try:
        ready = 0
        while ready < 2:  # both instances' ranks run: their lines came through slurm.out
            line = runner.stdout.readline()
            assert line, runner.stderr.read()
            ready += "ready" in line
        job_id = show(env, 1)["slurm_job_id"]
        assert show(env, 1)["state"] == "Running" and slurm.job_state(job_id) == "RUNNING"
        stop = disttrain("jobs", "stop", "1", env=cli_env(DISTTRAIN_STORE=env["DISTTRAIN_STORE"]), timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert "Stopped, exit code 143" in stop.stdout
        assert runner.wait(timeout=30) == 143
    finally:
        if runner.poll() is None:
            runner.kill()
        _, err = runner.communicate()
    assert f"disttrain: cancelled Slurm job {job_id}" in err
    record = show(env, 1)
    assert record["state"] == "Stopped" and record["failure"] == "stopped by SIGTERM"
    assert slurm.job_state(job_id) == "CANCELLED"
    slurm.assert_nothing_left()  # out of squeue, no process on either node


@pytest.mark.timeout(240)
def test_literal_opt_ml_is_private_to_each_slurm_instance(slurm, tmp_path, env):
    """Each Slurm node's agent gives its instance's script its own folder at /opt/ml (both nodes
    are namespaces of this one machine, so without it they would collide there)."""
    spec = spec_file(tmp_path, "optml", **literal_opt_ml_job(tmp_path), launcher="slurm", instance_count=2,
                     slurm={"time": "10"})
    before = opt_listing()
    runner = job_run(slurm, spec, env)
    out, err = runner.communicate(timeout=200)
    assert runner.returncode == 0, err
    assert opt_listing() == before  # the machine's /opt (and the absence of /opt/ml) untouched
    job_dir = Path(show(env, 1)["job_dir"])
    for host in ("algo-1", "algo-2"):
        assert (job_dir / host / "model" / "who.txt").read_text() == f"{host} hello"
        assert "ml" in json.loads((job_dir / host / "output" / "data" / "seen.json").read_text())["opt"]
    slurm.assert_nothing_left()
