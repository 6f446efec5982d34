"""Rank 1 leaves with exit code 0 after one step; rank 0 goes on calling collectives."""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    dist.destroy_process_group()
    # Its connections are closed; the process ends a moment later (an interpreter's teardown with
    # torch loaded takes that long on a busy machine): rank 0 fails before rank 1 has exited.
    time.sleep(0.3)
    sys.exit(0)
for _ in range(20):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.1)
