"""--track: MLflow against a real `mlflow server` (SQLite backend) this module starts and stops,
Trackio against its local store (TRACKIO_DIR), W&B offline (its run file read back)."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import SCRIPTS, cli_env, disttrain
from disttrain import trackline
from disttrain.tracking.follower import RunTracker

pytestmark = pytest.mark.timeout(300)  # the MLflow server takes up to a minute to answer on a busy machine
SERVER_START_S = 180


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """``mlflow server`` on a free loopback port with a SQLite backend; always stopped."""
    pytest.importorskip("mlflow")
    from disttrain.net import free_port

    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    log = open(folder / "server.log", "w")
    server = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder}/mlflow.db", "--default-artifact-root", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server on port {port} did not answer /health: "
                            f"{(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _metric_steps(client, run_id: str, name: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


def _runs(client, experiment: str):
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def test_run_tracked_in_mlflow(mlflow_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    env = cli_env(MLFLOW_TRACKING_URI=mlflow_uri, MLFLOW_EXPERIMENT_NAME="ok")
    run_dir = tmp_path / "run"
    proc = disttrain("run", "-n", "2", "--track", "mlflow", "--track-ranks", "--log-dir", str(run_dir),
                     str(SCRIPTS / "tracked.py"), "--lr", "0.1", timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "disttrain: tracked in mlflow as run" in proc.stderr
    client = MlflowClient(mlflow_uri)
    (run,) = _runs(client, "ok")
    assert run.info.status == "FINISHED" and run.data.tags["exit_code"] == "0"
    assert run.data.params["hp.lr"] == "0.1" and "--track mlflow" in run.data.params["argv"]
    # The mean over the 2 ranks (1/(s+1) + 0.5) at each step, and each rank's own.
    assert [(s, round(v, 4)) for s, v in _metric_steps(client, run.info.run_id, "loss")] == [
        (s, round(1 / (s + 1) + 0.5, 4)) for s in range(6)]
    assert [v for _, v in _metric_steps(client, run.info.run_id, "rank1/loss")] == pytest.approx(
        [1 / (s + 1) + 1 for s in range(6)])
    assert "goodput" in run.data.metrics and "goodput/startup_s" in run.data.metrics
    assert "goodput.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # The run folder keeps the same: the records and goodput.json, whose classes add up to the wall time.
    data = json.loads((run_dir / "goodput.json").read_text())
    assert data["exit_code"] == 0 and data["notes"] == []
    assert sum(data["seconds"].values()) == pytest.approx(data["wall_s"], abs=0.01)
    assert data["seconds"]["startup"] > 0 and data["seconds"]["training"] > 0
    kinds = [json.loads(line)["kind"] for line in (run_dir / "track.jsonl").read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("metrics") == 6 * 3


def test_hung_run_in_mlflow_with_its_artifacts(mlflow_uri, tmp_path, monkeypatch):
    """The launcher's writer in this process against the server: a run the hang verdict stopped."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hung")
    clock = [100.0]
    tracker = RunTracker(tmp_path / "run", tracker="mlflow", name="run-1", params={"hp.lr": "0.1"},
                         clock=lambda: clock[0], say=lambda _line: None)
    _fed(tracker, clock)
    (tmp_path / "model.tar.gz").write_bytes(b"model")
    clock[0] += 30.0
    data = tracker.finish(124, report="disttrain: hang verdict: rank 1 stuck in all_reduce",
                          artifacts=[tmp_path / "model.tar.gz"])
    assert data["seconds"]["hang"] == pytest.approx(31.0 * 2)
    client = MlflowClient(mlflow_uri)
    (run,) = _runs(client, "hung")
    assert run.info.status == "FAILED" and run.data.tags["exit_code"] == "124"
    assert {"model.tar.gz", "goodput.json", "membership.json", "hang_verdict.txt"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)}
    assert _metric_steps(client, run.info.run_id, "loss") == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert run.data.metrics["goodput/hang_s"] == pytest.approx(62.0)


