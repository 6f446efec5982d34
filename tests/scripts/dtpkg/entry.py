"""Launched with ``disttrain run -m dtpkg.entry``."""

import os
import sys

print(f"module rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]}", flush=True)
