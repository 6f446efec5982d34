"""``disttrain job run`` / ``disttrain jobs``: real jobs, real processes, gloo over loopback.

The script under test is a SageMaker-style entry point (tests/scripts/sm_train.py): it
reads only SM_* variables and argparse, as it would on SageMaker.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from conftest import SCRIPTS, assert_all_gone, cli_env, descendants, disttrain
from disttrain.jobs import Job
from disttrain.process_start import started
from disttrain.store import JobState, JobStore

NOTE = "a b; $(touch /tmp/pwned-job) 'q' \"dq\" `x` | & > <"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """y = 2x + 1 on 40 points, in two CSV files (a channel is a folder)."""
    folder = tmp_path / "data"
    folder.mkdir()
    for part in range(2):
        lines = [f"{x / 40},{2 * x / 40 + 1}" for x in range(part * 20, part * 20 + 20)]
        (folder / f"part{part}.csv").write_text("\n".join(lines) + "\n")
    return folder


def spec_file(tmp_path: Path, name: str, **fields) -> Path:
    spec = {"name": name, "entry_point": "sm_train.py", "source_dir": str(SCRIPTS),
            "processes_per_instance": 1, **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def show(env: dict, job: str | int) -> dict:
    result = disttrain("jobs", "show", str(job), "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def tar_members(path: str | Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.mark.timeout(150)
def test_sagemaker_script_on_two_instances_end_to_end(tmp_path, env, data):
    hps = {"epochs": 4, "lr": 0.5, "note": NOTE}
    spec = spec_file(tmp_path, "linear", instance_count=2, inputs={"training": str(data)},
                     output_path=str(tmp_path / "artifacts"), hyperparameters=hps)
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[algo-1 rank0] {\"loss\"" in result.stdout  # rank-prefixed, per instance

    record = show(env, 1)
    name = record["name"]
    assert name.startswith("linear-") and record["state"] == "Completed" and record["exit_code"] == 0
    assert [s["state"] for s in record["events"]] == ["Pending", "Staging", "Running", "Uploading", "Completed"]
    assert [h["instance"] for h in record["hosts"]] == ["algo-1", "algo-2"]
    metrics = record["metrics"]
    assert metrics["world"] == 2 and abs(metrics["w"] - 2) < 0.01 and abs(metrics["b"] - 1) < 0.01

    # model.tar.gz holds model/'s files at its top, as SageMaker packs it
    model_tar = tmp_path / "artifacts" / name / "model.tar.gz"
    assert record["artifacts"] == {"model": str(model_tar), "output": str(model_tar.with_name("output.tar.gz"))}
    members = tar_members(model_tar)
    assert list(members) == ["model.pth"]
    (tmp_path / "model.pth").write_bytes(members["model.pth"])
    weights = torch.load(tmp_path / "model.pth", weights_only=True)
    assert weights["w"].item() == pytest.approx(metrics["w"])
    assert json.loads(tar_members(model_tar.with_name("output.tar.gz"))["facts.json"])["rank"] == 0

    job_dir = Path(record["job_dir"])
    for rank, host in enumerate(["algo-1", "algo-2"]):
        facts = json.loads((job_dir / host / "output" / "data" / "facts.json").read_text())
        assert facts["rank"] == rank and facts["samples"] == 20  # each instance trained on its half
        assert facts["note"] == facts["hp_note"] == NOTE and facts["unknown"] == []
        assert facts["hps"] == hps and facts["channels"] == ["training"]
        assert facts["model_dir"] == str(job_dir / host / "model")
        resources = facts["resourceconfig"]
        assert (resources["current_host"], resources["hosts"], resources["network_interface_name"]) == \
            (host, ["algo-1", "algo-2"], "lo")
        config = job_dir / host / "input" / "config" / "hyperparameters.json"
        written = json.loads(config.read_text())  # as the SDK writes it: each value JSON-encoded
        assert {k: json.loads(v) for k, v in written.items() if not k.startswith("sagemaker_")} == hps
        assert sorted(p.name for p in (job_dir / host / "input" / "data" / "training").iterdir()) == \
            ["part0.csv", "part1.csv"]
    assert not Path("/tmp/pwned-job").exists()

    listing = disttrain("jobs", "ls", env=env).stdout.splitlines()
    assert listing[0].split() == ["ID", "NAME", "STATE", "CREATED", "DURATION", "EXIT", "INSTANCES"]
    assert listing[1].split()[:3] == ["1", name, "Completed"] and "2 on" in listing[1]
    human = disttrain("jobs", "show", name, env=env).stdout
    assert re.search(r"^state: +Completed$", human, re.M)
    assert re.search(rf"^model artifact: +{re.escape(str(model_tar))}$", human, re.M)
    logs = disttrain("jobs", "logs", "1", env=env).stdout
    assert f"disttrain: job {name} (id 1), 2 instance(s), local launcher" in logs
    assert "[algo-1 rank0] {\"loss\"" in logs and "Completed in" in logs
    assert '"world": 2' in disttrain("jobs", "logs", "1", "--rank", "0", env=env).stdout


@pytest.mark.timeout(150)
def test_failing_job_keeps_record_logs_and_root_cause(tmp_path, env, data):
    spec = spec_file(tmp_path, "broken", instance_count=2, inputs={"training": str(data)},
                     output_path=str(tmp_path / "artifacts"), hyperparameters={"fail-host": "algo-2"})
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    root_cause = "disttrain: rank 1 on algo-2 exited with code 1"
    assert root_cause in result.stderr

    record = show(env, 1)
    assert record["state"] == "Failed" and record["exit_code"] == 1
    assert [s["state"] for s in record["events"]] == ["Pending", "Staging", "Running", "Failed"]
    assert record["failure"].startswith(root_cause)
    assert "ValueError: algo-2 cannot go on: bad shard 17" in record["failure"]
    job_dir = Path(record["job_dir"])
    for host in ("algo-1", "algo-2"):
        assert (job_dir / host / "output" / "failure").read_text() == record["failure"] + "\n"
    assert not (tmp_path / "artifacts").exists()  # nothing uploaded for a failed job
    assert "ValueError: algo-2 cannot go on" in (job_dir / "logs" / "attempt_0" / "rank1.stderr").read_text()
    assert root_cause in disttrain("jobs", "logs", "1", env=env).stdout
    human = disttrain("jobs", "show", "1", env=env).stdout
    assert re.search(r"^state: +Failed$", human, re.M) and f"failure:\n  {root_cause}" in human


@pytest.mark.timeout(150)
def test_two_jobs_at_once_are_both_recorded_right(tmp_path, env, data, monkeypatch):
    """One job from the CLI, one from the Python API in this process, at the same time."""
    monkeypatch.setenv("DISTTRAIN_HOME", env["DISTTRAIN_HOME"])
    fields = {"entry_point": "sm_train.py", "source_dir": str(SCRIPTS), "processes_per_instance": 1,
              "inputs": {"training": str(data)}, "output_path": str(tmp_path / "artifacts")}
    spec = spec_file(tmp_path, "first", **fields, hyperparameters={"epochs": 1, "lr": 0.5})
    cli_run = subprocess.Popen([sys.executable, "-m", "disttrain", "job", "run", str(spec)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        api_record = Job(name="second", **fields, hyperparameters={"epochs": 2, "lr": 0.5}).run(
            store=tmp_path / "jobs.db")
        out, err = cli_run.communicate(timeout=120)
    finally:
        if cli_run.poll() is None:
            cli_run.kill()
            cli_run.communicate()
    assert cli_run.returncode == 0, err
    assert api_record.state == "Completed" and api_record.exit_code == 0
    with JobStore(tmp_path / "jobs.db") as store:
        assert store.integrity() == "ok"
        records = {r.spec["name"]: store.get(r.id) for r in store.list()}
    assert set(records) == {"first", "second"} and records["second"] == api_record
    for base, epochs in (("first", 1), ("second", 2)):
        record = records[base]
        assert record.state == "Completed" and record.exit_code == 0
        assert record.spec["hyperparameters"]["epochs"] == epochs and record.metrics["world"] == 1
        assert Path(record.artifacts["model"]).is_file() and record.name in record.artifacts["model"]
        assert [state for state, _ in record.events][-1] == "Completed" and len(record.events) == 5
    assert records["first"].job_dir != records["second"].job_dir
    assert records["first"].metrics != records["second"].metrics  # each its own run's last line


@pytest.mark.timeout(120)
def test_jobs_stop_ends_a_running_job_and_its_processes(tmp_path, env, data):
    spec = spec_file(tmp_path, "sleepy", inputs={"training": str(data)}, hyperparameters={"sleep": 300})
    runner = subprocess.Popen([sys.executable, "-m", "disttrain", "job", "run", str(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = runner.stdout.readline()
        assert "ready" in line, runner.stderr.read()
        family = descendants(runner.pid)
        assert show(env, 1)["state"] == "Running"
        follow = subprocess.Popen([sys.executable, "-m", "disttrain", "jobs", "logs", "1", "-f"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        stop = disttrain("jobs", "stop", "1", env=env, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout.startswith("job sleepy-") and "Stopped, exit code 143" in stop.stdout
        assert runner.wait(timeout=30) == 143
        assert_all_gone(family)
        followed, _ = follow.communicate(timeout=30)  # -f ends by itself when the job does
        assert "[rank0] ready" in followed and "Stopped in" in followed
    finally:
        if runner.poll() is None:
            runner.kill()
        runner.communicate()
    record = show(env, 1)
    assert record["state"] == "Stopped" and record["events"][-1]["state"] == "Stopped"
    again = disttrain("jobs", "stop", "1", env=env)
    assert again.returncode == 0 and "already Stopped; nothing to stop" in again.stdout



@pytest.mark.timeout(60)
def test_jobs_logs_follow_ends_after_the_runners_last_line(tmp_path, env):
    """The runner records the end, then writes its last line: a follower that ended when it saw
    the end recorded missed that line (issue 27). It ends after the line, or at once when the
    runner is gone without writing it."""
    import socket

    import psutil

    logs = tmp_path / "job" / "logs"
    logs.mkdir(parents=True)
    (logs / "job.log").write_text("[rank0] ready\n")
    me = psutil.Process()
    with JobStore(tmp_path / "jobs.db") as store:  # a job whose runner (this test) recorded Stopped
        job = store.create(name="tail", spec={}, job_dir=str(tmp_path / "job"), log_dir=str(logs),
                           runner_host=socket.gethostname(), runner_pid=me.pid, runner_started=started(me.pid))
        for state in ("Staging", "Running", "Stopped"):
            store.transition(job.id, JobState(state))
    follow = subprocess.Popen([sys.executable, "-m", "disttrain", "jobs", "logs", "tail", "-f"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert follow.stdout.readline() == "[rank0] ready\n"
        with pytest.raises(subprocess.TimeoutExpired):
            follow.wait(timeout=2)  # the runner is alive and has not written its last line
        with open(logs / "job.log", "a") as fh:
            fh.write(f"disttrain: job tail (id {job.id}) Stopped in 1.0 s, exit code 143; see ...\n")
        rest, err = follow.communicate(timeout=30)
        assert follow.returncode == 0, err
        assert rest.startswith("disttrain: job tail (id 1) Stopped in 1.0 s")
    finally:
        follow.kill()
        follow.communicate()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    began = started(gone.pid)
    gone.wait()
    with JobStore(tmp_path / "jobs.db") as store:  # killed before its last line: nothing to wait for
        job = store.create(name="killed", spec={}, job_dir=str(tmp_path / "job"), log_dir=str(logs),
                           runner_host=socket.gethostname(), runner_pid=gone.pid, runner_started=began)
        for state in ("Staging", "Running", "Stopped"):
            store.transition(job.id, JobState(state))
    result = disttrain("jobs", "logs", "killed", "-f", env=env, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("[rank0] ready"), result.stderr




def test_jobs_logs_of_a_rank_that_printed_nothing_is_empty_not_an_error(tmp_path, env):
    logs = tmp_path / "job" / "logs"
    logs.mkdir(parents=True)
    (logs / "plan.json").write_text(json.dumps({"world_size": 2}))
    (logs / "rank0.log").write_text("hello from 0\n")
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create(name="quiet", spec={}, job_dir=str(tmp_path / "job"), log_dir=str(logs))
        for state in ("Staging", "Running", "Uploading", "Completed"):
            store.transition(job.id, JobState(state))
    assert disttrain("jobs", "logs", "quiet", "--rank", "0", env=env).stdout == "hello from 0\n"
    silent = disttrain("jobs", "logs", "quiet", "--rank", "1", env=env)
    assert (silent.returncode, silent.stdout) == (0, "")
    assert silent.stderr == "disttrain: job quiet: rank 1 has printed nothing\n"
    followed = disttrain("jobs", "logs", "quiet", "--rank", "1", "-f", env=env)
    assert (followed.returncode, followed.stdout) == (0, "")
    wrong = disttrain("jobs", "logs", "quiet", "--rank", "2", env=env)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert "--rank 2: job quiet has ranks 0..1" in wrong.stderr


STEPS_SCRIPT = """\
import time
for step in range(5):
    print(f"step {step} loss={1.0 / (step + 1):.4f}", flush=True)
    print(f"lr={0.1 / (step + 1):.4f}", flush=True)  # a line of its own, right after: no step in it
    time.sleep(0.3)
