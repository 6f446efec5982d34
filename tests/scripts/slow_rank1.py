"""Ranks stepping at their own pace (no collective per step), rank 1 three times slower:
the launcher must name it as a straggler, once, and sum up steps/s per host at the end."""

import sys
import time

import disttrain
from disttrain.runtime import heartbeat

ctx = disttrain.init()
seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 12.0
step_s = 0.15 if ctx.rank == 1 else 0.05
end = time.monotonic() + seconds
while time.monotonic() < end:
    time.sleep(step_s)  # the "step"
    heartbeat.beat()  # what a prepared loader does for each batch
print(f"rank {ctx.rank} done", flush=True)
disttrain.shutdown()
