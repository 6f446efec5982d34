"""``disttrain.sagemaker``: SDK notebooks and SageMaker scripts, unchanged, as real jobs.

Every job here is real: the estimator starts the runner in a child process, the instances'
agents start the script (gloo over loopback), each instance in its own mount namespace
showing its folder at /opt/ml.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import warnings
from pathlib import Path

import pytest

from conftest import cli_env, disttrain, needs_namespace, write
from disttrain.errors import UsageError
from disttrain.store import JobStore

pytestmark = pytest.mark.timeout(180)

HOSTILE = "a b; $(touch /tmp/pwned-sm) 'q'"


def opt_listing() -> tuple[bool, list[str]]:
    return os.path.exists("/opt/ml"), sorted(os.listdir("/opt")) if os.path.isdir("/opt") else []


LITERAL_SCRIPT = """\
    import json, os, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("args " + json.dumps(sys.argv[1:]), flush=True)
    for step in range(3):
        print(f"step {step} loss={1.0 / (step + 1 + dist.get_rank()):.4f}", flush=True)
    data = open("/opt/ml/input/data/training/a.txt").read().strip()      # literal SageMaker paths
    env = json.loads(os.environ["SM_TRAINING_ENV"])
    with open("/opt/ml/model/who.txt", "w") as fh:
        fh.write(f"{os.environ['SM_CURRENT_HOST']} {data} world={dist.get_world_size()}")
    with open("/opt/ml/output/data/env.json", "w") as fh:
        json.dump({"argv": sys.argv[1:], "training_env": env, "user_args": json.loads(os.environ["SM_USER_ARGS"]),
                   "hp_flag": os.environ["SM_HP_FLAG"], "hp_note": os.environ["SM_HP_NOTE"]}, fh)
    dist.destroy_process_group()
