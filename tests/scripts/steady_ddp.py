"""A prepared DDP loop at a steady pace (a collective every step), for as many seconds as its
argument says; rank 0 prints each tenth step. For faults in the middle of a run."""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain

ctx = disttrain.init()
seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
data = TensorDataset(torch.randn(100000, 4), torch.randn(100000, 1))
model, opt, loader = disttrain.prepare(torch.nn.Linear(4, 1), None, DataLoader(data, batch_size=4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
end = time.monotonic() + seconds
for step, (x, y) in enumerate(loader):
    if time.monotonic() > end:
        break
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if step % 10 == 0:
        print(f"rank {ctx.rank} step {step}", flush=True)
    time.sleep(0.1)
disttrain.shutdown()
