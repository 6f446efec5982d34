"""The PyTorch AWS tutorial's program: ResNet-18 on STL-10, trained data-parallel with disttrain.

The tutorial ("PyTorch 1.0 Distributed Trainer with Amazon AWS") opens four ssh terminals
and types ``python main.py RANK LOCAL_RANK`` in each; here one command does it:

    python examples/resnet18_stl10.py                          # a world of one
    disttrain run -n 2 examples/resnet18_stl10.py              # two processes here
    disttrain run --hosts node0,node1 -n 2 examples/resnet18_stl10.py --data ~/stl10
    disttrain bench examples/resnet18_stl10.py -n 1,2,4 -- --samples 2000

Without ``--data`` it trains on generated STL-shaped images (3x96x96, ten classes; no
download); with ``--data DIR`` on the STL-10 binary release in DIR (``train_X.bin``...,
or its ``stl10_binary/`` folder), validating on the test split. Like the tutorial: SGD
with momentum 0.9 and weight decay 1e-4, the learning rate divided by 10 every 30 epochs,
top-1/top-5 on the validation set (here counted over every rank's share, each image
once), the best model by top-1 kept (``--output-dir``). Unlike it, the learning rate
starts at 0.01, not 0.1: the tutorial's 0.1 serves its 90 epochs at 224x224; from scratch,
for the few epochs of a first run, 0.1 makes the training loss climb above chance within an
epoch, and the batch-norm running statistics that evaluation uses are then so far from the
activations that the validation loss reads ~1e5 at chance accuracy (``--lr 0.1`` for the
tutorial's value). The tutorial resizes the 96x96
images to 224x224 for ResNet-18; ``--image-size`` does that, and defaults to 224 on a GPU
but 32 on CPU, where 224 costs about 50 times more per image.

``--batch-size`` is per process (the tutorial's 32); the global batch is that times the
number of processes. Rank 0 shows progress (a tqdm bar on a terminal, else a line every
``--log-every`` steps) and, as its last line, a JSON summary.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import disttrain
from disttrain.datasets import STL10Dataset, generate_stl10, load_stl10

NUM_CLASSES = 10


# ----------------------------------------------------------------------------- the model
# torchvision's resnet18, layer for layer and with the same state_dict keys, so that a
# model saved here loads into torchvision.models.resnet18(num_classes=10) and back.


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes=NUM_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64))
        self.layer2 = nn.Sequential(BasicBlock(64, 128, 2), BasicBlock(128, 128))
        self.layer3 = nn.Sequential(BasicBlock(128, 256, 2), BasicBlock(256, 256))
        self.layer4 = nn.Sequential(BasicBlock(256, 512, 2), BasicBlock(512, 512))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))  # any input size, 32 to 224
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model():
    """``(model, name)``: torchvision's resnet18 when torchvision imports, else ours."""
    try:
        from torchvision.models import resnet18
    except Exception:  # noqa: BLE001 -- not installed, or built for another torch (RuntimeError)
        return ResNet18(NUM_CLASSES), "resnet18 (built in)"
    return resnet18(num_classes=NUM_CLASSES), "resnet18 (torchvision)"


# ----------------------------------------------------------------------------- arguments


def at_least(minimum):
    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", metavar="DIR", help="STL-10 binary files (default: generated images)")
    parser.add_argument("--samples", type=at_least(1), default=500, help="generated training images")
    parser.add_argument("--val-samples", type=at_least(1), default=200, help="generated validation images")
    parser.add_argument("--image-size", type=at_least(16), default=None,
                        help="side the 96x96 images are resized to (default: 224 on a GPU, 32 on CPU)")
    parser.add_argument("--epochs", type=at_least(1), default=2)
    parser.add_argument("--batch-size", type=at_least(1), default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="starting learning rate (the tutorial's 0.1 diverges in a short run from scratch)")
    parser.add_argument("--lr-step", type=at_least(1), default=30, help="epochs between LR / 10")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--workers", type=at_least(0), default=0, help="data loading processes per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", metavar="DIR", help="where rank 0 keeps best_model.pt")
    parser.add_argument("--log-every", type=at_least(0), default=10, help="steps; 0: never")
    return parser


def datasets(args, image_size):
    """(train, validation): every rank builds the same full sets; prepare() shards them."""
    if args.data:
        return (load_stl10(args.data, "train", image_size=image_size),
                load_stl10(args.data, "test", image_size=image_size))
    return (STL10Dataset(*generate_stl10(args.samples, seed=args.seed), image_size=image_size),
            STL10Dataset(*generate_stl10(args.val_samples, seed=args.seed + 1), image_size=image_size))


# ----------------------------------------------------------------------------- the loops


def progress(loader, epoch, log_every):
    """Rank 0's view of an epoch: tqdm on a terminal, else a line every ``log_every`` steps.

    Under ``disttrain run`` (or any launcher) a worker's output goes through a pipe into a
    log, where a bar redrawn with carriage returns would arrive as one long line at the
    epoch's end; plain lines stream.
    """
    if disttrain.context().rank != 0:
        return loader
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(loader, desc=f"epoch {epoch}", unit="batch", leave=False)
    return loader


