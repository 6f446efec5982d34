"""A job made to be bound one way, for `disttrain bench --comm`'s split.

``--kind wire``: a 4 MB weight matrix and almost no arithmetic, so a step is the all-reduce;
``--kind compute``: a few hundred parameters behind a long chain of fixed (untrained)
matrix products, so a step is arithmetic. Usage: comm_bound.py --kind K [--batch-size B]
[--samples N] [--epochs E] (what `bench --comm` runs to the end for each mode).
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import disttrain

parser = argparse.ArgumentParser()
parser.add_argument("--kind", choices=("wire", "compute"), required=True)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--epochs", type=int, default=100)
args = parser.parse_args()


# Deep enough that a step's arithmetic (~0.2 s a rank) dwarfs what waking a rank for a 10 kB all-reduce costs on a
# machine loaded three lanes deep (at 60 products, 88 ms a step, CI once read 20.4 % of it as communication).
DEPTH = 150


class Compute(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mix", torch.randn(256, 256) / 16)  # not trained: nothing to send
        self.head = torch.nn.Linear(256, 10)

    def forward(self, x):
        for _ in range(DEPTH):
            x = torch.tanh(x @ self.mix)
        return self.head(x)


disttrain.init()
torch.manual_seed(0)
if args.kind == "wire":
    model, width = torch.nn.Linear(1024, 1024), 1024
else:
    model, width = Compute(), 256
data = TensorDataset(torch.randn(args.samples, width), torch.randint(0, 10, (args.samples,)))
loader = DataLoader(data, batch_size=args.batch_size if args.kind == "wire" else 256, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer, loader = disttrain.prepare(model, optimizer, loader)
for _epoch in disttrain.epochs(args.epochs):
    for X, y in loader:
        loss = F.cross_entropy(model(X)[:, :10], y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
