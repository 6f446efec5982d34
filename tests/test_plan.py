"""The pure layers: spec validation, planning, placement choices."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disttrain.config.launch import LaunchSpec, parse_env, parse_nproc, parse_ranks
from disttrain.errors import UsageError
from disttrain.placement import auto_nproc, choose_device, choose_dist_backend, omp_threads
from disttrain.plan.launch import NodeFacts, make_plan

CPU_NODE = NodeFacts(name="box", cpus=8)
GPU_NODE = NodeFacts(name="gpu", cpus=32, cuda_devices=4)


def plan(spec: LaunchSpec, facts: NodeFacts = CPU_NODE, env: dict | None = None):
    return make_plan(
        spec, facts, python="/py", master_port=29500, run_id="r1", run_dir="/runs/r1",
        inherited_env=env or {},
    )


def test_two_local_ranks_get_torchrun_env_and_verbatim_argv():
    p = plan(LaunchSpec(entry="train.py", script_args=("--lr", "a b;c'd"), nproc_per_node=2))
    assert p.world_size == 2 and p.dist_backend == "gloo"
    assert p.argv == ("/py", "-u", "train.py", "--lr", "a b;c'd")
    (node,) = p.nodes
    assert [w.rank for w in node.workers] == [0, 1]
    assert node.workers[1].env == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
    }
    assert node.env["OMP_NUM_THREADS"] == "4"  # 8 cores / 2 processes
    assert node.env["DISTTRAIN_BACKEND"] == "gloo"
    assert json.loads(p.to_json())["nodes"][0]["workers"][1]["rank"] == 1


def test_module_launch_argv():
    p = plan(LaunchSpec(entry="pkg.train", is_module=True, script_args=("-x",), nproc_per_node=1))
    assert p.argv == ("/py", "-u", "-m", "pkg.train", "-x")


def test_user_settings_win_over_defaults():
    p = plan(
        LaunchSpec(entry="t.py", nproc_per_node=2, env={"OMP_NUM_THREADS": "3", "FOO": "1"}),
        env={"OMP_NUM_THREADS": "2"},
    )
    assert p.worker_env(p.nodes[0])["OMP_NUM_THREADS"] == "3"  # --env wins over disttrain's own
    assert p.worker_env(p.nodes[0])["FOO"] == "1"
    p = plan(LaunchSpec(entry="t.py", nproc_per_node=2), env={"OMP_NUM_THREADS": "2"})
    assert "OMP_NUM_THREADS" not in p.nodes[0].env  # inherited as the user set it


def test_second_node_of_manual_multinode_gets_offset_ranks():
    spec = LaunchSpec(entry="t.py", nproc_per_node=2, nnodes=2, node_rank=1,
                      master_addr="10.0.0.1", master_port=29500)
    p = plan(spec)
    assert p.world_size == 4
    assert [w.rank for w in p.nodes[0].workers] == [2, 3]
    assert p.nodes[0].workers[0].env["MASTER_ADDR"] == "10.0.0.1"


def test_auto_uses_gpus_and_nccl_when_cuda_is_present():
    p = plan(LaunchSpec(entry="t.py"), facts=GPU_NODE)
    assert p.nodes[0].nproc == 4 and p.dist_backend == "nccl"
    assert p.nodes[0].env["OMP_NUM_THREADS"] == "8"


def test_auto_on_cpu_keeps_two_cores_per_process():
    assert plan(LaunchSpec(entry="t.py")).nodes[0].nproc == 4
    assert auto_nproc(cuda_devices=0, cpus=1) == 1
    assert auto_nproc(cuda_devices=0, cpus=2) == 1


def test_ranks_filter_is_planned_and_rejects_missing_ranks():
    p = plan(LaunchSpec(entry="t.py", nproc_per_node=2, ranks=(1,)))
    assert p.shown_ranks == (1,)  # each agent maps it to its workers' real ranks (test_torchrun_options)
    with pytest.raises(UsageError, match="rank 5"):
        plan(LaunchSpec(entry="t.py", nproc_per_node=2, ranks=(5,)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc_per_node": 0}, "at least 1"),
        ({"master_port": 70000}, "1..65535"),
        ({"master_port": 0}, "1..65535"),
        ({"dist_backend": "carrier-pigeon"}, "unknown backend"),
        ({"max_restarts": -1}, "cannot be negative"),
        ({"nnodes": 2, "master_port": 1234}, "--master-addr"),
        ({"nnodes": 2, "node_rank": 2, "master_addr": "h", "master_port": 1}, "--node-rank"),
    ],
)
def test_spec_rejects_bad_values_naming_the_flag(kwargs, message):
    with pytest.raises(UsageError, match=message):
        LaunchSpec(entry="t.py", **kwargs)


def test_parsers():
    assert parse_nproc("auto") == "auto" and parse_nproc("3") == 3
    for bad in ("0", "-1", "abc", "2.5"):
        with pytest.raises(UsageError, match="-n"):
            parse_nproc(bad)
    assert parse_ranks("all") is None
    assert parse_ranks("0,2-3") == (0, 2, 3)
    with pytest.raises(UsageError):
        parse_ranks("x")
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_env(["no-equals"])


@given(st.sets(st.integers(min_value=0, max_value=64), min_size=1))
def test_parse_ranks_roundtrips_any_set(ranks):
    assert parse_ranks(",".join(map(str, sorted(ranks)))) == tuple(sorted(ranks))


def test_placement_choices():
    assert omp_threads(cpus=2, nproc=4) == 1
    assert omp_threads(cpus=16, nproc=4) == 4
    assert choose_dist_backend(None, cuda_available=True) == "nccl"
    assert choose_dist_backend(None, cuda_available=False) == "gloo"
    assert choose_dist_backend("gloo", cuda_available=True) == "gloo"
    assert choose_device(local_rank=3, cuda_devices=4, dist_backend="nccl") == "cuda:3"
    assert choose_device(local_rank=0, cuda_devices=0, dist_backend="gloo") == "cpu"
    with pytest.raises(UsageError, match="LOCAL_RANK=4"):
        choose_device(local_rank=4, cuda_devices=4, dist_backend="nccl")
    with pytest.raises(UsageError, match="needs CUDA"):
        choose_device(local_rank=0, cuda_devices=0, dist_backend="nccl")


def test_plan_for_several_hosts_numbers_ranks_by_host_order():
    hosts = (
        NodeFacts(name="node0", cpus=4, socket_ifname="eth1"),
        NodeFacts(name="node1", cpus=4, socket_ifname="ens5"),
    )
    spec = LaunchSpec(entry="t.py", nproc_per_node=2, master_addr="10.0.0.1", master_port=29500)
    p = make_plan(spec, hosts, python="/py", master_port=29500, run_id="r", run_dir="/r",
                  inherited_env={"NCCL_SOCKET_IFNAME": "mine"})
    assert p.world_size == 4 and p.nnodes == 2
    assert [[w.rank for w in n.workers] for n in p.nodes] == [[0, 1], [2, 3]]
    assert [n.env["GLOO_SOCKET_IFNAME"] for n in p.nodes] == ["eth1", "ens5"]
    assert "NCCL_SOCKET_IFNAME" not in p.nodes[0].env  # the user's own setting is kept
    from disttrain.plan.launch import plan_from_json

    assert plan_from_json(p.to_private_json()) == p


def test_hosts_may_run_different_counts_from_slots_or_auto():
    hosts = (NodeFacts(name="a", cpus=8, cuda_devices=2), NodeFacts(name="b", cpus=8, cuda_devices=4),
             NodeFacts(name="c", cpus=8, slots=3))
    p = make_plan(LaunchSpec(entry="t.py", master_addr="h", master_port=1), hosts, python="/py",
                  master_port=1, run_id="r", run_dir="/r", inherited_env={})
    assert [n.nproc for n in p.nodes] == [2, 4, 3] and p.world_size == 9
    # torch's agent numbers ranks by the sum of the counts on the nodes before
    assert [[w.rank for w in n.workers] for n in p.nodes] == [[0, 1], [2, 3, 4, 5], [6, 7, 8]]
    assert p.nodes[2].workers[0].env["LOCAL_WORLD_SIZE"] == "3"
    fixed = make_plan(LaunchSpec(entry="t.py", nproc_per_node=1, master_addr="h", master_port=1), hosts,
                      python="/py", master_port=1, run_id="r", run_dir="/r", inherited_env={})
    assert [n.nproc for n in fixed.nodes] == [1, 1, 1]  # an explicit -n wins over slots


def test_c10d_rendezvous_is_hosted_by_the_first_node_at_its_own_address():
    from disttrain.agent.elastic_config import rdzv_configs

    hosts = (NodeFacts(name="a", cpus=2, address="10.0.0.1"), NodeFacts(name="b", cpus=2, address="10.0.0.2"))
    spec = LaunchSpec(entry="t.py", nproc_per_node=1, master_addr="10.0.0.1", master_port=29500,
                      rdzv_backend="c10d", rdzv_timeout_s=40)
    p = make_plan(spec, hosts, python="/py", master_port=29500, run_id="r", run_dir="/r", inherited_env={})
    assert p.rdzv_backend == "c10d" and [n.address for n in p.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert [rdzv_configs(p, n) for n in p.nodes] == [
        {"is_host": True, "join_timeout": 40}, {"is_host": False, "join_timeout": 40}]
    static = make_plan(LaunchSpec(entry="t.py", nproc_per_node=1), hosts[0], python="/py", master_port=1,
                       run_id="r", run_dir="/r", inherited_env={})
    assert rdzv_configs(static, static.nodes[0]) == {"rank": 0, "timeout": 120}
    with pytest.raises(UsageError, match="--rdzv-backend must be one of static, c10d, etcd, etcd-v2"):
        LaunchSpec(entry="t.py", rdzv_backend="zookeeper")


def test_user_variables_are_listed_by_name_only_in_the_shown_plan():
    """--env and forwarded values may be secrets: --dry-run and plan.json name them, the agent gets them."""
    from disttrain.plan.launch import plan_from_json

    spec = LaunchSpec(entry="t.py", nproc_per_node=1, env={"API_TOKEN": "s3cr3t-value"})
    p = make_plan(spec, NodeFacts(name="n", cpus=2), python="/py", master_port=29500, run_id="r",
                  run_dir="/runs/r", inherited_env={}, forwarded_env={"OUT_DIR": "/shared/x", "DB_PASS": "hunter2"})
    shown = p.to_json()
    assert "s3cr3t-value" not in shown and "hunter2" not in shown and "/shared/x" not in shown
    data = json.loads(shown)
    assert data["env_set"] == ["API_TOKEN"] and data["env_forwarded"] == ["DB_PASS", "OUT_DIR"]
    back = plan_from_json(p.to_private_json())
    assert back == p
    env = back.worker_env(back.nodes[0])
    assert env["API_TOKEN"] == "s3cr3t-value" and env["OUT_DIR"] == "/shared/x"


def test_the_environment_rule():
    from disttrain.workerenv import forwarded_env

    shell = {"OUT_DIR": "/shared/x", "PATH": "/bin", "HOSTNAME": "a", "PWD": "/home/me", "OLDPWD": "/",
             "SHLVL": "2", "_": "/usr/bin/disttrain", "SSH_AUTH_SOCK": "/tmp/s", "XDG_RUNTIME_DIR": "/run/u",
             "DISPLAY": ":0", "BASH_FUNC_foo%%": "() { :; }", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src",
             "SLURM_JOB_ID": "3"}
    assert forwarded_env(shell) == {"OUT_DIR": "/shared/x", "PATH": "/bin", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src"}
    assert forwarded_env(shell, everything=False) == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src"}
