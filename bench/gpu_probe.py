"""The programs `make gpu-check` (bench/gpu_check.py) runs, one per step, each printing one JSON
line on stdout; only ``facts`` runs without a GPU.

    python bench/gpu_probe.py facts | h2d | dcp
    disttrain run -n auto bench/gpu_probe.py launch
    disttrain run -n 1 --hang-timeout S bench/gpu_probe.py stall    (a plain torch script)
    disttrain run -n 2 --hang-timeout S bench/gpu_probe.py skip
    disttrain run -n 2 bench/gpu_probe.py comm

Only torch, the standard library and disttrain: the device image has no package registry.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def say(**figures) -> None:
    print(json.dumps(figures), flush=True)


def facts() -> None:
    """What the rest of the check depends on: versions, the GPU, /dev/shm (DataLoader workers and
    DCP's shared-memory staging live there), and which backend lets two ranks share the GPU."""
    from disttrain.placement import NCCL_MULTI_RANK_GPU_ENV, shared_gpu_backend

    cuda = torch.cuda.is_available()
    nccl = tuple(torch.cuda.nccl.version()) if cuda and torch.distributed.is_nccl_available() else None
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    props = torch.cuda.get_device_properties(0) if cuda else None
    shared = shared_gpu_backend(nccl)
    say(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
        cuda_available=cuda, gpus=torch.cuda.device_count() if cuda else 0,
        gpu=props.name if props else None, gpu_memory_gib=round(props.total_memory / 2**30, 1) if props else None,
        nccl=".".join(map(str, nccl)) if nccl else None,
        shm_gib=round(shm.f_blocks * shm.f_frsize / 2**30, 1) if shm else None,
        shared_gpu_backend=shared,
        shared_gpu_env={NCCL_MULTI_RANK_GPU_ENV: "1"} if shared == "nccl" else {})


def launch() -> None:
    """Under ``disttrain run -n auto``: where the runtime put this rank."""
    import disttrain

    ctx = disttrain.init()
    say(world_size=ctx.world_size, device=str(ctx.device), current_device=torch.cuda.current_device(),
        launcher_backend=os.environ.get("DISTTRAIN_BACKEND"))


def stall() -> None:
    """A plain script (no disttrain): NCCL's all_reduce is enqueued behind a kernel that never
    ends, so the collective stays 'scheduled' and the host waits in synchronize()."""
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    t = torch.ones(1 << 20, device=device)
    for _ in range(5):
        dist.all_reduce(t)
        torch.cuda.synchronize()
        time.sleep(0.2)
    print("at the stall", flush=True)
    torch.cuda._sleep(1 << 50)  # ~days of GPU cycles: the stream never reaches the collective
    dist.all_reduce(t)
    torch.cuda.synchronize()  # HANG: stall
    print("never gets here", flush=True)


def skip() -> None:
    """Two ranks on one GPU (NCCL >= 2.30, or gloo with CUDA tensors): rank 1 skips a collective
    and stays in its own code; rank 0 waits in it."""
    import torch.distributed as dist

    import disttrain

    ctx = disttrain.init()
    t = torch.ones(4, device=ctx.device)
    for _ in range(5):
        dist.all_reduce(t)
        time.sleep(0.2)
    print(f"rank {ctx.rank} on {ctx.device} over {ctx.dist_backend} at the branch", flush=True)
    if ctx.rank == 1:
        time.sleep(600)  # HANG: skip
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print("never gets here", flush=True)


def h2d() -> None:
    """A 256 MB batch to the GPU from pageable and from pinned memory; then a step whose next
    batch is copied (a) on the same stream, after it, as prepare()'s loader does, and (b) on a side
    stream, overlapped with it."""
    device = torch.device("cuda:0")
    n = 256 * 2**20 // 4
    pageable, pinned = torch.randn(n), torch.randn(n).pin_memory()
    out = torch.empty(n, device=device)

    def rate(src, reps=5):
        out.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            out.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return reps * src.numel() * 4 / (time.perf_counter() - start) / 1e9

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def compute():
        for _ in range(5):
            a @ a

    def timed(step, reps=10):
        step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1000

    side = torch.cuda.Stream()

    def overlapped():
        with torch.cuda.stream(side):
            out.copy_(pinned, non_blocking=True)
        compute()
        torch.cuda.current_stream().wait_stream(side)

    compute_ms, copy_ms = timed(compute), timed(lambda: out.copy_(pinned, non_blocking=True))
    same_ms = timed(lambda: (compute(), out.copy_(pinned, non_blocking=True)))
    side_ms = timed(overlapped)
    say(batch_mb=256, pageable_gb_s=round(rate(pageable), 2), pinned_gb_s=round(rate(pinned), 2),
        compute_ms=round(compute_ms, 2), copy_ms=round(copy_ms, 2), same_stream_step_ms=round(same_ms, 2),
        side_stream_step_ms=round(side_ms, 2),
        copy_hidden=round((compute_ms + copy_ms - side_ms) / max(min(compute_ms, copy_ms), 1e-9), 2))


def _model(seed: int, width: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])  # 134M parameters at 4096


