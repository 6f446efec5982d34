"""A tiny training script for ``disttrain bench`` tests: a linear model on random data.

Its training batches go through the runtime's step timer explicitly (``--timer``), as a
prepared loader's will on its own; without it, it only prints an MNIST-example-style
summary line, the bench's fallback. ``--fail-at-world N`` exits 3 on rank 1 when the
world has N processes, to test that one failing count keeps the others' results.
"""

import argparse
import json
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain
from disttrain.runtime import steptimer

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--per-proc", type=int, default=None, help="an alternative batch flag")
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--timer", action="store_true")
parser.add_argument("--fail-at-world", type=int, default=0)
args = parser.parse_args()
batch_size = args.per_proc or args.batch_size

ctx = disttrain.init()
if ctx.world_size == args.fail_at_world and ctx.rank == ctx.world_size - 1:
    print(f"rank {ctx.rank} fails on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(args.samples, 8, generator=g), torch.randint(0, 2, (args.samples,), generator=g))
train_dl = DataLoader(data, batch_size=batch_size, shuffle=True, generator=g)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, train_dl = disttrain.prepare(model, optimizer, train_dl)

trained, seconds = 0, 0.0
for _epoch in disttrain.epochs(args.epochs):
    start = time.perf_counter()
    batches = steptimer.timed(train_dl) if args.timer else train_dl
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trained += len(y)
    seconds += time.perf_counter() - start
summary = {
    "world_size": ctx.world_size,
    "global_batch_size": batch_size * ctx.world_size,
    "train_samples_per_s": disttrain.reduce_sum(trained) / disttrain.reduce_max(seconds),
    "epoch_seconds": [seconds],
}
disttrain.print0(json.dumps(summary))
