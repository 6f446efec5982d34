"""The smallest real 2-rank job: join the group, one barrier, leave. For launch latency."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
