"""A torchrun script with no disttrain in it: env:// and its own checkpoint (rank 0 saves the step
every few steps, every rank loads the newest at start). Under an elastic launch it is restarted
on the new world and goes on from its own checkpoint.

Usage: plain_elastic.py OUT CKPT STEPS — each rank appends "attempt world rank step" lines to
OUT/rank<R>.log; the last world to finish writes OUT/done.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out, ckpt, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = os.environ.get("DISTTRAIN_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
start = torch.load(ckpt, weights_only=True)["step"] + 1 if ckpt.exists() else 0
total = torch.zeros(1)
with open(out / f"rank{rank}.log", "a") as log:
    for step in range(start, steps):
        dist.all_reduce(total)  # a collective every step: a lost peer is felt here
        log.write(f"{attempt} {world} {rank} {step}\n")
        log.flush()
        if rank == 0 and step % 3 == 2:
            torch.save({"step": step}, f"{ckpt}.tmp")
            os.replace(f"{ckpt}.tmp", ckpt)
        time.sleep(0.3)
dist.barrier()
if rank == 0:
    (out / "done").write_text(f"{world}\n")
dist.destroy_process_group()
