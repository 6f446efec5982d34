"""A plain torchrun script (no disttrain) reporting what ``python script.py`` promises, as the hang
diagnostics' bootstrap must keep it: argv, __main__, sys.path[0], spawned DataLoader workers, the
user's own sitecustomize; and the process groups' default timeout the bootstrap set."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(float(i * i))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    batches = [b.tolist() for b in loader]
    t = torch.ones(1)
    dist.all_reduce(t)
    sockets = os.environ.get("DISTTRAIN_HANG_SOCKETS", "")
    claim = os.path.join(sockets, f"rank{dist.get_rank()}.pid")
    report = {
        "rank": dist.get_rank(), "argv": sys.argv, "name": __name__, "path0": sys.path[0], "file": __file__,
        "batches": batches, "sum": t.item(), "user_site": os.environ.get("USER_SITE_RAN"),
        "pg_timeout_s": dist.distributed_c10d._get_default_timeout("gloo").total_seconds(),
        "claimed_by_me": bool(sockets) and open(claim).read() == str(os.getpid()),
    }
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()
