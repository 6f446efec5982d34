"""Tests of the multi-node rig itself (tests/rig.py): namespaces, sshd per node, faults, teardown.

Only addresses inside namespaces these tests create (10.77.x.x there) and loopback are contacted.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

import rig
from rig import Cluster, cluster_fixture, pids_in_netns, skip_reason

cluster = cluster_fixture(2)
cluster3 = cluster_fixture(3)

SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("ready", flush=True)
while True:
    c, peer = s.accept()
    c.sendall(("pong from %s to %s" % (sys.argv[1], peer[0])).encode())
    c.close()
"""

CLIENT = r"""
import json, socket, sys, time
out = []
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=float(sys.argv[1])) as c:
            out.append(c.recv(100).decode())
    except OSError as e:
        out.append(type(e).__name__)
    out[-1] += " %.2f" % (time.monotonic() - t0)
print(json.dumps(out))
"""


def serve(c: Cluster, node: str, port: int, bind: str | None = None) -> subprocess.Popen:
    """A tiny TCP server in ``node`` on ``bind`` (the node's address by default)."""
    proc = c.popen_in(node, [sys.executable, "-c", SERVER, bind or c[node].ip, str(port)],
                      stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def connect(c: Cluster, src: str, *targets: str, timeout: float = 1.0) -> list[tuple[str, float]]:
    """From inside ``src``, connect to each "host:port"; ("pong from ..."|error name, seconds)."""
    r = c.run_in(src, [sys.executable, "-c", CLIENT, str(timeout), *targets], check=True)
    return [(s.rsplit(" ", 1)[0], float(s.rsplit(" ", 1)[1])) for s in json.loads(r.stdout)]


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def need_rig() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


def cmdlines(c: Cluster, node: str) -> list[str]:
    out = []
    for pid in c.processes_in(node):
        try:
            out.append(" ".join(psutil.Process(pid).cmdline()))
        except psutil.Error:  # exited (or became a zombie) meanwhile
            pass
    return out


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --------------------------------------------------------------------------- shape


@pytest.mark.timeout(60)
def test_two_nodes_layout(cluster):
    a, b = cluster.nodes
    assert (a.name, b.name) == ("node0", "node1")
    assert a.ip.rsplit(".", 1)[0] == b.ip.rsplit(".", 1)[0] and a.ip.startswith("10.77.")
    assert a.netns != b.netns and {a.netns, b.netns} <= netns_names()
    assert cluster.ns_id(a) != cluster.ns_id(b)
    for nd in cluster.nodes:
        r = cluster.run_in(nd, ["ip", "-o", "-4", "addr", "show"], check=True)
        addrs = {(line.split()[1], line.split()[3]) for line in r.stdout.splitlines()}
        assert addrs == {("lo", "127.0.0.1/8"), ("eth1", f"{nd.ip}/24")}, r.stdout
    # nothing of the rig in the root namespace: its interfaces are not there
    assert not any(name.startswith(("eth1", "p0", "p1", "br0")) for name in root_links())


@pytest.mark.timeout(60)
def test_tcp_between_two_nodes_and_loopback_inside_a_node(cluster):
    a, b = cluster.nodes
    serve(cluster, "node1", 29500)
    serve(cluster, "node1", 29501, bind="127.0.0.1")
    res = connect(cluster, "node0", f"{b.ip}:29500", "127.0.0.1:29501")
    assert res[0][0] == f"pong from {b.ip} to {a.ip}"
    # node0's loopback is its own: node1's 127.0.0.1 server is not there
    assert res[1][0] == "ConnectionRefusedError"
    res = connect(cluster, "node1", "127.0.0.1:29501", f"{b.ip}:29500")
    assert res[0][0] == "pong from 127.0.0.1 to 127.0.0.1"
    assert res[1][0] == f"pong from {b.ip} to {b.ip}"


@pytest.mark.timeout(60)
def test_two_clusters_at_once_do_not_clash(cluster):
    with Cluster(2) as other:
        assert other.subnet != cluster.subnet
        assert {n.netns for n in other.nodes}.isdisjoint({n.netns for n in cluster.nodes})
        assert other.ssh("node1", "echo", "ok").stdout == "ok\n"


# --------------------------------------------------------------------------- ssh


@pytest.mark.timeout(60)
def test_ssh_from_inside_node0(cluster):
    b = cluster["node1"]
    r = cluster.ssh("node1", "hostname; echo $SSH_CONNECTION")
    assert r.returncode == 0, r.stderr
    host, conn = r.stdout.splitlines()
    # every node shares the machine's hostname (UTS namespace not split): identify a node
    # by its address instead
    assert host == os.uname().nodename
    client_ip, _, server_ip, port = conn.split()
    assert (client_ip, server_ip, port) == (cluster["node0"].ip, b.ip, "22")
    # argv form: each word quoted for the remote shell
    r = cluster.ssh("node1", "echo", "a b", "$HOME", "c'd")
    assert r.stdout == "a b $HOME c'd\n"
    # by address too, and from a node to itself
    assert cluster.ssh(b.ip, "echo by-ip", src="node1").stdout == "by-ip\n"


@pytest.mark.timeout(60)
def test_remote_shell_environment_and_python(cluster, monkeypatch):
    """The remote shell is a fresh login's: its own PATH and cwd, none of the test's env.
    Only an absolute interpreter path (sys.executable; one file system) is the test's python."""
    monkeypatch.setenv("DT_RIG_MARKER", "from-the-test")
    code = "import os, sys; print(sys.executable); print(os.environ.get('DT_RIG_MARKER'))"
    r = cluster.ssh(
        "node1",
        f"echo $PATH; pwd; command -v python3 || echo none; python3 -c {shlex.quote(code)}; "
        f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}")
    assert r.returncode == 0, r.stderr
    path, cwd, which, plain_exe, plain_env, abs_exe, abs_env = r.stdout.splitlines()
    print(f"remote PATH={path}\nremote cwd={cwd}\nremote python3={which} -> {plain_exe}\n"
          f"test python={sys.executable}")
    assert cwd == os.path.expanduser("~root")
    assert path.endswith("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    assert plain_env == abs_env == "None"  # the test's environment does not travel
    assert abs_exe == sys.executable


@pytest.mark.timeout(60)
def test_ssh_from_root_namespace_fails_fast_without_leaving_the_machine(cluster):
    """The nodes are not routable from the root namespace; the config's BindInterface makes
    ssh fail locally instead of sending 10.77.x.x out through the default route."""
    if "eth1" in root_links():
        pytest.skip("the root namespace has an eth1 here; the guard does not apply")
    t0 = time.monotonic()
    r = subprocess.run(["ssh", "-F", str(cluster.ssh_config), "node1", "true"],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 255 and time.monotonic() - t0 < 3
    assert "no suitable addresses" in r.stderr or "failure" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_gloo_across_nodes_over_ssh(cluster):
    """The end-to-end use: one torch.distributed rank per node, started over ssh from node0,
    meeting at node0's address with GLOO_SOCKET_IFNAME=eth1."""
    a = cluster["node0"]
    code = ("import os, torch, torch.distributed as d; r = int(os.environ['RANK']); "
            f"d.init_process_group('gloo', init_method='tcp://{a.ip}:29500', rank=r, "
            "world_size=2); t = torch.tensor([r + 1.0]); d.all_reduce(t); "
            "print(r, t.item()); d.destroy_process_group()")
    procs = [
        subprocess.Popen(cluster.ssh_argv(
            node, f"env RANK={rank} GLOO_SOCKET_IFNAME=eth1 OMP_NUM_THREADS=1 "
                  f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        for rank, node in enumerate(["node0", "node1"])]
    outs = [p.communicate(timeout=50) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["0 3.0", "1 3.0"]


# --------------------------------------------------------------------------- faults


@pytest.mark.timeout(60)
def test_block_port_drops_or_refuses_only_on_eth1(cluster):
    a, b = cluster.nodes
    serve(cluster, "node1", 29500)
    serve(cluster, "node1", 29501)
    cluster.block_port("node1", 29500)
    cluster.block_port("node1", 29501, action="REJECT")
    res = connect(cluster, "node0", f"{b.ip}:29500", f"{b.ip}:29501", timeout=1.0)
    assert res[0][0] == "TimeoutError" and res[0][1] >= 0.9
    assert res[1][0] == "ConnectionRefusedError" and res[1][1] < 0.5
    # the node's own path (its address is reached over lo) stays open
    res = connect(cluster, "node1", f"{b.ip}:29500")
    assert res[0][0].startswith("pong")
    assert cluster.ssh("node1", "echo ssh-still-open").stdout == "ssh-still-open\n"
    cluster.clear_rules("node1")
    assert connect(cluster, "node0", f"{b.ip}:29500")[0][0].startswith("pong")


@pytest.mark.timeout(60)
def test_only_allow_keeps_ssh_and_the_nodes_own_outgoing_connections(cluster):
    a, b = cluster.nodes
    serve(cluster, "node1", 29500)
    serve(cluster, "node1", 40000)
    serve(cluster, "node0", 29600)
    cluster.only_allow("node1", [22, 29500])
    res = connect(cluster, "node0", f"{b.ip}:29500", f"{b.ip}:40000", timeout=1.0)
    assert res[0][0].startswith("pong") and res[1][0] == "TimeoutError"
    assert cluster.ssh("node1", "echo", "in").stdout == "in\n"
    # replies to node1's own connections come back in (a stateful security group)
    assert connect(cluster, "node1", f"{a.ip}:29600")[0][0].startswith("pong")
    # block_port wins over an allowed port
    cluster.block_port("node1", 29500)
    assert connect(cluster, "node0", f"{b.ip}:29500", timeout=0.5)[0][0] == "TimeoutError"


@pytest.mark.timeout(60)
def test_kill_all_empties_a_node_but_keeps_its_sshd(cluster):
    proc = cluster.popen_in("node1", ["sleep", "300"])
    deadline = time.monotonic() + 5
    while proc.pid not in cluster.processes_in("node1") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.processes_in("node1") == [proc.pid]
    cluster.kill_all("node1")
    assert proc.wait(timeout=5) == -signal.SIGTERM
    assert cluster.processes_in("node1") == []
    assert len(cluster.processes_in("node1", include_sshd=True)) == 1
    assert cluster.ssh("node1", "echo", "alive").stdout == "alive\n"


# --------------------------------------------------------------------------- teardown


@pytest.mark.timeout(60)
def test_teardown_kills_everything_in_the_namespaces_and_removes_them():
    need_rig()
    links_before = root_links()
    with Cluster(2) as c:
        names = {n.netns for n in c.nodes}
        ids = [c.ns_id(n) for n in c.nodes]
        sshd = [c.sshd_pid(n) for n in c.nodes]
        workdir = c.workdir
        assert c.processes_in("node0") == [] and c.processes_in("node1") == []
        # a local process, one that ignores SIGTERM, and a remote command orphaned by
        # killing its ssh client (the remote side keeps running: the trap of plain ssh)
        local = c.popen_in("node0", ["sleep", "300"])
        stubborn = c.popen_in("node0", [sys.executable, "-c",
                                        "import signal, time; signal.signal(signal.SIGTERM, "
                                        "signal.SIG_IGN); print('x', flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE)
        stubborn.stdout.readline()
        client = subprocess.Popen(c.ssh_argv("node1", "echo started; exec sleep 301"),
                                  stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert client.stdout.readline() == "started\n"
        client.kill()
        client.wait()
        client.stdout.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cmds = cmdlines(c, "node1")
            if "sleep 301" in cmds:
                break
            time.sleep(0.05)
        assert "sleep 301" in cmds, cmds
        assert {local.pid, stubborn.pid} <= set(c.processes_in("node0"))
    assert local.wait(timeout=5) == -signal.SIGTERM
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    assert names.isdisjoint(netns_names())
    assert all(pids_in_netns(i) == [] for i in ids)
    assert not any(running(p) for p in sshd)
    assert not workdir.exists()
    assert root_links() == links_before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_teardown_runs_on_failure_and_interrupt(exc):
    need_rig()
    with pytest.raises(exc):
        with Cluster(3) as c:
            names = {n.netns for n in c.nodes} | {c.switch_ns}
            ids = [c.ns_id(n) for n in c.nodes]
            c.popen_in("node2", ["sleep", "300"])
            c.block_port("node1", 22)
            raise exc("boom")
    assert names.isdisjoint(netns_names())
    assert all(pids_in_netns(i) == [] for i in ids)


@pytest.mark.timeout(60)
def test_a_dead_owners_namespaces_are_reaped():
    need_rig()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{rig.PREFIX}{dead.pid}x0n0"
    stale_dir = Path(tempfile.mkdtemp(prefix=f"{rig.PREFIX}{dead.pid}x0-"))
    subprocess.run(["ip", "netns", "add", stale], check=True)
    orphan = None
    try:
        orphan = subprocess.Popen(["nsenter", f"--net=/run/netns/{stale}", "--", "sh", "-c",
                                   "echo in; exec sleep 300"], stdout=subprocess.PIPE, text=True)
        assert orphan.stdout.readline() == "in\n"  # inside the namespace before the reaping
        with Cluster(2):
            assert stale not in netns_names()
            assert not stale_dir.exists()
        assert orphan.wait(timeout=5) < 0
    finally:
        if orphan is not None:
            if orphan.poll() is None:
                orphan.kill()
                orphan.wait()
            orphan.stdout.close()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        shutil.rmtree(stale_dir, ignore_errors=True)


# --------------------------------------------------------------------------- bridge


@pytest.mark.timeout(60)
def test_three_nodes_on_a_bridge(cluster3):
    nodes = cluster3.nodes
    assert [n.name for n in nodes] == ["node0", "node1", "node2"]
    assert cluster3.switch_ns and cluster3.switch_ns in netns_names()
    for n in nodes:
        serve(cluster3, n.name, 29500)
    for n in nodes:  # full mesh
        others = [f"{m.ip}:29500" for m in nodes if m is not n]
        res = connect(cluster3, n.name, *others)
        assert [r for r, _ in res] == [f"pong from {m.ip} to {n.ip}" for m in nodes if m is not n]
    r = cluster3.ssh("node2", "echo $SSH_CONNECTION", src="node1")
    assert r.stdout.split()[0::2] == [nodes[1].ip, nodes[2].ip]
    cluster3.block_port("node2", 29500)
    assert connect(cluster3, "node0", f"{nodes[2].ip}:29500", timeout=0.5)[0][0] == "TimeoutError"
    assert connect(cluster3, "node0", f"{nodes[1].ip}:29500")[0][0].startswith("pong")


@pytest.mark.timeout(60)
def test_skip_reason_is_none_here_or_a_clear_sentence():
    reason = skip_reason()
    assert reason is None or reason.startswith("rig: ")


@pytest.mark.timeout(60)
def test_rig_setup_is_fast_when_everything_is_installed():
    need_rig()  # everything is installed then
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(rig.SETUP_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "installing" not in r.stderr and time.monotonic() - t0 < 5
