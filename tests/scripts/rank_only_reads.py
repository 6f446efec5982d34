"""MeanMeter.avg read the ways tutorials do; MODE picks one. Prints what rank 0 read.

SLOW_EXIT=S: rank 0 takes S seconds more to exit after disttrain closed its group (an atexit
handler registered before init runs after disttrain's): its peer, told at once, ends first.
"""

import atexit
import os
import sys
import time

import torch

import disttrain

mode = sys.argv[1]
if float(os.environ.get("SLOW_EXIT", "0")) and os.environ.get("RANK") == "0":
    atexit.register(time.sleep, float(os.environ["SLOW_EXIT"]))
ctx = disttrain.init()
meter = disttrain.MeanMeter()
meter.update(torch.tensor(float(ctx.rank + 1)), n=2)  # rank 0: 1.0 twice, rank 1: 2.0 twice


def report():
    if ctx.rank != 0:
        return
    print(f"avg {meter.avg}", flush=True)


if mode == "every-rank":  # the rule: read on every rank, use on one
    avg = meter.avg
    if ctx.is_main:
        print(f"avg {avg}", flush=True)
    disttrain.print0(f"print0 {meter.avg}")
elif mode == "inside-if":  # the tutorials' habit
    if ctx.is_main:
        print(f"avg {meter.avg}", flush=True)
elif mode == "early-return":
    report()
elif mode == "hidden":  # a rank test the source does not show
    first = [ctx.is_main][0]
    if first:
        print(f"avg {meter.avg}", flush=True)
    else:
        time.sleep(60)  # work without a collective: rank 0 must not wait for it forever
loss = disttrain.reduce_mean(torch.tensor(1.0))  # the training goes on: the next collective
disttrain.print0(f"done {loss}")
