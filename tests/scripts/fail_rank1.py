"""Rank 1 raises (exit 3 through sys.exit after printing the traceback); rank 0 waits forever."""

import os
import sys
import time
import traceback

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"pid {os.getpid()} rank {dist.get_rank()}", flush=True)
if dist.get_rank() == 1:
    try:
        raise ValueError("rank one cannot go on: bad shard 17")
    except ValueError:
        traceback.print_exc()
        sys.exit(3)
time.sleep(600)
