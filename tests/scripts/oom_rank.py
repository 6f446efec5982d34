"""A rank that allocates until the kernel's OOM killer ends it (run inside a small memory cgroup).

It makes itself the OOM killer's first choice (oom_score_adj, which any process may raise for
itself), so that the kill lands on the rank and not on its agent, whatever their sizes.
"""

import time

with open("/proc/self/oom_score_adj", "w") as fh:
    fh.write("1000")
print("allocating", flush=True)
held = []
for _ in range(256):  # 8 GiB at most: far above the test's limit
    chunk = bytearray(32 << 20)
    chunk[::4096] = b"x" * len(chunk[::4096])  # touch every page: resident, charged to the cgroup
    held.append(chunk)
time.sleep(30)
print("not killed", flush=True)
