"""Each rank starts a helper in a session of its own (as a daemonising tool does) and a double-forked
grandchild, writes their pids to ``<out>/rank<R>.pids``, and exits 0: nothing may outlive the job."""

import os
import subprocess
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
if (child := os.fork()) == 0:  # the classic daemon: fork, setsid, fork again, parent exits
    os.setsid()
    if os.fork() == 0:
        (out / f"rank{rank}.daemon").write_text(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
os.waitpid(child, 0)
while not (out / f"rank{rank}.daemon").exists():
    time.sleep(0.05)
(out / f"rank{rank}.pids").write_text(f"{helper.pid} {(out / f'rank{rank}.daemon').read_text()}")
print(f"rank {rank} started {helper.pid} and a daemon", flush=True)
