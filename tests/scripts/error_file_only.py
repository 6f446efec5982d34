"""Rank 1 leaves its error only in torch's error file (as @record does when stderr is lost)."""

import json
import os
import sys

if os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
        json.dump({"message": {"message": "RuntimeError: shard index 17 is corrupt",
                               "extraInfo": {"py_callstack": "Traceback (most recent call last):\n"
                                             '  File "error_file_only.py", line 12, in <module>\n'
                                             "RuntimeError: shard index 17 is corrupt\n",
                                             "timestamp": "0"}}}, fh)
    sys.stderr.close()
    os._exit(1)