def _step_ms(model, opt, x, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(model, snapshot) -> bool:
    return all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def dcp() -> None:
    """Checkpoint saves of CUDA state (model + AdamW, 1.6 GB), side by side in one run: how long each
    save blocks the step (ms, and ms per GB, every save after the first being what a run sees), the
    step time while the files are written, the wait until the save is durable, and a bit-exact load.
    disttrain's asynchronous save (FSDP: DCP shards through the kept pinned stager; a plain model at a
    file:// URL: host buffers kept between saves, copies on a side stream), torch's ``dcp.async_save``
    with its pinned ``DefaultStager`` kept between saves, and the synchronous saves of both. A world of
    one. ``dcp small`` runs a small model on whatever device there is (a try-out without a GPU)."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # torch >= 2.9

    import disttrain
    from disttrain.runtime.checkpoint_stage import KeptStager, this_process

    ctx = disttrain.init()
    width = 64 if sys.argv[2:] == ["small"] else 4096
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-dcp-"))
    model = _model(0, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = disttrain.prepare(model, opt, strategy="fsdp")
    x = torch.randn(256, width, device=ctx.device)
    quiet = statistics.median(_step_ms(model, opt, x, 10)[2:])
    state_gb = sum(p.numel() for p in model.parameters()) * 12 / 1e9
    figures = {"state_gb": round(state_gb, 2), "step_ms": round(quiet, 2), "staging": vars(this_process())}

    def measure(name, save, wait, load, on=(model, opt), saves=3):
        """``saves`` saves (the first also allocates what the next reuse), then a load of the last."""
        net, optim = on
        try:
            blocked, during, waited = [], [], []
            for step in range(1, saves + 1):
                snapshot = _snapshot(net)
                if x.is_cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                pending = save(step)  # returns once the state may change again
                blocked.append(round((time.perf_counter() - start) * 1000, 1))
                during.append(round(statistics.median(_step_ms(net, optim, x, 10)), 2))
                start = time.perf_counter()
                wait(pending)
                waited.append(round((time.perf_counter() - start) * 1000, 1))
            fresh = _model(1, width).to(ctx.device)
            fresh = load(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-4))
            later = blocked[1:] or blocked
            figures[name] = {"blocked_ms": blocked, "blocked_ms_per_gb_after_first":
                             round(statistics.median(later) / state_gb, 1),
                             "step_ms_during": during, "wait_after_ms": waited,
                             "resume_bit_exact": _same(fresh, snapshot)}
        except Exception as err:  # one side failing must not hide the others' figures
            figures[name] = {"error": f"{type(err).__name__}: {err}"[:500]}

    ours = folder / "disttrain"
    measure("disttrain",
            lambda step: disttrain.checkpoint.save(ours, step=step, asynchronous=True, model=model, optimizer=opt),
            lambda _: disttrain.checkpoint.wait(),
            lambda m, o: _disttrain_load(disttrain, m, o, ours))
    sync = folder / "disttrain-sync"
    measure("disttrain_sync",
            lambda step: disttrain.checkpoint.save(sync, step=step, model=model, optimizer=opt),
            lambda _: None, lambda m, o: _disttrain_load(disttrain, m, o, sync), saves=2)
    shutil.rmtree(sync, ignore_errors=True)

    theirs = folder / "dcp"
    pinned = x.is_cuda
    # torch's own stager, kept between saves as a training loop keeps it. Some torch versions close
    # a caller's stager after each save, and the next save then fails with KeyError: <class 'type'>
    # (its copy table emptied): KeptStager ignores that close, and the figures say how often it came.
    stager = KeptStager(DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                     use_async_staging=pinned, use_non_blocking_copy=pinned)))

    def save(step):
        response = tdcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                   checkpoint_id=theirs / f"step{step}", async_stager=stager)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # staged in the background: the state may change only once it is copied
            staged.result()
        return response

    measure("dcp_async_save_pinned", save, lambda response: getattr(response, "upload_completion", response).result(),
            lambda m, o: _dcp_load(tdcp, m, o, theirs / "step3"))
    figures["dcp_async_save_pinned"]["torch_closed_the_callers_stager"] = stager.closes_ignored
    stager.dispose()
    measure("dcp_save_sync",
            lambda step: tdcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                   checkpoint_id=theirs / f"sync{step}"),
            lambda _: None, lambda m, o: _dcp_load(tdcp, m, o, theirs / "sync2"), saves=2)
    shutil.rmtree(theirs, ignore_errors=True)

    # A plain (unsharded) model at a URL: rank 0's file staged in the kept host buffers.
    plain = _model(0, width).to(ctx.device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    _step_ms(plain, plain_opt, x, 2)
    url = f"file://{folder}/url"
    measure("disttrain_url_async",
            lambda step: disttrain.checkpoint.save(url, step=step, asynchronous=True, model=plain, optimizer=plain_opt),
            lambda _: disttrain.checkpoint.wait(),
            lambda m, o: _url_load(disttrain, m, url), on=(plain, plain_opt))
    shutil.rmtree(folder, ignore_errors=True)
    say(**figures)


def _url_load(disttrain, model, url):
    disttrain.checkpoint.load_latest(url, model=model)
    return model


def _disttrain_load(disttrain, model, opt, folder):
    model, opt = disttrain.prepare(model, opt, strategy="fsdp")
    disttrain.checkpoint.load_latest(folder, model=model, optimizer=opt)
    return model


def _dcp_load(tdcp, model, opt, folder):
    """The model alone: a fresh optimizer's state dict has no moments for DCP to load into."""
    state = {"model": model.state_dict()}
    tdcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state["model"])
    return model


