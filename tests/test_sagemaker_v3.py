"""SDK v3's ModelTrainer and its container contract, ``sagemaker.Session`` and its default bucket,
and ``import sagemaker`` served in one process only.

Jobs here are real (2 instances where the SDK call asks for them); the contract's pieces are
also checked one by one, against what v3's own drivers produce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, needs_namespace, write
from disttrain.errors import UsageError
from disttrain.store import JobStore

pytestmark = pytest.mark.timeout(240)
RANKS_SCRIPT = """\
    import json, os, socket, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    seen = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(),
            "master_addr": os.environ["MASTER_ADDR"], "algo_1": socket.gethostbyname("algo-1"),
            "host": os.environ["SM_CURRENT_HOST"], "argv": sys.argv[1:]}
    with open(f"/opt/ml/output/data/rank{dist.get_rank()}.json", "w") as fh:
        json.dump(seen, fh)
    print(f"rank {dist.get_rank()} sum={total.item():.0f}", flush=True)
    dist.destroy_process_group()
"""


@needs_namespace
def test_source_code_command_torchrun_master_addr_algo_1(job_home):
    """SourceCode(command=...): torchrun as written, --master_addr algo-1 resolving in each instance."""
    from disttrain.sagemaker.train import ModelTrainer
    from disttrain.sagemaker.train.configs import Compute, SourceCode

    write(job_home / "src" / "ranks.py", RANKS_SCRIPT)
    command = ("torchrun --nnodes 2 --nproc_per_node 1 --master_addr algo-1 --master_port $SM_MASTER_PORT\n"
               "    --node_rank $SM_CURRENT_HOST_RANK ranks.py --note 'a b'")
    trainer = ModelTrainer(source_code=SourceCode(source_dir="src", command=command),
                           compute=Compute(instance_type="ml.c5.xlarge", instance_count=2), base_job_name="cmd")
    trainer.train(logs=False)
    job = trainer._latest_training_job
    assert job.training_job_status == "Completed"
    assert job.model_artifacts.s3_model_artifacts.startswith("s3://sagemaker-us-east-1-000000000000/cmd/")
    with JobStore() as store:
        record = store.get(job.training_job_name)
    job_dir = Path(record.job_dir)
    for rank, host in ((0, "algo-1"), (1, "algo-2")):
        seen = json.loads((job_dir / host / "output" / "data" / f"rank{rank}.json").read_text())
        assert seen == {"rank": rank, "world": 2, "sum": 3.0, "master_addr": "algo-1", "algo_1": "127.0.0.1",
                        "host": host, "argv": ["--note", "a b"]}
    log = (job_dir / "logs" / "job.log").read_text()
    assert "[algo-1 rank0] Executing command: torchrun --nnodes 2" in log  # one line, as ModelTrainer joins it
    assert not list(job_dir.glob("algo-*/output/failure"))


def test_a_failing_command_fails_the_job_and_writes_output_failure(job_home):
    from disttrain.sagemaker.exceptions import FailedStatusError
    from disttrain.sagemaker.train import ModelTrainer
    from disttrain.sagemaker.train.configs import SourceCode

    (job_home / "src").mkdir()
    trainer = ModelTrainer(source_code=SourceCode(source_dir="src", command="echo before && exit 3"),
                           disttrain={"private_opt_ml": "off"})
    with pytest.raises(FailedStatusError, match="Final Resource State: Failed") as err:
        trainer.train(logs=False)
    assert "\n" not in str(err.value)
    job = trainer._latest_training_job
    assert job.training_job_status == "Failed" and job.model_artifacts.s3_model_artifacts is None
    with JobStore() as store:
        record = store.get(job.training_job_name)
    failure = (Path(record.job_dir) / "algo-1" / "output" / "failure").read_text()
    assert failure.startswith(f"Training Execution failed (exit code 3): see `disttrain jobs logs "
                              f"{job.training_job_name}`")
    assert record.exit_code == 3


def test_v3_contract_pieces(tmp_path):
    """Each piece as SDK v3's drivers make it (sagemaker-train's container_drivers)."""
    from disttrain.agent.optml import hosts_file, prefix
    from disttrain.jobs import sagemaker_v3 as v3
    from disttrain.jobs.distribution import parse_distribution
    from disttrain.jobs.layout import InstancePaths
    from disttrain.jobs.sagemaker import Instance
    from disttrain.jobs.smdriver import command_line, container_env

    hps = {"use_bias": True, "ids": [1, 2], "name": "abc", "lr": 0.1, "a": "1.0", "cfg": {"k": 1}}
    assert v3.encoded_hyperparameters(hps) == {"use_bias": "true", "ids": "[1, 2]", "name": "abc", "lr": "0.1",
                                               "a": "1.0", "cfg": '{"k": 1}'}
    assert v3.cmd_args(hps) == ["--use_bias", "true", "--ids", "[1, 2]", "--name", "abc", "--lr", "0.1",
                                "--a", "1.0", "--cfg", '{"k": 1}']  # in order, one-letter keys too
    inst = Instance(job_name="j", name="algo-2", names=("algo-1", "algo-2"), channels=("train",),
                    hyperparameters={"n": 2}, instance_type="ml.c5.xlarge", num_cpus=4)
    paths = InstancePaths(tmp_path / "algo-2")
    paths.create()
    torchrun = v3.distributed_config(parse_distribution({"torch_distributed": {"enabled": True}}), 2)
    env = v3.instance_vars(inst, paths, master=("algo-1", 7777), source_dir="/code", entry_script="train.py",
                           distributed=torchrun)
    v3.write_files(inst, paths, env)
    assert (env["SM_HOST_COUNT"], env["SM_CURRENT_HOST_RANK"], env["SM_HOSTS"]) == ("2", "1", '["algo-1", "algo-2"]')
    assert (env["SM_MASTER_ADDR"], env["SM_MASTER_PORT"], env["SM_SOURCE_DIR"], env["SM_ENTRY_SCRIPT"]) == \
        ("algo-1", "7777", "/code", "train.py")
    assert env["SM_DISTRIBUTED_CONFIG"] == '{"process_count_per_node": 2, "smp": null}'
    assert env["SM_CHANNEL_TRAIN"] == str(paths.channel("train")) and env["SM_CHANNELS"] == '["train"]'
    assert (env["SM_HP_N"], env["SM_HPS"], env["TRAINING_JOB_NAME"]) == ("2", '{"n": 2}', "j")
    assert env["SM_OUTPUT_FAILURE"] == str(paths.failure) and env["SM_NUM_CPUS"] == "4"
    assert sorted(json.loads(env["SM_TRAINING_ENV"])) == sorted([
        "channel_input_dirs", "current_host", "current_instance_type", "hosts", "master_addr", "master_port",
        "hyperparameters", "input_data_config", "input_config_dir", "input_data_dir", "input_dir", "job_name",
        "log_level", "model_dir", "network_interface_name", "num_cpus", "num_gpus", "num_neurons",
        "output_data_dir", "resource_config"])
    assert json.loads((paths.config / "hyperparameters.json").read_text()) == {"n": "2"}
    sourced = subprocess.run(["bash", "-c", f"source {paths.input / 'sm_training.env'} && echo \"$SM_HPS|$SM_HOSTS\""],
                             capture_output=True, text=True, check=True).stdout
    assert sourced == '{"n": 2}|["algo-1", "algo-2"]\n'
    ten = Instance(job_name="j", name="algo-2", names=tuple(f"algo-{i}" for i in range(1, 11)))
    assert v3.training_env(ten, paths, master=("algo-1", 7777), source_dir="/code", entry_script="t.py",
                           distributed={})["SM_CURRENT_HOST_RANK"] == 2  # sorted as text, as v3 does: algo-10 < algo-2
    mpi = parse_distribution({"mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-x A=1"}})
    assert v3.distributed_config(mpi, "auto") == {"process_count_per_node": 2, "mpi_additional_options": ["-x", "A=1"]}
    assert v3.distributed_config(parse_distribution({}), "auto") == {}
    # algo-1 where the names resolve (a private /opt/ml), else the first address; the rendezvous port + 1
    assert v3.master_endpoint(["10.0.0.1", "10.0.0.2"], 29500, names_resolve=True) == ("algo-1", 29501)
    assert v3.master_endpoint(["10.0.0.1", "10.0.0.2"], 29500, names_resolve=False) == ("10.0.0.1", 29501)
    assert v3.worker_command("train.py", None, {"a": 1}) == ("train.py", False, ("--a", "1"))
    assert v3.worker_command("run.sh", None, {"a": "x y"}) == ("disttrain.jobs.smdriver", True,
                                                              ("--script", "run.sh", "--a", "x y"))
    assert command_line(["--command", "torchrun  --nnodes 2\n  train.py"]) == "torchrun --nnodes 2 train.py"
    assert command_line(["--script", "run me.sh", "--a", "x y"]) == "chmod +x 'run me.sh' && ./'run me.sh' --a 'x y'"
    env = container_env({"RANK": "0", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "SM_HOSTS": "[]", "PATH": "/b"})
    assert sorted(env) == ["PATH", "SM_HOSTS"] and env["PATH"] == f"{os.path.dirname(sys.executable)}:/b"
    # each instance's /etc/hosts: this machine's plus the job's names, bound over /etc/hosts in its namespace
    instance = tmp_path / "job" / "algo-1"
    instance.mkdir(parents=True)
    assert "--ro-bind" not in prefix("bwrap", str(instance))  # no hosts file: /etc/hosts as it is
    Path(hosts_file(str(instance))).write_text("10.0.0.1 algo-1\n10.0.0.2 algo-2\n")
    argv = prefix("bwrap", str(instance))
    merged = argv[argv.index("--ro-bind") + 1]
    assert argv[argv.index("--ro-bind") + 2] == "/etc/hosts" and argv[-4:] == ["--bind", str(instance), "/opt/ml", "--"]
    text = Path(merged).read_text()
    assert text.startswith(Path("/etc/hosts").read_text().rstrip("\n"))
    assert text.endswith("# the job's instances (disttrain)\n10.0.0.1 algo-1\n10.0.0.2 algo-2\n")
    unshare = prefix("unshare", str(instance))
    assert unshare[unshare.index("--etc-hosts") + 1] == merged


def test_model_trainer_bad_arguments_are_one_line(job_home):
    from disttrain.sagemaker.train import ModelTrainer
    from disttrain.sagemaker.train.configs import Compute, InstanceGroup, SourceCode
    from disttrain.sagemaker.train.distributed import Torchrun

    write(job_home / "src" / "train.py", "print('hi')\n")
    code = SourceCode(source_dir="src", entry_script="train.py")
    with pytest.raises(TypeError, match=r"ModelTrainer.__init__\(\) got an unexpected keyword argument 'source_cod'"):
        ModelTrainer(source_cod=code)
    with pytest.raises(TypeError, match="unexpected keyword argument 'entry_scirpt'"):
        SourceCode(source_dir="src", entry_scirpt="train.py")
    cases = [
        (dict(), "source_code=SourceCode(source_dir=..., entry_script=... or command=...) is required here"),
        (dict(source_code=SourceCode(source_dir="src")), "SourceCode needs entry_script or command"),
        (dict(source_code=SourceCode(entry_script="train.py")), "needs source_dir"),
        (dict(source_code=SourceCode(source_dir="src", command="python train.py"), distributed=Torchrun()),
         "distributed needs SourceCode(entry_script=...)"),
        (dict(source_code=SourceCode(source_dir="src", entry_script="train.py", requirements="reqs.txt")),
         "here the job installs requirements.txt from source_dir"),
        (dict(source_code=code, compute=Compute(instance_groups=[InstanceGroup(instance_count=1)])),
         "instance_groups (heterogeneous clusters) is not supported"),
        (dict(source_code=code, training_mode="CLOUD"), "training_mode must be Mode.SAGEMAKER_TRAINING_JOB"),
        (dict(source_code=code, hyperparameters="nope.yaml"), "hyperparameters file nope.yaml"),
    ]
    for args, message in cases:
        with pytest.raises(UsageError) as err:
            ModelTrainer(**args)
        assert message in str(err.value) and "\n" not in str(err.value)
    # found only at train(): a missing entry script or channel, nothing recorded
    for trainer, inputs, message in (
            (ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="nope.py")), None,
             "SourceCode.entry_script: nope.py not found in source_dir"),
            (ModelTrainer(source_code=code), {"train": str(job_home / "missing")}, "inputs.train: ")):
        with pytest.raises(UsageError, match=message) as err:
            trainer.train(input_data_config=inputs)
        assert "\n" not in str(err.value)
    with JobStore() as store:
        assert store.list() == []
    # a hyperparameters file (JSON or YAML), and what train() would run (dry_run)
    (job_home / "hps.yaml").write_text("lr: 0.1\nname: abc\n")
    trainer = ModelTrainer(source_code=code, hyperparameters="hps.yaml")
    assert trainer.hyperparameters == {"lr": 0.1, "name": "abc"}
    assert trainer.train(dry_run=True) is None
    with JobStore() as store:
        assert store.list() == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_session_default_bucket_and_s3_helpers(job_home, where, request, monkeypatch):
    """Session(), default_bucket(), upload_data/download_data, S3Uploader/S3Downloader, a job reading and
    writing the default bucket: a local folder without AWS, or a bucket at an S3-compatible endpoint."""
    import tarfile

    import disttrain.sagemaker as sagemaker
    from disttrain.sagemaker.s3 import S3Downloader, S3Uploader

    if where == "s3":
        fs, _ = request.getfixturevalue("s3")
    else:
        monkeypatch.setenv("DISTTRAIN_BUCKETS", str(job_home / "buckets"))
    sess = sagemaker.Session()
    bucket = sess.default_bucket()
    assert bucket == "sagemaker-us-east-1-000000000000" and sess.boto_region_name == "us-east-1"
    write(job_home / "data" / "a.txt", "A")
    write(job_home / "data" / "sub" / "b.txt", "B")
    assert sess.upload_data("data", bucket=bucket, key_prefix="demo") == f"s3://{bucket}/demo"
    assert sess.upload_data("data/a.txt", key_prefix="one") == f"s3://{bucket}/one/a.txt"
    assert sorted(S3Downloader.list(f"s3://{bucket}/demo")) == [f"s3://{bucket}/demo/a.txt",
                                                                 f"s3://{bucket}/demo/sub/b.txt"]
    assert sorted(S3Downloader.download(f"s3://{bucket}/demo", "back")) == ["back/a.txt", "back/sub/b.txt"]
    assert Path("back/sub/b.txt").read_text() == "B"
    url = S3Uploader.upload_string_as_file_body("hello", f"s3://{bucket}/notes/n.txt")
    assert S3Downloader.read_file(url) == "hello"
    assert S3Uploader.upload("data/a.txt", f"s3://{bucket}/up") == f"s3://{bucket}/up/a.txt"
    if where == "local":
        assert (job_home / "buckets" / bucket / "demo" / "sub" / "b.txt").read_text() == "B"
    else:
        assert fs.cat(f"{bucket}/demo/sub/b.txt") == b"B"
    write(job_home / "src" / "copy_in.py", """\
        import os, shutil
        shutil.copy(os.path.join(os.environ["SM_CHANNEL_TRAIN"], "a.txt"), os.environ["SM_MODEL_DIR"])
    """)
    est = sagemaker.Estimator(entry_point="copy_in.py", source_dir="src", output_path=f"s3://{bucket}/out",
                              disttrain={"private_opt_ml": "off"})
    est.fit({"train": f"s3://{bucket}/demo"}, logs=False)
    assert est.model_data.startswith(f"s3://{bucket}/out/")
    (local,) = S3Downloader.download(est.model_data, "model")
    with tarfile.open(local) as tar:
        assert tar.extractfile("a.txt").read() == b"A"
    assert sagemaker.get_execution_role().startswith("arn:aws:iam::000000000000:role/")
    assert sagemaker.image_uris.retrieve("pytorch", region="eu-west-1", version="2.5", py_version="py311",
                                         instance_type="ml.g5.xlarge", image_scope="training") == \
        "763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:2.5-gpu-py311"


SHIM = """\
import subprocess, sys
import sagemaker                                  # the installed SDK (a stand-in here)
print("before", sagemaker.WHO)
import disttrain.sagemaker as dt
dt.load_ipython_extension(None)                   # %load_ext disttrain.sagemaker
import sagemaker
from sagemaker.train.tuner import HyperparameterTuner
from sagemaker.modules.train import ModelTrainer
from sagemaker.core.parameter import ContinuousParameter
import sagemaker.pytorch.estimator
print("served", sagemaker is dt, ModelTrainer is dt.modeltrainer.ModelTrainer,
      sagemaker.train.tuner.HyperparameterTuner is HyperparameterTuner)
