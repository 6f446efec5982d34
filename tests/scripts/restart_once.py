"""Every rank joins the group and fails together on the first attempt; the restarted group
must join again. Usage: restart_once.py OUT_DIR (writes OUT_DIR/attempt<N>_rank<R>)."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import disttrain

ctx = disttrain.init()
total = torch.ones(1)
dist.all_reduce(total)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
(Path(sys.argv[1]) / f"attempt{attempt}_rank{ctx.rank}").write_text(str(int(total.item())))
if attempt == 0:
    sys.exit(3)