def comm() -> None:
    """Two ranks sharing the GPU over NCCL: each gradient compression hook trains a few steps with
    the ranks' weights kept equal; the metric reductions and the barrier on the NCCL branch."""
    import torch.distributed as dist

    import disttrain

    ctx = disttrain.init()
    results = {}
    for hook in ("fp16", "bf16", "powersgd"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = disttrain.prepare(model, opt, grad_compression=hook)
        x = torch.randn(64, 256, device=ctx.device)
        for _ in range(5):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        first = next(model.parameters()).detach()
        seen = [torch.zeros_like(first) for _ in range(ctx.world_size)]
        dist.all_gather(seen, first)
        results[hook] = all(torch.equal(seen[0], s) for s in seen)
    # The metric reductions on the context's device (numbers too: NCCL reduces GPU memory only).
    reduced = {"reduce_mean": float(disttrain.reduce_mean(torch.tensor(float(ctx.rank), device=ctx.device))),
               "reduce_sum": disttrain.reduce_sum(ctx.rank + 1), "reduce_max": disttrain.reduce_max(ctx.rank / 2)}
    disttrain.barrier()  # NCCL's barrier names the rank's device
    if ctx.rank == 0:
        say(backend=ctx.dist_backend, world_size=ctx.world_size, hooks_agree=results, **reduced)
    disttrain.shutdown()


if __name__ == "__main__":
    {"facts": facts, "launch": launch, "stall": stall, "skip": skip, "h2d": h2d, "dcp": dcp,
     "comm": comm}[sys.argv[1]]()
