"""The quick start: a plain PyTorch training loop, data-parallel with five disttrain calls.

    python examples/quickstart.py                 # one process
    disttrain run -n 2 examples/quickstart.py     # two processes (or torchrun --nproc-per-node 2 ...)
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import disttrain

torch.manual_seed(0)  # the same data and the same first weights on every rank
x = torch.randn(4096, 20)
y = (x[:, :10].sum(dim=1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

ctx = disttrain.init()                                            # rank, device, backend: from the launcher
train_dl = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)   # an ordinary DataLoader
model, optimizer, train_dl = disttrain.prepare(model, optimizer, train_dl)  # DDP, one shard per rank
for epoch in disttrain.epochs(3):                                 # reshuffled each epoch, alike on every rank
    meter = disttrain.MeanMeter()
    for xb, yb in train_dl:                                       # this rank's batches, on ctx.device
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()                                           # gradients averaged over the ranks
        optimizer.step()
        meter.update(loss, len(yb))
    disttrain.print0(f"epoch {epoch}: loss {meter.avg:.4f}")      # the mean over every rank's samples
