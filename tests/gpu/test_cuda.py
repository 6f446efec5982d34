"""The CUDA paths, run for real on a GPU; the whole module is skipped without CUDA.

What a GPU user relies on: one device per local rank, batches copied from pinned memory
without blocking, bf16 autocast, fp16 with a gradient scaler, FSDP on one GPU (and on two
when there are two), and a resume that is bit-exact with CUDA's own random generator in
play (dropout on the GPU).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _launch import kill_tree, run_ranks, run_single, worker_env
from disttrain.placement import NCCL_MULTI_RANK_GPU_ENV, shared_gpu_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TRAIN = SCRIPTS / "sharded_train.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL = tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else None


def steps(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def ok(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
def gpu_ctx(monkeypatch):
    """A world of one on the GPU, in this process."""
    import disttrain
    from disttrain.runtime import context as context_module

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(context_module, "_current", None)
    yield disttrain.init()
    disttrain.shutdown()


def test_device_pinned_loader_and_non_blocking_batches(gpu_ctx):
    from torch.utils.data import DataLoader, TensorDataset

    import disttrain

    assert gpu_ctx.device == torch.device("cuda:0")
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.arange(32)), batch_size=8, shuffle=True)
    model, _, data = disttrain.prepare(torch.nn.Linear(4, 2), None, data)
    assert next(model.parameters()).device.type == "cuda"
    assert data.pin_memory
    x, y = next(iter(data))
    assert x.device == gpu_ctx.device and y.device == gpu_ctx.device


def test_bf16_autocast_runs_the_forward_in_bf16_and_returns_float32(gpu_ctx):
    import disttrain

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model, _ = disttrain.prepare(model, None, mixed_precision="bf16")
    out = model(torch.randn(4, 8, device="cuda"))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32


def test_fp16_steps_through_a_grad_scaler(gpu_ctx):
    import disttrain

    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = disttrain.prepare(model, opt, mixed_precision="fp16")
    step = disttrain.accumulate(model, opt, 2)
    assert step.scaler is not None and step.scaler.is_enabled()
    before = model.weight.detach().clone()
    for _ in range(2):
        with step:
            step.backward(model(torch.randn(4, 8, device="cuda")).pow(2).mean())
    assert step.stepped and not torch.equal(before, model.weight.detach())
    assert step.state_dict()["scaler"]["scale"] > 0


@pytest.mark.timeout(300)
def test_fsdp_on_one_gpu_resumes_bit_exact_with_cuda_dropout(tmp_path):
    args = ["--strategy", "fsdp", "--precision", "bf16", "--dropout", "0.2"]
    ok(run_single(TRAIN, [tmp_path / "reference", *args], timeout=200))
    ckpt = ["--ckpt", tmp_path / "ckpt", "--every", "3"]
    assert run_single(TRAIN, [tmp_path / "run", *args, *ckpt, "--die-at", "11"], timeout=200).returncode != 0
    again = run_single(TRAIN, [tmp_path / "run", *args, *ckpt], timeout=200)
    ok(again)
    assert "resuming from step 9" in again.stderr
    a, b = weights(tmp_path / "reference"), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_two_gpus_fsdp_and_ddp_reach_the_same_loss_over_nccl(tmp_path):
    for strategy in ("ddp", "fsdp"):
        ok(run_ranks(TRAIN, 2, [tmp_path / strategy, "--strategy", strategy, "--epochs", "1",
                                "--dropout", "0"], timeout=250))
    for a, b in zip(steps(tmp_path / "ddp"), steps(tmp_path / "fsdp")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)


def run_sharing_one_gpu(args: list, backend: str) -> subprocess.CompletedProcess:
    """``disttrain run -n 2`` with both ranks on GPU 0, over ``backend``."""
    launcher, env = (([], {NCCL_MULTI_RANK_GPU_ENV: "1"}) if backend == "nccl" else (["--dist-backend", "gloo"], {}))
    env["CUDA_VISIBLE_DEVICES"] = "0"
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "run", "-n", "2", *launcher, str(TRAIN), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(env))
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(300)
def test_two_ranks_share_one_gpu_in_the_mode_the_nccl_version_allows(tmp_path):
    """NCCL >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1): FSDP sharded for real over NCCL; before, NCCL
    refuses a shared GPU and DDP runs over gloo with CUDA tensors. Either way a resume is bit-exact."""
    backend = shared_gpu_backend(NCCL)
    args = ["--strategy", "fsdp" if backend == "nccl" else "ddp", "--dropout", "0.2"]
    ok(run_sharing_one_gpu([tmp_path / "reference", *args], backend))
    ckpt = ["--ckpt", tmp_path / "ckpt", "--every", "3"]
    assert run_sharing_one_gpu([tmp_path / "run", *args, *ckpt, "--die-at", "11"], backend).returncode != 0
    again = run_sharing_one_gpu([tmp_path / "run", *args, *ckpt], backend)
    ok(again)
    assert "resuming from step 9" in again.stdout + again.stderr
    assert f"({backend})" in again.stderr  # the launcher's first line names the process group's backend
    a, b = weights(tmp_path / "reference"), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fp16_is_refused_on_cpu_even_with_a_gpu_present():
    from disttrain.errors import UsageError
    from disttrain.runtime.precision import resolve

    assert resolve("fp16", torch.device("cuda:0")).needs_scaler
    with pytest.raises(UsageError, match="needs a CUDA GPU"):
        resolve("fp16", torch.device("cpu"))


def test_remote_checkpoint_staging_copies_cuda_state_to_pinned_memory():
    from disttrain.runtime.checkpoint_write_remote import on_host, to_bytes

    state = {"w": torch.arange(6.0, device="cuda").view(2, 3).t(), "step": 3}  # a non-contiguous view
    staged = on_host(state)
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    assert torch.equal(staged["w"], state["w"].cpu()) and staged["step"] == 3
    assert torch.equal(torch.load(io.BytesIO(to_bytes(state)), weights_only=True)["w"], state["w"].cpu())


def test_kept_host_buffers_stage_cuda_state_on_a_side_stream_and_are_reused():
    """Rank 0's file at a URL, staged the GPU way: pinned buffers allocated at the first save only, the
    copies on the side stream, the training's stream made to wait for them on the GPU; the bytes are the
    state's as it was when staged, though the training writes it in place right after."""
    from disttrain.runtime.checkpoint_stage import HostBuffers, stage, this_process
    from disttrain.runtime.checkpoint_write_remote import serialise_staged, side_stream

    assert this_process().host == "pinned-kept"
    buffers = HostBuffers()
    w = torch.randn(1024, 1024, device="cuda")
    for round_ in range(3):
        before = w.clone()
        staged = stage({"w": w, "step": torch.tensor(round_)}, buffers, side_stream(), copy_host=True)
        assert staged.value["w"].is_pinned()
        w.mul_(2)  # the next step, queued on the training's stream after the copy
        loaded = torch.load(io.BytesIO(serialise_staged(staged)), weights_only=True)
        assert torch.equal(loaded["w"], before.cpu()) and int(loaded["step"]) == round_
    assert buffers.allocations == 1
