"""A small decoder-only transformer language model, trained on the Python standard
library's own source files -- text every Python installation ships, so nothing to download.

    python examples/transformer_lm.py --epochs 1                          # a world of one
    disttrain run -n 2 examples/transformer_lm.py --strategy fsdp --mixed-precision bf16
    disttrain run -n 2 examples/transformer_lm.py --accumulate 4 --checkpoint-dir ckpt

The text is read byte by byte (a 256-symbol vocabulary, no tokenizer to install); every
20th source file (by sorted path) is held out, and the held-out perplexity per byte is
printed before and after training. A model that has learned nothing scores 256.

``--strategy fsdp`` shards the parameters, gradients and AdamW state over the ranks, block
by block (the transformer blocks are what ``prepare()`` finds repeated); this is what
lets a model whose Adam state does not fit one device train at all. ``--mixed-precision
bf16`` computes the forward in bfloat16 (CPU or GPU), ``fp16`` (GPU only) with a gradient
scaler. ``--accumulate N`` sums N micro-batches into one optimizer step, with the
gradients averaged over the ranks once per step. With ``--checkpoint-dir`` a restarted run
resumes from the newest checkpoint -- on another number of ranks too, with fsdp.

Rank 0 prints one line per epoch and, as its last line, a JSON summary.
"""

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import disttrain
from disttrain.errors import DisttrainError


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.norm2(x)))


class ByteLM(nn.Module):
    def __init__(self, *, context: int, width: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def stdlib_text(max_bytes: int) -> tuple[bytes, bytes]:
    """(training text, held-out text) from the standard library's ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held_bytes = max(max_bytes // 10, 64 * 1024)
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        target, limit = (held, held_bytes) if i % 20 == 19 else (train, max_bytes)
        if len(target) < limit:
            target += path.read_bytes()
        if len(train) >= max_bytes and len(held) >= held_bytes:
            break
    return bytes(train[:max_bytes]), bytes(held[:held_bytes])


class Chunks(Dataset):
    """Consecutive ``context + 1``-byte pieces: the input and, one byte on, the target."""

    def __init__(self, text: bytes, context: int, limit: int | None = None):
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.context = context
        self.count = (len(self.data) - 1) // context
        if limit is not None:
            self.count = min(self.count, limit)

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        piece = self.data[i * self.context: (i + 1) * self.context + 1]
        return piece[:-1], piece[1:]


def heldout_perplexity(model, loader) -> float:
    """exp(mean negative log-likelihood per byte), summed over ranks before dividing.

    The model is the prepared one: with fsdp every forward gathers parameters from all
    ranks, so every rank must run as many batches (the held-out set is cut to fit).
    """
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            nll += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
    model.train()
    nll, count = disttrain.reduce_sum(nll), disttrain.reduce_sum(count)
    return math.exp(nll / count) if count else float("nan")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="ddp", help="ddp (default) or fsdp")
    p.add_argument("--mixed-precision", default=None, help="bf16 (CPU/GPU) or fp16 (GPU)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch, per rank")
    p.add_argument("--context", type=int, default=128, help="bytes of context")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="training text to read")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=os.environ.get("DISTTRAIN_CHECKPOINT_DIR"))
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: each epoch)")
    p.add_argument("--async-checkpoint", action="store_true", help="write while training (fsdp)")
    p.add_argument("--output-dir", default=os.environ.get("SM_MODEL_DIR"))
    p.add_argument("--log-every", type=int, default=50)
    return p


# Under `--nnodes MIN:MAX`, a host lost (or joining) calls main() again in the same process,
# with the state from memory: docs/elastic.md. Elsewhere a plain call.
@disttrain.elastic
def main() -> None:
    args = get_args_parser().parse_args()
    ctx = disttrain.init()
    train_text, held_text = stdlib_text(args.max_bytes)
    train_dl = DataLoader(Chunks(train_text, args.context), batch_size=args.batch_size,
                          shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    # Every rank evaluates the same number of full batches (an fsdp forward is collective).
    held = Chunks(held_text, args.context, limit=args.eval_batches * args.batch_size * ctx.world_size)
    held_dl = DataLoader(held, batch_size=args.batch_size)

    torch.manual_seed(args.seed)  # every rank starts from the same weights
    model = ByteLM(context=args.context, width=args.width, layers=args.layers,
                   heads=args.heads, dropout=args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, train_dl, held_dl = disttrain.prepare(
        model, optimizer, train_dl, held_dl,
        strategy=args.strategy, mixed_precision=args.mixed_precision)
    step = disttrain.accumulate(model, optimizer, args.accumulate,
                                clip_grad_norm=args.clip or None)
    state = disttrain.resume(args.checkpoint_dir, every=args.checkpoint_every, model=model,
                             optimizer=optimizer, accumulator=step,
                             asynchronous=args.async_checkpoint)
    params = sum(p.numel() for p in disttrain.unwrap(model).parameters())
    disttrain.print0(
        f"{ctx.world_size} rank(s), {args.strategy}, precision {args.mixed_precision or 'fp32'}, "
        f"device {ctx.device}: {len(train_text)} bytes of stdlib source, "
        f"{len(train_dl.dataset)} sequences of {args.context}; {params} parameters "
        f"({'sharded' if args.strategy == 'fsdp' else 'per rank'})")
    before = heldout_perplexity(model, held_dl)
    disttrain.print0(f"held-out perplexity before training: {before:.2f}")

    started, loss = time.perf_counter(), float("nan")
    for epoch in disttrain.epochs(args.epochs):
        for x, y in state.steps(train_dl):
            with step:
                logits = model(x)
                micro_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                step.backward(micro_loss)
            optimizer_steps = (state.step + 1) // args.accumulate
            if step.stepped and args.log_every and optimizer_steps % args.log_every == 0:
                loss = disttrain.reduce_mean(micro_loss.detach()).item()
                disttrain.print0(f"optimizer step {optimizer_steps}: loss {loss:.4f}")
        after = heldout_perplexity(model, held_dl)
        disttrain.print0(f"epoch {epoch}: held-out perplexity {after:.2f}")
    after = heldout_perplexity(model, held_dl)
    seconds = disttrain.reduce_max(time.perf_counter() - started)
    if args.output_dir:
        disttrain.checkpoint.export(Path(args.output_dir) / "model.pt", model)
    disttrain.print0(json.dumps({
        "world_size": ctx.world_size, "strategy": args.strategy,
        "mixed_precision": args.mixed_precision, "accumulate": args.accumulate,
        "parameters": params, "steps": state.step, "seconds": seconds,
        "heldout_perplexity_before": before, "heldout_perplexity": after,
    }))


if __name__ == "__main__":
    try:
        main()
    except DisttrainError as err:
        print(f"transformer_lm: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