other = subprocess.run([sys.executable, "-c", "import sagemaker; print(sagemaker.WHO)"], capture_output=True, text=True)
print("another process", other.stdout.strip())
try:
    import sagemaker.debugger
except ModuleNotFoundError as err:
    print("missing", str(err).split(" (")[0])
dt.unload_ipython_extension(None)
import sagemaker
print("after", sagemaker.WHO)
"""


def test_import_sagemaker_is_served_in_one_process_only(tmp_path):
    """%load_ext disttrain.sagemaker (and disttrain sagemaker run) serve `import sagemaker` in that process;
    an installed SDK is set aside there, used everywhere else, and given back on unload."""
    write(tmp_path / "real" / "sagemaker" / "__init__.py", "WHO = 'the installed SDK'\n")
    (tmp_path / "shim.py").write_text(SHIM)
    src = Path(__file__).resolve().parents[1] / "src"
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path / "real"), str(src)]))
    done = subprocess.run([sys.executable, "shim.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "before the installed SDK",
        "disttrain: `import sagemaker` in this process is now disttrain's SageMaker SDK; jobs run on your own "
        "machines (the real SDK imported before was set aside: import sagemaker again)",
        "served True True True", "another process the installed SDK",
        "missing No module named 'sagemaker.debugger' in disttrain's SageMaker SDK", "after the installed SDK"]


MPI_V3_SCRIPT = """\
    import json, os, sys
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank() + 1)
    seen = {"sum": total, "argv": sys.argv[1:], "config": json.loads(os.environ["SM_DISTRIBUTED_CONFIG"]),
            "host_rank": os.environ["SM_CURRENT_HOST_RANK"], "bar": os.environ.get("BAR")}
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], f"rank{comm.Get_rank()}.json"), "w") as fh:
        json.dump(seen, fh)