"""


@needs_namespace
def test_estimator_two_instances_torch_distributed_literal_opt_ml(job_home):
    import fsspec

    import disttrain.sagemaker as sagemaker
    from disttrain.sagemaker.pytorch import PyTorch

    write(job_home / "src" / "train.py", LITERAL_SCRIPT)
    write(job_home / "data" / "a.txt", "hello\n")
    before = opt_listing()
    hps = {"note": HOSTILE, "flag": True, "off": False, "x": 3, "lr": 0.1, "sizes": [1, 2]}
    est = PyTorch(entry_point="train.py", source_dir="src", role=sagemaker.get_execution_role(),
                  instance_count=2, instance_type="ml.c5.xlarge", framework_version="2.1", py_version="py3",
                  hyperparameters=hps, distribution={"torch_distributed": {"enabled": True}},
                  output_path=f"file://{job_home}/out",
                  metric_definitions=[{"Name": "loss", "Regex": r"loss=([0-9.]+)"}])
    est.fit({"training": str(job_home / "data")})

    assert opt_listing() == before  # the machine's /opt (and absence of /opt/ml) untouched
    assert not Path("/tmp/pwned-sm").exists()
    job = est.latest_training_job
    described = job.describe()
    assert described["TrainingJobStatus"] == "Completed"
    # model_data opened: algo-1's /opt/ml/model, packed
    with fsspec.open(est.model_data, "rb") as raw, tarfile.open(fileobj=raw) as tar:
        assert tar.extractfile("who.txt").read().decode() == "algo-1 hello world=2"
    job_dir = Path(described["JobDir"])
    assert (job_dir / "algo-2" / "model" / "who.txt").read_text() == "algo-2 hello world=2"  # no collision
    for host in ("algo-1", "algo-2"):
        assert (job_dir / host / "output" / "success").exists()
        seen = json.loads((job_dir / host / "output" / "data" / "env.json").read_text())
        # as the toolkit passes them: sorted, -k for one letter, str() of the decoded JSON value
        assert seen["argv"] == seen["user_args"] == [
            "--flag", "True", "--lr", "0.1", "--note", HOSTILE, "--off", "False", "--sizes", "[1, 2]", "-x", "3"]
        assert seen["hp_flag"] == "true" and seen["hp_note"] == HOSTILE
        env = seen["training_env"]
        assert env["current_host"] == host and env["hosts"] == ["algo-1", "algo-2"]
        assert env["is_master"] == (host == "algo-1") and env["master_hostname"] == "algo-1"
        assert env["job_name"] == job.name and env["current_instance_type"] == "ml.c5.xlarge"
        assert env["hyperparameters"] == hps and env["user_entry_point"] == "train.py"
        assert env["additional_framework_parameters"] == {"sagemaker_torch_distributed_enabled": True}
        assert env["channel_input_dirs"] == {"training": str(job_dir / host / "input" / "data" / "training")}
        assert env["output_intermediate_dir"].endswith("output/intermediate") and env["module_name"] == "train"
    # metrics: every rank's matches stored, final values in `jobs show`, plotted
    series = {m["MetricName"]: m["Value"] for m in described["FinalMetricDataList"]}
    assert list(series) == ["loss"] and series["loss"] in (0.25, 0.3333)
    with JobStore() as store:
        points = store.metric_series(store.get(job.name).id)["loss"]
    assert sorted(v for _, v in points) == [0.25, 0.3333, 0.3333, 0.5, 0.5, 1.0]
    attached = PyTorch.attach(job.name)  # another notebook, later
    assert attached.model_data == est.model_data and attached.hyperparameters() == hps
    assert [v for _, v in attached.training_job_analytics.series()["loss"]] == [v for _, v in points]
    env = cli_env()
    shown = disttrain("jobs", "show", job.name, env=env)
    assert "metric loss:" in shown.stdout
    png = job_home / "metrics.png"
    plotted = disttrain("jobs", "metrics", job.name, "--plot", str(png), "--json", env=env)
    assert plotted.returncode == 0, plotted.stderr
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(plotted.stdout.splitlines()[-1])["loss"]) == 6
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return
    assert list((job_dir / "tensorboard").glob("events.out.tfevents.*"))  # tensorboard --logdir ~/.disttrain/jobs


def test_bad_input_is_one_line_and_nothing_is_recorded(job_home):
    from disttrain.sagemaker import RenamedArgumentWarning
    from disttrain.sagemaker.pytorch import PyTorch

    write(job_home / "src" / "train.py", "print('hi')\n")
    with pytest.raises(TypeError, match="unexpected keyword argument 'instance_cuont'"):
        PyTorch(entry_point="train.py", source_dir="src", instance_cuont=2)
    with pytest.warns(RenamedArgumentWarning, match="train_instance_count has been renamed.*instance_count"):
        est = PyTorch(entry_point="train.py", source_dir="src", train_instance_count=2)
    assert est.instance_count == 2
    out = f"file://{job_home}/out"
    cases = [
        (dict(), {"training": str(job_home / "missing")}, "inputs.training: .*missing does not exist"),
        (dict(distribution={"torch_distributd": {"enabled": True}}), None, "unknown key 'torch_distributd'"),
        (dict(distribution={"torch_distributed": {"enabled": True}, "mpi": {"enabled": True}}), None,
         "torch_distributed and mpi cannot be combined"),
        (dict(distribution={"multi_worker_mirrored_strategy": {"enabled": True}}), None,
         "is for TensorFlow jobs"),
        (dict(entry_point="nope.py"), None, "entry_point: nope.py not found in source_dir"),
    ]
    for extra, inputs, message in cases:
        args = {"entry_point": "train.py", "source_dir": "src", "output_path": out, **extra}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(UsageError, match=message) as err:
                PyTorch(**args).fit(inputs)
        assert "\n" not in str(err.value)
    with JobStore() as store:
        assert store.list() == []
    assert not (job_home / "out").exists()


def test_max_run_exceeded_is_failed(job_home, capsys):
    from disttrain.sagemaker import Estimator, UnexpectedStatusException

    write(job_home / "src" / "sleepy.py", "import time\nprint('start', flush=True)\ntime.sleep(300)\n")
    est = Estimator(entry_point="sleepy.py", source_dir="src", max_run=3, disttrain={"private_opt_ml": "off"})
    est.fit(wait=False, logs=False)  # returns at once; the job runs on
    assert est.latest_training_job.describe()["TrainingJobStatus"] == "InProgress"
    with pytest.raises(UnexpectedStatusException, match="MaxRuntimeExceeded"):
        est.latest_training_job.wait()
    described = est.latest_training_job.describe()
    assert described["TrainingJobStatus"] == "Failed"
    assert described["FailureReason"].startswith("MaxRuntimeExceeded")
    assert not (Path(described["JobDir"]) / "algo-1" / "output" / "success").exists()
    capsys.readouterr()
    est.logs()  # the job's output, as the terminal would have shown it
    shown = capsys.readouterr().out
    assert f"job {described['TrainingJobName']}" in shown and "MaxRuntimeExceeded" in shown



def test_max_run_that_fires_before_the_launch_starts_is_failed(job_home, monkeypatch):
    """The max_run timer's SIGTERM reaching the runner outside the launch (here: a slow probe of
    the instances, before the launch stops on SIGTERM itself) was recorded Stopped, "stopped by
    SIGTERM" (issue 27); whichever of max_run and a stop comes first decides the record, once."""
    import time as clock

    from disttrain.jobs.runner import run_job
    from disttrain.jobs.spec import spec_from_mapping
    from disttrain.launch.local import InstancesLauncher

    write(job_home / "src" / "quick.py", "print('ran', flush=True)\n")
    probed = []

    def slow_facts(self, spec, ctx):
        probed.append(True)
        clock.sleep(30)  # max_run (1 s) ends while the instances are being probed
        raise AssertionError("max_run did not stop the job")

    monkeypatch.setattr(InstancesLauncher, "facts", slow_facts)
    spec = spec_from_mapping({"name": "slowstart", "entry_point": "quick.py", "source_dir": "src", "max_run": 1,
                              "private_opt_ml": "off"}, base_dir=job_home)
    record = run_job(spec)
    assert probed and str(record.state) == "Failed", record.failure
    assert record.failure.startswith("MaxRuntimeExceeded") and record.exit_code == 143



