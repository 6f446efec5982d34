"""Bad input: one line, exit code 2, nothing started, no run folder, no traceback."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import SCRIPTS, cli_env, disttrain

GOOD = str(SCRIPTS / "sleeper.py")


def assert_usage_error(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["run", "-n", "2", "missing_script.py"], ["script not found: missing_script.py"]),
        (["run", "-n", "1", str(SCRIPTS)], [f"{SCRIPTS} is a directory, not a script"]),
        (["run", "--log-dir", "/tmp/a\nb", GOOD], ["--log-dir '/tmp/a\\nb' holds a control character ('\\n'"]),
        (["run", "-n", "0", GOOD], ["-n/--nproc-per-node must be at least 1"]),
        (["run", "-n", "abc", GOOD], ["positive integer or 'auto'", "'abc'"]),
        (["run", "--master-port", "70000", GOOD], ["1..65535"]),
        (["run", "--backend", "nope", GOOD], ["unknown backend 'nope'", "--launcher local|ssh|slurm"]),
        (["run", "--launcher", "nope", GOOD], ["unknown launcher 'nope'", "--launcher takes local, ssh, slurm"]),
        (["run", "--dist-backend", "nope", GOOD], ["unknown backend 'nope'"]),
        (["run", "--backend", "gloo", "--dist-backend", "nccl", GOOD], ["disagree"]),
        (["run", "--launcher", "ssh", GOOD], ["--launcher ssh needs --hosts"]),
        (["run", "--nodes", "2", GOOD], ["--nodes is a Slurm flag: add --launcher slurm"]),
        (["run", "-m", "no_such_module_xyz"], ["module 'no_such_module_xyz' not found"]),
        (["run", "--ranks", "7", "-n", "2", GOOD], ["rank 7"]),
        (["run", "--env", "oops", GOOD], ["--env oops: oops is not set", "--env oops=VALUE"]),
        (["run", "--env", "1BAD=x", GOOD], ["KEY=VALUE or KEY"]),
        (["run", "--bogus-flag", GOOD], ["unrecognized arguments"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, fragments):
    result = disttrain(*args, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert_usage_error(result, *fragments)
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_a_free_port_is_below_the_range_of_outgoing_connections():
    """Not one the OS could give an outgoing connection before the rendezvous binds it."""
    import socket

    from disttrain.net import PORTS_FROM, _ephemeral_start, free_port

    ports = {free_port() for _ in range(20)}
    assert all(PORTS_FROM <= port < _ephemeral_start() for port in ports), ports
    assert len(ports) > 1  # random: two launchers at once rarely meet
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # free when given


def test_master_port_in_use_is_reported_before_start(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = disttrain("run", "--master-port", str(port), GOOD,
                           env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert_usage_error(result, f"--master-port {port} is already in use")
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_backend_gloo_still_works_with_one_line_of_warning(tmp_path):
    """--backend named the process-group backend before it named where processes start."""
    result = disttrain("run", "--backend", "gloo", "--dry-run", GOOD, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ("disttrain: warning: --backend gloo is deprecated for the process-group backend; "
                             "use --dist-backend gloo\n")
    assert json.loads(result.stdout)["dist_backend"] == "gloo"
    new = disttrain("run", "--dist-backend", "gloo", "--launcher", "local", "--dry-run", GOOD,
                    env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert new.returncode == 0 and new.stderr == "", new.stderr
    assert json.loads(new.stdout)["dist_backend"] == "gloo"
    old = disttrain("run", "--backend", "local", "--dry-run", GOOD, env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert old.returncode == 0, old.stderr
    assert old.stderr == "disttrain: warning: --backend local is deprecated for the launcher; use --launcher local\n"


@pytest.mark.timeout(60)
def test_a_control_character_in_disttrain_home_is_one_line(tmp_path):
    home = f"{tmp_path}/a\nb"
    for argv in (["run", GOOD], ["jobs", "ls"]):
        result = disttrain(*argv, env=cli_env(DISTTRAIN_HOME=home))
        assert_usage_error(result, "DISTTRAIN_HOME", "holds a control character ('\\n'", "plain folder path")
    assert list(tmp_path.iterdir()) == []
