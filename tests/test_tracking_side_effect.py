"""A tracker is a side effect (issue 46 points 1 and 2), against a real ``mlflow server`` on loopback:
20 runs at once share one experiment and all finish; a server killed and restarted mid-run gets its
points once it answers again; an unreachable or unknown tracker is one line and the run goes on or
exit 2; no secret (a script's password option, a tracking URI's password) reaches a tracker,
a terminal or a file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import cli_env, disttrain, write
from disttrain.net import free_port
from disttrain.tracking.sink import Sink

pytestmark = pytest.mark.timeout(600)
SERVER_START_S = 240
RUNS_AT_ONCE = 20

# A worker without torch: its track lines written by hand (the launcher reads them as disttrain.log's),
# then, with GATE set, a pause until the test lets it go on (no clock in the test).
TINY = r'''
import json, os, sys, time
def point(step):
    print("disttrain-track: " + json.dumps({"kind": "metrics", "rank": 0, "step": step,
          "values": {"loss": 1.0 / (step + 1)}, "reduced": True}), flush=True)
for step in range(3):
    point(step)
gate = os.environ.get("GATE")
if gate:
    open(gate + ".first", "w").close()
    while not os.path.exists(gate + ".more"):
        time.sleep(0.1)
    for step in range(3, 6):
        point(step)
    open(gate + ".second", "w").close()
    while not os.path.exists(gate + ".end"):
        time.sleep(0.1)
'''


class Server:
    """``mlflow server`` on one loopback port and one SQLite file: stopped and started again as the
    same server (its runs kept)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        log = open(self.folder / "server.log", "a")
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
             "--default-artifact-root", str(self.folder / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not answer: {(self.folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the server and its workers
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("mlflow")
    running = Server(tmp_path_factory.mktemp("mlflow"))
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([found.experiment_id]) if found else [])


def _run(tmp_path: Path, uri: str, experiment: str, *extra: str, env_extra: dict | None = None,
         popen: bool = False):
    script = tmp_path / "tiny.py"
    if not script.exists():
        write(script, TINY)
    env = cli_env(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME=experiment,
                  DISTTRAIN_HOME=str(tmp_path / "home"), **(env_extra or {}))
    argv = [sys.executable, "-m", "disttrain", "run", "-n", "1", "--track", "mlflow", *extra, str(script)]
    if popen:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400)


def test_twenty_runs_at_once_share_one_experiment_and_all_finish(server, tmp_path):
    for i in range(RUNS_AT_ONCE):
        (tmp_path / f"r{i}").mkdir()
    procs = [_run(tmp_path / f"r{i}", server.uri, "at-once", popen=True) for i in range(RUNS_AT_ONCE)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=500)
        results.append((proc.returncode, err))
    assert [code for code, _ in results] == [0] * RUNS_AT_ONCE, [err for code, err in results if code][:2]
    said = [line for _, err in results for line in err.splitlines() if "Traceback" in line or "warning" in line]
    assert not said, "\n".join(said)  # whole: pytest would cut a long line where its cause is said
    client, runs = _runs(server.uri, "at-once")
    assert len(runs) == RUNS_AT_ONCE
    assert {run.info.status for run in runs} == {"FINISHED"}
    assert all(len(client.get_metric_history(run.info.run_id, "loss")) == 3 for run in runs)


class SlowFirstCreate:
    """A loopback proxy before the server that answers the first ``runs/create`` only after the
    client gave up on it (its request reached the server): the client sends it again, as it does
    when a busy server is slow, and two runs are made for one open."""

    def __init__(self, upstream: str, hold_s: float) -> None:
        import http.server
        import threading
        import urllib.error

        proxy = self
        self.creates = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def _forward(self, body):
                request = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=60) as answer:
                        code, data = answer.status, answer.read()
                except urllib.error.HTTPError as refused:
                    code, data = refused.code, refused.read()
                if self.path.endswith("/runs/create"):
                    proxy.creates += 1
                    if proxy.creates == 1:
                        time.sleep(hold_s)
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client stopped waiting for the held answer
                    pass

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_a_run_created_twice_by_a_retried_request_is_kept_once(server, tmp_path):
    proxy = SlowFirstCreate(server.uri, hold_s=4)
    try:
        result = _run(tmp_path, proxy.uri, "twice", env_extra={"MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
    finally:
        proxy.close()
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    assert proxy.creates == 2  # the client did send it again
    client, (run,) = _runs(server.uri, "twice")
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3


def test_a_server_killed_and_restarted_mid_run_gets_every_point(server, tmp_path):
    gate = tmp_path / "gate"
    proc = _run(tmp_path, server.uri, "restarted", env_extra={"GATE": str(gate)}, popen=True)
    try:
        _wait_for(gate.with_suffix(".first"), proc)
        _wait_points(server.uri, "restarted", 3)
        server.stop(signal.SIGKILL)  # dead mid-run: the next points find no server
        (tmp_path / "gate.more").touch()
        _wait_for(gate.with_suffix(".second"), proc)
        server.start()  # the same server again, its runs kept
        (tmp_path / "gate.end").touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    said = [line for line in err.splitlines() if "mlflow tracker" in line]
    assert len([line for line in said if "stopped answering" in line]) == 1, err
    assert any("answers again" in line for line in said) and "did not take" not in err, err
    client, (run,) = _runs(server.uri, "restarted")
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(6))


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)


