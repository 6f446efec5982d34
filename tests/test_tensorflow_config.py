"""``--framework tensorflow`` without TensorFlow: TF_CONFIG's construction, the plan, the shim.

The runs here start real workers through the real launcher and torch's agent, with a
stdlib-only script that reports its environment, so they need no TensorFlow and stay fast.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest

from conftest import SCRIPTS, cli_env, disttrain, read_ranks
from disttrain import tfconfig
from disttrain.config.launch import LaunchSpec
from disttrain.errors import UsageError
from disttrain.plan.launch import NodeFacts, make_plan, plan_from_json
from disttrain.tfconfig import keras_env, shim_env, tf_config, worker_addresses
from disttrain.workerenv import TF_FIRST_TASK, TF_WORKERS

REPORT = SCRIPTS / "tf_env_report.py"
BOX = NodeFacts(name="box", cpus=8)


def plan(spec: LaunchSpec, facts: NodeFacts | tuple[NodeFacts, ...] = BOX, env: dict | None = None):
    return make_plan(spec, facts, python="/py", master_port=29500, run_id="r", run_dir="/r",
                     inherited_env=env or {})


def test_tf_config_lists_the_cluster_and_names_the_task():
    workers = ["10.0.0.1:29501", "10.0.0.2:29502"]
    assert json.loads(tf_config(workers, 1)) == {
        "cluster": {"worker": workers}, "task": {"type": "worker", "index": 1},
    }
    with pytest.raises(ValueError, match="task index 2"):
        tf_config(workers, 2)


def test_worker_ports_are_master_port_plus_one_plus_rank_node_by_node():
    assert worker_addresses([("10.0.0.1", 2), ("10.0.0.2", 1)], 29500) == (
        "10.0.0.1:29501", "10.0.0.1:29502", "10.0.0.2:29503",
    )
    assert worker_addresses([("fd00::1", 1)], 80) == ("[fd00::1]:81",)
    with pytest.raises(UsageError, match="--master-port 65534 leaves no room for 2 TensorFlow workers"):
        worker_addresses([("h", 2)], 65534)


def test_shim_builds_tf_config_from_the_node_list_and_local_rank():
    env = {TF_WORKERS: "a:1,a:2,b:3,b:4", TF_FIRST_TASK: "2", "LOCAL_RANK": "1", "RANK": "3"}
    assert json.loads(shim_env(env)["TF_CONFIG"])["task"] == {"type": "worker", "index": 3}
    assert shim_env({**env, "TF_CONFIG": "{}"}) == {}  # the user's own TF_CONFIG wins
    assert shim_env({TF_WORKERS: "a:1", "LOCAL_RANK": "0"}) == {}  # one worker: MirroredStrategy
    assert shim_env({"LOCAL_RANK": "0"}) == {}


def test_legacy_keras_only_when_installed_and_not_chosen_by_the_user():
    assert keras_env({}, have_tf_keras=True) == {"TF_USE_LEGACY_KERAS": "1"}
    assert keras_env({}, have_tf_keras=False) == {}  # it would break tf.keras altogether
    assert keras_env({"TF_USE_LEGACY_KERAS": "0"}, have_tf_keras=True) == {}


def test_tensorflow_plan_runs_the_script_through_the_shim_with_each_workers_tf_config():
    p = plan(LaunchSpec(entry="train.py", script_args=("--x", "a b"), nproc_per_node=2, framework="tensorflow"))
    assert p.framework == "tensorflow"
    assert p.argv == ("/py", "-u", "-m", "disttrain.tfconfig", "train.py", "--x", "a b")
    (node,) = p.nodes
    assert node.env[TF_WORKERS] == "127.0.0.1:29501,127.0.0.1:29502" and node.env[TF_FIRST_TASK] == "0"
    shown = [json.loads(w.env["TF_CONFIG"]) for w in node.workers]  # what --dry-run prints
    assert [c["task"]["index"] for c in shown] == [0, 1]
    assert plan_from_json(p.to_private_json()) == p

    module = plan(LaunchSpec(entry="pkg.train", is_module=True, nproc_per_node=1, framework="tensorflow"))
    assert module.argv == ("/py", "-u", "-m", "disttrain.tfconfig", "-m", "pkg.train")
    assert TF_WORKERS not in module.nodes[0].env and "TF_CONFIG" not in module.nodes[0].workers[0].env

    user = plan(LaunchSpec(entry="t.py", nproc_per_node=2, framework="tensorflow"), env={"TF_CONFIG": "{}"})
    assert "TF_CONFIG" not in user.nodes[0].workers[0].env  # the user's is what the workers get

    torch_plan = plan(LaunchSpec(entry="t.py", nproc_per_node=2))
    assert torch_plan.framework == "pytorch" and torch_plan.argv == ("/py", "-u", "t.py")
    assert TF_WORKERS not in torch_plan.nodes[0].env


def test_tensorflow_plan_across_hosts_uses_each_nodes_address():
    hosts = (NodeFacts(name="node0", cpus=2, address="10.0.0.1"),
             NodeFacts(name="node1", cpus=2, address="10.0.0.2", slots=2))
    spec = LaunchSpec(entry="t.py", master_addr="10.0.0.1", master_port=29500, framework="tensorflow")
    p = plan(spec, hosts)
    assert [n.env[TF_WORKERS] for n in p.nodes] == ["10.0.0.1:29501,10.0.0.2:29502,10.0.0.2:29503"] * 2
    assert [n.env[TF_FIRST_TASK] for n in p.nodes] == ["0", "1"]
    assert json.loads(p.nodes[1].workers[1].env["TF_CONFIG"])["task"]["index"] == 2


def test_framework_is_validated_and_manual_multinode_tensorflow_is_refused():
    with pytest.raises(UsageError, match="--framework must be one of pytorch, tensorflow, got 'jax'"):
        LaunchSpec(entry="t.py", framework="jax")
    spec = LaunchSpec(entry="t.py", nproc_per_node=1, nnodes=2, master_addr="10.0.0.1", master_port=29500,
                      framework="tensorflow")
    with pytest.raises(UsageError, match="needs --hosts"):
        plan(spec)


def test_keras_hint_is_one_line_naming_the_host_when_tf_keras_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(tfconfig, "have_tf_keras", lambda: False)
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    assert tfconfig.tf_node_env({}, host="node7", nproc=1, world_size=2, report_to=sys.stderr) == {}
    (line,) = capsys.readouterr().err.splitlines()
    assert "tf-keras is not installed on node7" in line and "pip install --no-deps tf-keras==" in line
    tfconfig.tf_node_env({}, host="node7", nproc=1, world_size=1, report_to=sys.stderr)
    assert capsys.readouterr().err == ""  # one process: MirroredStrategy, Keras 3's fit works


@pytest.mark.timeout(120)
def test_each_worker_gets_its_tf_config_in_the_process_the_agent_started(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "--framework", "tensorflow", "-n", "2", str(REPORT), str(out), "a b", "c'd")
    assert result.returncode == 0, result.stderr
    workers = read_ranks(out)
    assert set(workers) == {0, 1}
    lists = {tuple(w["tf_config"]["cluster"]["worker"]) for w in workers.values()}
    assert len(lists) == 1 and len(next(iter(lists))) == 2  # one cluster of two, seen the same by both
    for rank, rec in workers.items():
        assert rec["tf_config"]["task"] == {"type": "worker", "index": rank}
        assert rec["argv"] == ["a b", "c'd"]
        assert rec["legacy_keras"] == ("1" if tfconfig.have_tf_keras() else None)
        # exec'd, not a child of the shim: the script is the process torch's agent started
        assert "disttrain.tfconfig" not in rec["cmdline"] and str(REPORT) in rec["cmdline"]
        assert "run" in rec["parent_cmdline"] and "disttrain" in rec["parent_cmdline"]
    assert "[rank1] worker 1 ready" in result.stdout

    # A user's TF_CONFIG and Keras choice win; one worker gets no cluster (MirroredStrategy).
    mine = json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}})
    result = disttrain("run", "--framework", "tensorflow", "-n", "2", "--env", "TF_USE_LEGACY_KERAS=0",
                       str(REPORT), str(out), env=cli_env(TF_CONFIG=mine))
    assert result.returncode == 0, result.stderr
    assert [(w["tf_config"], w["legacy_keras"]) for w in read_ranks(out).values()] == [
        (json.loads(mine), "0")] * 2
    for path in out.iterdir():
        path.unlink()
    result = disttrain("run", "--framework", "tensorflow", "-n", "1", str(REPORT), str(out))
    assert result.returncode == 0, result.stderr
    assert read_ranks(out)[0]["tf_config"] is None


def busy_pair() -> tuple[socket.socket, int]:
    """A listening socket on master_port + 1, with master_port itself free."""
    while True:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1] - 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
        sock.listen()
        return sock, port


@pytest.mark.timeout(60)
def test_a_taken_worker_port_is_named_before_any_worker_starts(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    busy, master_port = busy_pair()
    with busy:
        result = disttrain("run", "--framework", "tensorflow", "-n", "2", "--master-port", str(master_port),
                           str(REPORT), str(out))
    assert result.returncode == 2, result.stderr
    assert f"error: port {master_port + 1} on " in result.stderr
    assert "TensorFlow worker 0" in result.stderr and "give another --master-port" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(out.iterdir())


@pytest.mark.timeout(60)
def test_unknown_framework_is_one_line_and_exit_2(tmp_path):
    result = disttrain("run", "--framework", "jax", str(REPORT), env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "disttrain: error: --framework must be one of pytorch, tensorflow, got 'jax'"]
