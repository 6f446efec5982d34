"""Host lists and hostfiles: the forms DeepSpeed and Horovod users already write."""

from __future__ import annotations

import pytest

from disttrain.config.hosts import Host, parse_host, parse_hostfile, parse_hosts
from disttrain.errors import UsageError


def test_host_forms():
    assert parse_host("node0") == Host(name="node0")
    assert parse_host("root@10.0.0.2:2222") == Host(name="10.0.0.2", user="root", port=2222)
    assert parse_host("[fe80::1]:22") == Host(name="fe80::1", port=22)
    assert parse_host("ubuntu@node1").destination == "ubuntu@node1"


def test_hosts_list_keeps_order():
    assert [h.name for h in parse_hosts("node1, node0,node2")] == ["node1", "node0", "node2"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node0,node0", "listed twice"),
        ("", "no hosts"),
        ("bad host", "not a host"),
        ("node0:70000", "not in 1..65535"),
        ("a;b", "not a host"),
    ],
)
def test_bad_host_lists(text, message):
    with pytest.raises(UsageError, match=message):
        parse_hosts(text)


def test_hostfile_with_slots_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("# the tutorial's two nodes\n\nnode0 slots=2\nroot@node1:2222 slots=4  # big one\n")
    assert parse_hostfile(path) == (
        Host(name="node0", slots=2),
        Host(name="node1", user="root", port=2222, slots=4),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node0 gpus=2\n", r"hosts.txt:1: 'gpus=2' is not understood"),
        ("node0\nnode1 slots=0\n", r"hosts.txt:2: 'slots=0'"),
        ("# only a comment\n", "no hosts"),
    ],
)
def test_bad_hostfile_names_the_line(tmp_path, text, message):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        parse_hostfile(path)


def test_missing_hostfile(tmp_path):
    with pytest.raises(UsageError, match="cannot read it"):
        parse_hostfile(tmp_path / "nope.txt")