"""


@pytest.mark.timeout(120)
def test_metric_points_are_timed_as_printed_and_plotted_by_step(tmp_path, env):
    """Points were timed when a 0.5 s poll of the log found them (a batch shared one time: +0.0,
    +0.0, +1.4, +1.4 s); now each line's point is timed when the launch relayed it, and the plot's
    x axis is the step the job reports (issue 27)."""
    from disttrain.jobs.metrics import plot_axes

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "steps.py").write_text(STEPS_SCRIPT)
    spec = spec_file(tmp_path, "steps", entry_point="steps.py", source_dir=str(tmp_path / "src"),
                     private_opt_ml="off",
                     metric_definitions=[{"Name": "step", "Regex": r"step (\d+)"},
                                         {"Name": "loss", "Regex": r"loss=([0-9.]+)"},
                                         {"Name": "lr", "Regex": r"lr=([0-9.]+)"}])
    result = disttrain("job", "run", str(spec), env=env, timeout=100)
    assert result.returncode == 0, result.stderr
    with JobStore(tmp_path / "jobs.db") as store:
        series = store.metric_series(1)
    assert len({t for name in ("loss", "lr") for t, _ in series[name]}) == 10  # every line its own time
    assert [t for t, _ in series["step"]] == [t for t, _ in series["loss"]]
    xlabel, drawn = plot_axes(series)
    assert xlabel == "step"
    assert drawn["loss"] == ([0, 1, 2, 3, 4], [1.0, 0.5, 0.3333, 0.25, 0.2])
    assert drawn["lr"] == ([0, 1, 2, 3, 4], [0.1, 0.05, 0.0333, 0.025, 0.02])
    plotted = disttrain("jobs", "metrics", "1", "--plot", str(tmp_path / "noext"), env=env)
    assert plotted.returncode == 0, plotted.stderr
    assert plotted.stdout.strip() == f"wrote {tmp_path / 'noext.png'}"
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "noext").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("where", "fragment"), [
    ("/proc/x.png", "cannot write in /proc"),
    ("{tmp}/nonexistent/dir/x.png", "the folder {tmp}/nonexistent/dir does not exist"),
    ("{tmp}/plot.foo", ".foo is not an image format"),
])
def test_a_plot_path_that_cannot_be_written_is_one_line(tmp_path, env, where, fragment):
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create(name="m", spec={}, job_dir=str(tmp_path / "job"))
        store.add_metrics(job.id, [("loss", 1.0, 0.5), ("loss", 2.0, 0.25)])
    where, fragment = where.format(tmp=tmp_path), fragment.format(tmp=tmp_path)
    result = disttrain("jobs", "metrics", "m", "--plot", where, env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr
    assert not (tmp_path / "nonexistent").exists()


def test_a_metric_regex_without_a_group_is_refused_when_the_spec_is_read(tmp_path, env):
    spec = spec_file(tmp_path, "nogroup", metric_definitions=[{"Name": "loss", "Regex": "loss=[0-9.]+"}])
    result = disttrain("job", "run", str(spec), env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "metric_definitions[0].Regex 'loss=[0-9.]+' has no group" in result.stderr
    assert "(e.g. 'loss=([0-9.eE+-]+)')" in result.stderr
    assert not (tmp_path / "jobs.db").exists() or disttrain("jobs", "ls", env=env).stdout.count("\n") == 1


# --- S3: a real S3-protocol server (moto) on loopback, reached through s3fs -------------------

@pytest.mark.timeout(150)
def test_channel_and_output_on_s3(tmp_path, env, data, s3):
    fs, bucket = s3
    for csv in data.iterdir():
        fs.put_file(str(csv), f"{bucket}/datasets/linear/{csv.name}")
    env = {**env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    spec = spec_file(tmp_path, "s3job", inputs={"training": f"s3://{bucket}/datasets/linear"},
                     output_path=f"s3://{bucket}/jobs", hyperparameters={"epochs": 4, "lr": 0.5})
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    record = show(env, 1)
    name = record["name"]
    assert f"staging channel training from s3://{bucket}/datasets/linear" in result.stderr
    assert record["artifacts"]["model"] == f"s3://{bucket}/jobs/{name}/model.tar.gz"
    assert sorted(fs.ls(f"{bucket}/jobs/{name}")) == [f"{bucket}/jobs/{name}/model.tar.gz",
                                                       f"{bucket}/jobs/{name}/output.tar.gz"]  # no partials
    fs.get_file(f"{bucket}/jobs/{name}/model.tar.gz", str(tmp_path / "model.tar.gz"))
    assert list(tar_members(tmp_path / "model.tar.gz")) == ["model.pth"]
    assert record["metrics"]["world"] == 1 and abs(record["metrics"]["w"] - 2) < 0.01
    staged = Path(record["job_dir"]) / "channels" / "training"
    assert sorted(p.name for p in staged.iterdir()) == ["part0.csv", "part1.csv"]


def test_missing_s3_channel_is_named_before_anything_runs(tmp_path, env, s3):
    _, bucket = s3
    env = {**env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    spec = spec_file(tmp_path, "nodata", inputs={"training": f"s3://{bucket}/no/such/prefix"})
    result = disttrain("job", "run", str(spec), env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"disttrain: error: inputs.training: s3://{bucket}/no/such/prefix "
                                     "does not exist")
    assert json.loads(disttrain("jobs", "ls", "--json", env=env).stdout) == []


HOST_SCRIPT = "import os, sys\nprint(os.environ['SM_CURRENT_HOST'], sys.executable, flush=True)\n"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("requirements", [False, True], ids=["plain", "requirements"])
def test_the_dry_run_is_the_plan_that_runs(tmp_path, env, data, requirements):
    """What `job run --dry-run` prints is, to the byte, the plan.json the real run keeps: the
    container's part (each instance's SM_*, its /opt/ml, the job's own interpreter) included."""
    from disttrain.net import free_port

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(HOST_SCRIPT)
    if requirements:  # installed into the job's own venv, whose interpreter the workers run
        (src / "requirements.txt").write_text("# nothing to install\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "twin", "entry_point": "train.py", "source_dir": str(src), "instance_count": 2,
        "processes_per_instance": 1, "distribution": {"torch_distributed": {"enabled": True}},
        "master_port": free_port("127.0.0.1"), "inputs": {"training": str(data)},
        "hyperparameters": {"lr": 0.5, "note": NOTE}, "env": {"API_TOKEN": "tok456"},
        "output_path": str(tmp_path / "out")}))
    dry = disttrain("job", "run", str(spec), "--dry-run", "--job-name", "twin-1", env=env)
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "jobs.db").exists() and not (tmp_path / "home").exists()  # nothing recorded or made
    assert "tok456" not in dry.stdout  # the job's env by name only, as in plan.json
    real = disttrain("job", "run", str(spec), "--job-name", "twin-1", env=env, timeout=200)
    assert real.returncode == 0, real.stderr
    job_dir = tmp_path / "home" / "jobs" / "twin-1"
    assert dry.stdout == (job_dir / "logs" / "plan.json").read_text() + "\n"
    plan = json.loads(dry.stdout)
    assert [node["env"]["SM_CURRENT_HOST"] for node in plan["nodes"]] == ["algo-1", "algo-2"]
    assert plan["env_set"] == ["API_TOKEN"]
    python = str(job_dir / "venv" / "bin" / "python") if requirements else sys.executable
    assert plan["argv"][0] == python
    assert f"algo-2 {python}" in real.stdout  # and that interpreter ran the script


