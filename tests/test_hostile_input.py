"""Hostile or unlucky input is refused by disttrain itself: one line, exit 2, no traceback.

The cases an attacker and an unlucky user tried (issue 17): host names that ssh would read as
options, hostfiles and job specs that are not what they look like, a full disk under a
checkpoint, a reader that leaves the pipe, a rank stopped with SIGSTOP.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from conftest import SCRIPTS, assert_all_gone, cli_env, descendants
from disttrain.cli.main import main
from disttrain.errors import DisttrainError

GOOD = str(SCRIPTS / "ranks_report.py")


def one_line(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1, err
    return code, err.strip()


@pytest.mark.parametrize("hosts, fragment", [
    ("-V", "'-V' starts with '-', which ssh would read as an option"),
    ("-oProxyCommand=touch /tmp/x", "starts with '-'"),
    ("node0,-F/etc/passwd", "'-F/etc/passwd' starts with '-'"),
    ("-E/tmp/log", "starts with '-'"),
    ("root@-x", "is not a host"),
    ("node0,node0:22", "host 'node0' (ssh port 22) is listed twice"),
    ("node0:2222,NODE0:2222", "is listed twice"),
    ("node0:99999999", "is not a host"),
])
def test_bad_hosts_are_one_line_exit_2(capsys, hosts, fragment):
    code, err = one_line(capsys, ["run", f"--hosts={hosts}", GOOD])
    assert code == 2 and fragment in err


@pytest.mark.parametrize("content, fragment", [
    (b"node0 slots=2 slots=3\n", "slots= is given twice"),
    (b"node0 slots=99999999999999999999\n", "1 <= N <= 4096"),
    (b"node0 slots=\xd9\xa3\n", "1 <= N <= 4096"),  # an Arabic-Indic 3: isdigit(), yet no slot count
    (b"node\xff0\n", "not UTF-8 text"),
    (b"-oProxyCommand=x\n", "starts with '-'"),
    (b"node0\nnode0:22 slots=1\n", "listed twice"),
])
def test_bad_hostfiles_are_one_line_exit_2(capsys, tmp_path, content, fragment):
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(content)
    code, err = one_line(capsys, ["run", "--hostfile", str(hostfile), GOOD])
    assert code == 2 and fragment in err


@pytest.mark.parametrize("content, fragment", [
    (b"name: a\nname: b\nentry_point: t.py\n", "line 2: key 'name' is given twice"),
    (b"name: a\nenv: {A: '1', A: '2'}\nentry_point: t.py\n", "key 'A' is given twice"),
    (b"name: caf\xe9\n", "not UTF-8 text (byte 9)"),
    (b"name: " + b"[" * 100_000, "nested too deeply"),
    (b"name: " + b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"name: " + b"{a: " * 50_000, "nested too deeply"),
])
def test_bad_job_specs_are_one_line_exit_2(capsys, tmp_path, monkeypatch, content, fragment):
    monkeypatch.setenv("DISTTRAIN_STORE", str(tmp_path / "jobs.db"))
    spec = tmp_path / "job.yaml"
    spec.write_bytes(content)
    code, err = one_line(capsys, ["job", "run", str(spec)])
    assert code == 2 and fragment in err
    assert not (tmp_path / "jobs.db").exists()  # nothing recorded


@pytest.mark.timeout(60)
def test_jobs_show_into_head_is_quiet(tmp_path):
    from disttrain.store import JobStore

    store = tmp_path / "jobs.db"
    with JobStore(store) as db:  # a record far bigger than a pipe's buffer
        db.create(name="big", spec={"hyperparameters": {f"p{i}": "x" * 50 for i in range(4000)}}, job_dir="/x")
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "jobs", "show", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env(DISTTRAIN_STORE=str(store)))
    assert proc.stdout.readline().startswith(b"id:")
    proc.stdout.close()  # what `| head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=30) == 128 + signal.SIGPIPE
    assert err == ""


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: a full disk, for real."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_the_main_checkpoint_file_names_the_disk(ctx, small_disk):
    from disttrain import checkpoint

    root = small_disk / "ck"
    checkpoint.save(root, step=1, model=torch.nn.Linear(8, 8))
    with pytest.raises(DisttrainError) as raised:
        checkpoint.save(root, step=2, model=torch.nn.Linear(512, 512))  # 1 MiB of weights
    assert str(raised.value) == f"cannot write checkpoint directory {root}: No space left on device"
    assert checkpoint.latest(root).name == "step_00000001"  # the previous one intact
    assert [p.name for p in root.iterdir()] == ["step_00000001"]  # the half-written one gone


@pytest.mark.timeout(90)
def test_a_sigstopped_rank_is_reported_as_stopped(home):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "-n", "2", "--hang-timeout", "4", "--stop-grace", "2",
         str(SCRIPTS / "hang_rank1.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        assert "rank 1 gets stuck" in launcher.stdout.readline()
        workers = descendants(launcher.pid)
        (rank1,) = [p for p in workers if _rank(p) == "1"]
        rank1.send_signal(signal.SIGSTOP)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 124, err
        assert f"it is stopped by a signal (SIGSTOP/SIGTSTP, pid {rank1.pid})" in err
        assert "did not answer" not in err
        assert_all_gone(workers)
    finally:
        for proc in descendants(launcher.pid):
            proc.kill()
        launcher.kill()
        launcher.wait()


def _rank(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("RANK") if "hang_rank1.py" in " ".join(proc.cmdline()) else None
    except psutil.Error:
        return None


@pytest.mark.timeout(150)
def test_a_34_kb_hyperparameter_reaches_the_script(tmp_path):
    """Once plans travel over a private channel (issue 13's transport), not as one argv word."""
    import yaml

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(
        "import json, os, sys\n"
        "value = json.loads(os.environ['SM_HPS'])['note']\n"
        "print('note', len(value), sys.argv[sys.argv.index('--note') + 1] == value)\n")
    note = "x" * 34 * 1024
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "bighp", "entry_point": "train.py", "source_dir": str(src),
                                    "processes_per_instance": 1, "hyperparameters": {"note": note},
                                    "output_path": str(tmp_path / "artifacts")}))
    env = cli_env(DISTTRAIN_HOME=str(tmp_path / "home"), DISTTRAIN_STORE=str(tmp_path / "jobs.db"))
    result = subprocess.run([sys.executable, "-m", "disttrain", "job", "run", str(spec)], capture_output=True,
                            text=True, timeout=120, env=env)
    if "Argument list too long" in result.stderr:
        pytest.skip("the plan still travels as one argv word (E2BIG); issue 13 moves it to a private channel")
    assert result.returncode == 0, result.stderr
    assert f"note {len(note)} True" in result.stdout


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client (tests/rig_setup.sh installs it)")
def test_ssh_reads_a_host_name_as_a_name_even_past_the_checks():
    """Defence in depth: were a '-' name to slip past parse_host, "--" before the destination keeps
    ssh from taking it as an option (``ssh ... -V -- cmd`` printed ssh's version and exited 0)."""
    from disttrain.config.hosts import Host
    from disttrain.launch.ssh import master_address
    from disttrain.ssh import ssh_argv

    hostile = Host(name="-V")
    argv = ssh_argv(hostile, ["true"], options=["ConnectTimeout=3"])
    assert argv[argv.index("--") + 1] == "-V"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 255 and "OpenSSH_" not in done.stderr
    with pytest.raises(DisttrainError, match="cannot ask ssh how to reach -V"):
        master_address(hostile, [])


