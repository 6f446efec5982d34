"""The smallest real 2-rank job: join the group, one barrier, leave. For launch latency.

With ``BENCH_STAMPS`` set (a folder), each rank writes its times there -- the script's start, the
group joined, its end, on the system's monotonic clock the launcher's bench shares -- so that
bench/torchrun_compare.py can place the workers on its timeline.
"""

import os
import time

started = time.monotonic()

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
joined = time.monotonic()
dist.barrier()
dist.destroy_process_group()
if os.environ.get("BENCH_STAMPS"):
    with open(os.path.join(os.environ["BENCH_STAMPS"], f"rank{os.environ['RANK']}"), "w") as fh:
        fh.write(f"{started} {joined} {time.monotonic()}\n")
