"""What the per-step SIGTERM vote of ``disttrain.resume`` costs, next to a training step.

    python bench/stop_vote.py            # launches itself with `disttrain run -n 2`

Each rank times ``--votes`` stop votes (one all-reduce of an int32 on the CPU group, what
``TrainingState.steps()`` does after every step while it has a checkpoint directory) and
``--steps`` DDP training steps of the example's ConvNet at its batch size, interleaved in
blocks so that both see the same machine load. Prints JSON (rank 0's figures) and writes
it to bench/results/stop_vote-<date>-<machine>-<cpus>cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("--votes", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import disttrain
    from disttrain.runtime import preemption

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_convnet import ConvNet

    ctx = disttrain.init()
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=0.5)
    model, optimizer = disttrain.prepare(model, optimizer)
    vote = preemption.StopVote(distributed=ctx.distributed)
    x = torch.randn(args.batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch_size,))

    def step() -> None:
        loss = F.nll_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(5):  # warm up DDP's buckets and gloo's connections
        step()
        vote()
    vote_s, step_s = [], []
    blocks = 10
    for _ in range(blocks):
        disttrain.barrier()
        start = time.perf_counter()
        for _ in range(args.votes // blocks):
            vote()
        vote_s.append((time.perf_counter() - start) / (args.votes // blocks))
        disttrain.barrier()
        start = time.perf_counter()
        for _ in range(args.steps // blocks):
            step()
        step_s.append((time.perf_counter() - start) / (args.steps // blocks))
    if ctx.is_main:
        vote_us, step_ms = statistics.median(vote_s) * 1e6, statistics.median(step_s) * 1e3
        print(json.dumps({
            "world_size": ctx.world_size,
            "backend": ctx.dist_backend,
            "batch_size_per_rank": args.batch_size,
            "vote_us_median": round(vote_us, 1),
            "step_ms_median": round(step_ms, 2),
            "vote_share_of_step": round(vote_us / (step_ms * 1e3), 5),
        }))


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    argv = [sys.executable, "-m", "disttrain", "run", "-n", str(args.nproc), "--ranks", "0",
            __file__, "--votes", str(args.votes), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    lines = [line.split("] ", 1)[-1] for line in result.stdout.splitlines()]
    found = [line for line in lines if line.startswith("{")]
    if result.returncode != 0 or not found:
        sys.stderr.write(result.stdout + result.stderr)
        return result.returncode or 1
    result = {"bench": "stop_vote", "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "cpus": os.cpu_count(), **json.loads(found[-1])}
    name = f"stop_vote-{result['date']}-{result['machine']}-{result['cpus']}cpu.json"
    (ROOT / "bench" / "results" / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