# --- names and paths a user gives, checked whole at every door (issue 23) ---------------------

HUGE = "x" * 10 * 1024


def _job_spec(tmp_path, **change) -> Path:
    import yaml

    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("print('ran')\n")
    data = {"name": "hj", "entry_point": "train.py", "source_dir": str(src), **change}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))  # safe_dump writes NUL and newline as YAML escapes
    return path


def _refused_before_anything(capsys, tmp_path, monkeypatch, spec: Path) -> str:
    monkeypatch.setenv("DISTTRAIN_HOME", str(tmp_path / "home"))
    code, err = one_line(capsys, ["job", "run", str(spec), "--store", str(tmp_path / "jobs.db")])
    assert code == 2
    assert not (tmp_path / "jobs.db").exists() and not (tmp_path / "home").exists()  # nothing recorded or made
    return err


@pytest.mark.parametrize("change, fragment", [
    ({"name": "hj\n"}, "name must be 1-63 letters, digits and hyphens"),
    ({"inputs": {"training\n": "/tmp"}}, "inputs: channel name 'training\\n' must be"),
    ({"hyperparameters": {"lr\n": 1}}, "hyperparameters: 'lr\\n' is not a usable name"),
    ({"env": {"API_KEY\n": "x"}}, "env: 'API_KEY\\n' is not a valid environment variable name"),
    ({"inputs": {"c" * 65: "/tmp"}}, "is 65 characters long; the limit is 64"),
    ({"hyperparameters": {"h" * 257: 1}}, "is 257 characters long; the limit is 256"),
])
def test_names_are_matched_whole_in_a_job_spec(capsys, tmp_path, monkeypatch, change, fragment):
    err = _refused_before_anything(capsys, tmp_path, monkeypatch, _job_spec(tmp_path, **change))
    assert fragment in err


@pytest.mark.parametrize("key", ["entry_point", "source_dir", "output_path", "checkpoint_s3_uri",
                                 "checkpoint_local_path", "inputs.training", "python"])
@pytest.mark.parametrize("bad, fragment", [
    ("a\x00b", "must not contain control characters (NUL, newline, tab...): '\\x00' at position 1"),
    ("a\nb", "must not contain control characters (NUL, newline, tab...): '\\n' at position 1"),
    (HUGE, "is 10240 characters long; the limit is 4096"),
    ("x" * 300, "has a component of 300 bytes"),
    ("/".join(["d" * 200] * 25), "is 5024 characters long; the limit is 4096"),
])
def test_nul_control_characters_and_huge_paths_are_one_line(capsys, tmp_path, monkeypatch, key, bad, fragment):
    change = {"inputs": {"training": bad}} if key == "inputs.training" else {key: bad}
    err = _refused_before_anything(capsys, tmp_path, monkeypatch, _job_spec(tmp_path, **change))
    assert f": {key} " in err and fragment in err