def _wait_points(uri: str, experiment: str, count: int) -> None:
    while True:
        client, runs = _runs(uri, experiment)
        if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) >= count:
            return
        time.sleep(0.2)


def test_an_unreachable_tracker_is_one_line_and_the_run_goes_on_with_no_password_shown(tmp_path):
    result = _run(tmp_path, "http://someone:S3cretPass@127.0.0.1:9", "nowhere")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "mlflow tracker" in line]
    assert len(said) == 1 and "could not be opened" in said[0] and "goes on untracked" in said[0], result.stderr
    assert "Traceback" not in result.stderr
    (run_dir,) = (tmp_path / "home" / "runs").iterdir()
    assert (run_dir / "goodput.json").exists()  # the run trained and recorded itself
    files = [p for p in (tmp_path / "home").rglob("*") if p.is_file()]
    assert not [p for p in files if b"S3cretPass" in p.read_bytes()]
    assert "S3cretPass" not in result.stdout + result.stderr


@pytest.mark.parametrize("uri,track,said", [
    ("nosuch://x", "mlflow", "MLFLOW_TRACKING_URI 'nosuch://x' is no MLflow tracking store"),
    ("", "", "--track '': choose one of mlflow, trackio, wandb")])
def test_an_unknown_tracker_is_one_line_exit_2(tmp_path, uri, track, said):
    env = cli_env(MLFLOW_TRACKING_URI=uri, DISTTRAIN_HOME=str(tmp_path / "home"))
    result = disttrain("run", "-n", "1", "--track", track, str(write(tmp_path / "t.py", TINY)), env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr


def test_no_secret_reaches_the_tracker(server, tmp_path):
    """One run with both kinds of secret: a tracking URI's password, and script arguments that look secret
    by the job records' rule."""
    env = cli_env(MLFLOW_TRACKING_URI=server.uri.replace("://", "://me:Pw0rd@"), MLFLOW_EXPERIMENT_NAME="secrets",
                  DISTTRAIN_HOME=str(tmp_path / "home"))
    result = disttrain("run", "-n", "1", "--track", "mlflow", str(write(tmp_path / "tiny.py", TINY)), "--db-password",
                       "Hunter2x", "--api-key=Hunter3x", "--lr", "0.1", env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    _client, (run,) = _runs(server.uri, "secrets")
    assert run.data.params["hp.db-password"] == "***" and run.data.params["hp.api-key"] == "***"
    assert run.data.params["hp.lr"] == "0.1"
    assert "Hunter2x" not in run.data.params["argv"] and "Hunter3x" not in run.data.params["argv"]
    assert "--db-password '***'" in run.data.params["argv"]
    assert "Pw0rd" not in result.stdout + result.stderr  # MLflow's own "View run at" line included


def test_the_masking_rule_is_the_job_records_one():
    from disttrain.private import MASK, mask_argv, redact_urls
    from disttrain.tracking import script_params

    argv = ["disttrain", "run", "t.py", "--db-password", "X1", "--api-key=X2", "DB_PASS=X3", "--lr", "0.1",
            "--bypass", "ok", "--uri", "http://u:X4@h:5000/p"]
    assert mask_argv(argv) == ["disttrain", "run", "t.py", "--db-password", MASK, f"--api-key={MASK}",
                               f"DB_PASS={MASK}", "--lr", "0.1", "--bypass", "ok", "--uri", f"http://u:{MASK}@h:5000/p"]
    params = script_params(argv, argv[3:])
    assert params["hp.db-password"] == MASK and params["hp.api-key"] == MASK and params["hp.lr"] == "0.1"
    assert not any(secret in params["argv"] for secret in ("X1", "X2", "X3", "X4"))
    assert redact_urls("View run at http://me:Pw@127.0.0.1:5000/#/x and s3://k:s@b") == \
        f"View run at http://me:{MASK}@127.0.0.1:5000/#/x and s3://k:{MASK}@b"


@pytest.mark.parametrize("error,grace_s", [(ConnectionRefusedError("no server"), 30),
                                           (TimeoutError("read timed out"), 30), (TimeoutError("read timed out"), 0)])
def test_a_tracker_that_answers_again_gets_what_was_kept(tmp_path, monkeypatch, error, grace_s):
    """In-process, a fake tracker down for its first two calls: one line when it stops answering, one
    when it answers again (a server only slow to answer, for less than BUSY_GRACE_S: no line), every
    point delivered in order, and the end's record last."""
    from disttrain import trackline
    from disttrain.tracking import follower
    from disttrain.tracking.follower import RunTracker
    from disttrain.tracking.sink import Sink

    class Flaky(Sink):
        tracker = client = "flaky"
        run_id = "r1"

        def __init__(self, name, *, params, parent=None, key=None):
            self.down, self.got = 2, []

        def metrics(self, values, step, wall_time):
            if self.down:
                self.down -= 1
                raise error
            self.got.append(("metrics", step))

        def text(self, name, text):
            self.got.append(("text", name))

        def artifact(self, path):
            self.got.append(("artifact", path))

        def finish(self, exit_code):
            self.got.append(("finish", exit_code))

    monkeypatch.setattr(follower, "open_sink", lambda tracker, name, **kw: Flaky(name, **kw))
    monkeypatch.setattr(follower, "BUSY_GRACE_S", grace_s)
    said: list[str] = []
    tracker = RunTracker(tmp_path / "run", tracker="flaky", name="run-1", params={}, say=said.append)
    tracker.starting(1)
    for step in range(4):
        tracker.line("[h rank0] " + trackline.encode("metrics", rank=0, step=step, values={"loss": 1.0},
                                                     reduced=True))
    tracker.finish(0)
    gone = [] if grace_s and isinstance(error, TimeoutError) else [
        f"disttrain: warning: the flaky tracker stopped answering ({type(error).__name__}: {error}); the run goes "
        "on, its records are kept and sent when it answers again",
        "disttrain: the flaky tracker answers again; the records kept meanwhile are sent"]
    assert [line for line in said if "flaky" in line] == [*gone, "disttrain: tracked in flaky as run r1 (run-1)"]
    sent = tracker.sink.got
    assert [step for kind, step in sent if kind == "metrics" and step is not None] == [0, 1, 2, 3]
    assert sent[-1] == ("finish", 0)


class _Stepped(Sink):
    """A fake tracker's run that keeps the steps of its points, then "finish"."""

    def metrics(self, values, step, wall_time):
        self.got.append(step)

    def text(self, name, text):
        pass

    def artifact(self, path):
        pass

    def finish(self, exit_code):
        self.got.append("finish")


def test_a_tracker_slow_to_open_is_asked_again_and_a_refusing_one_is_said_at_once(tmp_path, monkeypatch):
    """In-process: a server that times out twice while a run opens (twenty runs starting at once) gets
    the run and its points without a word; one that refuses the connection is one line at once."""
    from disttrain import trackline
    from disttrain.tracking import follower
    from disttrain.tracking.follower import RunTracker

    class Slow(_Stepped):
        tracker = client = "slow"
        run_id = "r2"
        opens = 0

        def __init__(self, name, *, params, parent=None, key=None):
            Slow.opens += 1
            if Slow.opens <= 2:
                raise Slow.error
            self.got = []

    monkeypatch.setattr(follower, "open_sink", lambda tracker, name, **kw: Slow(name, **kw))
    monkeypatch.setattr(follower, "RETRY_EVERY_S", 0.01)
    for error, opened in ((TimeoutError("read timed out"), True), (ConnectionRefusedError("refused"), False)):
        Slow.opens, Slow.error = 0, error
        said: list[str] = []
        tracker = RunTracker(tmp_path / type(error).__name__, tracker="slow", name="run-2", params={},
                             say=said.append)
        tracker.starting(1)
        for step in range(3):
            tracker.line("[h rank0] " + trackline.encode("metrics", rank=0, step=step, values={"loss": 1.0},
                                                         reduced=True))
        tracker.finish(0)
        if opened:
            assert Slow.opens == 3 and tracker.sink.got[:3] == [0, 1, 2] and tracker.sink.got[-1] == "finish"
            assert not [line for line in said if "warning" in line], said
        else:
            assert Slow.opens == 1 and tracker.sink is None
            warned = [line for line in said if "warning" in line]
            assert len(warned) == 1 and "could not be opened (ConnectionRefusedError: refused)" in warned[0]


def test_a_tracker_whose_client_is_slow_to_import_still_gets_a_short_run(tmp_path, monkeypatch):
    """In-process, the CI's failure: twenty runs at once on two loaded cores take a minute to import
    MLflow's client, then its server is slow to answer. Neither the open's patience nor the end's wait
    counts that import: a run that ended before its tracker opened still gets every point, no line."""
    import threading

    from disttrain import trackline
    from disttrain.tracking import follower
    from disttrain.tracking.follower import RunTracker

    imported = threading.Event()

    class Late(_Stepped):
        tracker = client = "late"
        run_id = "r3"
        opens = 0

        def __init__(self, name, *, params, parent=None, key=None):
            imported.wait(10)  # the import, let go by the test once the run has ended
            Late.opens += 1
            if Late.opens == 1:
                raise TimeoutError("read timed out")
            self.got = []

    monkeypatch.setattr(follower, "open_sink", lambda tracker, name, **kw: Late(name, **kw))
    monkeypatch.setattr(follower, "RETRY_EVERY_S", 0.01)
    monkeypatch.setattr(follower, "OPEN_PATIENCE_S", 5.0)
    said: list[str] = []
    tracker = RunTracker(tmp_path / "run", tracker="late", name="run-3", params={}, say=said.append,
                         stop_wait_s=0.5)
    tracker.starting(1)
    for step in range(3):
        tracker.line("[h rank0] " + trackline.encode("metrics", rank=0, step=step, values={"loss": 1.0},
                                                     reduced=True))
    monkeypatch.setattr(follower.time, "monotonic", lambda real=follower.time.monotonic: real() + 3600)
    finishing = threading.Thread(target=tracker.finish, args=(0,))
    finishing.start()  # the run ended; an hour (its clock) passes before the client is imported
    time.sleep(1.0)  # past the end's stop_wait_s: a wait counted from the run's end would give up here
    imported.set()
    finishing.join(30)
    assert not finishing.is_alive()
    assert not [line for line in said if "warning" in line], said
    assert Late.opens == 2 and tracker.sink.got[:3] == [0, 1, 2] and tracker.sink.got[-1] == "finish"


def test_an_mlflow_server_that_is_not_there_is_known_before_mlflow_is_imported(monkeypatch):
    """The probe: a refused port is a ConnectionRefusedError at once; a listening one passes."""
    import socket

    from disttrain.tracking.mlflow_sink import MlflowSink
    from disttrain.tracking.sink import busy

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        MlflowSink.probe()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://u:p@127.0.0.1:{port}")
    with pytest.raises(ConnectionRefusedError) as refused:
        MlflowSink.probe()
    assert not busy(refused.value)


def test_an_mlflow_write_refused_as_its_own_twin_is_sent_once_more(monkeypatch):
    """In-process, MLflow's client against a busy server: a write (the parameters, a tag) timed out and
    was sent again while the server still wrote the first, and the second was refused (``UNIQUE
    constraint failed``, seen in twenty runs at once). Sent once more, it is taken; refused twice, or
    refused for anything else, it is raised."""
    pytest.importorskip("mlflow")
    from mlflow.exceptions import RestException

    from disttrain.tracking import mlflow_sink

    def refusing(refusals, message):
        calls = []

        def write(*args, **kwargs):
            calls.append(args)
            if len(calls) <= refusals:
                raise RestException({"error_code": "BAD_REQUEST", "message": message})
        return write, calls

    monkeypatch.setattr(mlflow_sink, "AGAIN_S", 0.0)
    twin = "(sqlite3.IntegrityError) UNIQUE constraint failed: tags.key, tags.run_uuid"
    write, calls = refusing(1, twin)
    mlflow_sink.MlflowSink._again(write, "r", "exit_code", "0")
    assert calls == [("r", "exit_code", "0")] * 2
    for refusals, message, tries in ((2, twin, 2), (1, "Invalid value for metric", 1)):
        write, calls = refusing(refusals, message)
        with pytest.raises(RestException):
            mlflow_sink.MlflowSink._again(write, "r")
        assert len(calls) == tries
