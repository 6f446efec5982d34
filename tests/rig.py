"""A real multi-node test rig on one Linux machine: network namespaces + one sshd per node.

Each *node* is a network namespace with loopback up and one interface, named the same in
every node (``eth1`` by default, so one ``GLOO_SOCKET_IFNAME=eth1`` serves all of them),
holding a private address ``10.77.<k>.<i+1>/24`` (``k`` differs per cluster).  Two nodes are
joined by a veth pair; three or more by a bridge that lives in its own "switch" namespace.
Nothing is added to the root namespace: no interface, no route, no address, no firewall rule.

Every node runs its own OpenSSH ``sshd`` listening on the node's address only, configured
entirely from a temp dir (host key, authorized client key, pid and log files).  A client
config written there has one ``Host nodeK`` entry per node, so from *inside any node*::

    ssh -F <cluster.ssh_config> node1 <command>

works without prompts.  The root namespace has no route to the nodes (10.77.x.x would
leave through its default route, to the outside): run ssh (and the launcher under test)
inside a node, typically node0, as a user logged in on node0 would.  The config binds the
client to ``eth1`` (``BindInterface``), so ssh started in the root namespace by mistake
fails at once ("eth1: no suitable addresses") rather than contacting the outside.

What a remote command sees (``ssh nodeK cmd``, the same as on a real Debian box): the
command runs in ``bash -c`` started by sshd with ``UsePAM no``, so PATH starts as sshd's
default ``/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin`` and then whatever
root's ``~/.bashrc`` adds (Debian's bash reads ``~/.bashrc`` for ssh commands); the cwd is
``$HOME``; none of the test's environment variables are passed.  A bare ``python3`` there
is therefore not necessarily the interpreter running the tests (a venv, a pyenv version):
use ``sys.executable`` (an absolute path; all nodes share the file system) and pass any
environment explicitly (``env VAR=... /abs/python ...``).  All nodes share the machine's
hostname (which resolves to 127.0.0.1): identify a node by its address, e.g. from
``$SSH_CONNECTION`` remotely.

Teardown always runs (exception, KeyboardInterrupt, pytest-timeout's signal): every process
whose network namespace is a node's is killed (sshd too), the namespaces are deleted (which
removes their veths, the bridge and their iptables rules) and the temp dir is removed.  A
cluster left behind by a killed test process (SIGKILL, ``os._exit``) is reaped by the next
``Cluster.start()`` on the machine: namespace names carry the owner's pid.  Killed daemons
(sshd) are re-parented to PID 1, which on this machine reaps them within a few seconds:
``ps`` may briefly show ``[sshd] <defunct>``; ``processes_in`` ignores zombies.

Usage::

    from rig import Cluster, cluster_fixture

    cluster = cluster_fixture(n=2)          # a pytest fixture named "cluster"

    def test_something(cluster):
        r = cluster.ssh("node1", "echo", "hi")          # runs ssh inside node0
        assert r.stdout == "hi\\n"
        cluster.block_port("node0", 29500)
        subprocess.run(cluster.ns_exec("node0", [sys.executable, "-m", "disttrain", ...]))

    with Cluster(3) as c:                   # outside pytest
        print(c.nodes, c.ssh_config)
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

NETNS_DIR = Path("/run/netns")
SSHD = "/usr/sbin/sshd"
SETUP_SCRIPT = Path(__file__).with_name("rig_setup.sh")
PREFIX = "dtr"  # namespace names: dtr<owner pid>x<cluster no>n<node no> / ...sw
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x(\d+)(?:n\d+|sw)$")
_counter = itertools.count()
_live: "set[Cluster]" = set()

REQUIRED_TOOLS = ("ip", "nsenter", "iptables", "ssh", "ssh-keygen", "tc")


# --------------------------------------------------------------------------- helpers


def _run(argv: Sequence[str], *, input: str | None = None, timeout: float = 30,
         check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                       timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RigError(f"{shlex.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
    return r


class RigError(RuntimeError):
    pass


def _ns_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in_netns(ns_id: tuple[int, int]) -> list[int]:
    """Live (non-zombie) processes whose network namespace is ``ns_id`` (st_dev, st_ino)."""
    me = os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == me:
            continue
        try:
            st = os.stat(f"/proc/{pid}/ns/net")  # fails for zombies and vanished pids
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == ns_id:
            out.append(pid)
    return out


def _kill_netns_processes(ns_id: tuple[int, int], grace: float = 1.0, deadline: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process in the namespace until none is left.
    Returns the pids still alive after ``deadline`` seconds (normally none)."""
    end = time.monotonic() + deadline
    termed: set[int] = set()
    term_time = None
    while True:
        pids = pids_in_netns(ns_id)
        if not pids:
            return []
        now = time.monotonic()
        if now > end:
            return pids
        for pid in pids:
            if pid not in termed:
                sig = signal.SIGTERM
                termed.add(pid)
                term_time = term_time or now
            elif now - (term_time or now) >= grace:
                sig = signal.SIGKILL
            else:
                continue
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()  # nsenter execs argv, so this is the process itself
    proc.wait(timeout=5)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream:
            stream.close()


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> list[str]:
    """Delete rig namespaces (and kill their processes) and temp dirs whose owning process
    is gone. Returns the namespace names deleted."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*x*-*"):
        m = re.match(rf"^{PREFIX}(\d+)x\d+-", path.name)
        if m and path.is_dir() and not _owner_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    if not NETNS_DIR.is_dir():
        return []
    reaped = []
    for path in sorted(NETNS_DIR.iterdir()):
        m = _NAME_RE.match(path.name)
        if not m or _owner_alive(int(m.group(1))):
            continue
        ns_id = _ns_id(path)
        if ns_id:
            _kill_netns_processes(ns_id, grace=0.2)
        if _run(["ip", "netns", "del", path.name], check=False).returncode == 0:
            reaped.append(path.name)
    return reaped


# --------------------------------------------------------------------------- link shaping

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 bits per second (tc's decimal units)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", rate.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"rate {rate!r}: a number and one of {', '.join(_UNITS)}, e.g. 1gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def tbf_burst(rate: str) -> str:
    """tbf's bucket: 1 ms of traffic at ``rate``, at least 64 kB. Large enough that the
    rate is reached (a bucket below rate/HZ starves the queue), small enough that a burst
    of small messages does not pass unshaped."""
    return f"{max(64 * 1024, int(rate_bits(rate) / 8 / 1000))}b"


@lru_cache(maxsize=None)
def netem_available() -> bool:
    """Whether ``tc qdisc add ... netem`` works here (tried on a dummy link in a throwaway
    namespace)."""
    probe = f"{PREFIX}{os.getpid()}netem"
    if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
        return False
    try:
        _run(["ip", "-n", probe, "link", "add", "d0", "type", "dummy"], check=False)
        r = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "d0", "root", "netem",
                  "delay", "1ms"], check=False)
        return r.returncode == 0
    finally:
        _run(["ip", "netns", "del", probe], check=False)


# --------------------------------------------------------------------------- can we?


@lru_cache(maxsize=None)
def skip_reason(install: bool = True) -> str | None:
    """None if this machine can run a Cluster, else a one-line reason to skip.

    With ``install``, missing tools are installed once by tests/rig_setup.sh (apt-get)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "rig: needs Linux network namespaces"
    if os.geteuid() != 0:
        return "rig: needs root (network namespaces, sshd)"

    def missing() -> list[str]:
        return [t for t in REQUIRED_TOOLS if shutil.which(t) is None] + \
            ([SSHD] if not os.access(SSHD, os.X_OK) else [])

    if missing() and install and SETUP_SCRIPT.exists():
        try:
            r = subprocess.run(["bash", str(SETUP_SCRIPT)], capture_output=True, text=True,
                               timeout=600, stdin=subprocess.DEVNULL)
            note = r.stderr.strip().splitlines()[-1:] if r.returncode else []
        except (OSError, subprocess.TimeoutExpired) as e:
            note = [str(e)]
        if missing():
            return f"rig: missing {', '.join(missing())} and {SETUP_SCRIPT.name} could not install them {note}"
    elif missing():
        return f"rig: missing {', '.join(missing())} (run tests/rig_setup.sh)"

    probe = f"{PREFIX}{os.getpid()}probe"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"rig: `ip netns add` fails: {r.stderr.strip()}"
    try:
        r = _run(["ip", "-n", probe, "link", "add", "eth1", "type", "veth", "peer", "name", "eth2"],
                 check=False)
        if r.returncode != 0:
            return f"rig: cannot create a veth pair: {r.stderr.strip()}"
        r = _run(["nsenter", f"--net={NETNS_DIR / probe}", "--", "iptables", "-w", "-S", "INPUT"],
                 check=False)
        if r.returncode != 0:
            return f"rig: iptables does not work in a namespace: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class Node:
    name: str       # ssh alias, "node0".. ; also the key for every Cluster method
    index: int
    netns: str      # network namespace name (under /run/netns)
    ip: str         # address on `ifname` inside the namespace
    ifname: str     # "eth1"

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)