def test_a_dry_run_shows_the_containers_wrapper_and_records_nothing(tmp_path, env):
    """parameter_server: every instance's TF_CONFIG pair and the ps wrapper before the script."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "ps.py").write_text("print('ps')\n")
    spec = tmp_path / "ps.yaml"
    spec.write_text(yaml.safe_dump({"name": "ps", "entry_point": "ps.py", "source_dir": str(tmp_path / "src"),
                                    "framework": "tensorflow", "instance_count": 2, "master_port": 29400,
                                    "distribution": {"parameter_server": {"enabled": True}},
                                    "private_opt_ml": "off"}))
    dry = disttrain("job", "run", str(spec), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["argv"][1:5] == ["-u", "-m", "disttrain.jobs.psshim", "ps.py"]
    tasks = [json.loads(node["env"]["DISTTRAIN_PS_TASK_TF_CONFIG"])["task"] for node in plan["nodes"]]
    assert tasks == [{"type": "ps", "index": 0}, {"type": "ps", "index": 1}]
    assert [node["opt_ml"] for node in plan["nodes"]] == [None, None]
    assert not (tmp_path / "jobs.db").exists() and not (tmp_path / "home").exists()


@pytest.mark.timeout(150)
def test_a_job_whose_code_shadows_the_standard_library_still_runs(tmp_path, env):
    """The instances' agents start in the job's code folder: a user's `copy.py` or `json.py` there
    (harmless to their own script, which never imports them) must not replace the standard
    library inside disttrain's agent."""
    code = tmp_path / "code"
    code.mkdir()
    for name in ("copy", "json", "signal"):
        (code / f"{name}.py").write_text(f"raise ImportError('the job\\'s own {name}.py was imported')\n")
    (code / "train.py").write_text("import os\nprint('trained on', os.environ['SM_CURRENT_HOST'], flush=True)\n")
    spec = tmp_path / "shadow.yaml"
    spec.write_text(yaml.safe_dump({"name": "shadow", "entry_point": "train.py", "source_dir": str(code),
                                    "instance_count": 2, "processes_per_instance": 1, "private_opt_ml": "off"}))
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "was imported" not in result.stderr
    assert "trained on algo-1" in result.stdout and "trained on algo-2" in result.stdout