def _fed(tracker: RunTracker, clock: list[float]) -> None:
    """What a 2-rank run of 3 steps prints, and a host change recorded in membership.json."""
    tracker.starting(2)
    for step in range(3):
        clock[0] += 1.0
        for rank in (0, 1):
            tracker.line("[h rank%d] " % rank + trackline.encode("metrics", rank=rank, step=step,
                                                                   values={"loss": float(rank + step)}, reduced=False))
        tracker.line("[h rank0] " + trackline.encode("metrics", rank=0, step=step,
                                                       values={"loss": step + 0.5}, reduced=True))
    tracker.line("[h rank0] " + trackline.encode("checkpoint", rank=0, step=2, seconds=0.25))
    (tracker.run_dir / "membership.json").write_text(json.dumps([
        {"time": 0.0, "change": "start", "host": None, "why": "", "hosts": ["a", "b"]}]))
    clock[0] += 1.0


def test_trackio_local_store(tmp_path, monkeypatch):
    if "trackio" in sys.modules:  # it reads TRACKIO_DIR when imported
        pytest.skip("trackio was imported before TRACKIO_DIR was set")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("TRACKIO_PROJECT", "tracked")
    pytest.importorskip("trackio")
    clock = [100.0]
    tracker = RunTracker(tmp_path / "run", tracker="trackio", name="run-1", params={"argv": "x", "hp.lr": "0.1"},
                         clock=lambda: clock[0], say=lambda _line: None)
    _fed(tracker, clock)
    (tmp_path / "model.tar.gz").write_bytes(b"model")
    data = tracker.finish(0, artifacts=[tmp_path / "model.tar.gz"])
    assert data["seconds"]["checkpoint"] == pytest.approx(0.5)  # 0.25 s x 2 hosts
    from trackio import SQLiteStorage

    logs = SQLiteStorage.get_logs("tracked", "run-1")
    series = {(row.get("step"), key): value for row in logs for key, value in row.items()}
    assert series[(2, "loss")] == 2.5 and series[(1, "rank1/loss")] == 2.0
    assert any("goodput" in row for row in logs) and any(row.get("exit_code") == 0 for row in logs)
    assert SQLiteStorage.get_run_config("tracked", "run-1")["hp.lr"] == "0.1"
    artifacts = SQLiteStorage.get_run_artifacts("tracked", "run-1", None)
    names = {entry["name"] for entries in artifacts.values() for entry in entries}
    assert (tmp_path / "store" / "tracked.db").is_file()
    assert {"model-tar-gz", "goodput-json", "membership-json"} <= names, names