def train_one_epoch(model, loader, criterion, optimizer, epoch, log_every):
    """(mean loss over every rank's samples, seconds, samples this rank trained on)."""
    model.train()
    loss_meter = disttrain.MeanMeter()
    samples = 0
    start = time.perf_counter()
    bar = progress(loader, epoch, log_every)
    for step, (images, target) in enumerate(bar):
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_meter.update(loss, len(target))
        samples += len(target)
        if log_every and step % log_every == 0:
            # Every rank runs the same number of steps, so all of them reach this collective.
            step_loss = disttrain.reduce_mean(loss.detach()).item()
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{step_loss:.4f}")
            else:
                rate = samples / (time.perf_counter() - start)
                disttrain.print0(f"epoch {epoch} step {step}/{len(loader)} loss {step_loss:.4f} "
                                 f"({rate:.0f} images/s on rank 0)")
    if hasattr(bar, "close"):
        bar.close()
    return loss_meter.avg, time.perf_counter() - start, samples


@torch.no_grad()
def validate(model, loader, criterion):
    """(top-1, top-5, loss) over the whole validation set, each image counted once.

    Each rank counts on its own share; the sums are reduced once, after the loop (the
    shares may differ by one batch, so no collective may run per batch).
    """
    model.eval()
    top1 = top5 = total = 0
    loss_sum = 0.0
    for images, target in loader:
        output = model(images)
        loss_sum += criterion(output, target).item() * len(target)
        hits1, hits5 = disttrain.topk_correct(output, target, (1, 5))
        top1, top5, total = top1 + hits1, top5 + hits5, total + len(target)
    totals = disttrain.reduce_sum(torch.tensor([top1, top5, total, loss_sum], dtype=torch.float64))
    top1, top5, total, loss_sum = totals.tolist()
    if not total:
        return math.nan, math.nan, math.nan, 0
    return top1 / total, top5 / total, loss_sum / total, int(total)


def save_best(model, output_dir):
    """Rank 0 writes ``best_model.pt`` (the unwrapped model) whole or not at all."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "best_model.pt")
    temp = f"{path}.{os.getpid()}.tmp"
    torch.save(model.state_dict(), temp)
    os.replace(temp, path)  # a reader never sees a half-written file


def main():
    args = get_args_parser().parse_args()
    image_size = args.image_size or (224 if torch.cuda.is_available() else 32)
    try:
        train_set, val_set = datasets(args, image_size)
    except (FileNotFoundError, ValueError) as err:
        print(f"{os.path.basename(sys.argv[0])}: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)

    ctx = disttrain.init()
    train_dl = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                          num_workers=args.workers,
                          # the shuffle seed, which prepare() gives every rank's sampler
                          generator=torch.Generator().manual_seed(args.seed))
    val_dl = DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers)

    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model, model_name = build_model()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step, gamma=0.1)
    # Train through the DDP wrapper; validate and save `model` itself (see validate()).
    ddp_model, optimizer, train_dl, val_dl = disttrain.prepare(model, optimizer, train_dl, val_dl)
    disttrain.print0(
        f"{ctx.world_size} process(es), backend {ctx.dist_backend or 'none'}, device {ctx.device}: "
        f"{model_name}, {len(train_set)} training and {len(val_set)} validation images at "
        f"{image_size}x{image_size} ({'STL-10 from ' + args.data if args.data else 'generated'})"
    )

    epoch_seconds, trained = [], 0
    train_loss = val_loss = top1 = top5 = math.nan
    best_top1, best_epoch, val_samples = -1.0, None, 0
    for epoch in disttrain.epochs(args.epochs):
        train_loss, seconds, samples = train_one_epoch(
            ddp_model, train_dl, criterion, optimizer, epoch, args.log_every)
        scheduler.step()
        epoch_seconds.append(disttrain.reduce_max(seconds))  # the slowest rank's epoch
        trained += disttrain.reduce_sum(samples)
        top1, top5, val_loss, val_samples = validate(model, val_dl, criterion)
        is_best = top1 > best_top1
        if is_best:
            best_top1, best_epoch = top1, epoch
            if args.output_dir and ctx.is_main:
                save_best(model, args.output_dir)
        disttrain.print0(
            f"epoch {epoch}: train loss {train_loss:.4f}, val loss {val_loss:.4f}, "
            f"top-1 {top1:.4f}, top-5 {top5:.4f}{' (best)' if is_best else ''}, "
            f"lr {optimizer.param_groups[0]['lr']:g}, {epoch_seconds[-1]:.1f} s")

    summary = {
        "world_size": ctx.world_size,
        "epochs": args.epochs,
        "model": model_name,
        "image_size": image_size,
        "global_batch_size": args.batch_size * ctx.world_size,
        "train_samples": len(train_set),
        "val_samples": val_samples,  # summed over ranks: len(val_set) if none counted twice
        "train_samples_per_s": trained / sum(epoch_seconds) if trained else 0.0,
        "epoch_seconds": epoch_seconds,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_top1": top1,
        "val_top5": top5,
        "best_top1": best_top1,
        "best_epoch": best_epoch,
    }
    disttrain.print0(json.dumps(summary))


if __name__ == "__main__":
    main()
