"""Notebooks run untouched: ``disttrain sagemaker run FILE`` serves ``import sagemaker`` (v2 and v3 paths).

The notebooks in tests/notebooks/ are small equivalents of real ones, written here because nothing
can be downloaded: AWS's two "get started" notebooks (PyTorch and TensorFlow MNIST,
amazon-sagemaker-examples/frameworks/*/get_started_mnist_train.ipynb: the same cells, shortened)
and a notebook in the shape of the SDK v3 examples (ModelTrainer + Torchrun). Their data cell
downloads from AWS's public bucket with boto3: the test serves that bucket from a local S3 server
(moto, through AWS_ENDPOINT_URL) holding generated MNIST files, instead of editing the cell. Every
job is real (2 instances where the notebook asks for them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import cli_env, needs_namespace
from disttrain.store import JobStore

pytestmark = pytest.mark.timeout(300)
NOTEBOOKS = Path(__file__).parent / "notebooks"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SAMPLE_BUCKET = "sagemaker-sample-files"  # what the get-started notebooks' data cell reads
def run_notebook(folder: Path, name: str, cwd: Path, *args: str, timeout: float = 280):
    """A copy of the notebook's folder (the notebook writes beside itself, as in Jupyter), run untouched."""
    work = cwd / folder.name
    shutil.copytree(folder, work)
    return subprocess.run([sys.executable, "-m", "disttrain", "sagemaker", "run", str(work / name), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=cli_env())


def serve_mnist(fs, tmp: Path) -> None:
    """AWS's public MNIST objects, generated, on the local S3 server."""
    from disttrain.datasets.mnist import generate_digits, write_mnist

    for split, n, seed in (("train", 512, 0), ("test", 128, 1)):
        images, labels = generate_digits(n, seed=seed)
        for path in write_mnist(tmp / "mnist", split, images, labels, compress=True):
            fs.put(str(path), f"{SAMPLE_BUCKET}/datasets/image/MNIST/{path.name}")


@needs_namespace
def test_v3_model_trainer_torchrun_notebook_untouched(job_home):
    """SDK v3: ModelTrainer + Torchrun on 2 instances, v3's hyperparameter rendering, SM_HOST_COUNT,
    literal /opt/ml, _latest_training_job's status and artifacts, the default bucket (a local folder)."""
    done = run_notebook(NOTEBOOKS / "v3_model_trainer", "model_trainer_torchrun.ipynb", job_home)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # cell 1's install is not run, and says so in one line
    assert "cell 1: skipped `!pip install --upgrade --quiet \"sagemaker>=3\"`" in done.stderr
    assert "Writing code/train.py" in out  # %%writefile
    assert "'s3://sagemaker-us-east-1-000000000000/model-trainer-demo/data'" in out  # a cell's last value shown
    assert "ignored on your own machines: role, training_image" in done.stderr
    job = out.split("job: ", 1)[1].split()[0]
    assert "status: Completed" in out
    model = f"s3://sagemaker-us-east-1-000000000000/mt-torchrun/{job}/model.tar.gz"
    assert f"model: {model}" in out
    run = json.loads(out.split("run: ", 1)[1].splitlines()[0])  # what rank 0 saw, from the downloaded model
    # v3's rendering: --key value in the hyperparameters' order, non-strings as JSON
    assert run["argv"] == ["--epochs", "3", "--use_bias", "true", "--ids", "[1, 2]", "--lr", "0.5"]
    assert run["hyperparameters"] == {"epochs": "3", "use_bias": "true", "ids": "[1, 2]", "lr": "0.5"}
    assert run["distributed"] == {"process_count_per_node": 1, "smp": None} and run["world"] == 2
    # the default bucket is a folder beside the job store; model.tar.gz is there
    local = job_home / "home" / "buckets" / "sagemaker-us-east-1-000000000000" / "mt-torchrun" / job / "model.tar.gz"
    with tarfile.open(local) as tar:
        assert {"model.pt", "run.json"} <= set(tar.getnames())
    with JobStore() as store:
        record = store.get(job)
    assert str(record.state) == "Completed" and record.spec["contract"] == "model_trainer"
    job_dir = Path(record.job_dir)
    for rank, host in ((0, "algo-1"), (1, "algo-2")):  # each instance wrote its literal /opt/ml
        seen = json.loads((job_dir / host / "output" / "data" / f"rank{rank}.json").read_text())
        assert (seen["host_count"], seen["host_rank"], seen["current_host"]) == ("2", str(rank), host)
        assert seen["master_addr"] == "algo-1"
        env_file = job_dir / host / "input" / "sm_training.env"  # /opt/ml/input/sm_training.env, sourceable
        shown = subprocess.run(["bash", "-c", f"source {env_file} && echo $SM_HOST_COUNT $SM_HPS"],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert shown == '2 {"epochs": 3, "use_bias": true, "ids": [1, 2], "lr": 0.5}'


def test_v3_local_training_notebook_untouched(job_home):
    """SDK v3's distributed local-training shape: Compute(instance_type="local_cpu", instance_count=2),
    Torchrun, Mode.LOCAL_CONTAINER; then the tree SDK local mode leaves under the container root
    (compressed_artifacts/, artifacts/model and artifacts/output from both instances, no algo-N/input/shared),
    checked by the notebook itself; `%env`, `!cmd`, `%%writefile {expr}`, `display()` and `%matplotlib`."""
    done = run_notebook(NOTEBOOKS / "v3_local_training", "local_training_torchrun.ipynb", job_home)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "cell 1: skipped `%matplotlib inline` (display settings do not apply here)" in done.stderr
    assert "instance_type must be" not in done.stderr and "made " in out and "Writing " in out
    assert "rank 0 loss=" in out and "rank 1 loss=" in out and "env=yes" in out  # %env reached the job
    assert "['model.tar.gz', 'output.tar.gz']" in out  # display() of a list
    assert "status: Completed" in out
    root = job_home / "v3_local_training"
    with tarfile.open(root / "compressed_artifacts" / "model.tar.gz") as tar:
        assert set(tar.getnames()) == {"model-0.pt", "model-1.pt"}  # every instance's /opt/ml/model
    with tarfile.open(root / "compressed_artifacts" / "output.tar.gz") as tar:
        assert {"data/rank0.txt", "data/rank1.txt"} <= set(tar.getnames())


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_v3_tuning_notebook_describe_analytics_display(job_home):
    """SDK v3's tuner over a ModelTrainer (its three trials at once): describe() is the tuning job resource
    (sagemaker-core's names), analytics().dataframe() shown with display(), as the v3 tuning example reads them."""
    pytest.importorskip("optuna")
    pytest.importorskip("pandas")
    done = run_notebook(NOTEBOOKS / "v3_tuning", "tuning_describe.ipynb", job_home)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for line in ("name: True", "status: Completed", "completed: 3", "best: True", "objective: loss", "rows: 3"):
        assert line in out, out[-2000:]
    assert "Analytics not yet available" not in out
    assert "FinalObjectiveValue" in out and "TrainingJobName" in out  # the DataFrame's head, displayed


@pytest.mark.timeout(360)
def test_pytorch_get_started_notebook_untouched(job_home, s3):
    """AWS's PyTorch MNIST get-started cells: Session(), default_bucket(), upload_data(), PyTorch(...).fit,
    model_data; the default bucket at the S3 endpoint; `!pygmentize` run, `%store` skipped."""
    fs, _ = s3
    if not fs.exists(SAMPLE_BUCKET):
        fs.mkdir(SAMPLE_BUCKET)
    serve_mnist(fs, job_home)
    done = run_notebook(NOTEBOOKS / "pytorch_mnist", "get_started_mnist_train.ipynb", job_home)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Test set: Average loss:" in done.stdout and "Saving the model" in done.stdout
    model = done.stdout.split("Model artifact saved at:\n ", 1)[1].splitlines()[0]
    assert model.startswith("s3://sagemaker-us-east-1-000000000000/mnist/pytorch-training-")
    with fs.open(model[len("s3://"):], "rb") as raw, tarfile.open(fileobj=raw) as tar:
        assert "model.pth" in tar.getnames()
    assert fs.exists("sagemaker-us-east-1-000000000000/mnist/train-images-idx3-ubyte.gz")  # upload_data
    assert "cell 8: skipped `%store pt_mnist_model_data`" in done.stderr
    with JobStore() as store:
        (record,) = store.list()
    assert str(record.state) == "Completed" and sorted(record.spec["inputs"]) == ["testing", "training"]


@pytest.mark.timeout(420)
def test_tensorflow_get_started_notebook_untouched(job_home, s3):
    pytest.importorskip("tensorflow")
    fs, _ = s3
    if not fs.exists(SAMPLE_BUCKET):
        fs.mkdir(SAMPLE_BUCKET)
    serve_mnist(fs, job_home)
    done = run_notebook(NOTEBOOKS / "tensorflow_mnist", "get_started_mnist_train.ipynb", job_home, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Test set: loss=" in done.stdout
    model = done.stdout.split("Model artifact saved at:\n ", 1)[1].splitlines()[0]
    assert model.startswith("s3://sagemaker-us-east-1-000000000000/tensorflow/mnist/tensorflow-training-")
    with fs.open(model[len("s3://"):], "rb") as raw, tarfile.open(fileobj=raw) as tar:
        assert "mnist.keras" in tar.getnames()
    assert "cell 8: skipped `%store tf_mnist_model_data`" in done.stderr


@needs_namespace
@pytest.mark.timeout(420)
def test_seed_article_notebook_untouched(job_home):
    """The seed article's cell as it was written (import sagemaker, SDK v1 names), as a notebook."""
    pytest.importorskip("tensorflow")
    done = subprocess.run([sys.executable, "-m", "disttrain", "sagemaker", "run",
                           str(EXAMPLES / "sagemaker_tf" / "notebook.ipynb")], capture_output=True, text=True,
                          timeout=400, cwd=job_home, env=cli_env(EPOCHS="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train_instance_count has been renamed" in done.stderr
    model = done.stdout.strip().splitlines()[-1].removeprefix("model: ")
    assert model.startswith("s3://sagemaker-us-east-1-000000000000/")
    bucket_folder = job_home / "home" / "buckets"
    with tarfile.open(bucket_folder / model[len("s3://"):]) as tar:
        assert {"classifier.keras", "vocab.txt"} <= set(tar.getnames())
    with JobStore() as store:
        series = store.metric_series(store.list()[0].id)
    assert series["valid:accuracy"][-1][1] > 0.8



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_v3_example_on_the_sagemaker_page(job_home):
    """docs/sagemaker.md's SDK v3 example as it is: ModelTrainer on 2 instances with Torchrun, then the tuner
    over it; the best trial is the one with the least of the recorded objectives."""
    done = subprocess.run([sys.executable, "-m", "disttrain", "sagemaker", "run",
                           str(EXAMPLES / "sagemaker_v3" / "notebook.py")], capture_output=True, text=True,
                          timeout=280, cwd=job_home, env=cli_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "status: Completed" in done.stdout
    assert "host algo-2 rank 1/2 epoch 2 loss=" in done.stdout  # the second instance trained too
    said = (done.stdout + done.stderr).splitlines()
    objectives = [float(line.rsplit("loss=", 1)[1].split()[0]) for line in said if ") Completed: loss=" in line]
    assert len(objectives) == 4
    assert float(done.stdout.strip().splitlines()[-1].split()[-1]) == min(objectives)

SCRIPT = """\
import sys
import sagemaker
from sagemaker.estimator import Estimator
from sagemaker.train.configs import SourceCode

print("argv", sys.argv[1:], "session", type(sagemaker.Session()).__module__)
if sys.argv[1:] == ["bad"]:
    SourceCode(source_dir=".", entry_scirpt="train.py")
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


def test_py_script_and_bad_input_are_one_line(job_home):
    (job_home / "script.py").write_text(SCRIPT)
    env = cli_env()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "disttrain", "sagemaker", "run", *args], capture_output=True,
                              text=True, timeout=120, cwd=job_home, env=env)

    done = run("script.py", "3")  # sys.argv and the exit code, as python would
    assert done.returncode == 3 and "argv ['3'] session disttrain.sagemaker.session" in done.stdout
    bad = run("script.py", "bad")  # a mistyped SDK argument: one line naming the file and line
    assert bad.returncode == 1
    said = [line for line in bad.stderr.splitlines() if line.startswith("disttrain: error:")]
    assert said == [f"disttrain: error: {job_home / 'script.py'}, line 8: TypeError: SourceCode.__init__() got an "
                    "unexpected keyword argument 'entry_scirpt'"]
    missing = run("nope.ipynb")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "disttrain: error: nope.ipynb: no such file (give a .py script or a .ipynb notebook)"
    (job_home / "broken.ipynb").write_text("{not json")
    broken = run("broken.ipynb")
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1
    assert "broken.ipynb: not a notebook (invalid JSON at line 1)" in broken.stderr


CELLS = [
    "import sagemaker\nfrom sagemaker.train import ModelTrainer\nx = 41",
    "%env FROM_MAGIC=yes\nimport os\nnames = !echo {x + 1} $x\n%matplotlib inline",
    "print(names, os.environ['FROM_MAGIC'])\nModelTrainer(source_cod=None)",
    "print('not reached')",
]


def test_ipynb_magics_and_a_bad_argument_in_a_cell(job_home):
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": src}
             for src in CELLS]
    (job_home / "nb.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    done = subprocess.run([sys.executable, "-m", "disttrain", "sagemaker", "run", "nb.ipynb"], capture_output=True,
                          text=True, timeout=120, cwd=job_home, env=cli_env())
    assert done.returncode == 1
    assert "['42 41'] yes" in done.stdout and "not reached" not in done.stdout
    assert "cell 2: skipped `%matplotlib inline` (display settings do not apply here)" in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("disttrain: error:")]
    assert errors == ["disttrain: error: nb.ipynb cell 3, line 2: TypeError: ModelTrainer.__init__() got an "
                      "unexpected keyword argument 'source_cod'"]
