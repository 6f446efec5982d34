"""Training DDP on a sequential (unpadded) loader: 5 samples on 2 ranks give rank 0 three
batches and rank 1 two. The prepared loop must end on both, not hang in backward."""

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain

ctx = disttrain.init()
torch.manual_seed(0)
data = TensorDataset(torch.randn(5, 4), torch.randn(5, 1))
model, _, loader = disttrain.prepare(torch.nn.Linear(4, 1), None, DataLoader(data, batch_size=1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    steps += 1
weights = disttrain.unwrap(model).weight.detach().flatten().tolist()
with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as fh:
    json.dump({"steps": steps, "weights": weights}, fh)
disttrain.shutdown()
