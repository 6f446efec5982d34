"""A small MLP classifier trained with disttrain.prepare + disttrain.resume, for the gradient
compression tests. Usage: comm_train.py OUT_DIR [--epochs E] [--crash-at STEP] [--kill-at STEP]

Compression comes from the launcher (``--grad-compression``). ``--crash-at STEP``: on the
first attempt, rank 1 dies (exit 3) right after that step, so that ``--max-restarts 1``
resumes from the newest checkpoint; ``--kill-at STEP`` the same with SIGKILL. A resumed run's
ranks each write OUT_DIR/start_rank{R}.json: a sha256 of the weights they start from. Rank 0 writes OUT_DIR/result.json: the first and last
epochs' mean training loss, the validation accuracy, a sha256 of the final weights, and
the step the run resumed from.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import disttrain

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--crash-at", type=int, default=None)
parser.add_argument("--kill-at", type=int, default=None)
args = parser.parse_args()

ctx = disttrain.init()
gen = torch.Generator().manual_seed(0)
centers = torch.randn(10, 32, generator=gen) * 2


def blobs(n: int) -> TensorDataset:
    y = torch.randint(0, 10, (n,), generator=gen)
    return TensorDataset(centers[y] + torch.randn(n, 32, generator=gen), y)


train_set, val_set = blobs(1280), blobs(400)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
train_dl = DataLoader(train_set, batch_size=32, shuffle=True)
val_dl = DataLoader(val_set, batch_size=100)
ddp_model, optimizer, train_dl, val_dl = disttrain.prepare(model, optimizer, train_dl, val_dl)
state = disttrain.resume(model=ddp_model, optimizer=optimizer)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def weights_sha256() -> str:
    digest = hashlib.sha256()
    for name, tensor in disttrain.unwrap(ddp_model).state_dict().items():
        digest.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


if state.resumed_from is not None:
    Path(args.out, f"start_rank{ctx.rank}.json").write_text(json.dumps({"weights_sha256": weights_sha256()}))

losses = []
for epoch in state.epochs(args.epochs):
    meter = disttrain.MeanMeter()
    for X, y in state.steps(train_dl):
        loss = F.cross_entropy(ddp_model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter.update(loss, len(y))
        if args.crash_at is not None and attempt == 0 and ctx.rank == 1 and state.step + 1 == args.crash_at:
            sys.stdout.flush()
            os._exit(3)  # dies mid-run, as a lost host would
        if args.kill_at is not None and attempt == 0 and ctx.rank == 1 and state.step + 1 == args.kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    losses.append(meter.avg)
    disttrain.print0(f"epoch {epoch}: loss {meter.avg:.4f}")

correct = total = 0
ddp_model.eval()
with torch.no_grad():
    for X, y in val_dl:
        correct += int((ddp_model(X).argmax(1) == y).sum())
        total += len(y)
accuracy = disttrain.reduce_sum(correct) / disttrain.reduce_sum(total)
if ctx.is_main:
    Path(args.out, "result.json").write_text(json.dumps({
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "val_accuracy": accuracy, "weights_sha256": weights_sha256(),
        "resumed_from": state.resumed_from, "world_size": ctx.world_size, "steps": state.step,
    }))
