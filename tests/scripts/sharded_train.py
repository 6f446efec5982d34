"""A small model with repeated blocks trained under ``disttrain.resume``; the tests of
strategies, precision, accumulation and sharded checkpoints drive it by flags.

Writes OUT/rank<r>.jsonl (one line per optimizer step: step, epoch, the sample indices
this rank trained on, the reduced loss) and OUT/model.pt (the consolidated model).
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import disttrain
from disttrain.errors import DisttrainError


class Block(torch.nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class Net(torch.nn.Module):
    def __init__(self, width=16, depth=4, dropout=0.1):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.out = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Indexed(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def hold_async_save(step: int) -> None:
    """The background commit of ``step``'s checkpoint waits for ever on rank 0 (a daemon thread:
    the process's end, here its SIGKILL, ends it): however fast the machine, that save lags."""
    import threading

    from disttrain.runtime import checkpoint_write

    commit = checkpoint_write.PendingSave._commit

    def held(self, ctx, gather, finish, abandon, describe):
        # The step's temporary folder is what abandon() would remove: the only place it is named.
        folders = [str(cell.cell_contents) for cell in abandon.__closure__ or ()]
        if any(f"step_{step:08d}-" in folder for folder in folders):
            threading.Event().wait()
        commit(self, ctx, gather, finish, abandon, describe)

    checkpoint_write.PendingSave._commit = held


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--precision", default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--asynchronous", action="store_true")
    p.add_argument("--die-at", type=int, default=None, help="SIGKILL rank 0 after this step")
    p.add_argument("--hold-async-save-at", type=int, default=None,
                   help="rank 0 never commits the asynchronous checkpoint of this step: a save slower than "
                        "the steps up to a kill, made certain")
    p.add_argument("--model", default="net", choices=["net", "wide"])
    p.add_argument("--die-in-upload", type=int, default=None,
                   help="SIGKILL rank 0 while it uploads this step to a store: state.pt is there, no marker")
    args = p.parse_args()
    ctx = disttrain.init()
    if args.die_in_upload is not None:
        die_in_upload(f"step_{args.die_in_upload:08d}")
    if args.hold_async_save_at is not None and ctx.rank == 0:
        hold_async_save(args.hold_async_save_at)
    torch.manual_seed(0)
    width = args.width * (2 if args.model == "wide" else 1)
    model = Net(width=width, dropout=args.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(Indexed(args.samples), batch_size=args.batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(3))
    model, opt, data = disttrain.prepare(model, opt, data, strategy=args.strategy,
                                         mixed_precision=args.precision)
    step = disttrain.accumulate(model, opt, args.accumulate, clip_grad_norm=args.clip)
    state = disttrain.resume(args.ckpt, every=args.every, model=model, optimizer=opt,
                             accumulator=step, asynchronous=args.asynchronous)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"rank{ctx.rank}.jsonl", "a")
    for epoch in disttrain.epochs(args.epochs):
        for idx, x, y in state.steps(data):
            with step:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                step.backward(loss)
            record = {"step": state.step, "epoch": epoch, "idx": idx.tolist(),
                      "loss": float(disttrain.reduce_mean(loss.detach())),
                      "dtype": str(loss.dtype)}
            if step.grad_norm is not None:
                record["grad_norm"] = float(step.grad_norm)
            log.write(json.dumps(record) + "\n")
            log.flush()
            if args.die_at is not None and state.step + 1 == args.die_at and ctx.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    disttrain.checkpoint.export(args.out / "model.pt", model)


def die_in_upload(folder_name):
    """Stands for a host lost mid-upload: the process dies between two objects of the step."""
    from disttrain.checkpoint_url import RemoteLayout

    put = RemoteLayout.put

    def put_then_die(self, folder, name, data):
        if folder.name == folder_name and name.startswith("rank_"):
            os.kill(os.getpid(), signal.SIGKILL)
        return put(self, folder, name, data)

    RemoteLayout.put = put_then_die


if __name__ == "__main__":
    try:
        main()
    except DisttrainError as err:
        print(f"sharded_train: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
