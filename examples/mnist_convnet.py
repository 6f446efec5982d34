"""The MNIST ConvNet of "Mastering PyTorch", chapter 11, trained data-parallel with disttrain.

The same file runs as one process or many:

    python examples/mnist_convnet.py                    # a world of one
    disttrain run -n 2 examples/mnist_convnet.py        # two processes
    torchrun --standalone --nproc-per-node 2 examples/mnist_convnet.py

Without ``--data`` it trains on generated digits (no download needed); with
``--data DIR`` on the real MNIST IDX files in DIR (``train-images-idx3-ubyte`` and
friends, plain or ``.gz``), validating on the t10k split.

``--batch-size`` is per process, so two processes train with twice the global batch; the
chapter halves it by hand to keep the global batch at 128.

Rank 0 prints one line per epoch and, as its last line, a JSON summary.

With ``--checkpoint-dir DIR`` it saves a checkpoint every ``--checkpoint-every`` steps (or
at the end of each epoch) and, started again -- by ``disttrain run --max-restarts K`` after
a crash, or by you after a preemption (SIGTERM) -- carries on from the newest one, ending
with the same weights as a run that never stopped.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader

import disttrain
from disttrain.datasets import load_mnist, synthetic_digits


class ConvNet(nn.Module):
    """The chapter's model, layer for layer."""

    def __init__(self):
        super().__init__()
        self.cn1 = nn.Conv2d(1, 16, 3, 1)
        self.cn2 = nn.Conv2d(16, 32, 3, 1)
        self.dp1 = nn.Dropout2d(0.10)
        # The chapter has Dropout2d(0.25) here, on a (batch, 64) tensor; torch now warns
        # that this is deprecated, and Dropout is what it amounts to.
        self.dp2 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4608, 64)  # 4608 = 12 x 12 x 32
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.cn1(x))
        x = F.relu(self.cn2(x))
        x = F.max_pool2d(x, 2)
        x = self.dp1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dp2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def at_least(minimum):
    """An argparse type: an int no smaller than ``minimum``."""

    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", metavar="DIR", help="MNIST IDX files (default: generated digits)")
    parser.add_argument("--samples", type=at_least(1), default=60000, help="generated images")
    parser.add_argument("--epochs", type=at_least(1), default=1)
    parser.add_argument("--batch-size", type=at_least(1), default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", metavar="DIR", help="where rank 0 saves model.pt")
    parser.add_argument("--num-workers", type=at_least(0), default=0)
    parser.add_argument("--log-every", type=at_least(0), default=50, help="steps; 0: never")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="save checkpoints here and resume from the newest one "
                        "(default: $DISTTRAIN_CHECKPOINT_DIR, else none)")
    parser.add_argument("--checkpoint-every", metavar="N", type=at_least(0), default=None,
                        help="steps between checkpoints; 0: at the end of each epoch "
                        "(default: $DISTTRAIN_CHECKPOINT_EVERY, else 0)")
    return parser


