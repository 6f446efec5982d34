"""Joins the job through the runtime and reports; used where the network is made to fail."""

import disttrain

ctx = disttrain.init()
disttrain.barrier()
print(f"rank {ctx.rank} joined {ctx.world_size}", flush=True)
