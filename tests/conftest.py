"""Shared fixtures: run the real ``disttrain`` CLI in a subprocess and check for leaks."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"

# A suite started as `make test &` from a shell without job control inherits SIGINT ignored (bash does
# that to background commands), and so would every job it starts: the Ctrl-C tests need it as a
# terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The modules that take minutes, in the order the lanes take them: `make test` runs xdist with
# --no-loadscope-reorder, so a lane's next module is the next of the collection, taken as it nears the
# end of its last. Long first, so that none ends alone at the tail; the ones that mostly wait (hosts lost
# and back, regroups, hangs, Slurm) spread among the ones that compute, since while two lanes only wait a
# core idles. Wall times of a 3-lane run: docs/testing.md. The other modules follow, those with the
# most tests first (xdist's own order).
LONG_MODULES = ("test_elastic_ssh.py", "test_comm.py", "test_sharded.py", "test_checkpoint_remote.py",
                "test_multinode.py", "test_tracking_side_effect.py", "test_resume_ranks.py", "test_regroup.py",
                "test_sagemaker.py", "test_sagemaker_notebooks.py", "test_tracking.py", "test_hangs.py",
                "test_jobs.py", "test_torchrun_run.py", "test_periodic.py", "test_slurm.py", "test_elastic_slurm.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    counts = collections.Counter(item.path.name for item in items)

    def rank(item: pytest.Item) -> tuple[int, int, str]:
        name = item.path.name
        if name in LONG_MODULES:
            return LONG_MODULES.index(name), 0, ""
        return len(LONG_MODULES), -counts[name], str(item.path)

    items.sort(key=rank)  # stable: a module's own tests keep their order


@pytest.fixture(autouse=True, scope="session")
def _session_home(tmp_path_factory: pytest.TempPathFactory):
    """Run folders of every test land in a temporary DISTTRAIN_HOME, never in ~/.disttrain."""
    saved = os.environ.get("DISTTRAIN_HOME")
    os.environ["DISTTRAIN_HOME"] = str(tmp_path_factory.mktemp("disttrain-home"))
    yield
    if saved is None:
        os.environ.pop("DISTTRAIN_HOME", None)
    else:
        os.environ["DISTTRAIN_HOME"] = saved


# Started by in-process tests, they live as long as the process that started them: ended between
# modules (a later module's "nothing left behind" counts this process's children), never blamed.
HELPERS = ("multiprocessing.resource_tracker", "wandb-core")


@pytest.fixture(autouse=True, scope="module")
def _no_process_outlives_its_module():
    """Whatever a module started is gone when it ends: a process left behind would be blamed on the
    next module that checks for leftovers (under `make test`'s lanes, on whichever module comes next)."""
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()  # its service process, ended as wandb ends it
    left = []
    _, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=3)  # those ending now
    for child in alive:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                line = f"{child.pid} {' '.join(child.cmdline())[:200]}"
                child.kill()
                if not any(helper in line for helper in HELPERS):
                    left.append(line)
        except psutil.Error:
            pass
    assert not left, f"processes left behind by this module: {left}"


JOB_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def ctx(monkeypatch: pytest.MonkeyPatch):
    """A fresh world-of-one runtime context, whatever the environment pytest runs in."""
    import disttrain as runtime  # `disttrain` in this module is the CLI helper below
    from disttrain.runtime import context as context_module

    for name in JOB_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in os.environ if k.startswith("DISTTRAIN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(context_module, "_current", None)
    yield runtime.init()
    runtime.shutdown()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated DISTTRAIN_HOME, so run folders land in the test's tmp dir."""
    path = tmp_path / "home"
    monkeypatch.setenv("DISTTRAIN_HOME", str(path))
    return path


@pytest.fixture
def job_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A job test's own world: DISTTRAIN_HOME and the job store (the tuning store beside it) in
    tmp_path, one thread per process (parallel jobs on a small machine), no bucket map from the
    environment, and tmp_path as the working directory (SDK paths are relative to it)."""
    monkeypatch.setenv("DISTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DISTTRAIN_STORE", str(tmp_path / "jobs.db"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("DISTTRAIN_BUCKETS", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# A tuning job's script, first part: its loss a known function of its hyperparameters (hp_loss), which
# the tuner tests check as the objective; each test prints it its own way after this.
HP_LOSS_SCRIPT = """\
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float)
    p.add_argument("--layers", type=int)
    p.add_argument("--opt")
    p.add_argument("--epochs", type=int)
    a = p.parse_args()
    loss = (a.lr - 0.3) ** 2 + 0.01 * a.layers + (0.1 if a.opt == "sgd" else 0.0) + 0.001 * a.epochs
"""


def hp_loss(lr: float, layers: int, opt: str, epochs: int = 2) -> float:
    """HP_LOSS_SCRIPT's loss, to 6 places as the scripts print it."""
    return round((lr - 0.3) ** 2 + 0.01 * layers + (0.1 if opt == "sgd" else 0.0) + 0.001 * epochs, 6)


def write(path: Path, text: str) -> Path:
    """``text`` (dedented) at ``path``, its folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _needs_namespace():
    from disttrain.agent.optml import namespace_tool

    tool, why = namespace_tool()
    return pytest.mark.skipif(tool is None, reason=f"no mount namespace here: {why}")


needs_namespace = _needs_namespace()  # a test that needs a private /opt/ml (a mount namespace)


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def disttrain(*args: str, timeout: float = 90, cwd: Path | None = None, env: dict | None = None):
    """Run ``python -m disttrain ARGS`` to completion and return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "disttrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env or cli_env(),
    )


def read_ranks(out: Path, prefix: str = "rank") -> dict[int, dict]:
    """``{rank: report}`` from the ``<prefix><N>.json`` files test scripts write into ``out``."""
    return {int(p.stem[len(prefix):]): json.loads(p.read_text()) for p in out.glob(f"{prefix}*.json")}


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(procs: list[psutil.Process], timeout: float = 10) -> None:
    """Every process in ``procs`` has exited (zombies reaped or not, none still running)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:  # leave nothing behind even when the assertion fails
        proc.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A real S3-protocol server on loopback, as a process of its own (moto's ``moto_server``), for
    jobs' s3:// channels, outputs and checkpoints; always stopped, whatever the tests did."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from disttrain.net import free_port

    server = Path(sys.executable).with_name("moto_server")
    if not server.exists():
        pytest.skip(f"no moto_server next to {sys.executable}: pip install 'moto[server]'")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto_server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_listening(proc, port, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def elastic_bench():
    """bench/elastic.py as a module (the elastic rig tests drive its scenarios), loaded once."""
    import importlib.util

    name = "disttrain_bench_elastic"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / "elastic.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s: a test's server process never outlives it."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _wait_listening(proc: subprocess.Popen, port: int, log: Path, timeout: float = 60) -> None:
    """Until ``proc`` answers on ``port``; fails naming the port and the server's log otherwise."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"moto_server on 127.0.0.1:{port} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"moto_server did not listen on 127.0.0.1:{port} within {timeout:.0f} s: {log.read_text()[-2000:]}")


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """(filesystem, a fresh bucket) on the moto server; the AWS_* variables point every client there."""
    import s3fs

    from disttrain.net import free_port

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    bucket = f"b{free_port()}"
    fs.mkdir(bucket)
    return fs, bucket