def test_max_run_and_the_end_of_the_launch_decide_the_outcome_once(tmp_path):
    """Whichever comes first wins: a launch that ended (or a stop that reached the runner) before
    max_run fired stays as it ended; a max_run that fired first is the outcome whatever follows."""
    import signal as signals

    from disttrain.jobs.container import Watch
    from disttrain.jobs.layout import JobLayout
    from disttrain.jobs.spec import spec_from_mapping

    spec = spec_from_mapping({"name": "w", "entry_point": "x.py", "max_run": 60}, base_dir=tmp_path)
    layout = JobLayout(tmp_path / "job", ("algo-1",))
    received: list[int] = []
    previous = signals.signal(signals.SIGTERM, lambda signum, _frame: received.append(signum))
    try:
        ended_first = Watch(spec, layout, tmp_path / "jobs.db", 1, say=lambda _line: None)
        assert ended_first.settle() is None
        ended_first._expire()  # the timer firing a moment too late
        assert (ended_first.timed_out, received) == (False, [])
        fired_first = Watch(spec, layout, tmp_path / "jobs.db", 1, say=lambda _line: None)
        fired_first._expire()
        assert fired_first.settle().startswith("MaxRuntimeExceeded") and received == [signals.SIGTERM]
        assert fired_first.settle().startswith("MaxRuntimeExceeded")  # asked again: the same answer
    finally:
        signals.signal(signals.SIGTERM, previous)


CHECKPOINT_SCRIPT = """\
    import os
    path = "/opt/ml/checkpoints/step.txt"
    step = int(open(path).read()) if os.path.exists(path) else 0
    print(f"resumed at {step}", flush=True)
    with open(path, "w") as fh:
        fh.write(str(step + 1))
"""


@needs_namespace
@pytest.mark.parametrize("where", ["file", "s3"])
def test_checkpoints_restored_and_synced(job_home, where, request):
    from disttrain.sagemaker import Estimator

    write(job_home / "src" / "ckpt.py", CHECKPOINT_SCRIPT)
    if where == "file":
        uri = f"file://{job_home}/ckpts"
        write(job_home / "ckpts" / "step.txt", "41")
        read = lambda: (job_home / "ckpts" / "step.txt").read_text()  # noqa: E731
    else:
        fs, bucket = request.getfixturevalue("s3")
        uri = f"s3://{bucket}/ckpts"
        fs.pipe(f"{bucket}/ckpts/step.txt", b"41")
        read = lambda: fs.cat(f"{bucket}/ckpts/step.txt").decode()  # noqa: E731
    est = Estimator(entry_point="ckpt.py", source_dir="src", checkpoint_s3_uri=uri,
                    output_path=f"file://{job_home}/out")
    est.fit()
    assert read() == "42"
    if where == "file":  # a second job resumes from what the first one synced
        est.fit()
        assert read() == "43"


