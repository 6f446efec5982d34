"""What does sharding buy? Peak memory per rank and throughput of FSDP over DDP, one run.

A ~150M-parameter model of 16 transformer-sized blocks (width 896: attention-sized and
4x MLP linears, ~9.6M parameters each) trained with AdamW on 2 ranks, once with
``prepare(strategy="ddp")`` -- every rank holds the whole model, its gradients and Adam's
two moments, plus DDP's gradient buckets -- and once with ``strategy="fsdp"``, which holds
a half of each and gathers one block's parameters at a time. Reported per strategy: each
rank's peak resident memory (``ru_maxrss``, so the Python + torch runtime's own ~0.2 GB is
in both; glibc's mmap threshold fixed, see ``run()``) and steps/s over the timed steps; then fsdp / ddp of both. Goal: memory <= 0.6
(the limit is 1/2 plus the fixed runtime). A few steps on 2 CPU cores take minutes.

    python bench/sharded.py [--steps 3] [--width 896] [--blocks 16]

Prints one JSON object and writes it to bench/results/sharded-<date>-<arch>-<cpus>cpu.json.
With ``--worker`` it is the training script itself (started by ``disttrain run``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MMAP_THRESHOLD = "131072"


def worker(args: argparse.Namespace) -> None:
    import torch

    import disttrain

    class Block(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.attn = torch.nn.Linear(width, 4 * width)  # q, k, v and output, as one
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            h = self.norm(x)
            a = self.attn(h)
            x = x + a[..., : x.shape[-1]]
            return x + self.down(torch.relu(self.up(h)))

    ctx = disttrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = disttrain.prepare(model, opt, strategy=args.strategy)
    x = torch.randn(args.batch, args.seq, args.width)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        disttrain.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    report = {"rank": ctx.rank, "params": params, "peak_rss_mb": round(peak_mb, 1),
              "step_s": [round(t, 3) for t in times]}
    Path(args.out, f"{args.strategy}-rank{ctx.rank}.json").write_text(json.dumps(report))


def run(strategy: str, args: argparse.Namespace, out: str) -> list[dict]:
    threads = max(1, (os.cpu_count() or 1) // 2)
    # glibc raises its mmap threshold (up to 32 MB) each time a large block is freed, after
    # which FSDP's per-block gather buffers come from the heap and stay in RSS when freed:
    # the peak would measure the allocator's cache, not the tensors. A fixed threshold
    # returns freed large blocks to the OS, for both strategies alike (what
    # torch.cuda.max_memory_allocated shows on a GPU).
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    cmd = [sys.executable, "-m", "disttrain", "run", "-n", "2", __file__, "--worker",
           "--strategy", strategy, "--out", out, "--width", str(args.width),
           "--blocks", str(args.blocks), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--seq", str(args.seq)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench/sharded.py: the {strategy} run failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return [json.loads(Path(out, f"{strategy}-rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=896)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as out:
        ranks = {s: run(s, args, out) for s in ("ddp", "fsdp")}
    peak = {s: max(r["peak_rss_mb"] for r in ranks[s]) for s in ranks}
    rate = {s: len(ranks[s][0]["step_s"]) / sum(max(r["step_s"][i] for r in ranks[s])
                                                 for i in range(len(ranks[s][0]["step_s"])))
            for s in ranks}
    result = {
        "bench": "sharded",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "params": ranks["ddp"][0]["params"],
        "blocks": args.blocks,
        "width": args.width,
        "ranks": 2,
        "timed_steps": args.steps,
        "malloc_mmap_threshold": int(MMAP_THRESHOLD),
        "tokens_per_step_per_rank": args.batch * args.seq,
        "peak_rss_mb": {s: [r["peak_rss_mb"] for r in ranks[s]] for s in ranks},
        "steps_per_s": {s: round(v, 4) for s, v in rate.items()},
        "memory_ratio_fsdp_over_ddp": round(peak["fsdp"] / peak["ddp"], 3),
        "memory_goal": 0.6,
        "throughput_ratio_fsdp_over_ddp": round(rate["fsdp"] / rate["ddp"], 3),
    }
    out = ROOT / "bench" / "results" / (f"sharded-{result['date']}-{platform.machine()}-"
                                        f"{result['cpus']}cpu.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
