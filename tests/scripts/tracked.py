"""Logs a loss at each of 6 steps through disttrain.log (the tracking tests); exits with $EXIT_CODE."""

import os
import sys

import disttrain

ctx = disttrain.init()
for step in range(6):
    disttrain.log({"loss": 1.0 / (step + 1) + ctx.rank, "lr": 0.1}, step=step)
disttrain.shutdown()
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
