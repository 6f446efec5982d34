"""A torchrun-style script: plain torch.distributed, env://, one JSON file per rank."""

import json
import os
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo", init_method="env://")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
record = {
    "rank": int(os.environ["RANK"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "world_size": int(os.environ["WORLD_SIZE"]),
    "backend": os.environ.get("DISTTRAIN_BACKEND"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "extra": os.environ.get("DT_TEST_EXTRA"),
    "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "sum": value.item(),
    "argv": sys.argv[2:],
}
with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as fh:
    json.dump(record, fh)
print(f"hello from rank {record['rank']}", flush=True)
print(f"warning line from rank {record['rank']}", file=sys.stderr, flush=True)
dist.destroy_process_group()