@pytest.mark.parametrize("change, fragment", [
    ({"hyperparameters": {"note": "a\x00b"}}, "hyperparameters.note contains a NUL byte (position 1)"),
    ({"hyperparameters": {"layers": [1, "x\x00"]}}, "hyperparameters.layers[1] contains a NUL byte"),
    ({"env": {"TOKEN": "t\x00k"}}, "env.TOKEN contains a NUL byte (position 1)"),
])
def test_a_nul_in_a_value_is_refused_before_the_job_is_recorded(capsys, tmp_path, monkeypatch, change, fragment):
    err = _refused_before_anything(capsys, tmp_path, monkeypatch, _job_spec(tmp_path, **change))
    assert fragment in err


def test_values_with_newlines_and_quotes_are_still_values(tmp_path):
    from disttrain.jobs import Job

    src = tmp_path / "src"
    src.mkdir()
    job = Job(name="hj", entry_point="t.py", source_dir=str(src),
              hyperparameters={"note": "two\nlines; $(x) 'q'"}, env={"MOTD": "a\tb\nc"})
    assert job.spec.program.hyperparameters["note"] == "two\nlines; $(x) 'q'"


@pytest.mark.parametrize("checkpoint, channel", [
    ("s3://bucket/data", "s3://bucket/data"),
    ("s3://bucket/data/ckpt", "s3://bucket/data/"),
    ("s3://bucket/data", "s3://bucket/data/train"),
    ("{tmp}/data/ckpt", "{tmp}/data"),
    ("file://{tmp}/data", "{tmp}/data/"),
])
def test_checkpoints_never_land_in_an_input_channel(tmp_path, checkpoint, channel):
    from disttrain.errors import UsageError
    from disttrain.jobs import Job

    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(UsageError, match=r"checkpoint_s3_uri .* and inputs.training .* overlap"):
        Job(name="hj", entry_point="t.py", source_dir=str(src), inputs={"training": channel.format(tmp=tmp_path)},
            checkpoint_s3_uri=checkpoint.format(tmp=tmp_path))
    Job(name="hj", entry_point="t.py", source_dir=str(src), inputs={"training": "s3://bucket/data"},
        checkpoint_s3_uri="s3://bucket/data-checkpoints")  # a sibling with a common prefix is fine


@pytest.mark.parametrize("output_path, url", [
    ("/", "/hj-1/model.tar.gz"),
    ("file:///", "file:///hj-1/model.tar.gz"),
    ("s3://bucket", "s3://bucket/hj-1/model.tar.gz"),
    ("s3://bucket/", "s3://bucket/hj-1/model.tar.gz"),
    ("/data/out//", "/data/out/hj-1/model.tar.gz"),
])
def test_output_path_root_means_the_root(tmp_path, output_path, url):
    from disttrain.jobs import Job
    from disttrain.jobs.results import artifact_url

    job = Job(name="hj", entry_point="t.py", source_dir=str(tmp_path), output_path=output_path)
    assert job.spec.container.output_path.startswith(("/", "file:///", "s3://bucket"))  # never relative
    assert artifact_url(job.spec.container.output_path, "hj-1", "model.tar.gz") == url


def test_fit_job_name_is_matched_whole(tmp_path, monkeypatch):
    from disttrain.errors import UsageError
    from disttrain.sagemaker.pytorch import PyTorch
    from disttrain.store import JobStore

    monkeypatch.setenv("DISTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DISTTRAIN_STORE", str(tmp_path / "jobs.db"))
    (tmp_path / "train.py").write_text("print('hi')\n")
    est = PyTorch(entry_point=str(tmp_path / "train.py"))
    for name, fragment in [("hj\n", "job_name must be 1-63 letters"), ("a" * 64, "job_name must be 1-63"),
                           ("hj\x00", "job_name must be 1-63")]:
        with pytest.raises(UsageError, match=fragment) as err:
            est.fit(job_name=name)
        assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="base_job_name must be 1-63"):
        PyTorch(entry_point=str(tmp_path / "train.py"), base_job_name="base\n").fit()
    with pytest.raises(UsageError, match="dependencies\\[0\\] must not contain control characters"):
        PyTorch(entry_point=str(tmp_path / "train.py"), dependencies=["lib\x00"]).fit()
    with JobStore() as store:
        assert store.list() == []


@pytest.mark.parametrize("argv, fragment", [
    (["run", "--dry-run", "--env", "API_KEY\n=x", GOOD], "--env takes KEY=VALUE or KEY with a valid variable name"),
    (["job", "run", "--dry-run", "--job-name", "hj\n", "job.yaml"], "--job-name must be 1-63 letters"),
])
def test_command_line_names_are_matched_whole(capsys, argv, fragment):
    code, err = one_line(capsys, argv)
    assert code == 2 and fragment in err
