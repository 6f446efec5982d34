"""Gradient compression and bucket size (``disttrain.runtime.comm``, ``run --grad-compression``):
bad input refused up front, every option training for real across two namespace hosts over a
shaped link, and a PowerSGD run killed mid-training and resumed ending bit-for-bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, disttrain
from disttrain.errors import UsageError
from disttrain.runtime import comm
from disttrain.scaling.comm import TRIED, Split, recommend_compression, ring_bound_s
from disttrain.workerenv import WorkerEnv
from rig import cluster_fixture

ROOT = Path(__file__).resolve().parents[1]
TRAIN = SCRIPTS / "comm_train.py"


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize("raw, expected", [
    (None, ("none", 0)), ("none", ("none", 0)), ("fp16", ("fp16", 0)), ("BF16", ("bf16", 0)),
    ("powersgd", ("powersgd", comm.POWERSGD_RANK)), ("powersgd:4", ("powersgd", 4)),
])
def test_compression_names(raw, expected):
    assert comm.parse_compression(raw) == expected


@pytest.mark.parametrize("raw", ["zstd", "fp16:2", "powersgd:0", "powersgd:x", "int8"])
def test_unknown_compression_names_the_choices(raw):
    with pytest.raises(UsageError, match="choose one of none, fp16, bf16, powersgd|positive integer"):
        comm.parse_compression(raw)


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "nan", "inf", True])
def test_bucket_size_must_be_a_positive_number(raw):
    with pytest.raises(UsageError, match="positive number of megabytes"):
        comm.parse_bucket_mb(raw)


def test_bench_comm_modes_are_checked_before_anything_runs(tmp_path):
    from disttrain.cli.bench import comm_modes

    assert comm_modes(None, asked=True) == TRIED
    assert comm_modes(" PowerSGD,none,localsgd:8,powersgd", asked=True) == ("powersgd", "localsgd:8")
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    for flags, said in ((["--comm", "--comm-modes", "fp16,zstd"], "--comm-modes: unknown gradient compression 'zstd'"),
                        (["--comm-modes", "fp16"], "--comm-modes needs --comm")):
        result = disttrain("bench", *flags, str(script))
        assert result.returncode == 2 and said in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_environment_gives_prepare_its_defaults_and_arguments_win():
    env = WorkerEnv.from_environ({"DISTTRAIN_GRAD_COMPRESSION": "fp16", "DISTTRAIN_BUCKET_MB": "5"})
    assert comm.CommSettings.resolve(env=env) == comm.CommSettings(compression="fp16", bucket_mb=5.0)
    explicit = comm.CommSettings.resolve("powersgd", 2, env=env)
    assert (explicit.compression, explicit.bucket_mb) == ("powersgd", 2.0)
    assert explicit.ddp_kwargs("nccl") == {"bucket_cap_mb": 2.0}
    with pytest.raises(UsageError, match="one bucket"):  # gloo: PowerSGD needs a single bucket
        explicit.ddp_kwargs("gloo")
    assert comm.CommSettings.resolve("powersgd").ddp_kwargs("gloo") == {"bucket_cap_mb": comm.ONE_BUCKET_MB}


def test_recommendation_needs_a_real_gain():
    assert recommend_compression(100.0, {"fp16": 180.0, "powersgd": 150.0}).name == "fp16"
    choice = recommend_compression(100.0, {"fp16": 102.0, "powersgd": 60.0})
    assert choice.name == "none" and "not worth it" in choice.reason


def test_split_puts_a_step_on_its_side():
    wire = Split(step_s=1.0, compute_s=0.3, gradient_bytes=44_000_000, world_size=2)
    assert wire.bound == "communication" and wire.comm_fraction == pytest.approx(0.7)
    assert Split(step_s=1.0, compute_s=0.95, gradient_bytes=1_000, world_size=2).bound == "compute"
    # 44 MB over 1 Gbit/s between 2 ranks: the ring all-reduce needs at least 352 ms.
    assert ring_bound_s(44_000_000, 2, 1.0) == pytest.approx(0.352)


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("flags, message", [
    (["--grad-compression", "zstd"], "unknown gradient compression 'zstd'"),
    (["--bucket-mb", "0"], "--bucket-mb '0': the gradient bucket size must be a positive number"),
    (["--bucket-mb", "lots"], "--bucket-mb 'lots'"),
    (["--grad-compression", "powersgd", "--dist-backend", "mpi"], "cannot run on --dist-backend mpi"),
    (["--grad-compression", "powersgd", "--dist-backend", "gloo", "--bucket-mb", "4"], "one bucket"),
    (["--grad-compression", "fp16", "--framework", "tensorflow"], "does nothing with --framework tensorflow"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(home, flags, message):
    result = disttrain("run", "-n", "2", *flags, str(TRAIN), "out")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (home / "runs").exists()  # nothing was started or written


def test_the_flags_reach_every_worker_as_variables(home):
    result = disttrain("run", "-n", "2", "--grad-compression", "bf16", "--bucket-mb", "8",
                       "--dry-run", str(TRAIN), "out")
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)["nodes"][0]["env"]
    assert env["DISTTRAIN_GRAD_COMPRESSION"] == "bf16" and env["DISTTRAIN_BUCKET_MB"] == "8"
    result = disttrain("run", "-n", "2", "--grad-compression", "powersgd:4", "--dry-run", str(TRAIN), "out")
    env = json.loads(result.stdout)["nodes"][0]["env"]
    assert env["DISTTRAIN_GRAD_COMPRESSION"] == "powersgd:4" and "DISTTRAIN_BUCKET_MB" not in env


def test_prepare_refuses_an_unknown_compression_even_alone(ctx):
    import torch

    import disttrain as runtime

    with pytest.raises(UsageError, match="unknown gradient compression"):
        runtime.prepare(torch.nn.Linear(2, 2), None, grad_compression="zip")
    model, _ = runtime.prepare(torch.nn.Linear(2, 2), None, grad_compression="powersgd")
    assert isinstance(model, torch.nn.Linear)  # a world of one: nothing to compress


# --------------------------------------------------------------------------- two hosts, shaped


cluster = cluster_fixture(2, scope="module")


@pytest.fixture(scope="module")
def shaped(cluster):
    cluster.shape("200mbit")
    assert "rate 200Mbit" in cluster.qdisc("node1")
    return cluster


def run_hosts(cluster, *args: str, timeout: float = 200):
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    ssh = cluster.cli_ssh_args()
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "-n", "1", "--no-preflight",
            *ssh, "--env", "OMP_NUM_THREADS=1", *args]
    return cluster.run_in("node0", argv, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def powersgd_run(shaped, tmp_path_factory):
    """One PowerSGD run to the end across the two hosts, made once: the ``[powersgd]`` case of the
    test below checks that it trained and converged, and the resume test that its run killed and
    resumed ends with these weights. (result, its output folder)."""
    out = tmp_path_factory.mktemp("powersgd")
    result = run_hosts(shaped, "--grad-compression", "powersgd", str(TRAIN), str(out))
    shaped.assert_nothing_left()
    return result, out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "powersgd"])
def test_each_compression_trains_and_converges_across_two_hosts(shaped, tmp_path, compression, request):
    if compression == "powersgd":  # the same run as the resume test's reference: made once for both
        result, folder = request.getfixturevalue("powersgd_run")
    else:
        result, folder = run_hosts(shaped, "--grad-compression", compression, str(TRAIN), str(tmp_path)), tmp_path
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((folder / "result.json").read_text())
    assert out["world_size"] == 2
    assert out["last_loss"] < out["first_loss"] / 3
    assert out["val_accuracy"] >= 0.9
    shaped.assert_nothing_left()


@pytest.mark.timeout(300)
def test_powersgd_resumed_after_a_lost_host_ends_bit_exact(shaped, tmp_path, powersgd_run):
    result, reference = powersgd_run  # the run that never stopped (the fixture)
    assert result.returncode == 0, result.stderr[-3000:]
    # Rank 1 (node1) dies after step 33; the checkpoint of step 30 is past PowerSGD's start, so
    # its error feedback and warm-started factors are in use and must come back exactly.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    result = run_hosts(shaped, "--grad-compression", "powersgd", "--max-restarts", "1",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5",
                       str(TRAIN), str(crashed), "--crash-at", "33")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from step 30" in result.stderr + result.stdout
    expected = json.loads((reference / "result.json").read_text())
    got = json.loads((crashed / "result.json").read_text())
    assert got["resumed_from"] == 30
    assert got["weights_sha256"] == expected["weights_sha256"]
    import torch

    # Each rank's own PowerSGD memory is in its rank file (the newest checkpoint; step 30's
    # was pruned since), in use (past PowerSGD's start) and not rank 0's copy.
    newest = sorted((tmp_path / "ckpt").glob("step_*"))[-1]
    ranks = [torch.load(newest / f"rank_0000{r}.pt", weights_only=True)["powersgd"][0] for r in (0, 1)]
    assert ranks[1]["iter"] > comm.POWERSGD_START and ranks[1]["error"][0].abs().sum() > 0
    assert not torch.equal(ranks[0]["error"][0], ranks[1]["error"][0])
    shaped.assert_nothing_left()


# Each mode runs to the script's end: a budget of steps that covers the most any run steps, the
# references' (which stop after their timed steps), and 2 more. They time 2 x 8 + 1 steps (scaling.comm's
# PAIRS) after the warm-up: PowerSGD's start + 1 = 11 steps where PowerSGD is tried (wire: 28 in all),
# else --warmup's 2 (compute: 19).
BUDGET = {"wire": ("--samples", "480", "--epochs", "1"),  # 30 steps of 16 samples
          "compute": ("--samples", "1024", "--epochs", "11")}  # 2 steps of 256 samples an epoch: 22


# The modes each test tries (every mode is a launch across the two hosts): one each. The split comes
# from the reference run's own pairs of steps, whatever modes are tried beside it, and a script that
# prints no accuracy is never told to compress.
MODES = {"wire": "powersgd", "compute": "fp16"}


def bench_split(cluster, kind: str) -> dict:
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    ssh = cluster.cli_ssh_args()
    argv = [sys.executable, "-m", "disttrain", "bench", "--hosts", hosts, "-n", "1", "--no-preflight",
            *ssh, "--env", "OMP_NUM_THREADS=1", "--comm", "--comm-modes", MODES[kind], "--link-gbit", "0.05", "--steps", "4",
            "--warmup", "2", "--global-batch", "16", "--repeat", "1", "--json", str(SCRIPTS / "comm_bound.py"),
            "--", "--kind", kind, *BUDGET[kind]]
    result = cluster.run_in("node0", argv, timeout=520, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (comm_result,) = json.loads(result.stdout)["communication"]
    return comm_result


@pytest.mark.timeout(600)
def test_bench_puts_a_wire_bound_job_on_the_communication_side(cluster):
    cluster.shape("50mbit")
    split = bench_split(cluster, "wire")
    assert split["bound"] == "communication" and split["comm_fraction"] > 0.5, split
    assert split["gradient_bytes"] == (1024 * 1024 + 1024) * 4
    # 4.2 MB between 2 hosts at 50 Mbit/s: the ring all-reduce cannot take less than 0.67 s.
    assert split["ring_bound_s"] == pytest.approx(0.671, abs=0.01)
    assert split["comm_s"] > 0.5 * split["ring_bound_s"]
    # 4 MB -> a few kB: far faster here; but the script measures no accuracy, so plain DDP it is.
    assert split["speedup"]["powersgd"] > 2 and split["recommended"] == "none", split
    assert "never chosen for speed alone" in split["recommendation"]


@pytest.mark.timeout(600)
def test_bench_puts_an_arithmetic_bound_job_on_the_compute_side(cluster):
    cluster.shape("50mbit")
    split = bench_split(cluster, "compute")
    # Never called communication-bound: the split comes from steps with and without sync side by
    # side in one run (two runs minutes apart, the old way, read 38 % of a step as communication in CI).
    assert split["bound"] == "compute" and split["paired_steps"] >= 8, split
    assert split["recommended"] == "none", split
    assert split["gradient_bytes"] < 20_000


@pytest.mark.timeout(400)
def test_compression_keeps_the_examples_validation_accuracy_within_a_point(home):
    """The MNIST example, 2 processes, one epoch of 12,000 images: what each option costs in
    accuracy after the same epochs (measured here: 0.979 plain, 0.9785 fp16, 0.976 powersgd)."""
    accuracy = {}
    for compression in ("none", "fp16", "powersgd"):
        result = disttrain("run", "-n", "2", "--grad-compression", compression,
                           str(ROOT / "examples" / "mnist_convnet.py"), "--samples", "12000",
                           "--log-every", "0", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        last = result.stdout.strip().splitlines()[-1]
        accuracy[compression] = json.loads(last[last.index("{"):])["val_accuracy"]
    assert accuracy["none"] > 0.9, accuracy
    for compression in ("fp16", "powersgd"):
        assert abs(accuracy[compression] - accuracy["none"]) <= 0.01, accuracy
