"""A checkpoint store's outage is ridden out. In-process: which errors are transient (botocore's
own exception classes) and the bounded retry, on a fake clock. For real: two ranks save
asynchronously to a moto server on loopback reached through a TCP relay that the test stops at an
upload (connections refused and reset) and starts again 10 s or 60 s later (the default bound: 120 s);
the job exits 0, says "unreachable" once and "back" once, and every checkpoint it reported is complete
on the store."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from conftest import cli_env
from disttrain.checkpoint_layout import MARKER
from disttrain.checkpoint_retry import DEFAULT_RETRY_S, StoreRetry, is_transient

# -- in process: the rules ------------------------------------------------------------------------

def botocore_errors():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    return EndpointConnectionError, NoCredentialsError, client_error


def test_transient_errors_are_told_apart_from_mistakes():
    pytest.importorskip("botocore")
    endpoint, no_credentials, client_error = botocore_errors()
    assert is_transient(endpoint(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionRefusedError(111, "refused"))
    assert is_transient(ConnectionResetError(104, "reset"))
    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("Throttling", 400))
    assert is_transient(client_error("InternalError", 500))
    assert not is_transient(client_error("NoSuchBucket", 404))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(no_credentials())
    assert not is_transient(FileNotFoundError("gone"))
    try:  # told through the OSError checkpoint_url wraps a client's error in
        try:
            raise endpoint(endpoint_url="http://127.0.0.1:1")
        except Exception as err:
            raise OSError(f"{type(err).__name__}: cannot connect") from err
    except OSError as wrapped:
        assert is_transient(wrapped)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def flaky(failures: int, error: BaseException):
    calls = {"n": 0}

    def operation() -> str:
        calls["n"] += 1
        if calls["n"] <= failures:
            raise error
        return "stored"

    return operation, calls


def test_an_outage_within_the_bound_is_waited_out_with_one_line_each_way():
    clock, said = FakeClock(), []
    retry = StoreRetry("s3://b/run", 60, clock=clock, sleep=clock.sleep, say=said.append)
    operation, calls = flaky(6, ConnectionRefusedError(111, "Connection refused"))
    assert retry.call(operation) == "stored"
    assert calls["n"] == 7
    assert clock.slept == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]  # backoff, capped
    assert said == ["disttrain: checkpoint store s3://b/run unreachable (ConnectionRefusedError: [Errno 111] "
                    "Connection refused); retrying for up to 60 s while training goes on (--checkpoint-retry-s)",
                    "disttrain: checkpoint store s3://b/run back after 18 s"]
    assert retry.call(lambda: "again") == "again" and len(said) == 2  # no outage, nothing said


def test_the_default_bound_rides_out_a_60_s_outage_with_a_slow_store():
    """The issue's 60 s outage under the default bound, each failed try itself slow (a connect that
    times out after 10 s): the store is back within the bound. The same outage runs for real, 60 s of
    wall time, under `pytest -m field` (the real upload test's [60])."""
    clock = FakeClock()
    retry = StoreRetry("s3://b/run", clock=clock, sleep=clock.sleep, say=lambda line: None)
    down_until = clock.now + 60

    def upload() -> str:
        if clock.now < down_until:
            clock.now += 10
            raise ConnectionRefusedError(111, "Connection refused")
        return "stored"

    assert retry.call(upload) == "stored" and clock.now - (down_until - 60) < DEFAULT_RETRY_S


def test_an_outage_past_the_bound_raises_and_mistakes_are_not_retried():
    clock, said = FakeClock(), []
    retry = StoreRetry("s3://b/run", 10, clock=clock, sleep=clock.sleep, say=said.append)
    operation, calls = flaky(100, ConnectionResetError(104, "reset"))
    with pytest.raises(ConnectionResetError):
        retry.call(operation)
    assert 10 <= clock.now < 16 and len(said) == 1
    operation, calls = flaky(1, PermissionError("denied"))
    with pytest.raises(PermissionError):
        StoreRetry("s3://b/run", 60, clock=clock, sleep=clock.sleep, say=said.append).call(operation)
    assert calls["n"] == 1
    operation, calls = flaky(1, ConnectionResetError(104, "reset"))
    with pytest.raises(ConnectionResetError):  # 0: no retry at all
        StoreRetry("s3://b/run", 0, clock=clock, sleep=clock.sleep, say=said.append).call(operation)
    assert calls["n"] == 1


def test_nested_operations_retry_only_at_the_outermost():
    clock = FakeClock()
    retry = StoreRetry("s3://b/run", 60, clock=clock, sleep=clock.sleep, say=lambda _: None)
    inner, inner_calls = flaky(1, ConnectionResetError(104, "reset"))
    outer_calls = {"n": 0}

    def outer() -> str:
        outer_calls["n"] += 1
        return retry.call(inner)  # an upload reading its object back

    assert retry.call(outer) == "stored"
    assert (outer_calls["n"], inner_calls["n"]) == (2, 2)  # the whole upload again, not the read alone


def test_dcp_shard_writes_ride_out_an_outage_and_land_whole():
    """A sharded model's files are DCP's to write, through fsspec: its writer retries them like the
    checkpoint's own files. A store whose first three file writes fail with a reset connection (an
    fsspec memory store here; the same retry as S3's) ends with every shard written once, whole."""
    import torch
    import torch.distributed.checkpoint as dcp
    from fsspec import register_implementation
    from fsspec.implementations.memory import MemoryFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from disttrain.checkpoint_url import RemotePath
    from disttrain.runtime.strategies.dcp import _writer

    class FlakyStore(MemoryFileSystem):
        protocol = "flakystore"
        failures = 3

        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode and FlakyStore.failures > 0:
                FlakyStore.failures -= 1
                raise ConnectionResetError(104, "Connection reset by peer")
            return super()._open(path, mode=mode, **kwargs)

    register_implementation("flakystore", FlakyStore, clobber=True)
    clock, said = FakeClock(), []
    retry = StoreRetry("flakystore://ckpt", 60, clock=clock, sleep=clock.sleep, say=said.append)
    store = FlakyStore()
    folder = RemotePath(store, "/dcp-outage/step_1/sharded", retry)
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}}
    with warnings.catch_warnings():  # DCP's own: no process group, a world of one
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=_writer(folder))
    assert FlakyStore.failures == 0 and said[0].startswith(
        "disttrain: checkpoint store flakystore://ckpt unreachable (ConnectionResetError")
    assert said[1].startswith("disttrain: checkpoint store flakystore://ckpt back after")
    loaded = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(5)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=FsspecReader(str(folder)))
    assert all(torch.equal(loaded["model"][k], state["model"][k]) for k in state["model"])


