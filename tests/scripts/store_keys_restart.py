"""A torchrun-style script (its own init_process_group, env://) that keeps notes in the job's
store: the first attempt writes a key and fails; a restarted attempt must not find it.
Usage: store_keys_restart.py OUT_DIR (writes OUT_DIR/attempt<N>_rank<R>.json)."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
# Both ways a script reaches the store: the group's own, and a client of MASTER_ADDR:MASTER_PORT.
group_store = dist.distributed_c10d._get_default_store()
direct = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                       timeout=timedelta(seconds=30))
seen = {"group": group_store.check(["note"]), "direct": direct.check(["note"])}
(Path(sys.argv[1]) / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(seen))
dist.barrier()
if attempt == 0:
    if rank == 0:
        group_store.set("note", "from attempt 0")
        direct.set("note", "from attempt 0")
    dist.barrier()
    sys.exit(3)
dist.barrier()
dist.destroy_process_group()
