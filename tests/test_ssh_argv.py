"""Golden tests of the generated ssh argv, with hostile paths and arguments."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from disttrain.backends.ssh import parse_ssh_options, remote_command, ssh_argv
from disttrain.config.hosts import Host
from disttrain.errors import UsageError

WEIRD = "/tmp/a'; echo foo"


def test_golden_ssh_argv():
    argv = ssh_argv(
        Host(name="node1", user="root", port=2222),
        ["/venv/bin/python", "-u", "train.py", "--name", "a b;c'd"],
        options=["IdentityFile=/keys/id", "StrictHostKeyChecking=accept-new"],
        cwd=WEIRD,
        env={"GLOO_SOCKET_IFNAME": "eth1", "X": "$(reboot)"},
    )
    assert argv == [
        "ssh", "-T",
        "-o", "IdentityFile=/keys/id",
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=10",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-p", "2222",
        "--", "root@node1",
        "cd '/tmp/a'\"'\"'; echo foo' && exec env GLOO_SOCKET_IFNAME=eth1 'X=$(reboot)' "
        "/venv/bin/python -u train.py --name 'a b;c'\"'\"'d'",
    ]


def test_tool_never_turns_host_key_checking_off():
    argv = ssh_argv(Host(name="n"), ["true"])
    assert not any("StrictHostKeyChecking" in word or "UserKnownHostsFile" in word for word in argv)


@pytest.mark.timeout(10)
def test_remote_command_round_trips_through_a_real_shell(tmp_path):
    words = ["printf", "%s\\n", "a b", "c'd", 'e"f', "g;h", "$(touch x)", "*", ""]
    cwd = tmp_path / "dir with 'quote'; and more"
    cwd.mkdir()
    out = subprocess.run(["sh", "-c", remote_command(words, cwd=str(cwd))],
                         capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:-1] == ["a b", "c'd", 'e"f', "g;h", "$(touch x)", "*", ""]
    assert not (cwd / "x").exists()
    assert shlex.split(remote_command(["a b"]))[-1] == "a b"


def test_ssh_option_parsing():
    assert parse_ssh_options(["IdentityFile=~/.ssh/k"]) == ("IdentityFile=~/.ssh/k",)
    for bad in ("IdentityFile", "=x", "Ident ity=x"):
        with pytest.raises(UsageError, match="--ssh-option"):
            parse_ssh_options([bad])