def datasets(args):
    """(train, validation). Every rank builds the same full datasets; prepare() shards them."""
    if args.data:
        return load_mnist(args.data, "train"), load_mnist(args.data, "test")
    # A different seed for validation: images the model has never seen.
    return (
        synthetic_digits(args.samples, seed=args.seed),
        synthetic_digits(max(args.samples // 6, 1), seed=args.seed + 1),
    )


def train_one_epoch(model, optimizer, loader, state, log_every):
    """Returns (mean loss over every rank's samples, seconds, samples this rank trained on).

    A resumed epoch runs only its remaining steps, and its loss is theirs.
    """
    model.train()
    loss_meter = disttrain.MeanMeter()
    samples = 0
    start = time.perf_counter()
    for X, y in state.steps(loader):  # skips what a checkpoint says is done
        step = state.epoch_step
        pred_prob = model(X)
        loss = F.nll_loss(pred_prob, y)  # nll is the negative log likelihood loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_meter.update(loss, len(y))
        samples += len(y)
        if log_every and step % log_every == 0:
            # Every rank runs the same number of steps, so all of them reach this collective.
            step_loss = disttrain.reduce_mean(loss.detach())
            disttrain.print0(
                f"epoch {state.epoch} step {step}/{len(loader)} loss {step_loss.item():.4f}")
    seconds = time.perf_counter() - start
    return loss_meter.avg, seconds, samples


@torch.no_grad()
def evaluate(model, loader):
    """(accuracy, samples) over the whole validation set, each sample counted once.

    Each rank counts hits on its own share; the counts are summed once, after the loop.
    """
    model.eval()
    correct = total = 0
    for X, y in loader:
        correct += disttrain.topk_correct(model(X), y)[0]
        total += len(y)
    correct, total = disttrain.reduce_sum(correct), disttrain.reduce_sum(total)
    return (correct / total if total else float("nan")), total


# Under `--nnodes MIN:MAX`, a host lost (or joining) calls main() again in the same process,
# with the state from memory: docs/elastic.md. Elsewhere a plain call.
@disttrain.elastic
def main():
    args = get_args_parser().parse_args()

    ctx = disttrain.init()
    train_set, val_set = datasets(args)
    train_dl = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        # the shuffle seed, which prepare() gives every rank's DistributedSampler
        generator=torch.Generator().manual_seed(args.seed),
    )
    val_dl = DataLoader(val_set, batch_size=2 * args.batch_size, num_workers=args.num_workers)

    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model = ConvNet()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    # prepare() moves `model` to ctx.device in place and, with several processes, returns
    # it wrapped in DistributedDataParallel: train through the wrapper; evaluate and save
    # `model` itself (a DDP forward may talk to the other ranks, and evaluation shards
    # are uneven).
    ddp_model, optimizer, train_dl, val_dl = disttrain.prepare(model, optimizer, train_dl, val_dl)
    # Loads the newest checkpoint, if any, into the model and optimizer; disttrain.epochs()
    # and state.steps() then skip what it says is done.
    state = disttrain.resume(args.checkpoint_dir, every=args.checkpoint_every,
                             model=model, optimizer=optimizer)
    disttrain.print0(
        f"{ctx.world_size} process(es), backend {ctx.dist_backend or 'none'}, device {ctx.device}: "
        f"{len(train_set)} training and {len(val_set)} validation images "
        f"({'MNIST from ' + args.data if args.data else 'generated'})"
    )

    epoch_seconds, trained = [], 0
    train_loss = val_accuracy = float("nan")
    val_samples = 0
    for epoch in disttrain.epochs(args.epochs):
        train_loss, seconds, samples = train_one_epoch(
            ddp_model, optimizer, train_dl, state, args.log_every
        )
        # the epoch ends when the slowest rank does
        epoch_seconds.append(disttrain.reduce_max(seconds))
        trained += disttrain.reduce_sum(samples)
        val_accuracy, val_samples = evaluate(model, val_dl)
        disttrain.print0(
            f"epoch {epoch}: train loss {train_loss:.4f}, val accuracy {val_accuracy:.4f}, "
            f"{epoch_seconds[-1]:.1f} s"
        )

    if args.output_dir and ctx.is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, "model.pt")
        torch.save(model.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)  # a reader never sees a half-written file
    summary = {
        "world_size": ctx.world_size,
        "epochs": args.epochs,
        "global_batch_size": args.batch_size * ctx.world_size,
        "train_samples": len(train_set),
        "val_samples": val_samples,  # summed over ranks: len(val_set) if none counted twice
        "train_samples_per_s": trained / sum(epoch_seconds) if trained else 0.0,
        "epoch_seconds": epoch_seconds,
        "train_loss": train_loss,
        "val_accuracy": val_accuracy,
    }
    disttrain.print0(json.dumps(summary))


if __name__ == "__main__":
    main()
