"""Secrets stay secret: files that can hold them are 0600, records and ``jobs show`` mask them,
and ``--env KEY`` takes the value from the launcher's environment.

(That plans and env values never travel on a command line is the launch layer's part, issue 13.)
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _launch import worker_env
from conftest import cli_env, disttrain
from disttrain.private import mask_secrets

CHECK_ENV = """
import json, os, sys
wanted = json.loads(sys.argv[1])
got = {k: os.environ.get(k) for k in wanted}
print("env ok" if got == wanted else f"env differs: {sorted(k for k in wanted if got[k] != wanted[k])}")
"""
SECRETS = ["tok456", "hunter2", "AKIAEXAMPLE", "s3cr3t-nested", "pw-in-list"]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_mask_secrets_at_any_depth():
    spec = {"env": {"API_TOKEN": "tok456", "PLAIN": "x"},
            "storage_options": {"key": "AKIA", "client_kwargs": {"aws_secret_access_key": "s", "region": "eu"},
                                "profiles": [{"password": "p", "user": "u"}], "Credentials": {"a": 1}},
            "hyperparameters": {"lr": 0.1, "db_passwd": "x", "max_tokens": 512, "tokenizer": "bpe",
                                "secretKey": "x", "HF_TOKEN": "x", "keyframes": 4}}
    assert mask_secrets(spec) == {
        "env": {"API_TOKEN": "***", "PLAIN": "x"},
        "storage_options": {"key": "***", "client_kwargs": {"aws_secret_access_key": "***", "region": "eu"},
                            "profiles": [{"password": "***", "user": "u"}], "Credentials": "***"},
        "hyperparameters": {"lr": 0.1, "db_passwd": "***", "max_tokens": 512, "tokenizer": "bpe",
                            "secretKey": "***", "HF_TOKEN": "***", "keyframes": 4}}


@pytest.mark.timeout(150)
def test_job_secrets_reach_the_script_but_no_record(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(CHECK_ENV)
    env = {"API_TOKEN": "tok456", "DB_PASSWORD": "hunter2"}
    spec = {"name": "secretive", "entry_point": "train.py", "source_dir": str(src), "processes_per_instance": 1,
            "env": env, "hyperparameters": {"db_passwd": "hunter2", "lr": 0.1},
            "output_path": str(tmp_path / "artifacts"),
            "storage_options": {"key": "AKIAEXAMPLE", "client_kwargs": {"aws_secret_access_key": "s3cr3t-nested"},
                                "profiles": [{"password": "pw-in-list"}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    (src / "wanted.json").write_text(json.dumps(env))  # not in the spec: the check reads it here
    (src / "train.py").write_text(CHECK_ENV.replace("sys.argv[1]", "open('wanted.json').read()"))
    store = tmp_path / "jobs.db"
    jobs_env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(store))
    result = disttrain("job", "run", str(path), env=jobs_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "env ok" in result.stdout

    shown = disttrain("jobs", "show", "1", env=jobs_env).stdout + disttrain("jobs", "show", "1", "--json",
                                                                               env=jobs_env).stdout
    shown += disttrain("jobs", "ls", "--json", env=jobs_env).stdout
    assert '"API_TOKEN": "***"' in shown and '"aws_secret_access_key": "***"' in shown
    for secret in SECRETS:
        assert secret not in shown
        for kept in store.parent.glob("jobs.db*"):
            assert secret.encode() not in kept.read_bytes(), kept
    for kept in store.parent.glob("jobs.db*"):
        assert mode(kept) == 0o600, kept
    record = json.loads(disttrain("jobs", "show", "1", "--json", env=jobs_env).stdout)
    plan = Path(record["log_dir"]) / "plan.json"
    assert mode(plan) == 0o600


@pytest.mark.timeout(90)
def test_env_key_alone_takes_the_launchers_value(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(CHECK_ENV)
    wanted = json.dumps({"API_TOKEN": "tok456"})
    run = [sys.executable, "-m", "disttrain", "run", "-n", "1", "--env", "API_TOKEN", str(script), wanted]
    home = tmp_path / "home"
    result = subprocess.run(run, capture_output=True, text=True, timeout=60,
                            env=worker_env({"API_TOKEN": "tok456", "DISTTRAIN_HOME": str(home)}))
    assert result.returncode == 0, result.stderr
    assert "env ok" in result.stdout
    (plan,) = home.glob("runs/*/plan.json")
    assert mode(plan) == 0o600

    unset = worker_env({"DISTTRAIN_HOME": str(home)})
    unset.pop("API_TOKEN", None)
    missing = subprocess.run(run, capture_output=True, text=True, timeout=60, env=unset)
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("disttrain: error: --env API_TOKEN: API_TOKEN is not set in this "
                                      "environment; export it first or give --env API_TOKEN=VALUE")


@pytest.mark.parametrize("key", ["DB_PASS", "dbPass", "db-pass", "MYSQL_PWD", "mysqlpwd", "PGPASSWORD", "db_passwd",
                                 "dbpasswd", "SMTP_PASSPHRASE", "userPassword", "API_TOKEN", "aws_secret_access_key"])
def test_secret_looking_keys_are_masked(key):
    assert mask_secrets({key: "hunter2"}) == {key: "***"}


@pytest.mark.parametrize("key", ["bypass", "lowpass", "compass", "passes", "num_passes", "high_pass_filter",
                                 "passthrough", "max_tokens", "tokenizer", "keyframes", "monkey", "lr"])
def test_innocent_keys_stay_readable(key):
    assert mask_secrets({key: 1}) == {key: 1}


@pytest.fixture
def reachable_tmp():
    """A folder every user may enter (pytest's own tmp_path is under a 0700 folder), so the job's
    own modes are the only thing between another user and its files."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="disttrain-private-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


WRITE_MODEL = """
import os
open(os.path.join(os.environ["SM_MODEL_DIR"], "model.pth"), "w").write("weights")
open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "eval.txt"), "w").write("0.9")
print("saved", flush=True)
"""


@pytest.mark.timeout(150)
def test_a_jobs_files_are_its_owners_only(reachable_tmp):
    src = reachable_tmp / "src"
    src.mkdir()
    (src / "train.py").write_text(WRITE_MODEL)
    artifacts = reachable_tmp / "artifacts"
    artifacts.mkdir(mode=0o755)  # a shared output folder: the job's own folder inside it is private
    spec = reachable_tmp / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "private", "entry_point": "train.py", "source_dir": str(src),
                                    "processes_per_instance": 1, "hyperparameters": {"api_token": "tok456"},
                                    "output_path": str(artifacts)}))
    env = cli_env(DISTTRAIN_HOME=str(reachable_tmp / "home"), DISTTRAIN_STORE=str(reachable_tmp / "jobs.db"))
    result = disttrain("job", "run", str(spec), env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    record = json.loads(disttrain("jobs", "show", "1", "--json", env=env).stdout)
    job_dir, logs = Path(record["job_dir"]), Path(record["log_dir"])
    model, output = Path(record["artifacts"]["model"]), Path(record["artifacts"]["output"])
    hyperparameters = job_dir / "algo-1" / "input" / "config" / "hyperparameters.json"
    assert "tok456" in hyperparameters.read_text()  # the script's, whole
    for folder in (job_dir, job_dir / "algo-1", logs, model.parent):
        assert mode(folder) == 0o700, folder
    for path in (hyperparameters, logs / "job.log", logs / "plan.json", model, output):
        assert mode(path) == 0o600, path
    rank_logs = [p for p in logs.rglob("*") if p.is_file() and "rank" in p.name]
    assert rank_logs
    if os.geteuid() == 0:  # and another user, for real, can read none of it
        for path in (hyperparameters, logs / "job.log", model, output, job_dir / "algo-1" / "model" / "model.pth",
                     *rank_logs):
            done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(path)],
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode != 0 and "Permission denied" in done.stderr, path
        assert subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat",
                               str(artifacts / ".." / "job.yaml")], capture_output=True, timeout=30).returncode == 0
