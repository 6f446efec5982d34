"""A plain torchrun script (no disttrain) that hangs after a few steps, in the way its argument names:

  op    rank 1 calls all_gather where the others call all_reduce (a branch taken on one rank only)
  lock  rank 1 deadlocks on a lock in its own code; the others wait for it in the next all_reduce
  group ranks 0 and 1 use a subgroup in opposite orders with the default group (each waits for the other)
"""

import sys
import threading
import time

import torch
import torch.distributed as dist

case = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pair = dist.new_group([0, 1])
t = torch.ones(4)
for _ in range(5):
    dist.all_reduce(t)
    time.sleep(0.2)
print(f"rank {rank} at the branch", flush=True)
if case == "op" and rank == 1:
    dist.all_gather([torch.zeros(4) for _ in range(world)], t)  # HANG: op
elif case == "lock" and rank == 1:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # HANG: lock
elif case == "group" and rank in (0, 1):
    first, second = (pair, None) if rank == 0 else (None, pair)
    dist.all_reduce(t, group=first)  # HANG: group
    dist.all_reduce(t, group=second)
else:
    dist.all_reduce(t)  # HANG: others
print(f"rank {rank} never gets here", flush=True)
dist.destroy_process_group()
