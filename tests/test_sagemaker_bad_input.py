"""Bad input to the SDK surface: one line saying what is wrong, exit code 2, nothing recorded or started.

Each case is a script run untouched by ``disttrain sagemaker run`` (the CLI's own exit code and
stderr), then the job store and the bucket folder are checked for anything left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import cli_env

pytestmark = pytest.mark.timeout(120)

HEAD = """\
import os
from sagemaker.train import ModelTrainer
from sagemaker.train.configs import Compute, InputData, SourceCode
from sagemaker.train.tuner import HyperparameterTuner
from sagemaker.core.parameter import ContinuousParameter
from sagemaker.core.helper.session_helper import Session
os.makedirs("src", exist_ok=True)
open("src/train.py", "w").write("print('loss=1.0')\\n")
"""

CASES = {
    "instance_count_0": (
        'ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="train.py"),\n'
        '             compute=Compute(instance_type="local_cpu", instance_count=0)).train()',
        "line 9: UsageError: ModelTrainer: Compute(instance_count=0): a job needs at least 1 instance "
        "(SageMaker refuses InstanceCount < 1)"),
    "empty_range": (
        'trainer = ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="train.py"))\n'
        'HyperparameterTuner(trainer, "loss", {"lr": ContinuousParameter(0.5, 0.5)},\n'
        '                    metric_definitions=[{"Name": "loss", "Regex": "loss=([0-9.]+)"}]).tune()',
        "UsageError: hyperparameter_ranges['lr']: ContinuousParameter(0.5, 0.5) has nothing to search; give a "
        "wider range, or put lr in the hyperparameters as a static value"),
    "entry_script_typo": (
        'ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="trian.py")).train()',
        "UsageError: SourceCode.entry_script: trian.py not found in source_dir "),
    "missing_s3_input": (
        'bucket = Session().default_bucket()\n'
        'ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="train.py")).train(\n'
        '    input_data_config=[InputData(channel_name="train", data_source=f"s3://{bucket}/no/such/prefix")])',
        "UsageError: input channel train: s3://sagemaker-us-east-1-000000000000/no/such/prefix does not exist"),
    "dotdot_key_prefix": (
        'Session().upload_data("src/train.py", key_prefix="../../escaped")',
        "UsageError: s3://sagemaker-us-east-1-000000000000/../../escaped/train.py: a key (or key_prefix) with "
        "'.' or '..' between slashes would leave the bucket's folder here; name the key without them"),
    "dotdot_bucket": (
        'Session().upload_data("src/train.py", bucket="..", key_prefix="escaped")',
        "UsageError: bucket name '..' is not a valid S3 bucket name"),
    "dotdot_bucket_in_url": (
        'ModelTrainer(source_code=SourceCode(source_dir="src", entry_script="train.py")).train(\n'
        '    input_data_config=[InputData(channel_name="train", data_source="s3://../home")])',
        "UsageError: bucket name '..' is not a valid S3 bucket name"),
}


def run_script(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "nb.py").write_text(HEAD + textwrap.dedent(body) + "\n")
    return subprocess.run([sys.executable, "-m", "disttrain", "sagemaker", "run", "nb.py"], capture_output=True,
                          text=True, timeout=100, cwd=tmp_path, env=cli_env(**env))


def nothing_started(tmp_path: Path) -> None:
    assert not (tmp_path / "home" / "jobs").exists()  # no job folder: nothing was recorded or started
    assert not (tmp_path / "home" / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert not any(tmp_path.rglob("escaped"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, case):
    body, said = CASES[case]
    monkeypatch.setenv("DISTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DISTTRAIN_STORE", str(tmp_path / "home" / "jobs.db"))
    monkeypatch.delenv("DISTTRAIN_BUCKETS", raising=False)
    done = run_script(tmp_path, body)
    errors = [line for line in done.stderr.splitlines() if line.startswith("disttrain: error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and said in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    nothing_started(tmp_path)


def test_unwritable_home_at_default_bucket_is_one_line(tmp_path, monkeypatch):
    """Session().default_bucket() under a DISTTRAIN_HOME it cannot write: one line naming the folder and
    the fix, not a traceback. (As root, a 0500 folder is still writable, so a folder under a file stands in:
    mkdir fails there for everyone.)"""
    blocked = tmp_path / "ro"
    blocked.write_text("a file, not a folder")
    home = blocked / "home"
    if os.geteuid() != 0:
        blocked.unlink()
        blocked.mkdir(mode=0o500)
    monkeypatch.delenv("DISTTRAIN_BUCKETS", raising=False)
    done = run_script(tmp_path, "Session().default_bucket()", DISTTRAIN_HOME=str(home),
                      DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("disttrain: error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert (f"cannot create bucket sagemaker-us-east-1-000000000000 as the folder {home}/buckets/"
            f"sagemaker-us-east-1-000000000000") in errors[0]
    assert "set DISTTRAIN_BUCKETS (or DISTTRAIN_HOME) to a writable folder" in errors[0]


def test_dotdot_refused_in_process_for_every_local_bucket_path(tmp_path, monkeypatch):
    """resolve() (every input, output and checkpoint URL of a local bucket) refuses a '..' step; a '..'
    inside a key's text (`a..b`) is fine, as S3 keeps it."""
    from disttrain.errors import UsageError
    from disttrain.sagemaker import buckets

    monkeypatch.setenv("DISTTRAIN_BUCKETS", str(tmp_path / "buckets"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    name = buckets.default_bucket_name()
    assert buckets.resolve(f"s3://{name}/a..b/c") == str(tmp_path / "buckets" / name / "a..b" / "c")
    for url in (f"s3://{name}/x/../../../etc", f"s3://{name}/./x", "s3://../x", "s3://a/../x", "s3://UP/x"):
        with pytest.raises(UsageError):
            buckets.resolve(url)
    with pytest.raises(UsageError):
        buckets.make_bucket("../outside")
    assert not (tmp_path / "outside").exists()
