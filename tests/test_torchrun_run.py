"""torchrun's command lines under ``disttrain run``: real workers, gloo over loopback or across
network namespaces (tests/rig.py), accelerate's and Lightning's own code on CPU."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, cli_env, disttrain, read_ranks
from disttrain.net import free_port
from disttrain.workerenv import attempt_library_env, cpu_library_env, cpu_library_warning
from rig import cluster_fixture

ROOT = Path(__file__).resolve().parent.parent
REPORT = str(SCRIPTS / "ranks_report.py")

cluster = cluster_fixture(2)


def _no_socket_settings() -> dict[str, str]:
    """The by-hand recipe sets nothing: no interface variable, whatever the test's shell has."""
    return {k: v for k, v in cli_env().items() if not k.startswith(("GLOO_", "NCCL_", "PET_"))}


@pytest.mark.timeout(180)
def test_by_hand_recipe_forms_a_job_across_two_hosts(cluster, tmp_path):
    """PyTorch's multi-node recipe, the same command on every node and nothing else set: each node
    finds its own address and interface toward the endpoint, and only node0 hosts the c10d store
    (the host name resolves to 127.0.0.1 in both namespaces, so torch's own guess says neither)."""
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"{cluster.nodes[0].ip}:{29400}"
    argv = [sys.executable, "-m", "disttrain", "run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "JOB", REPORT, str(out)]
    procs = [cluster.popen_in(node, argv, cwd=ROOT, env=_no_socket_settings(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in reversed(cluster.nodes)]
    results = [proc.communicate(timeout=150) for proc in procs]
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    ranks = read_ranks(out)
    assert set(ranks) == {0, 1}
    for rec in ranks.values():
        assert rec["world_size"] == 2 and rec["sum"] == 3.0  # one all-reduce across the two hosts
        assert rec["ifname"] == "eth1"  # found from the route to the endpoint
    deadline = time.monotonic() + 15
    while any(cluster.processes_in(node) for node in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(cluster.processes_in(node) for node in cluster.nodes)


@pytest.mark.timeout(120)
def test_nnodes_range_on_one_node_starts_after_the_last_call(tmp_path):
    """``--nnodes 1:2``: one node is enough once the rendezvous' last call (here 1 s) has passed."""
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "--nnodes", "1:2", "-n", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                       "--rdzv-conf", "last_call_timeout=1", REPORT, str(out))
    assert result.returncode == 0, result.stderr
    assert "2 to 4 workers (gloo)" in result.stderr  # the banner says what the rendezvous may form
    ranks = read_ranks(out)
    assert set(ranks) == {0, 1} and all(rec["world_size"] == 2 for rec in ranks.values())


@pytest.mark.timeout(90)
def test_local_ranks_filter_shows_only_that_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--local-ranks-filter", "1", REPORT, str(out))
    assert result.returncode == 0, result.stderr
    assert "[rank1] hello from rank 1" in result.stdout and "[rank1] warning line from rank 1" in result.stderr
    assert "rank0]" not in result.stdout + result.stderr
    assert set(read_ranks(out)) == {0, 1}


@pytest.mark.timeout(90)
def test_tee_with_log_dir_writes_torchruns_files_and_the_terminal(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "D"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--tee", "3", "--log-dir", str(logs), REPORT, str(out))
    assert result.returncode == 0, result.stderr
    assert "[rank0] hello from rank 0" in result.stdout and "[rank1] warning line from rank 1" in result.stderr
    (run,) = [p for p in logs.iterdir() if p.is_dir() and not p.name.startswith(("attempt_", "heartbeat"))]
    for rank in (0, 1):  # torchrun's layout: <log-dir>/<rdzv id>_<suffix>/attempt_<k>/<local rank>/
        assert (run / "attempt_0" / str(rank) / "stdout.log").read_text() == f"hello from rank {rank}\n"
        assert (run / "attempt_0" / str(rank) / "stderr.log").read_text().endswith(f"warning line from rank {rank}\n")
        assert (logs / "attempt_0" / f"rank{rank}.stdout").read_text() == f"hello from rank {rank}\n"  # disttrain's


@pytest.mark.timeout(90)
def test_redirects_keep_a_local_ranks_streams_from_the_terminal(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--redirects", "0:3,1:2", "--duplicate-stdout-filters", "hello",
                       "--log-dir", str(tmp_path / "D"), REPORT, str(out))
    assert result.returncode == 0, result.stderr
    assert "rank0]" not in result.stdout + result.stderr  # both of local rank 0's streams: files only
    assert "[rank1] hello from rank 1" in result.stdout and "warning line" not in result.stderr
    assert (tmp_path / "D" / "attempt_0" / "rank0.stdout").read_text() == "hello from rank 0\n"
    # torch copies the matching lines of the streams it shows
    assert "hello from rank 1" in (tmp_path / "D" / "attempt_0" / "filtered_stdout.log").read_text()


@pytest.mark.timeout(90)
def test_logs_specs_entry_point_writes_its_layout(tmp_path):
    """--logs-specs NAME: the class a package registers (torch's default one, here) gets the files."""
    site = tmp_path / "site" / "dt_specs-1.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: dt-specs\nVersion: 1.0\n")
    (site / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nmine = torch.distributed.elastic.multiprocessing:DefaultLogsSpecs\n")
    env = cli_env()
    env["PYTHONPATH"] = f"{site.parent}:{env.get('PYTHONPATH', '')}"
    out, logs = tmp_path / "out", tmp_path / "D"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--logs-specs", "mine", "--redirects", "1", "--log-dir", str(logs),
                       REPORT, str(out), env=env)
    assert result.returncode == 0, result.stderr
    assert "hello from rank" not in result.stdout  # redirected: files only
    (run,) = [p for p in logs.iterdir() if p.is_dir() and not p.name.startswith(("attempt_", "heartbeat"))]
    assert (run / "attempt_0" / "1" / "stdout.log").read_text() == "hello from rank 1\n"
    assert (logs / "attempt_0" / "rank1.stdout").read_text() == "hello from rank 1\n"


@pytest.mark.timeout(90)
def test_no_python_runs_the_program_on_each_rank(tmp_path):
    result = disttrain("run", "-n", "2", "--no-python", "/bin/sh", "-c", 'echo "sh says rank $RANK of $WORLD_SIZE"',
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank0] sh says rank 0 of 2" in result.stdout and "[rank1] sh says rank 1 of 2" in result.stdout


@pytest.mark.timeout(120)
def test_run_path_runs_the_script_in_multiprocessing_workers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "-n", "2", "--run-path", "--start-method", "fork", REPORT, str(out), "x y")
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
    assert set(ranks) == {0, 1} and all(rec["sum"] == 3.0 and rec["argv"] == ["x y"] for rec in ranks.values())


@pytest.mark.timeout(90)
def test_pet_nproc_per_node_gives_two_ranks(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", REPORT, str(out), env=cli_env(PET_NPROC_PER_NODE="2"))
    assert result.returncode == 0, result.stderr
    assert set(read_ranks(out)) == {0, 1}


@pytest.mark.timeout(90)
def test_numa_binding_without_gpus_is_said_and_the_run_goes_on(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "-n", "1", "--numa-binding", "node", REPORT, str(out))
    assert result.returncode == 0, result.stderr
    assert ("disttrain: note: --numa-binding node binds each worker to the CPUs near its GPU, and this node has "
            "no CUDA GPU: the workers run unbound") in result.stderr
    assert set(read_ranks(out)) == {0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--master-addr", "no-such-host.invalid"], "--master-addr no-such-host.invalid does not resolve here"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid"], "does not resolve here"),
    (["--nnodes", "2", "--master-addr", "192.0.2.77", "--master-port", "29511"],
     "--master-addr 192.0.2.77 is not an address of this machine, and node rank 0 hosts the rendezvous"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "nope.invalid:29400"],
     "the rendezvous endpoint nope.invalid does not resolve here"),
])
def test_bad_master_addr_is_one_line_and_exit_2(tmp_path, args, message):
    result = disttrain("run", *args, REPORT, str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disttrain: error: ") and message in lines[0], lines


# ---- accelerate and Lightning on CPU


@pytest.mark.timeout(240)
def test_accelerates_own_test_script_sees_two_processes_on_cpu(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    script = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_script.py"
    result = disttrain("run", "-n", "2", str(script), timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}] Num processes: 2" in result.stdout
        assert f"[rank{rank}] Distributed environment: DistributedType.MULTI_CPU  Backend: gloo" in result.stdout


LIGHTNING = """
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning as L

fabric = L.Fabric()
fabric.launch()
total = fabric.all_reduce(torch.tensor([1.0]), reduce_op="sum").item()
print(f"fabric devices {len(fabric._connector._parallel_devices)} world {fabric.world_size} sum {total}", flush=True)

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=4))
print(f"trainer devices {trainer.num_devices} world {trainer.world_size} batches {trainer.num_training_batches}",
      flush=True)
"""


@pytest.mark.timeout(240)
def test_lightning_fabric_and_trainer_use_every_process_on_cpu(tmp_path):
    pytest.importorskip("lightning")
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING)
    result = disttrain("run", "-n", "2", str(script), timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}] fabric devices 2 world 2 sum 2.0" in result.stdout
        assert f"[rank{rank}] trainer devices 2 world 2 batches 2" in result.stdout  # 16 samples / 4 / 2 ranks