def tiny_wheel(folder: Path) -> Path:
    """A real wheel of one module, made by hand (no build backend, no network)."""
    import base64
    import hashlib
    import zipfile

    files = {
        "tinydep14/__init__.py": b"VALUE = 'from the job venv'\n",
        "tinydep14-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinydep14\nVersion: 0.1\n",
        "tinydep14-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for name, data in files.items()]
    record.append("tinydep14-0.1.dist-info/RECORD,,")
    path = folder / "tinydep14-0.1-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr("tinydep14-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_requirements_txt_into_the_jobs_own_environment(job_home):
    from disttrain.sagemaker import Estimator, UnexpectedStatusException

    wheel = tiny_wheel(job_home / "wheels")
    write(job_home / "src" / "train.py", """\
        import tinydep14, torch, mylib
        print("dep:", tinydep14.VALUE, "torch:", torch.__version__, mylib.NAME, flush=True)
    """)
    write(job_home / "lib" / "mylib" / "__init__.py", "NAME = 'dependency copied beside the code'\n")
    (job_home / "src" / "requirements.txt").write_text(f"tinydep14 @ file://{wheel}\n")
    est = Estimator(entry_point="train.py", source_dir="src", dependencies=[str(job_home / "lib" / "mylib")],
                    disttrain={"private_opt_ml": "off"})
    est.fit()
    job_dir = Path(est.latest_training_job.describe()["JobDir"])
    log = (job_dir / "logs" / "job.log").read_text()
    import torch

    # torch untouched, seen from the venv; `dependencies` importable beside the entry point
    assert f"dep: from the job venv torch: {torch.__version__} dependency copied beside the code" in log
    with pytest.raises(ImportError):
        __import__("tinydep14")  # never installed into the user's own environment
    # a requirement that cannot install: the job fails naming requirements.txt, before Running
    (job_home / "src" / "requirements.txt").write_text(f"torch==0.0.1 @ file://{wheel}\n")
    with pytest.raises(UnexpectedStatusException, match="requirements.txt"):
        est.fit()
    described = est.latest_training_job.describe()
    assert described["TrainingJobStatus"] == "Failed" and described["TrainingStartTime"] is None


PS_SCRIPT = """\
    import json, os, socket, sys, time
    cfg = json.loads(os.environ["TF_CONFIG"])
    task = cfg["task"]
    if task["type"] == "ps":
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)  # --ps-start S: slow to start
    out = os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"{task['type']}.json")
    with open(out, "w") as fh:
        json.dump(cfg, fh)
    if task["type"] == "ps":  # a ps task serves on its address until the job ends, as TF's Server
        server = socket.create_server(("", int(cfg["cluster"]["ps"][task["index"]].rsplit(":", 1)[1])))
        time.sleep(300)
"""


def test_parameter_server_tf_config_per_instance(job_home):
    from disttrain.sagemaker.tensorflow import TensorFlow

    write(job_home / "src" / "ps.py", PS_SCRIPT)
    est = TensorFlow(entry_point="ps.py", source_dir="src", instance_count=2, model_dir=False,
                     distribution={"parameter_server": {"enabled": True}}, disttrain={"private_opt_ml": "off"})
    est.fit()
    job_dir = Path(est.latest_training_job.describe()["JobDir"])
    master = json.loads((job_dir / "algo-1" / "output" / "data" / "master.json").read_text())
    worker = json.loads((job_dir / "algo-2" / "output" / "data" / "worker.json").read_text())
    ps = [json.loads((job_dir / h / "output" / "data" / "ps.json").read_text()) for h in ("algo-1", "algo-2")]
    assert master["cluster"] == worker["cluster"] == ps[0]["cluster"]
    assert sorted(master["cluster"]) == ["master", "ps", "worker"] and len(master["cluster"]["ps"]) == 2
    assert master["task"] == {"type": "master", "index": 0} and worker["task"] == {"type": "worker", "index": 0}
    assert [p["task"] for p in ps] == [{"type": "ps", "index": 0}, {"type": "ps", "index": 1}]



def test_parameter_server_ps_task_slow_to_start_is_kept_until_it_serves(job_home):
    """A ps task still starting (imports on a loaded machine) when the master's task ended was
    stopped before it wrote anything: the job Completed without its output (issue 27). The ps task
    is now stopped once it serves on its address (or has ended)."""
    from disttrain.sagemaker.tensorflow import TensorFlow

    write(job_home / "src" / "ps.py", PS_SCRIPT)
    est = TensorFlow(entry_point="ps.py", source_dir="src", instance_count=1, model_dir=False,
                     hyperparameters={"ps-start": 3}, distribution={"parameter_server": {"enabled": True}},
                     disttrain={"private_opt_ml": "off"})
    est.fit()
    job_dir = Path(est.latest_training_job.describe()["JobDir"])
    assert (job_dir / "algo-1" / "output" / "data" / "master.json").exists()
    ps = json.loads((job_dir / "algo-1" / "output" / "data" / "ps.json").read_text())
    assert ps["task"] == {"type": "ps", "index": 0}


def test_contract_units():
    from disttrain.agent.optml import prefix
    from disttrain.jobs.distribution import Distribution, parse_distribution
    from disttrain.jobs.layout import InstancePaths
    from disttrain.jobs.sagemaker import Instance, cmd_args, sm_env

    assert cmd_args({"b": {"y": 2, "x": 1}, "a-b": "s p", "sagemaker_program": "t.py"}) == \
        ["--a-b", "s p", "-b", "x=1,y=2"]
    env = sm_env(Instance(job_name="j", name="algo-1", names=("algo-1",), channels=("train",),
                          hyperparameters={"n": 2}), InstancePaths(Path("/jobs/j/algo-1")))
    expected = {"SM_HOSTS", "SM_NETWORK_INTERFACE_NAME", "SM_HPS", "SM_USER_ENTRY_POINT", "SM_FRAMEWORK_PARAMS",
                "SM_RESOURCE_CONFIG", "SM_INPUT_DATA_CONFIG", "SM_OUTPUT_DATA_DIR", "SM_CHANNELS",
                "SM_CURRENT_HOST", "SM_CURRENT_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_GROUP",
                "SM_CURRENT_INSTANCE_GROUP_HOSTS", "SM_INSTANCE_GROUPS", "SM_INSTANCE_GROUPS_DICT",
                "SM_DISTRIBUTION_INSTANCE_GROUPS", "SM_IS_HETERO", "SM_MODULE_NAME", "SM_LOG_LEVEL",
                "SM_FRAMEWORK_MODULE", "SM_INPUT_DIR", "SM_INPUT_CONFIG_DIR", "SM_OUTPUT_DIR", "SM_NUM_CPUS",
                "SM_NUM_GPUS", "SM_NUM_NEURONS", "SM_MODEL_DIR", "SM_MODULE_DIR", "SM_TRAINING_ENV",
                "SM_USER_ARGS", "SM_OUTPUT_INTERMEDIATE_DIR", "SM_CHANNEL_TRAIN", "SM_HP_N"}
    assert set(env) == expected
    assert env["SM_HPS"] == '{"n":2}' and env["SM_USER_ARGS"] == '["-n","2"]' and env["SM_IS_HETERO"] == "false"
    assert parse_distribution({"mpi": {"enabled": True, "processes_per_host": 2}}, framework="pytorch") == \
        Distribution("mpi", processes_per_host=2)
    assert parse_distribution({"torch_distributed": {"enabled": False}}, framework="pytorch").kind == "none"
    argv = prefix("bwrap", "/jobs/j/algo-1")
    assert argv[:5] == ["bwrap", "--dev-bind", "/", "/", "--die-with-parent"]
    assert argv[-4:] == ["--bind", "/jobs/j/algo-1", "/opt/ml", "--"]
    assert sys.executable  # the unshare prefix execs this interpreter


MPI_SCRIPT = """\
    import os
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank() + 1)
    print(f"rank {comm.Get_rank()} of {comm.Get_size()} on {os.environ['SM_CURRENT_HOST']} sum={total} "
          f"FOO={os.environ.get('FOO')}", flush=True)
    if comm.Get_rank() == 0:
        with open(os.path.join(os.environ["SM_MODEL_DIR"], "sum.txt"), "w") as fh:
            fh.write(str(total))
"""


def test_mpi_two_processes(job_home):
    import shutil

    if not shutil.which("mpirun"):
        pytest.skip("Open MPI's mpirun is not installed (tests/rig_setup.sh installs it)")
    pytest.importorskip("mpi4py")
    from disttrain.sagemaker.pytorch import PyTorch

    write(job_home / "src" / "mpi_train.py", MPI_SCRIPT)
    est = PyTorch(entry_point="mpi_train.py", source_dir="src", instance_count=2, output_path=f"file://{job_home}/out",
                  distribution={"mpi": {"enabled": True, "processes_per_host": 1, "custom_mpi_options": "-x FOO=1"}})
    est.fit()
    job_dir = Path(est.latest_training_job.describe()["JobDir"])
    log = (job_dir / "logs" / "job.log").read_text()
    # custom_mpi_options reach every instance's ranks (mpirun applies -x to one application context)
    assert "[algo-1 rank0] rank 0 of 2 on algo-1 sum=3 FOO=1" in log
    assert "[algo-2 rank1] rank 1 of 2 on algo-2 sum=3 FOO=1" in log
    assert (job_dir / "algo-1" / "model" / "sum.txt").read_text() == "3"


@needs_namespace
@pytest.mark.timeout(400)
def test_seed_tensorflow_notebook(job_home):
    """The seed article's notebook cell (SDK v1 names) and its training script, as the README runs them."""
    pytest.importorskip("tensorflow")
    example = Path(__file__).resolve().parents[1] / "examples" / "sagemaker_tf"
    env = cli_env(DISTTRAIN_HOME=str(job_home / "home"), DISTTRAIN_STORE=str(job_home / "jobs.db"),
                  OUTPUT_URL=f"file://{job_home}/out", EPOCHS="2")
    import subprocess

    done = subprocess.run([sys.executable, str(example / "notebook.py")], capture_output=True, text=True,
                          env=env, timeout=360, cwd=job_home)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train_instance_count has been renamed" in done.stderr
    model = done.stdout.strip().splitlines()[-1].removeprefix("model: ").removeprefix("file://")
    with tarfile.open(model) as tar:
        assert {"classifier.keras", "vocab.txt"} <= set(tar.getnames())
    with JobStore(job_home / "jobs.db") as store:
        series = store.metric_series(store.list()[0].id)
    assert series["valid:accuracy"][-1][1] > 0.8


@pytest.fixture
def world_tmp():
    """A folder nobody can reach (pytest's own tmp_path is under a 0700 folder)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="disttrain-bwrap-", dir="/tmp"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_bwrap_prefix_gives_an_unprivileged_user_its_own_opt_ml(world_tmp):
    """The bubblewrap way, run as nobody: /opt/ml is the instance folder, the machine's /opt unchanged."""
    import shutil
    import subprocess

    from disttrain.agent.optml import prefix

    if os.geteuid() != 0 or not shutil.which("bwrap") or not shutil.which("setpriv"):
        pytest.skip("needs root (to become nobody), bubblewrap and setpriv")
    inst = world_tmp / "algo-1"
    inst.mkdir()
    os.chmod(inst, 0o777)
    before = opt_listing()
    argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
            *prefix("bwrap", str(inst)), "sh", "-c", "echo hi > /opt/ml/x && ls /opt"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode and "namespace" in done.stderr:
        pytest.skip(f"no unprivileged user namespaces here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert (inst / "x").read_text() == "hi\n"
    assert "ml" in done.stdout.split() and set(before[1]) <= set(done.stdout.split())
    assert opt_listing() == before


MWMS_SCRIPT = """\
    import json, os
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x = np.random.RandomState(0).rand(256, 4).astype("float32")
    y = (x.sum(1) > 2).astype("float32")
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"),
                                     tf.keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="adam", loss="binary_crossentropy")
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2, verbose=0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print(f"task {task['index']} of {strategy.num_replicas_in_sync} loss={history.history['loss'][-1]:.4f}", flush=True)
"""


@pytest.mark.timeout(300)
def test_multi_worker_mirrored_strategy_keras_fit(job_home):
    pytest.importorskip("tensorflow")
    from disttrain.tfconfig import have_tf_keras

    if not have_tf_keras():
        pytest.skip("tf-keras is not installed (the job would refuse to start, naming it)")
    from disttrain.sagemaker.tensorflow import TensorFlow

    write(job_home / "src" / "mwms.py", MWMS_SCRIPT)
    est = TensorFlow(entry_point="mwms.py", source_dir="src", instance_count=2, model_dir=False,
                     distribution={"multi_worker_mirrored_strategy": {"enabled": True}},
                     metric_definitions=[{"Name": "loss", "Regex": r"loss=([0-9.]+)"}],
                     disttrain={"private_opt_ml": "off"})
    est.fit()
    job_dir = Path(est.latest_training_job.describe()["JobDir"])
    log = (job_dir / "logs" / "job.log").read_text()
    assert "task 0 of 2 loss=" in log and "task 1 of 2 loss=" in log


def test_mpirun_output_and_metric_definitions_units():
    from disttrain.jobs.metrics import check_definitions
    from disttrain.jobs.patterns import PatternMatcher
    from disttrain.launch.mpi import Untag

    untag = Untag(["algo-1", "algo-2"], ranks_per_instance=2)
    # mpirun tags each write of a rank, not each line
    assert untag.feed("[1,0]<stdout>:loss=1[1,3]<stdout>:hi\n") == ["[algo-2 rank3] hi\n"]
    assert untag.feed("[1,0]<stdout>:\n") == ["[algo-1 rank0] loss=1\n"]
    assert untag.feed("mpirun's own line\n") == ["mpirun's own line\n"]
    assert untag.feed("[1,2]<stderr>:no newline yet") == []
    assert untag.flush() == ["[algo-2 rank2] no newline yet\n"]
    defs = check_definitions([{"Name": "loss", "Regex": r"loss=([0-9.e+-]+)"}, {"Name": "n", "Regex": r"(\d+)"}])
    with PatternMatcher([pattern.pattern for _, pattern in defs], print) as matcher:
        assert matcher.match(["step 3 loss=2.5e-03"]) == [[(0, 0.0025), (1, 3.0), (1, 2.0), (1, 5.0), (1, 3.0)]]
    with pytest.raises(UsageError, match=r"metric_definitions\[0\].Regex '\(' is not a regular expression"):
        check_definitions([{"Name": "x", "Regex": "("}])
    with pytest.raises(UsageError, match=r"metric_definitions\[0\] must be"):
        check_definitions([{"name": "x", "regex": "y"}])


ANALYTICS_SCRIPT = """\
    import time
    for epoch, (loss, acc) in enumerate([(0.9, 0.5), (0.5, 0.7), (0.2, 0.9)]):
        print(f"epoch {epoch} loss={loss} acc={acc}", flush=True)
        time.sleep(0.3)  # each epoch's points at their own time (a point is timed when its line is relayed)
"""


def test_training_job_analytics_dataframe_as_the_sdk(job_home):
    """The SDK's TrainingJobAnalytics frame: timestamp (seconds since the metric's first point),
    metric_name, value; metrics in the order of metric_definitions; without pandas, one line."""
    pytest.importorskip("pandas")
    import subprocess

    from disttrain.sagemaker import Estimator, TrainingJobAnalytics
    from disttrain.sagemaker.analytics import PANDAS_MISSING

    write(job_home / "src" / "epochs.py", ANALYTICS_SCRIPT)
    est = Estimator(entry_point="epochs.py", source_dir="src", disttrain={"private_opt_ml": "off"},
                    metric_definitions=[{"Name": "loss", "Regex": r"loss=([0-9.]+)"},
                                        {"Name": "acc", "Regex": r"acc=([0-9.]+)"}])
    est.fit(logs=False)
    analytics = est.training_job_analytics
    frame = analytics.dataframe()
    assert list(frame.columns) == ["timestamp", "metric_name", "value"]
    assert frame["metric_name"].tolist() == ["loss"] * 3 + ["acc"] * 3  # the definitions' order, not sorted
    assert frame["value"].tolist() == [0.9, 0.5, 0.2, 0.5, 0.7, 0.9]
    for name in ("loss", "acc"):
        times = frame[frame["metric_name"] == name]["timestamp"].tolist()
        assert times[0] == 0.0 and times == sorted(times)  # each metric from its own first point
    assert analytics.dataframe() is frame and analytics.dataframe(force_refresh=True) is not frame  # cached
    only = TrainingJobAnalytics(est.latest_training_job.name, metric_names=["acc"]).dataframe()
    assert only["metric_name"].tolist() == ["acc"] * 3
    analytics.export_csv(str(job_home / "metrics.csv"))
    assert (job_home / "metrics.csv").read_text().splitlines()[0] == ",timestamp,metric_name,value"

    hidden = ("import sys; sys.modules['pandas'] = None\n"  # as if pandas were not installed
              "from disttrain.errors import UsageError\n"
              "from disttrain.sagemaker import TrainingJobAnalytics\n"
              "analytics = TrainingJobAnalytics(sys.argv[1])\n"
              "print(len(analytics.series()['loss']))\n"
              "try:\n    analytics.dataframe()\nexcept UsageError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", hidden, est.latest_training_job.name], capture_output=True,
                          text=True, timeout=60, env=cli_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["3", PANDAS_MISSING] and "pip install pandas" in PANDAS_MISSING


LIVE_SCRIPT = """\
    import os, sys, time
    for step in range(3):
        print(f"step {step} loss={1.0 / (step + 1):.4f}", flush=True)
    go = sys.argv[sys.argv.index("--go") + 1]
    while not os.path.exists(go):  # the test lets it end once it has seen the curve
        time.sleep(0.1)
    print("last loss=0.1", flush=True)
"""


def tensorboard_scalars(logdir: Path) -> list[tuple[str, int, float]]:
    """What TensorBoard itself reads from the folder: (tag, step, value) of every scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return [(tag, s.step, round(s.value, 4)) for tag in events.Tags()["scalars"] for s in events.Scalars(tag)]


def test_tensorboard_event_file_grows_while_the_job_runs(job_home):
    pytest.importorskip("tensorboard")
    import time

    from disttrain.sagemaker import Estimator

    write(job_home / "src" / "live.py", LIVE_SCRIPT)
    go = job_home / "go"
    est = Estimator(entry_point="live.py", source_dir="src", hyperparameters={"go": str(go)},
                    disttrain={"private_opt_ml": "off"},
                    metric_definitions=[{"Name": "loss", "Regex": r"loss=([0-9.]+)"}])
    est.fit(wait=False, logs=False)
    job = est.latest_training_job
    try:
        logdir = Path(job.describe()["JobDir"]) / "tensorboard"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen = tensorboard_scalars(logdir) if logdir.is_dir() else []
            if len(seen) >= 3:
                break
            time.sleep(0.5)
        # the first points are there while the script still waits for the test
        assert seen == [("loss", 0, 1.0), ("loss", 1, 0.5), ("loss", 2, 0.3333)]
        assert job.describe()["TrainingJobStatus"] == "InProgress"
    finally:
        go.write_text("")
        job.wait()  # it ends (and leaves no process) whatever was asserted above
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1  # one file per job, nothing added at the end
    assert tensorboard_scalars(logdir) == [("loss", 0, 1.0), ("loss", 1, 0.5), ("loss", 2, 0.3333), ("loss", 3, 0.1)]


SM_ONLY_SCRIPT = """\
    import os
    with open(os.path.join(os.environ["SM_MODEL_DIR"], "who.txt"), "w") as fh:
        fh.write(os.environ["SM_CURRENT_HOST"])
"""


def test_without_a_mount_namespace_one_line_names_the_fix_and_sm_scripts_run(job_home):
    """A machine that cannot make a mount namespace (here: neither unshare nor bwrap on PATH)."""
    import subprocess

    import yaml

    write(job_home / "src" / "sm_only.py", SM_ONLY_SCRIPT)
    (job_home / "bin").mkdir()
    env = cli_env(PATH=str(job_home / "bin"))
    spec = {"name": "nons", "entry_point": "sm_only.py", "source_dir": str(job_home / "src"), "instance_count": 2,
            "output_path": str(job_home / "out")}
    (job_home / "auto.yaml").write_text(yaml.safe_dump(spec))
    (job_home / "required.yaml").write_text(yaml.safe_dump({**spec, "private_opt_ml": "required"}))
    done = disttrain("job", "run", str(job_home / "auto.yaml"), env=env, timeout=150)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "private /opt/ml" in line]
    assert len(said) == 1 and "apt-get install bubblewrap" in said[0] and "SM_* run" in said[0]
    with JobStore() as store:
        (record,) = store.list()
    for host in ("algo-1", "algo-2"):  # the script that reads SM_* ran on both instances
        assert (Path(record.job_dir) / host / "model" / "who.txt").read_text() == host
    refused = disttrain("job", "run", str(job_home / "required.yaml"), env=env, timeout=60)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "private_opt_ml: required, but this machine cannot make a private /opt/ml" in refused.stderr
    with JobStore() as store:
        assert len(store.list()) == 1  # nothing recorded for the refused job

    # The same check where an ssh or Slurm instance runs: its agent's, on its own machine.
    check = ("import sys\nfrom disttrain.agent.optml import instance_prefix\nfrom disttrain.errors import UsageError\n"
             "print(instance_prefix('/jobs/j/algo-2', required=False, host='node1', say=print))\n"
             "try:\n    instance_prefix('/jobs/j/algo-2', required=True, host='node1', say=print)\n"
             "except UsageError as err:\n    print(err)\n")
    agent = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, env=env)
    note, prefix, error = agent.stdout.splitlines()
    assert note.startswith("disttrain: no private /opt/ml on node1 (") and "apt-get install bubblewrap" in note
    assert prefix == "[]"
    assert error.startswith("private_opt_ml: required, but node1 cannot make a private /opt/ml") and "bubblewrap" in error
