"""A SageMaker-style PyTorch training script, written as for a SageMaker estimator.

It reads only what SageMaker gives a script: hyperparameters as ``--key value``, ``SM_HOSTS``
and ``SM_CURRENT_HOST`` (rank = hosts.index(current_host)), data from ``SM_CHANNEL_TRAINING``,
and saves with ``torch.save`` into ``SM_MODEL_DIR``. It fits y = w*x + b on the channel's
CSV files, each host its shard, gradients averaged with a plain all_reduce; every host
leaves what it saw in its ``SM_OUTPUT_DATA_DIR/facts.json``, and rank 0 prints a final
JSON metrics line.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--note", default="")
parser.add_argument("--fail-host", default="")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])
parser.add_argument("--train", default=os.environ["SM_CHANNEL_TRAINING"])
args, unknown = parser.parse_known_args()

hosts = json.loads(os.environ["SM_HOSTS"])
current_host = os.environ["SM_CURRENT_HOST"]
rank, world = hosts.index(current_host), len(hosts)
dist.init_process_group(backend="gloo", rank=rank, world_size=world)

if args.sleep:
    print(f"ready {os.getpid()}", flush=True)
    time.sleep(args.sleep)
if current_host == args.fail_host:
    raise ValueError(f"{current_host} cannot go on: bad shard 17")
if args.fail_host:
    time.sleep(120)  # the failing host is the root cause; this one is stopped by the launcher

rows = []
for path in sorted(Path(args.train).glob("*.csv")):
    for line in path.read_text().splitlines():
        x, y = line.split(",")
        rows.append((float(x), float(y)))
x, y = torch.tensor(rows).T
x, y = x[rank::world], y[rank::world]  # this host's shard

w = torch.zeros(1, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
for _ in range(args.epochs * 50):
    loss = ((w * x + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in (w, b):
            dist.all_reduce(p.grad)
            p -= args.lr * p.grad / world
            p.grad.zero_()
loss_t = ((w * x + b - y) ** 2).mean().detach()
dist.all_reduce(loss_t)

out = Path(os.environ["SM_OUTPUT_DATA_DIR"])
(out / "facts.json").write_text(json.dumps({
    "rank": rank,
    "note": args.note,
    "unknown": unknown,
    "hps": json.loads(os.environ["SM_HPS"]),
    "hp_note": os.environ.get("SM_HP_NOTE"),
    "channels": json.loads(os.environ["SM_CHANNELS"]),
    "model_dir": args.model_dir,
    "resourceconfig": json.loads(
        (Path(os.environ["SM_INPUT_CONFIG_DIR"]) / "resourceconfig.json").read_text()),
    "num_cpus": int(os.environ["SM_NUM_CPUS"]),
    "samples": len(x),
}))
if rank == 0:
    torch.save({"w": w.detach(), "b": b.detach()}, os.path.join(args.model_dir, "model.pth"))
    print(json.dumps({"loss": loss_t.item() / world, "w": w.item(), "b": b.item(), "world": world}), flush=True)
dist.destroy_process_group()
