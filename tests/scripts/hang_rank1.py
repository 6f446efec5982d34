"""A prepared DDP loop in which rank 1 stops making progress at step 3 (a stuck data source,
a deadlock): rank 0 then waits in the gradient all-reduce. For the hang watchdog."""

import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain

ctx = disttrain.init()
data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
model, opt, loader = disttrain.prepare(torch.nn.Linear(4, 1), None, DataLoader(data, batch_size=4, shuffle=True))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    if step == 3 and ctx.rank == 1:
        print("rank 1 gets stuck", flush=True)
        time.sleep(600)  # the line the watchdog must point at
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    time.sleep(0.5)  # slow steps: progress must be seen across the heartbeat interval
disttrain.shutdown()
