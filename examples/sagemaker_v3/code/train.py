"""The training script of notebook.py: a line fitted by gradient descent, one data shard per process."""

import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.5)
args = parser.parse_args()

dist.init_process_group("gloo")  # torchrun's variables: every instance's processes in one group
rank, world = dist.get_rank(), dist.get_world_size()
rows = [line.split(",") for line in open(os.path.join(os.environ["SM_CHANNEL_TRAIN"], "points.csv"))]
x = torch.tensor([float(r[0]) for r in rows])[rank::world]
y = torch.tensor([float(r[1]) for r in rows])[rank::world]
w = torch.zeros(2, requires_grad=True)
for epoch in range(args.epochs):
    loss = ((w[0] * x + w[1] - y) ** 2).mean()
    loss.backward()
    dist.all_reduce(w.grad)
    with torch.no_grad():
        w -= args.lr * w.grad / world
        w.grad.zero_()
    print(f"host {os.environ['SM_CURRENT_HOST']} rank {rank}/{world} epoch {epoch} loss={loss.item():.4f}")
if rank == 0:
    torch.save({"w": w.detach()}, os.path.join(os.environ["SM_MODEL_DIR"], "model.pt"))
dist.destroy_process_group()
