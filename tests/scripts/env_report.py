"""Reports what the environment rule delivered to this rank, without printing any value of a secret.

Writes ``env<RANK>.json`` into argv[1]: chosen variables, a hash of DT_SECRET (never the value),
and whether any process on this machine has the secret in its command line (``ps`` would show it).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

secret = os.environ.get("DT_SECRET")
in_argv = []
if secret:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if secret.encode() in cmdline.read_bytes():
                in_argv.append(cmdline.parent.name)
        except OSError:
            pass
record = {
    "rank": int(os.environ["RANK"]),
    "out_dir": os.environ.get("DT_OUT_DIR"),
    "hostname": os.environ.get("HOSTNAME"),
    "pwd": os.environ.get("PWD"),
    "ssh_connection": os.environ.get("SSH_CONNECTION"),
    "secret_sha": hashlib.sha256(secret.encode()).hexdigest() if secret else None,
    "secret_in_argv_of": in_argv,
    "set_by_env_flag": os.environ.get("DT_SET"),
    "home": os.environ.get("HOME"),
    "path": os.environ.get("PATH"),
}
(Path(sys.argv[1]) / f"env{record['rank']}.json").write_text(json.dumps(record))
print(f"rank {record['rank']} reported", flush=True)