# -- for real: a store that goes away in the middle of an upload ---------------------------------

class Relay:
    """A TCP relay on loopback to ``target``: ``stop()`` closes its port and every connection (the
    clients see connection refused and reset, as when a server dies), ``start()`` opens the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._listener is not listener:
                client.close()
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


SAVER = """
import pathlib, sys, time
import torch
import disttrain

ctx = disttrain.init()
url, flags = sys.argv[1], pathlib.Path(sys.argv[2])
net = torch.nn.Linear(64, 64)
model, opt = disttrain.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
for step in range(1, 26):
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 5 == 0:
        if step == 10 and ctx.is_main:  # the test takes the store away now, before this upload
            (flags / "saving").write_text("10")
            while not (flags / "down").exists():
                time.sleep(0.05)
        where = disttrain.checkpoint.save(url, step=step, keep_last=None, asynchronous=True, model=model)
        if ctx.is_main:
            print(f"saved {where}", flush=True)
    if ctx.is_main:
        (flags / "step").write_text(str(step))
    time.sleep(0.1)
disttrain.checkpoint.wait()
disttrain.print0("done")
"""


def until(proc: subprocess.Popen, ready, timeout: float, missing: str) -> None:
    """Wait for ``ready()`` while the job runs; ``missing`` says what did not come in time."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the job ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, missing
        time.sleep(0.05)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    until(proc, path.exists, timeout, f"{path.name} never came")


