"""A plain torchrun script (no disttrain) whose rank 1, after a few steps, sleeps in C code that holds
the GIL: no Python runs in that process (no worker-server handler, no Python signal handler) while
the others wait for it in the next all_reduce."""

import ctypes
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for _ in range(5):
    dist.all_reduce(t)
    time.sleep(0.2)
print(f"rank {rank} at the branch", flush=True)
if rank == 1:
    ctypes.PyDLL(None).sleep(100000)  # HANG: gil
dist.all_reduce(t)  # HANG: others
print(f"rank {rank} never gets here", flush=True)
dist.destroy_process_group()