def _wandb_records(path: str):
    """The records of a W&B run file (its own log format: 7-byte header, 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            return
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_PROJECT": "tracked",
                       "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    clock = [100.0]
    tracker = RunTracker(tmp_path / "run", tracker="wandb", name="run-1", params={"hp.lr": "0.1"},
                         clock=lambda: clock[0], say=lambda _line: None)
    _fed(tracker, clock)
    (tmp_path / "model.tar.gz").write_bytes(b"model")
    tracker.finish(124, report="disttrain: hang verdict: rank 1 stuck", artifacts=[tmp_path / "model.tar.gz"])
    (path,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 60  # W&B's core process writes the file after finish() returns
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        assert time.monotonic() < deadline, "W&B's run file got no exit record within 60 s"
        time.sleep(0.2)
    history, summary, files, config = [], {}, set(), {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): item.value_json for item in record.summary.update})
        elif kind == "files":
            files |= {f.path for f in record.files.files}
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    by_step = {(row["_step"], k): v for row in history for k, v in row.items()}
    assert by_step[(2, "loss")] == 2.5 and by_step[(0, "rank1/loss")] == 1.0
    assert summary["exit_code"] == "124" and config["hp.lr"] == "0.1"
    assert {"model.tar.gz", "goodput.json", "membership.json", "hang_verdict.txt"} <= files
    assert "goodput/hang_s" in summary


def test_missing_client_names_the_extra(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    env = cli_env(PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]))
    proc = disttrain("run", "-n", "1", "--track", "wandb", str(SCRIPTS / "tracked.py"), env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "disttrain: error: --track wandb: the wandb client is not installed; pip install 'disttrain[track]'"]


def test_unknown_tracker_and_ranks_without_tracker(tmp_path):
    proc = disttrain("run", "-n", "1", "--track", "neptune", str(SCRIPTS / "tracked.py"))
    assert proc.returncode == 2 and "--track 'neptune': choose one of mlflow, trackio, wandb" in proc.stderr
    proc = disttrain("run", "-n", "1", "--track-ranks", str(SCRIPTS / "tracked.py"))
    assert proc.returncode == 2 and "--track-ranks needs --track" in proc.stderr


@pytest.mark.timeout(240)
def test_job_with_track_key_goodput_in_its_record(tmp_path):
    """A job spec's ``track:`` key: the job as a W&B run (offline), its goodput in the job record and
    ``jobs show``, model.tar.gz among the run's files."""
    pytest.importorskip("wandb")
    import yaml

    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"),
                  WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wb"), WANDB_SILENT="true")
    spec = {"name": "tracked", "entry_point": "tracked.py", "source_dir": str(SCRIPTS), "instance_count": 1,
            "processes_per_instance": 2, "hyperparameters": {"lr": 0.1}, "track": "wandb",
            "metric_definitions": [{"Name": "loss", "Regex": r'"loss":([0-9.]+)'}]}  # the track lines themselves
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    proc = disttrain("job", "run", str(tmp_path / "job.yaml"), env=env, timeout=200)
    assert proc.returncode == 0, proc.stderr
    shown = disttrain("jobs", "show", "1", "--json", env=env)
    record = json.loads(shown.stdout)
    assert record["goodput"]["exit_code"] == 0 and record["goodput"]["seconds"]["training"] > 0
    assert record["goodput"]["notes"] == []  # the steps were seen
    assert "goodput " in disttrain("jobs", "show", "1", env=env).stdout
    (path,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    files, config, losses = set(), {}, []
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "files":
            files |= {f.path for f in rec.files.files}
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in rec.run.config.update})
        elif kind == "history":
            losses += [json.loads(i.value_json) for i in rec.history.item
                       if (i.key or "/".join(i.nested_key)) == "loss"]
    assert {"model.tar.gz", "goodput.json"} <= files and config["hp.lr"] == "0.1"
    if importlib.util.find_spec("matplotlib"):  # the metric_definitions series, drawn
        assert "metrics.png" in files
    assert losses == pytest.approx([1 / (s + 1) + 0.5 for s in range(6)])


def test_job_spec_track_key_is_checked(tmp_path):
    from disttrain.errors import UsageError
    from disttrain.jobs.spec import spec_from_mapping

    base = {"name": "t", "entry_point": "tracked.py", "source_dir": str(SCRIPTS)}
    with pytest.raises(UsageError, match="track: 'comet': choose one of mlflow, trackio, wandb"):
        spec_from_mapping({**base, "track": "comet"}, base_dir=tmp_path)
    with pytest.raises(UsageError, match="track_ranks: true needs track"):
        spec_from_mapping({**base, "track_ranks": True}, base_dir=tmp_path)
    spec = spec_from_mapping({**base, "track": "mlflow", "track_ranks": True}, base_dir=tmp_path)
    assert spec.container.track_mode == "ranks"


@pytest.mark.timeout(400)
def test_tuner_trials_are_child_runs_in_mlflow(mlflow_uri, tmp_path, monkeypatch):
    pytest.importorskip("optuna")
    from mlflow.tracking import MlflowClient

    from disttrain.sagemaker.pytorch import PyTorch
    from disttrain.sagemaker.tuner import ContinuousParameter, HyperparameterTuner

    for key, value in {"DISTTRAIN_HOME": str(tmp_path / "home"), "DISTTRAIN_STORE": str(tmp_path / "jobs.db"),
                       "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": mlflow_uri,
                       "MLFLOW_EXPERIMENT_NAME": "tuned"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "loss.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float)\n"
        "a = p.parse_args()\nprint(f'loss={(a.lr - 0.3) ** 2:.6f}', flush=True)\n")
    est = PyTorch(entry_point="loss.py", source_dir="src", instance_type="ml.c5.xlarge", framework_version="2.1",
                  py_version="py3", disttrain={"private_opt_ml": "off", "track": "mlflow"})
    tuner = HyperparameterTuner(est, "loss", {"lr": ContinuousParameter(0.01, 1.0)},
                                metric_definitions=[{"Name": "loss", "Regex": r"loss=([0-9.]+)"}],
                                objective_type="Minimize", max_jobs=2, max_parallel_jobs=2, random_seed=7,
                                base_tuning_job_name="tr")
    tuner.fit()
    client = MlflowClient(mlflow_uri)
    runs = {run.info.run_name: run for run in _runs(client, "tuned")}
    parent = runs.pop(tuner.latest_tuning_job.name)
    assert parent.info.status == "FINISHED" and parent.data.params["max_jobs"] == "2"
    assert len(runs) == 2 and all(r.data.tags.get("mlflow.parentRunId") == parent.info.run_id for r in runs.values())
    assert all(r.info.status == "FINISHED" and "goodput" in r.data.metrics for r in runs.values())
    assert sorted(step for step, _ in _metric_steps(client, parent.info.run_id, "loss")) == [0, 1]


