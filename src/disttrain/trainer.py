"""``Trainer``: the tutorial's train / validate / keep-the-best loop in one call.

::

    trainer = disttrain.trainer.Trainer(model, optimizer, train_dl, val_dl, F.cross_entropy,
                                        scheduler=sched, metrics=("top1", "top5"),
                                        checkpoint_dir="ckpt")
    history = trainer.fit(epochs=90)

A small loop on top of the runtime, for those who want one: it calls
:func:`disttrain.prepare`, runs :func:`disttrain.epochs`, reduces every metric over ranks
(sums and counts, so each validation sample counts once), keeps the best model by the
first metric, checkpoints after every epoch and resumes from the newest checkpoint. Rank 0
shows progress, appends one JSON line per epoch to ``metrics.jsonl`` in the run folder
(``disttrain run`` sets it) and, when tensorboard is installed, writes the same numbers as
TensorBoard scalars there (with tensorboard's record writer: ``torch.utils.tensorboard``
would import TensorFlow where it is installed). Anything it does not do is a plain loop away: the runtime
underneath is the same.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .checkpoint_url import join, location
from .errors import UsageError
from .runtime import checkpoint, periodic, regroup, strategies, track
from .runtime.accumulate import Accumulator
from .runtime.context import context
from .runtime.data import prepare
from .runtime.metrics import MeanMeter, barrier, print0, reduce_max, reduce_mean, reduce_sum, topk_correct
from .runtime.resume import counting
from .tbevents import EventFile

__all__ = ["Trainer"]

# name -> how many of a batch's samples it counts as hits; the metric is hits / samples
Metric = Callable[[torch.Tensor, torch.Tensor], "int | float | torch.Tensor"]
BEST_MODEL = "best_model.pt"
METRICS_FILE = "metrics.jsonl"


def _topk(k: int) -> Metric:
    return lambda output, target: topk_correct(output, target, (k,))[0]


def _metrics(metrics: Sequence[str] | Mapping[str, Metric]) -> dict[str, Metric]:
    if isinstance(metrics, Mapping):
        return dict(metrics)
    known = {}
    for name in metrics:
        if not (name.startswith("top") and name[3:].isdigit() and int(name[3:]) >= 1):
            raise UsageError(f"Trainer(metrics=...): unknown metric {name!r}; name topK ones "
                             "(top1, top5) or pass {name: fn(output, target) -> hits}")
        known[name] = _topk(int(name[3:]))
    return known


class Trainer:
    """Train ``model`` on ``train_loader``, validate on ``val_loader`` after every epoch.

    ``loss_fn(output, target)`` gives the batch's mean loss. ``metrics``: ``("top1",
    "top5")`` or ``{name: fn(output, target) -> hits in the batch}``; the first one picks
    the best model (higher is better; the validation loss when there are none). The
    scheduler steps once per epoch. ``checkpoint_dir`` (default
    ``$DISTTRAIN_CHECKPOINT_DIR``): a checkpoint after each epoch, the best model as
    ``best_model.pt``, and :meth:`fit` resumes from the newest checkpoint there.
    ``strategy``, ``mixed_precision``, ``comm`` are :func:`disttrain.prepare`'s (with
    ``comm="localsgd:H"``/``"diloco:H"`` the replicas are one model again at each epoch's end,
    where the checkpoint keeps DiLoCo's anchor and outer momentum); ``accumulate``
    micro-batches make one optimizer step, with gradients clipped to ``clip_grad_norm``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 train_loader: Iterable, val_loader: Iterable | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, *,
                 scheduler: Any = None, metrics: Sequence[str] | Mapping[str, Metric] = ("top1",),
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 run_dir: str | os.PathLike[str] | None = None, log_every: int = 50,
                 progress: bool = True, strategy: str = "ddp", mixed_precision: str | None = None,
                 accumulate: int = 1, clip_grad_norm: float | None = None, comm: str | None = None) -> None:
        if loss_fn is None:
            raise UsageError("Trainer(loss_fn=...): give the loss, e.g. torch.nn.functional.cross_entropy")
        self.metrics = _metrics(metrics)  # before prepare(): a typo should cost nothing
        # What prepare() is given, kept: an in-place regroup prepares it again for the new world.
        self._given = (model, optimizer, train_loader, val_loader,
                       {"strategy": strategy, "mixed_precision": mixed_precision, "comm": comm},
                       {"steps": accumulate, "clip_grad_norm": clip_grad_norm})
        self._prepare()
        env = context().env
        self.loss_fn, self.scheduler = loss_fn, scheduler
        directory = checkpoint_dir or env.checkpoint_dir
        self.checkpoint_dir = location(directory) if directory else None  # a local Path or a URL
        where = run_dir or env.run_dir
        self.run_dir = Path(where) if where else None
        self.log_every, self.progress = log_every, progress
        self.best: float | None = None
        self.history: list[dict[str, Any]] = []
        self._writer: Any = None
        self._state: Any = None  # fit()'s loop position (runtime.resume.counting)

    def _prepare(self) -> None:
        model, optimizer, train_loader, val_loader, options, stepping = self._given
        ctx = context()
        loaders = [train_loader] + ([val_loader] if val_loader is not None else [])
        self.ddp_model, self.optimizer, *prepared = prepare(model, optimizer, *loaders, **options)
        self.step = Accumulator(self.ddp_model, self.optimizer, stepping["steps"],
                                clip_grad_norm=stepping["clip_grad_norm"])
        # DDP: validated unwrapped (see EvalShardSampler). FSDP: every forward gathers the
        # shards from all ranks, so validation runs the sharded model on every rank.
        strategy_used = strategies.of(self.ddp_model, ctx)
        self.sharded = strategy_used.collective_forward
        self.model = strategy_used.eval_model(self.ddp_model)
        self.train_loader = prepared[0]
        self.val_loader = prepared[1] if val_loader is not None else None

    # -- the loop ------------------------------------------------------------------------

    def fit(self, epochs: int) -> list[dict[str, Any]]:
        """Train until ``epochs`` epochs are done (counting those a checkpoint holds);
        return one record per epoch run now.

        In an elastic job, an in-place regroup re-enters here: the same model, optimizer and
        loaders are prepared for the new world and the loop goes on from the step it stood at.
        A sharded model cannot be prepared twice: its regroup re-enters the script
        (``@disttrain.elastic``, or the script from its top)."""
        ran: list[dict[str, Any]] = []
        if self.sharded:
            return self._fit(epochs, ran)
        return regroup.reentered(lambda: self._fit(epochs, ran), rejoined=self._prepare)

    def _fit(self, epochs: int, ran: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # The loop's position, for a regroup in place: after one, the state comes from the other ranks.
        self._state = counting(model=self.ddp_model, optimizer=self.optimizer, **self._extra_objects(),
                               disk_between_epochs=self.checkpoint_dir is not None,
                               why_not_in_place=f"its gradients are accumulated over {self.step.steps} batches"
                               if self.step.steps > 1 else "")
        start = self._state.epoch if self._state.resumed_from is not None else self._resume()
        self._state.epoch = start
        try:
            for epoch in self._state.epochs(epochs):
                record = {"epoch": epoch, **self.train_epoch(epoch)}
                if self.val_loader is not None:
                    record.update(self.validate())
                record["lr"] = self.optimizer.param_groups[0]["lr"]
                if self.scheduler is not None:
                    self.scheduler.step()
                record["best"] = self._keep_if_best(record)
                self._checkpoint(epoch)
                self._log(record)
                ran.append(record)
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        return ran

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.ddp_model.train()
        loss_meter = MeanMeter()
        # The clock starts with every rank here: rank 0's writing after the last epoch (its
        # metrics, the best model) would otherwise count in the other ranks' first step.
        barrier()
        start = time.perf_counter()
        batches = self._bar(self._state.steps(self.train_loader) if self._state is not None else self.train_loader,
                            epoch)
        for step, (inputs, target) in enumerate(batches):
            with self.step:  # the optimizer steps every `accumulate` batches
                loss = self.loss_fn(self.ddp_model(inputs), target)
                self.step.backward(loss)
            loss_meter.update(loss, len(target))
            if hasattr(batches, "set_postfix"):
                batches.set_postfix(loss=f"{loss_meter.local_avg:.4f}")
            elif self.progress and self.log_every and step % self.log_every == 0:
                # every rank runs as many steps, so all of them reach this collective
                print0(f"epoch {epoch} step {step}/{len(self.train_loader)} "
                       f"loss {reduce_mean(loss.detach()).item():.4f}")
        if hasattr(batches, "close"):
            batches.close()
        return {"train_loss": loss_meter.avg, "seconds": reduce_max(time.perf_counter() - start)}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """``val_loss`` and ``val_<metric>`` over every rank's share, each sample once."""
        self.model.eval()
        sums = torch.zeros(2 + len(self.metrics), dtype=torch.float64)  # loss, count, hits...
        for inputs, target in self._even(self.val_loader):
            output = self.model(inputs)
            if target is None:  # a pass only to match the other ranks' collectives
                continue
            n = len(target)
            sums[0] += float(self.loss_fn(output, target)) * n
            sums[1] += n
            for i, metric in enumerate(self.metrics.values()):
                sums[2 + i] += float(metric(output, target))
        sums = reduce_sum(sums).tolist()  # once, after the loop: shares may differ by a batch
        count = sums[1]
        values = [s / count if count else math.nan for s in (sums[0], *sums[2:])]
        return {"val_loss": values[0],
                **{f"val_{name}": v for name, v in zip(self.metrics, values[1:])}}

    def _even(self, loader: Iterable) -> Iterable:
        """``loader``'s batches; sharded, padded with ``(batch, None)`` passes up to the
        longest rank's count, since each forward is a collective and shares may differ by
        a batch."""
        if not self.sharded:
            yield from loader
            return
        longest = int(reduce_max(len(loader)))
        last = None
        for batch in loader:
            last = batch
            yield batch
        for _ in range(longest - len(loader)):
            yield last[0], None

    # -- around the loop -----------------------------------------------------------------

    def _resume(self) -> int:
        if self.checkpoint_dir is None:
            return 0
        state = checkpoint.load_latest(self.checkpoint_dir, model=self.ddp_model,
                                       optimizer=self.optimizer, **self._extra_objects())
        if state is None:
            return 0
        self.best = state.get("best")
        periodic.restore(state.get(periodic.SHARED_KEY), None)  # saved at an epoch's end: one model
        print0(f"disttrain: Trainer resumes after epoch {state['epoch'] - 1} "
               f"from {self.checkpoint_dir}", file=sys.stderr)
        return state["epoch"]

    def _score(self, record: Mapping[str, Any]) -> float | None:
        if self.metrics:
            return record.get(f"val_{next(iter(self.metrics))}")
        loss = record.get("val_loss")
        return None if loss is None else -loss

    def _keep_if_best(self, record: Mapping[str, Any]) -> bool:
        score = self._score(record)
        if score is None or math.isnan(score) or (self.best is not None and score <= self.best):
            return False
        self.best = score
        if self.checkpoint_dir is not None:
            # Whole or not at all; a sharded model is gathered first (every rank calls it).
            checkpoint.export(join(self.checkpoint_dir, BEST_MODEL), self.ddp_model)
        return True

    def _checkpoint(self, epoch: int) -> None:
        if self.checkpoint_dir is None:
            return
        checkpoint.save(self.checkpoint_dir, step=epoch + 1, model=self.ddp_model,
                        optimizer=self.optimizer, epoch=epoch + 1, best=self.best,
                        **periodic.shared_state(), **self._extra_objects())

    def _extra_objects(self) -> dict[str, Any]:
        objects: dict[str, Any] = {}
        if self.scheduler is not None:
            objects["scheduler"] = self.scheduler
        if self.step.steps > 1 or self.step.scaler is not None:  # only then has it state
            objects["accumulator"] = self.step
        return objects

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in record.items() if k != "epoch")
        if self.progress:
            print0(f"epoch {record['epoch']}: {shown}")
        track.record("metrics", step=record["epoch"], reduced=True, values={  # already over every rank
            key: value for key, value in record.items() if isinstance(value, (int, float)) and key != "epoch"})
        if not context().is_main or self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is None:  # None again without tensorboard: it is optional
            self._writer = EventFile.open(self.run_dir / "tensorboard")
        if self._writer is not None:
            self._writer.scalars({key: value for key, value in record.items()
                                  if isinstance(value, (int, float)) and key != "epoch"}, step=record["epoch"])

    def _bar(self, loader: Iterable, epoch: int) -> Iterable:
        """tqdm on rank 0 at a terminal; through a launcher's pipes (where a redrawn bar
        arrives as one long line at the epoch's end) plain lines every ``log_every`` steps."""
        if not (self.progress and context().is_main and sys.stderr.isatty()):
            return loader
        try:
            from tqdm import tqdm
        except ImportError:
            return loader
        return tqdm(loader, desc=f"epoch {epoch}", unit="batch", leave=False)