"""


def test_mpi_runner_local_container_mode(job_home):
    """MPI(process_count_per_node, mpi_additional_options) on 2 instances, in LOCAL_CONTAINER mode (no
    Docker here either): the model lands under local_container_root."""
    import shutil

    if not shutil.which("mpirun"):
        pytest.skip("Open MPI's mpirun is not installed (tests/rig_setup.sh installs it)")
    pytest.importorskip("mpi4py")
    from disttrain.sagemaker.train import Mode, ModelTrainer
    from disttrain.sagemaker.train.configs import Compute, SourceCode
    from disttrain.sagemaker.train.distributed import MPI

    write(job_home / "src" / "mpi_v3.py", MPI_V3_SCRIPT)
    trainer = ModelTrainer(training_mode=Mode.LOCAL_CONTAINER, local_container_root=str(job_home / "local"),
                           source_code=SourceCode(source_dir="src", entry_script="mpi_v3.py"),
                           compute=Compute(instance_type="local", instance_count=2),
                           distributed=MPI(process_count_per_node=1, mpi_additional_options=["-x", "FOO=1"]),
                           hyperparameters={"flag": False}, environment={"BAR": "2"})
    trainer.train(logs=False)
    job = trainer._latest_training_job
    assert job.training_job_status == "Completed"
    assert Path(job.model_artifacts.s3_model_artifacts) == job_home / "local" / job.training_job_name / "model.tar.gz"
    with JobStore() as store:
        job_dir = Path(store.get(job.training_job_name).job_dir)
    for rank, host in ((0, "algo-1"), (1, "algo-2")):
        seen = json.loads((job_dir / host / "output" / "data" / f"rank{rank}.json").read_text())
        assert seen == {"sum": 3, "argv": ["--flag", "false"], "host_rank": str(rank), "bar": "2",
                        "config": {"process_count_per_node": 1, "mpi_additional_options": ["-x", "FOO=1"]}}
