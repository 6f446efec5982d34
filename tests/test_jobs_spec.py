"""Job specs are checked before anything runs; tarballs never escape; hyperparameters arrive verbatim."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from conftest import SCRIPTS, cli_env, disttrain
from disttrain.cli.main import main
from disttrain.errors import UsageError
from disttrain.jobs import Job, spec_from_mapping
from disttrain.jobs.sagemaker import hyperparameter_args
from disttrain.jobs.tarballs import pack_dir, safe_extract
from disttrain.store import JobStore

BASE = {"name": "linear", "entry_point": "sm_train.py", "source_dir": str(SCRIPTS)}
HOSTILE = {"note": "a b; $(touch /tmp/pwned-hp) 'q' \"dq\" `x` | & > <", "empty": "", "lr": 0.5,
           "layers": [64, 32], "flag": True}


def write_spec(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("change, message", [
    ({"instance_cnt": 2}, "unknown key 'instance_cnt'; known keys: name, entry_point"),
    ({"instance_count": "two"}, "instance_count must be a positive integer, got 'two'"),
    ({"instance_count": 0}, "instance_count must be a positive integer, got 0"),
    ({"processes_per_instance": "many"}, "processes_per_instance must be a positive integer or 'auto'"),
    ({"name": "bad_name!"}, "name must be 1-63 letters, digits and hyphens"),
    ({"name": "x" * 43}, "name may have at most 42 characters"),
    ({"framework": "jax"}, "framework must be one of pytorch, tensorflow, got 'jax'"),
    ({"launcher": "kubernetes"}, "launcher must be one of local, ssh, slurm, got 'kubernetes'"),
    ({"launcher": "slurm", "slurm": {"partitions": "gpu"}}, "slurm: unknown key 'partitions'; known keys: partition"),
    ({"launcher": "slurm", "slurm": {"time": 3600}}, 'slurm.time must be a string, got 3600: quote it in YAML'),
    ({"launcher": "slurm", "slurm": {"partition": "a b"}}, "slurm.partition: --partition 'a b': use a Slurm"),
    ({"launcher": "slurm", "slurm": {"sbatch_args": "--mem=8G"}}, "slurm.sbatch_args must be a list like"),
    ({"launcher": "slurm", "slurm": {"sbatch_args": ["mem=8G"]}}, "slurm.sbatch_args: --sbatch-arg takes one"),
    ({"launcher": "slurm", "slurm": {"gpus_per_node": -1}}, "slurm.gpus_per_node must be an integer >= 0"),
    ({"launcher": "slurm", "slurm": ["gpu"]}, "slurm must be a mapping"),
    ({"slurm": {"partition": "gpu"}}, "slurm is only used with launcher: slurm"),
    ({"launcher": "slurm", "hosts": ["a"]}, "hosts is only used with launcher: ssh"),
    ({"launcher": "ssh"}, "launcher ssh needs hosts"),
    ({"launcher": "ssh", "hosts": ["a", "b"], "instance_count": 3}, "instance_count is 3 but hosts lists 2"),
    ({"inputs": {"train data": "/tmp"}}, "channel name 'train data'"),
    ({"inputs": ["/tmp"]}, "inputs must be a mapping"),
    ({"hyperparameters": {"lr": None}}, "hyperparameters.lr has no value"),
    ({"env": {"1BAD": "x"}}, "env: '1BAD' is not a valid environment variable name"),
    ({"max_restarts": -1}, "max_restarts must be an integer >= 0"),
    ({"entry_point": "../escape.py"}, "entry_point must be a path inside source_dir"),
    ({"hyperparameters": {"note": "x" * 125_000}}, "hyperparameters are 125011 bytes as JSON; the limit is 122880"),
])
def test_bad_spec_is_one_line_exit_2_naming_the_key(tmp_path, capsys, change, message):
    store = tmp_path / "jobs.db"
    spec = write_spec(tmp_path / "job.yaml", {**BASE, **change})
    assert main(["job", "run", str(spec), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"disttrain: error: {spec}: ")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not store.exists()  # nothing recorded, nothing started


def test_missing_name_and_non_mapping_and_bad_yaml(tmp_path, capsys):
    for text, message in [("entry_point: a.py\n", "name is required"),
                          ("- a\n- b\n", "expected a mapping of keys"),
                          ("name: [unclosed\n", "not valid YAML at line")]:
        (tmp_path / "job.yaml").write_text(text)
        assert main(["job", "run", str(tmp_path / "job.yaml"), "--store", str(tmp_path / "s.db")]) == 2
        assert message in capsys.readouterr().err


def test_python_api_rejects_the_same_way():
    with pytest.raises(UsageError, match=r"disttrain.Job: unknown key 'epochs'"):
        Job(**BASE, epochs=3)
    job = Job(**{**BASE, "source_dir": "tests/scripts"}, inputs={"training": "s3://bucket/x"})
    assert Path(job.spec.program.source_dir).is_absolute() and job.spec.container.inputs["training"] == "s3://bucket/x"


def test_relative_paths_are_relative_to_the_yaml_file(tmp_path):
    (tmp_path / "sub").mkdir()
    spec = spec_from_mapping({"name": "a", "entry_point": "t.py", "source_dir": "sub", "inputs": {"train": "data"},
                              "output_path": "out"}, base_dir=tmp_path)
    assert spec.program.source_dir == str(tmp_path / "sub")
    assert spec.container.inputs == {"train": str(tmp_path / "data")}
    assert spec.container.output_path == str(tmp_path / "out")


def test_missing_channel_or_entry_point_is_reported_before_anything_is_recorded(tmp_path, capsys):
    store = tmp_path / "jobs.db"
    spec = write_spec(tmp_path / "job.yaml", {**BASE, "inputs": {"training": str(tmp_path / "nope")}})
    assert main(["job", "run", str(spec), "--store", str(store)]) == 2
    assert f"inputs.training: {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    spec = write_spec(tmp_path / "job.yaml", {**BASE, "entry_point": "missing.py"})
    assert main(["job", "run", str(spec), "--store", str(store)]) == 2
    assert "entry_point: missing.py not found in source_dir" in capsys.readouterr().err
    with JobStore(store) as db:
        assert db.list() == []


def test_hyperparameters_reach_the_script_verbatim(tmp_path):
    """The exact argv disttrain builds, run through a real interpreter: nothing is shell-parsed."""
    args = hyperparameter_args(HOSTILE)
    # as SageMaker's toolkit passes them: str() of each value (Python's True, a list's repr)
    assert args == ["--empty", "", "--flag", "True", "--layers", "[64, 32]", "--lr", "0.5",
                    "--note", HOSTILE["note"]]
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *args],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == args
    assert not Path("/tmp/pwned-hp").exists()
    assert shlex.split(shlex.join(args)) == args  # and the ssh boundary quotes it back to the same words


def _tar_with(tmp_path: Path, name: str, *, link: str | None = None, kind=tarfile.REGTYPE) -> Path:
    path = tmp_path / f"evil-{abs(hash((name, link)))}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        data = b"pwned"
        if link is not None:
            info.linkname = link
            tar.addfile(info)
        else:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("name, link, kind, reason", [
    ("../escaped.txt", None, tarfile.REGTYPE, "climbs out with '..'"),
    ("ok/../../escaped.txt", None, tarfile.REGTYPE, "climbs out with '..'"),
    ("/tmp/escaped-abs.txt", None, tarfile.REGTYPE, "is an absolute path"),
    ("link", "../../etc", tarfile.SYMTYPE, "links outside the destination"),
    ("link", "/etc/passwd", tarfile.SYMTYPE, "links outside the destination"),
    ("hard", "../outside", tarfile.LNKTYPE, "links outside the destination"),
    ("dev", None, tarfile.CHRTYPE, "is a device, fifo or other special file"),
])
def test_tar_extraction_refuses_path_traversal(tmp_path, name, link, kind, reason):
    archive = _tar_with(tmp_path, name, link=link, kind=kind)
    dest = tmp_path / "dest" / "inner"
    with pytest.raises(UsageError, match=f"member '{name}' {reason}"):
        safe_extract(archive, dest)
    assert not dest.exists() and not (tmp_path / "dest" / "escaped.txt").exists()


def test_pack_and_extract_round_trip(tmp_path):
    (tmp_path / "model" / "sub").mkdir(parents=True)
    (tmp_path / "model" / "model.pth").write_bytes(b"weights")
    (tmp_path / "model" / "sub" / "vocab.txt").write_text("a\nb\n")
    (tmp_path / "model" / "sub" / "inside").symlink_to("vocab.txt")
    archive = pack_dir(tmp_path / "model", tmp_path / "out" / "model.tar.gz")
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == ["model.pth", "sub", "sub/inside", "sub/vocab.txt"]  # no model/ prefix
    safe_extract(archive, tmp_path / "x")
    assert (tmp_path / "x" / "sub" / "inside").read_text() == "a\nb\n"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.tar.gz"]  # no temporary left


@pytest.mark.timeout(60)
def test_source_dir_tarball_with_traversal_is_refused_and_recorded(tmp_path):
    archive = _tar_with(tmp_path, "../../escaped-src.py")
    spec = write_spec(tmp_path / "job.yaml", {"name": "evil", "entry_point": "train.py", "source_dir": str(archive)})
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = disttrain("job", "run", str(spec), env=env)
    assert result.returncode == 2
    assert "refusing to extract" in result.stderr and "climbs out with '..'" in result.stderr
    assert not list(tmp_path.rglob("escaped-src.py"))
    record = json.loads(disttrain("jobs", "show", "1", "--json", env=env).stdout)
    assert record["state"] == "Failed" and "refusing to extract" in record["failure"]


def test_the_old_backend_key_still_works_with_one_line_of_warning(tmp_path, capsys):
    spec = spec_from_mapping({"name": "j", "entry_point": "t.py", "backend": "local"}, base_dir=tmp_path)
    assert spec.placement.launcher == "local"
    assert capsys.readouterr().err.count("the key backend is deprecated; use launcher: local") == 1
    with pytest.raises(UsageError, match="not both launcher and backend"):
        spec_from_mapping({"name": "j", "entry_point": "t.py", "backend": "local", "launcher": "ssh"},
                          base_dir=tmp_path)


def test_a_spec_is_three_typed_parts_and_gives_its_keys_back(tmp_path):
    from disttrain.jobs.distribution import Distribution
    from disttrain.jobs.spec import KNOWN_KEYS, Container, Placement, Program

    fields = {**BASE, "hyperparameters": {"lr": 0.5}, "env": {"A": "1"}, "instance_count": 2,
              "distribution": {"torch_distributed": {"enabled": True}}, "inputs": {"training": "s3://b/d"},
              "max_run": 60, "metric_definitions": [{"Name": "loss", "Regex": "loss=([0-9.]+)"}]}
    spec = spec_from_mapping(fields, base_dir=tmp_path)
    assert isinstance(spec.program, Program) and isinstance(spec.placement, Placement)
    assert isinstance(spec.container, Container)
    assert spec.program.distribution == Distribution("torch_distributed")  # parsed once, typed from then on
    assert spec.placement.instance_count == 2 and spec.container.max_run == 60
    flat = spec.to_dict()
    assert tuple(flat) == KNOWN_KEYS  # every user-visible key, none added
    assert flat["distribution"] == {"torch_distributed": {"enabled": True}}  # as the user wrote it
    again = spec_from_mapping(flat, base_dir="/elsewhere")  # what a Slurm step and the estimator's child do
    assert again == spec and again.to_dict() == flat


@pytest.mark.parametrize("part, fields, message", [
    ("Program", {"entry_point": "t.py", "framework": "jax"}, "framework must be one of pytorch, tensorflow"),
    ("Program", {"entry_point": "t\n.py"}, "entry_point must not contain control characters"),
    ("Placement", {"launcher": "ssh"}, "launcher ssh needs hosts"),
    ("Placement", {"master_port": 70000}, "master_port must be in 1..65535"),
    ("Container", {"max_run": 0}, "max_run must be a positive number of seconds"),
    ("Container", {"checkpoint_local_path": "ckpt"}, "checkpoint_local_path must be an absolute path"),
])
def test_each_part_checks_its_own_keys(part, fields, message):
    import disttrain.jobs.spec as spec_module

    with pytest.raises(UsageError, match=message):
        getattr(spec_module, part)(**fields)


def test_a_tensorflow_strategy_in_a_pytorch_program_is_refused_by_the_program():
    from disttrain.jobs.distribution import Distribution
    from disttrain.jobs.spec import Program

    with pytest.raises(UsageError, match="distribution parameter_server is for TensorFlow jobs"):
        Program(entry_point="t.py", distribution=Distribution("parameter_server"))
    with pytest.raises(UsageError, match="distribution mpi runs the instances of launcher local only"):
        spec_from_mapping({**BASE, "launcher": "ssh", "hosts": ["a"], "distribution": {"mpi": {"enabled": True}}},
                          base_dir="/")


@pytest.mark.timeout(120)
def test_the_distribution_is_parsed_and_the_launcher_chosen_once_per_run(tmp_path, monkeypatch):
    import disttrain.jobs.distribution as distribution
    import disttrain.jobs.runner as runner

    monkeypatch.setenv("DISTTRAIN_HOME", str(tmp_path / "home"))
    calls = {"parse": 0, "launcher": 0}
    parse, launcher_for = distribution.parse_distribution, runner.launcher_for

    def counted_parse(*args, **kwargs):
        calls["parse"] += 1
        return parse(*args, **kwargs)

    def counted_launcher(*args, **kwargs):
        calls["launcher"] += 1
        return launcher_for(*args, **kwargs)

    monkeypatch.setattr("disttrain.jobs.spec.parse_distribution", counted_parse)
    monkeypatch.setattr(runner, "launcher_for", counted_launcher)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "t.py").write_text("print('ran')\n")
    job = Job(name="once", entry_point="t.py", source_dir=str(tmp_path / "src"), processes_per_instance=1,
              distribution={"torch_distributed": {"enabled": True}}, output_path=str(tmp_path / "out"))
    record = job.run(store=tmp_path / "jobs.db")
    assert str(record.state) == "Completed"
    assert calls == {"parse": 1, "launcher": 1}
