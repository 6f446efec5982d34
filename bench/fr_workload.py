"""A plain DDP loop (no disttrain) for bench/flight_recorder.py: small layers, so that a step is
short and its gradient all-reduces are many -- the case where recording each collective would
show. Rank 0 prints its steady-state steps/s as one JSON line."""

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def step(model, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU()) for _ in range(4)]
    # One bucket per layer (bucket_cap_mb tiny): four all-reduces per step.
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)), bucket_cap_mb=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, args.width), torch.randn(32, 1)

    for _ in range(args.warmup):
        step(model, opt, x, y)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(model, opt, x, y)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(json.dumps({"steps_per_s": args.steps / elapsed}), flush=True)
    # DDP's reducer torn down at interpreter exit, after the group, sometimes aborts the process
    # ("terminate called without an active exception"): gone first (shared/rig/README.md).
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
