"""A small DDP training that ends on an optimizer step, with no cleanup of its own.

That ending is the hazardous one: the DDP model stays alive in a module global until the
interpreter exits, and gloo's threads are still freeing the last backward's collectives
when the script's last line returns. disttrain's atexit shutdown must make every exit
clean anyway. Usage: OUT_DIR.
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain

ctx = disttrain.init()
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
model, opt, loader = disttrain.prepare(
    torch.nn.Linear(8, 2), None, DataLoader(data, batch_size=8, shuffle=True))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_meter = disttrain.MeanMeter()
for _epoch in disttrain.epochs(1):
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss_meter.update(loss, n=len(y))
disttrain.print0(f"loss {loss_meter.avg:.4f}")
(Path(sys.argv[1]) / f"rank_{ctx.rank}.started").write_text("ok")
# No DataLoader or report after the last collective: the process goes straight to exit.
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(8, 8)).sum().backward()
    opt.step()