class Cluster:
    """N nodes (network namespaces) each with its own sshd; see the module docstring.

    ``Cluster(n=2, workdir=None, subnet=None, ifname="eth1", bridge=None, ssh_port=22)``:
    ``subnet`` is three octets ("10.77.5"), picked per cluster when None; ``bridge`` forces
    a bridge (default: veth pair for 2 nodes, bridge for 1 or 3+); ``workdir`` holds keys,
    configs, pid and log files (a fresh temp dir, removed at teardown, when None).
    ``private`` maps a node name to folders that node sees as its own, empty (a tmpfs in a
    mount namespace of its sshd's): a host without the launcher's files, as on machines
    that share no filesystem. The folders must exist. ``binds`` maps a node name to
    ``{path: replacement}``: that node sees the replacement file at ``path`` (another
    version of a package file, say), the others the original.
    """

    def __init__(self, n: int = 2, *, workdir: str | os.PathLike | None = None,
                 subnet: str | None = None, ifname: str = "eth1", bridge: bool | None = None,
                 ssh_port: int = 22, private: dict[str, Sequence[str]] | None = None,
                 binds: dict[str, dict[str, str]] | None = None):
        if not 1 <= n <= 250:
            raise ValueError("n must be in 1..250")
        self.n = n
        self.ifname = ifname
        self.ssh_port = ssh_port
        self.bridge = (n != 2) if bridge is None else bridge
        if not self.bridge and n != 2:
            raise ValueError("without a bridge there must be exactly 2 nodes (a veth pair)")
        self.id = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        if subnet is None:
            subnet = f"10.77.{(os.getpid() * 31 + int(self.id.rsplit('x', 1)[1])) % 254 + 1}"
        self.subnet = subnet
        self.nodes: list[Node] = [
            Node(f"node{i}", i, f"{self.id}n{i}", f"{subnet}.{i + 1}", ifname) for i in range(n)]
        self.switch_ns = f"{self.id}sw" if self.bridge else None
        self._own_workdir = workdir is None
        self._workdir_arg = workdir
        self.workdir: Path | None = None
        self.ssh_config: Path | None = None
        self.ssh_key: Path | None = None
        self._ns_ids: dict[str, tuple[int, int]] = {}
        self._rules: dict[str, list[list[str]]] = {}
        self._popens: list[subprocess.Popen] = []
        self._started = False
        self.timings: dict[str, float] = {}
        self.private = dict(private or {})
        self.binds = dict(binds or {})

    # ---- lookup

    def node(self, node: "str | int | Node") -> Node:
        if isinstance(node, Node):
            return node
        if isinstance(node, int):
            return self.nodes[node]
        for nd in self.nodes:
            if node in (nd.name, nd.netns, nd.ip):
                return nd
        raise KeyError(node)

    def __getitem__(self, node: "str | int") -> Node:
        return self.node(node)

    @property
    def client_ssh_options(self) -> list[str]:
        """The rig's key and known-hosts choice as ssh -o values: what a test hands disttrain as
        ``--ssh-option``/``ssh_options`` (disttrain itself never adds them)."""
        return [f"IdentityFile={self.ssh_key}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
                "LogLevel=ERROR"]

    def cli_ssh_args(self) -> list[str]:
        """``--ssh-option VALUE`` for each of :attr:`client_ssh_options`."""
        return [arg for option in self.client_ssh_options for arg in ("--ssh-option", option)]

    def ns_id(self, node: "str | int | Node") -> tuple[int, int]:
        """(st_dev, st_ino) of the node's network namespace; stays valid after teardown."""
        return self._ns_ids[self.node(node).netns]

    def __repr__(self) -> str:
        return f"Cluster({self.id}, {[(n.name, n.ip) for n in self.nodes]})"

    # ---- lifecycle

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Cluster":
        if self._started:
            return self
        t0 = time.perf_counter()
        reap_stale()
        self._started = True
        _live.add(self)
        try:
            self._make_workdir()
            self._make_network()
            self.timings["network_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self._make_keys_and_configs()
            for nd in self.nodes:
                self._start_sshd(nd)
            self.timings["sshd_s"] = time.perf_counter() - t1
        except BaseException:
            self.stop()
            raise
        self.timings["up_s"] = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        """Tear everything down; safe to call twice, keeps going past errors and ^C."""
        if not self._started:
            return
        t0 = time.perf_counter()
        errors: list[BaseException] = []

        def step(fn, *args):
            for _attempt in range(3):  # a second ^C / timeout signal must not skip cleanup
                try:
                    fn(*args)
                    return
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
                    if not isinstance(e, (KeyboardInterrupt,)) and type(e).__name__ != "Failed":
                        return

        for nd in self.nodes:
            step(self._stop_sshd, nd)
        all_ns = [nd.netns for nd in self.nodes] + ([self.switch_ns] if self.switch_ns else [])
        for ns in all_ns:
            if ns in self._ns_ids:
                step(self._kill_all_in, self._ns_ids[ns])
        for proc in self._popens:  # reap what popen_in started (no zombies, no warnings)
            step(_reap, proc)
        self._popens.clear()
        for nd in self.nodes:
            if self._rules.get(nd.name):
                step(self.clear_rules, nd)
        for ns in all_ns:
            step(self._del_netns, ns)
        if self._own_workdir and self.workdir is not None:
            step(shutil.rmtree, self.workdir, True)
        self._started = False
        _live.discard(self)
        self.timings["down_s"] = time.perf_counter() - t0
        leftover = [e for e in errors if not isinstance(e, KeyboardInterrupt)]
        if any(isinstance(e, KeyboardInterrupt) for e in errors):
            raise KeyboardInterrupt
        if leftover:
            raise leftover[0]

    # ---- building blocks

    def _make_workdir(self) -> None:
        if self._own_workdir:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        else:
            self.workdir = Path(self._workdir_arg) / self.id
            self.workdir.mkdir(parents=True, exist_ok=False)

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        ns_id = _ns_id(NETNS_DIR / name)
        if ns_id is None:
            raise RigError(f"namespace {name} created but {NETNS_DIR / name} is missing")
        self._ns_ids[name] = ns_id

    def _make_network(self) -> None:
        for nd in self.nodes:
            self._add_ns(nd.netns)
        if self.switch_ns:
            self._add_ns(self.switch_ns)
            _run(["ip", "-n", self.switch_ns, "-batch", "-"],
                 input="link set lo up\nlink add br0 type bridge\nlink set br0 up\n")
            for nd in self.nodes:
                # created directly inside the two namespaces: no name ever exists in the root one
                _run(["ip", "link", "add", "name", nd.ifname, "netns", nd.netns, "type", "veth",
                      "peer", "name", f"p{nd.index}", "netns", self.switch_ns])
            _run(["ip", "-n", self.switch_ns, "-batch", "-"],
                 input="".join(f"link set p{nd.index} master br0\nlink set p{nd.index} up\n"
                               for nd in self.nodes))
        else:
            a, b = self.nodes
            _run(["ip", "link", "add", "name", a.ifname, "netns", a.netns, "type", "veth",
                  "peer", "name", b.ifname, "netns", b.netns])
        for nd in self.nodes:
            _run(["ip", "-n", nd.netns, "-batch", "-"],
                 input=f"link set lo up\naddr add {nd.ip}/24 dev {nd.ifname}\n"
                       f"link set {nd.ifname} up\n")

    def _make_keys_and_configs(self) -> None:
        w = self.workdir
        for key in ("host_key", "client_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.id}-{key}",
                  "-f", str(w / key)])
        shutil.copyfile(w / "client_key.pub", w / "authorized_keys")
        os.chmod(w / "authorized_keys", 0o600)
        self.ssh_key = w / "client_key"
        for nd in self.nodes:
            (w / f"sshd_{nd.name}.conf").write_text(
                f"ListenAddress {nd.ip}\n"
                f"Port {self.ssh_port}\n"
                f"HostKey {w / 'host_key'}\n"
                f"AuthorizedKeysFile {w / 'authorized_keys'}\n"
                f"PidFile {w / f'sshd_{nd.name}.pid'}\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "UseDNS no\n"
                "PrintMotd no\n"
                "PrintLastLog no\n"
                "X11Forwarding no\n"
                "MaxStartups 200\n"
                "MaxSessions 200\n"
                "LogLevel VERBOSE\n"
                "AcceptEnv LANG LC_*\n"
                "Subsystem sftp /usr/lib/openssh/sftp-server\n")
        common = ("  User root\n"
                  f"  Port {self.ssh_port}\n"
                  f"  IdentityFile {self.ssh_key}\n"
                  "  IdentitiesOnly yes\n"
                  "  StrictHostKeyChecking no\n"
                  "  UserKnownHostsFile /dev/null\n"
                  "  LogLevel ERROR\n"
                  "  BatchMode yes\n"
                  "  ConnectTimeout 5\n"
                  # A guard: from a namespace without this interface (the root one) ssh fails
                  # at once instead of sending the nodes' private addresses out the default route.
                  f"  BindInterface {self.ifname}\n")
        entries = [f"Host {nd.name} {nd.ip}\n  HostName {nd.ip}\n{common}" for nd in self.nodes]
        self.ssh_config = w / "ssh_config"
        self.ssh_config.write_text("\n".join(entries))

    def _start_sshd(self, nd: Node) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        conf = self.workdir / f"sshd_{nd.name}.conf"
        log = self.workdir / f"sshd_{nd.name}.log"
        # nsenter, not `ip netns exec`: that one also unshares the mount namespace and
        # remounts /sys (hiding /sys/fs/cgroup) for sshd and every session it spawns.
        # sshd daemonizes first, then listens, then writes its pid file: the node accepts
        # connections once the pid file exists.
        argv = [SSHD, "-f", str(conf), "-E", str(log)]
        mounts = [f"mount -t tmpfs tmpfs {shlex.quote(d)}" for d in self.private.get(nd.name, ())]
        mounts += [f"mount --bind {shlex.quote(src)} {shlex.quote(path)}"
                   for path, src in self.binds.get(nd.name, {}).items()]
        if mounts:
            # The mounts live as long as the mount namespace: sshd and its sessions.
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    f"{' && '.join(mounts)} && exec {shlex.join(argv)}"]
        r = _run(self.ns_exec(nd, argv), check=False)
        end = time.monotonic() + 10
        # sshd creates the pid file and then writes it: an empty file is not started yet.
        while r.returncode == 0 and self.sshd_pid(nd) is None and time.monotonic() < end:
            time.sleep(0.005)
        if r.returncode != 0 or self.sshd_pid(nd) is None:
            logtext = log.read_text() if log.exists() else ""
            raise RigError(f"sshd for {nd.name} did not start (rc {r.returncode}): "
                           f"{r.stderr.strip()} {logtext.strip()}")

    def sshd_pid(self, node: "str | int | Node") -> "int | None":
        """The node's listening sshd, once its pid file is complete."""
        if self.workdir is None:
            return None
        try:
            text = (self.workdir / f"sshd_{self.node(node).name}.pid").read_text()
            return int(text.split()[0]) if text.endswith("\n") else None
        except (OSError, ValueError, IndexError):
            return None

    def _stop_sshd(self, nd: Node) -> None:
        pid = self.sshd_pid(nd)
        if pid is None:
            return
        # only if it still is our sshd, in our namespace (pid reuse)
        if pid in pids_in_netns(self._ns_ids.get(nd.netns, (0, 0))):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _kill_all_in(self, ns_id: tuple[int, int]) -> None:
        left = _kill_netns_processes(ns_id)
        if left:
            raise RigError(f"processes survived SIGKILL in namespace {ns_id}: {left}")

    def _del_netns(self, ns: str) -> None:
        if (NETNS_DIR / ns).exists():
            _run(["ip", "netns", "del", ns])

    # ---- running things

    def ns_exec(self, node: "str | int | Node", argv: Sequence[str] = ()) -> list[str]:
        """``[nsenter, --net=/run/netns/NS, --, *argv]``: run argv inside the node's network
        namespace (same mount namespace, /sys and cgroups as the caller)."""
        return ["nsenter", f"--net={self.node(node).netns_path}", "--", *argv]

    def ssh_argv(self, node: "str | int | Node", *cmd: str, src: "str | int | Node" = 0,
                 options: Sequence[str] = ()) -> list[str]:
        """argv that runs ``ssh -F <config> NODE CMD`` inside node ``src`` (node0 by default).

        One ``cmd`` string is a remote shell command line, sent as is; several are an argv,
        each quoted (``ssh_argv("node1", "python3", "-c", "print(1)")``)."""
        remote = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
        argv = ["ssh", "-F", str(self.ssh_config), *options, self.node(node).name]
        if cmd:
            argv.append(remote)
        return self.ns_exec(src, argv)

    def ssh(self, node: "str | int | Node", *cmd: str, src: "str | int | Node" = 0,
            options: Sequence[str] = (), timeout: float = 30, check: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """Run CMD on NODE over ssh from inside node ``src``; returns the CompletedProcess
        (text, stdout/stderr captured, stdin /dev/null unless given)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        if "input" not in kwargs:
            kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.ssh_argv(node, *cmd, src=src, options=options),
                              timeout=timeout, check=check, **kwargs)

    def run_in(self, node: "str | int | Node", argv: Sequence[str], *, timeout: float = 30,
               check: bool = False, **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(argv) inside the node's namespace (no ssh; the caller's env)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        if "input" not in kwargs:
            kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.ns_exec(node, argv), timeout=timeout, check=check, **kwargs)

    def popen_in(self, node: "str | int | Node", argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen(argv) inside the node's namespace (teardown kills and reaps it)."""
        proc = subprocess.Popen(self.ns_exec(node, argv), **kwargs)
        self._popens.append(proc)
        return proc

    def assert_nothing_left(self, timeout: float = 20, *, cut_off=()) -> None:
        """No process of a test left on any node (their sshds aside), within ``timeout``. On the nodes
        ``cut_off`` (their network dropped), an ssh session's sshd is not counted either: it learns that
        its client is gone only from traffic that never comes."""
        cut = {self.node(node).name for node in cut_off}
        deadline = time.monotonic() + timeout
        while True:
            left = {node.name: [p for p in self.processes_in(node)
                                if node.name not in cut or not _described(p).split(" ", 1)[-1].startswith("sshd:")]
                    for node in self.nodes}
            if not any(left.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"processes left behind: { {name: [_described(p) for p in pids] for name, pids in left.items() if pids} }")
            time.sleep(0.2)

    def processes_in(self, node: "str | int | Node", *, include_sshd: bool = False) -> list[int]:
        """Live pids whose network namespace is the node's (the listening sshd excluded
        unless ``include_sshd``; its session children are included)."""
        nd = self.node(node)
        ns_id = self._ns_ids.get(nd.netns)
        if ns_id is None:
            return []
        pids = pids_in_netns(ns_id)
        if not include_sshd:
            sshd = self.sshd_pid(nd)
            pids = [p for p in pids if p != sshd]
        return pids

    def kill_all(self, node: "str | int | Node", *, include_sshd: bool = False,
                 grace: float = 1.0) -> None:
        """Kill every process in the node (not its sshd unless asked): a node "reboot"."""
        keep = set(self.processes_in(node, include_sshd=True)) - set(self.processes_in(node, include_sshd=include_sshd))
        end = time.monotonic() + 10
        sig, t0 = signal.SIGTERM, time.monotonic()
        while (pids := [p for p in self.processes_in(node, include_sshd=True) if p not in keep]):
            if time.monotonic() > end:
                raise RigError(f"processes survived SIGKILL on {node}: {pids}")
            if time.monotonic() - t0 > grace:
                sig = signal.SIGKILL
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)

    def cut_off(self, node: "str | int | Node") -> None:
        """The node's network drops, the node runs on: its traffic is dropped both ways (no FIN,
        no RST reaches anyone); its processes, the ssh sessions into it included, never hear of it."""
        nd = self.node(node)
        for chain, side in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _run(self.ns_exec(nd, ["iptables", "-w", "-I", chain, "1", side, nd.ifname, "-j", "DROP"]))

    def power_off(self, node: "str | int | Node") -> None:
        """The node vanishes without a word, like a machine losing power: its network is cut
        off, then every process in it dies."""
        self.cut_off(node)
        self.kill_all(node, include_sshd=True, grace=0)

    def power_on(self, node: "str | int | Node") -> None:
        """A node powered off comes back: its traffic flows again and its sshd answers (the node's
        other processes stay dead, as after a reboot)."""
        nd = self.node(node)
        for chain, side in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _run(self.ns_exec(nd, ["iptables", "-w", "-D", chain, side, nd.ifname, "-j", "DROP"]), check=False)
        (self.workdir / f"sshd_{nd.name}.pid").unlink(missing_ok=True)  # the dead sshd's
        self._start_sshd(nd)

    # ---- a real network's limits (tc in the node's namespace; gone with it)

    def shape(self, rate: str | None, *, delay_ms: float = 0, burst: str | None = None,
              nodes: "Iterable[str | int | Node] | None" = None) -> None:
        """Limit what every node (or ``nodes``) sends on its interface to ``rate`` (tc units:
        ``"1gbit"``, ``"100mbit"``); ``None`` removes the limit. Both directions of a link are
        then limited, as on a real NIC. Uses the ``tbf`` qdisc; ``burst`` defaults to 1 ms of
        traffic at the rate (at least 64 kB), so short messages cannot pass at memory speed.

        ``delay_ms`` adds one-way latency through ``netem``, which some kernels lack (this
        machine's does): then :class:`RigError` says so, and nothing is changed."""
        targets = [self.node(n) for n in (nodes if nodes is not None else self.nodes)]
        if delay_ms and not netem_available():
            raise RigError("link delay needs the kernel's netem qdisc, which this kernel lacks "
                           "(`tc qdisc add ... netem` fails): shape the rate only")
        for nd in targets:
            _run(self.ns_exec(nd, ["tc", "qdisc", "del", "dev", nd.ifname, "root"]), check=False)
            if rate is None and not delay_ms:
                continue
            if delay_ms:  # netem for the delay, tbf under it for the rate
                _run(self.ns_exec(nd, ["tc", "qdisc", "add", "dev", nd.ifname, "root", "handle",
                                       "1:", "netem", "delay", f"{delay_ms}ms"]))
                if rate is None:
                    continue
                where = ["parent", "1:1", "handle", "10:"]
            else:
                where = ["root"]
            _run(self.ns_exec(nd, ["tc", "qdisc", "add", "dev", nd.ifname, *where, "tbf", "rate",
                                   rate, "burst", burst or tbf_burst(rate), "latency", "100ms"]))

    def qdisc(self, node: "str | int | Node") -> str:
        """``tc qdisc show`` of the node's interface (what shape() set)."""
        nd = self.node(node)
        return _run(self.ns_exec(nd, ["tc", "qdisc", "show", "dev", nd.ifname])).stdout

    # ---- fault injection (iptables in the node's namespace; gone with it)

    def _iptables(self, node: Node, rule: list[str], op: str = "-A") -> None:
        _run(self.ns_exec(node, ["iptables", "-w", op, *rule]))

    def block_port(self, node: "str | int | Node", port: int, *, action: str = "DROP") -> None:
        """Drop (or, with action="REJECT", refuse with a TCP reset) TCP arriving on the
        node's eth1 for ``port``. Loopback inside the node stays open (like a security
        group). Inserted first in INPUT, so it wins over only_allow()."""
        if action not in ("DROP", "REJECT"):
            raise ValueError("action must be DROP or REJECT")
        nd = self.node(node)
        target = ["-j", "DROP"] if action == "DROP" else ["-j", "REJECT", "--reject-with", "tcp-reset"]
        rule = ["INPUT", "-i", nd.ifname, "-p", "tcp", "--dport", str(int(port)), *target]
        _run(self.ns_exec(nd, ["iptables", "-w", "-I", *rule[:1], "1", *rule[1:]]))
        self._rules.setdefault(nd.name, []).append(rule)

    def only_allow(self, node: "str | int | Node", ports: Iterable[int]) -> None:
        """Refuse every new TCP connection arriving on the node's eth1 except to ``ports``
        (dropped SYNs: connects time out). Replies to the node's own outgoing connections
        still pass, like a stateful security group. Keep the ssh port in ``ports`` if ssh
        to this node is needed."""
        nd = self.node(node)
        for port in ports:
            rule = ["INPUT", "-i", nd.ifname, "-p", "tcp", "--dport", str(int(port)), "-j", "ACCEPT"]
            self._iptables(nd, rule)
            self._rules.setdefault(nd.name, []).append(rule)
        rule = ["INPUT", "-i", nd.ifname, "-p", "tcp", "--syn", "-j", "DROP"]
        self._iptables(nd, rule)
        self._rules.setdefault(nd.name, []).append(rule)

    def clear_rules(self, node: "str | int | Node") -> None:
        """Remove every rule block_port/only_allow added on the node."""
        nd = self.node(node)
        if (NETNS_DIR / nd.netns).exists():
            _run(self.ns_exec(nd, ["iptables", "-w", "-F", "INPUT"]))
        self._rules.pop(nd.name, None)


@contextlib.contextmanager
def cpu_hog(n: int):
    """``n`` busy loops beside whatever runs in the block (a loaded machine), ended and reaped after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@atexit.register
def _stop_live_clusters() -> None:  # a cluster never stopped (no with/fixture teardown)
    for c in list(_live):
        try:
            c.stop()
        except BaseException:  # noqa: BLE001
            pass


def _described(pid: int) -> str:
    try:
        return f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ').decode(errors='replace')[:160]}"
    except OSError:
        return str(pid)


# --------------------------------------------------------------------------- pytest


def cluster_fixture(n: int = 2, *, scope: str = "function", name: str | None = None, **kwargs):
    """A pytest fixture yielding a started ``Cluster(n, **kwargs)``; skips with
    ``skip_reason()`` when the machine cannot do it. Assign it in a test module::

        cluster = cluster_fixture(2)
        cluster3 = cluster_fixture(3, name="cluster3")
    """
    import pytest

    @pytest.fixture(scope=scope, name=name)
    def _cluster():
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        with Cluster(n, **kwargs) as c:
            yield c

    return _cluster