def test_library_variables_are_defaults_and_only_without_cuda():
    env = cpu_library_env(local_world_size=2, nnodes=3, inherited={"PL_TRAINER_DEVICES": "1"})
    assert env == {"ACCELERATE_USE_CPU": "true", "LT_DEVICES": "2", "LT_NUM_NODES": "3", "PL_TRAINER_NUM_NODES": "3"}
    assert "LT_NUM_NODES" not in cpu_library_env(local_world_size=2, nnodes=None, inherited={})
    from disttrain.workerenv import launcher_env

    common = {"dist_backend": "gloo", "run_dir": "/r", "omp_threads": 1, "inherited": {}, "local_world_size": 2}
    assert "ACCELERATE_USE_CPU" not in launcher_env(**common, cuda_devices=2)
    assert launcher_env(**common, cuda_devices=0)["LT_DEVICES"] == "2"
    # --nnodes MIN:MAX: the node count comes from each attempt's world
    environ = {"ACCELERATE_USE_CPU": "true", "LT_DEVICES": "2"}
    assert attempt_library_env({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}, environ) == {
        "LT_NUM_NODES": "3", "PL_TRAINER_NUM_NODES": "3"}
    assert attempt_library_env({"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"}, environ) == {}
    assert attempt_library_env({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, {}) == {}  # a node with CUDA


def test_partial_state_alone_is_warned_about():
    assert "PartialState(cpu=True)" in cpu_library_warning("s = PartialState()\n", "infer.py")
    assert cpu_library_warning("s = PartialState(cpu=True)\n", "infer.py") is None
    assert cpu_library_warning("a = Accelerator()\ns = PartialState()\n", "t.py") is None
    assert cpu_library_warning("import torch\n", "t.py") is None