@pytest.mark.timeout(200)
def test_bench_tracked_in_trackio(tmp_path):
    """``disttrain bench --track``: one run, samples/s at each world size, the bench's JSON."""
    pytest.importorskip("trackio")
    store = tmp_path / "store"
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), TRACKIO_DIR=str(store), TRACKIO_PROJECT="bench")
    proc = disttrain("bench", str(SCRIPTS / "bench_tiny.py"), "-n", "1,2", "--repeat", "1", "--global-batch", "16",
                     "--steps", "4", "--warmup", "2", "--track", "trackio", "--", "--timer", "--samples", "256",
                     timeout=190, env=env)
    assert proc.returncode == 0, proc.stderr
    read = ("from trackio import SQLiteStorage as S; import json; "
            "print(json.dumps([S.get_runs('bench'), S.get_logs('bench', S.get_runs('bench')[0])]))")
    runs, logs = json.loads(subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True,
                                           timeout=60, check=True).stdout.splitlines()[-1])
    assert runs == ["bench-bench_tiny"]
    assert sorted(row["step"] for row in logs if "samples_per_s" in row) == [1, 2]
    assert [row["speedup"] for row in logs if row.get("step") == 1 and "speedup" in row] == [1.0]


def test_a_tracker_that_fails_is_said_once_and_the_records_stay(tmp_path, monkeypatch):
    """A tracker that stops answering mid-run (its server gone) never fails the run: one warning, its
    records kept and tried again until the run's end stops waiting (a bounded wait); track.jsonl and
    goodput.json are whole."""
    from disttrain.tracking import follower
    from disttrain.tracking.sink import Sink

    class Failing(Sink):
        tracker = client = "failing"

        def __init__(self, name, *, params, parent=None, key=None):
            self.calls = []

        run_id = "r1"

        def metrics(self, values, step, wall_time):
            self.calls.append(("metrics", step))
            raise ConnectionError("the server went away\nmore lines")

        def text(self, name, text):
            self.calls.append(("text", name))

        def artifact(self, path):
            self.calls.append(("artifact", path))

        def finish(self, exit_code):
            self.calls.append(("finish", exit_code))

    monkeypatch.setattr(follower, "open_sink", lambda tracker, name, **kw: Failing(name, **kw))
    said: list[str] = []
    clock = [100.0]
    tracker = RunTracker(tmp_path / "run", tracker="failing", name="run-1", params={}, clock=lambda: clock[0],
                         say=said.append, stop_wait_s=0.5)
    _fed(tracker, clock)
    data = tracker.finish(0)
    assert [line for line in said if "tracker" in line and "goodput" not in line] == [
        "disttrain: warning: the failing tracker stopped answering (ConnectionError: the server went away); the run "
        "goes on, its records are kept and sent when it answers again",
        "disttrain: warning: the failing tracker did not take the run's last records within 0.5 s; they stay in "
        f"{tmp_path / 'run'}"]
    assert set(tracker.sink.calls) == {("metrics", 0)}  # the first point, tried again; nothing after it
    assert data["seconds"]["checkpoint"] == pytest.approx(0.5)
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "run" / "track.jsonl").read_text().splitlines()]
    assert kinds.count("metrics") == 9 and kinds[-1] == "end"