def told(home: Path, words: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until a rank's log in the run's folder says ``words``."""
    until(proc, lambda: any(words in log.read_text(errors="replace")
                            for log in home.glob("runs/*/attempt_*/rank*.stderr")),
          timeout, f"no rank said {words!r} within {timeout:g} s")


def said(err: str, words: str) -> int:
    """How many of the job's own lines say ``words`` (a failure report's quoted log tail left out)."""
    return sum(words in line for line in err.splitlines() if not line.startswith(" "))


def start_saver(s3, s3_endpoint: str, tmp_path: Path, *flags_before: str):
    """Two ranks of SAVER under ``disttrain run``, saving to the bucket through a relay the test can
    cut: (the filesystem, the bucket, the relay, the job, its flags folder, the checkpoint URL)."""
    fs, bucket = s3
    host, port = s3_endpoint.rsplit("//", 1)[1].split(":")
    relay = Relay((host, int(port)))
    relay.start()
    flags = tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "saver.py").write_text(SAVER)
    url = f"s3://{bucket}/run"
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), AWS_ENDPOINT_URL=f"http://127.0.0.1:{relay.port}")
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "run", "-n", "2", "--checkpoint-dir", url,
                             *flags_before, str(tmp_path / "saver.py"), url, str(flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return fs, bucket, relay, proc, flags, url


@pytest.mark.timeout(360)
# 60 s is the goal, measured (docs/measured.md) and run under `pytest -m field`; the suite runs the
# same path with 10 s and checks the default bound against 60 s on a fake clock (above).
@pytest.mark.parametrize("outage_s", [10, pytest.param(60, marks=pytest.mark.field)])
def test_an_outage_at_an_upload_is_ridden_out_and_every_reported_checkpoint_is_whole(s3, s3_endpoint, tmp_path,
                                                                                     outage_s):
    fs, bucket, relay, proc, flags, url = start_saver(s3, s3_endpoint, tmp_path)
    try:
        wait_for(flags / "saving", proc, 150)
        relay.stop()
        (flags / "down").write_text("")
        stopped = time.monotonic()
        # Down for outage_s at least, and until disttrain's retry took over: the store client's own
        # retries (botocore's random backoff) may ride out a short outage without a word.
        told(tmp_path / "home", "unreachable", proc, 90)
        time.sleep(max(0.0, outage_s - (time.monotonic() - stopped)))
        steps_while_down = int((flags / "step").read_text())
        relay.start()
        out, err = proc.communicate(timeout=150)
    finally:
        relay.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert steps_while_down > 10, "training stopped while the upload waited"
    assert said(err, "unreachable") == said(err, "back after") == 1, err[-4000:]
    reported = [line.split("saved ", 1)[1] for line in out.splitlines() if "saved " in line]
    assert [r.rsplit("_", 1)[1] for r in reported] == ["00000005", "00000010", "00000015", "00000020", "00000025"]
    fs.invalidate_cache()
    for where in reported:
        assert fs.exists(f"{where.split('://', 1)[1]}/{MARKER}"), f"{where} reported but not complete"
    import disttrain.runtime.checkpoint as checkpoint

    assert checkpoint.latest(url) == reported[-1]


def test_the_retry_bound_reaches_the_workers_and_a_negative_one_is_refused(tmp_path):
    from conftest import disttrain

    script = Path(__file__).parent / "scripts" / "sleeper.py"
    env = cli_env(DISTTRAIN_HOME=str(tmp_path))
    plan = disttrain("run", "-n", "1", "--dry-run", "--checkpoint-dir", "s3://bucket/run", "--checkpoint-retry-s",
                     "120", str(script), env=env)
    assert plan.returncode == 0, plan.stderr
    assert '"DISTTRAIN_CHECKPOINT_RETRY_S": "120"' in plan.stdout
    refused = disttrain("run", "-n", "1", "--dry-run", "--checkpoint-retry-s", "-1", str(script), env=env)
    assert refused.returncode == 2
    assert refused.stderr.strip() == "disttrain: error: --checkpoint-retry-s must be in 0..86400 seconds, got -1.0"


@pytest.mark.timeout(300)
def test_an_outage_past_the_bound_fails_the_job_and_leaves_nothing_to_resume_from(s3, s3_endpoint, tmp_path,
                                                                                  monkeypatch):
    """The store never comes back. The job's S3 client makes one try per request (AWS_MAX_ATTEMPTS=1):
    botocore's own retries, up to 5 tries with a random backoff each time disttrain tries, would only
    add about 20 s of waiting before the same end; here the 2 s bound is disttrain's alone."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    fs, bucket, relay, proc, flags, url = start_saver(s3, s3_endpoint, tmp_path, "--checkpoint-retry-s", "2")
    try:
        wait_for(flags / "saving", proc, 150)
        relay.stop()  # and never back
        (flags / "down").write_text("")
        out, err = proc.communicate(timeout=200)
    finally:
        relay.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-4000:]
    assert said(err, "unreachable") == 1 and "back after" not in err and "Exception in thread" not in err, err[-4000:]
    assert "the asynchronous checkpoint was not written: cannot write a checkpoint to " + url in err, err[-4000:]
    fs.invalidate_cache()
    assert fs.exists(f"{bucket}/run/step_00000005/{MARKER}")
    assert not fs.exists(f"{bucket}/run/step_00000010/{MARKER}")  # nothing resume could take
    import disttrain.runtime.checkpoint as checkpoint

    assert checkpoint.latest(url).endswith("step_00000005")
