"""No TensorFlow needed: what a ``--framework tensorflow`` worker finds in its environment."""

import json
import os
import sys

out_dir = sys.argv[1]
record = {
    "rank": int(os.environ["RANK"]),
    "tf_config": json.loads(os.environ["TF_CONFIG"]) if "TF_CONFIG" in os.environ else None,
    "legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS"),
    "cmdline": open("/proc/self/cmdline").read().split("\0"),
    "parent_cmdline": open(f"/proc/{os.getppid()}/cmdline").read().split("\0"),
    "argv": sys.argv[2:],
}
with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as fh:
    json.dump(record, fh)
print(f"worker {record['rank']} ready", flush=True)
