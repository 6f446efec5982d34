"""The seed chapter's distributed ConvNet, the plain PyTorch way (the baseline of overhead.py).

``mp.spawn``, a hand-set MASTER_ADDR/PORT, ``init_process_group(env://)``, a
DistributedSampler and DDP, exactly as ``convnet_distributed.py`` does it; same model,
data and per-process batch as ``examples/mnist_convnet.py``, timed the same way (training
loop only), last stdout line a JSON object.
"""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from disttrain.datasets.mnist import synthetic_digits


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.cn1 = nn.Conv2d(1, 16, 3, 1)
        self.cn2 = nn.Conv2d(16, 32, 3, 1)
        self.dp1 = nn.Dropout2d(0.10)
        self.dp2 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4608, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.cn1(x))
        x = F.relu(self.cn2(x))
        x = F.max_pool2d(x, 2)
        x = self.dp1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dp2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(cpu_num, args):
    rank = args.machine_id * args.num_processes + cpu_num
    dist.init_process_group(backend="gloo", init_method="env://", world_size=args.world_size, rank=rank)
    torch.manual_seed(args.seed)
    train_dataset = synthetic_digits(args.samples, seed=args.seed)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=args.world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=0, sampler=sampler
    )
    model = nn.parallel.DistributedDataParallel(ConvNet())
    optimizer = optim.Adadelta(model.parameters(), lr=0.5)
    model.train()
    seen = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for X, y in loader:
            loss = F.nll_loss(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(X)
    elapsed = time.perf_counter() - start
    total = torch.tensor([float(seen)])
    dist.all_reduce(total)
    if rank == 0:
        print(json.dumps({"world_size": args.world_size, "train_samples_per_s": total.item() / elapsed}))
    del model, optimizer
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", default=2, type=int)
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("--batch-size", default=128, type=int)
    parser.add_argument("--samples", default=60000, type=int)
    parser.add_argument("--seed", default=0, type=int)
    args = parser.parse_args()
    args.machine_id = 0
    args.world_size = args.num_processes
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    with socket.socket() as s:  # the seed hard-codes 8892; a free port keeps repeats independent
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    mp.spawn(train, nprocs=args.num_processes, args=(args,))


if __name__ == "__main__":
    main()
