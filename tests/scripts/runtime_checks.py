"""Exercise the runtime from inside a job and record what each rank saw.

Usage: runtime_checks.py OUT_DIR CHECKPOINT_DIR. Writes OUT_DIR/rank_<r>.json. Runs
unchanged as a plain ``python`` script (a world of one) and under a launcher.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain
import disttrain.errors
from disttrain import checkpoint
from disttrain.runtime.strategies import unwrap

out_dir, ckpt_dir = Path(sys.argv[1]), Path(sys.argv[2])
ctx = disttrain.init()
assert disttrain.init() is ctx and disttrain.context() is ctx
report = {
    "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
    "device": str(ctx.device), "dist_backend": ctx.dist_backend, "is_main": ctx.is_main,
    "distributed": ctx.distributed,
}

# -- reductions -----------------------------------------------------------------------
mine = torch.tensor([ctx.rank + 1.0, 10.0])
report["reduce_sum_tensor"] = disttrain.reduce_sum(mine).tolist()
report["input_untouched"] = mine.tolist() == [ctx.rank + 1.0, 10.0]
report["reduce_sum_int"] = disttrain.reduce_sum(ctx.rank + 1)
report["reduce_mean_int"] = disttrain.reduce_mean(ctx.rank)
report["reduce_max_float"] = disttrain.reduce_max(float(ctx.rank) * 1.5)

# -- data: training shards, epochs, evaluation shards --------------------------------
def items(n):
    return TensorDataset(torch.arange(n))

def seeded(seed):
    return torch.Generator().manual_seed(seed)

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_even = DataLoader(items(12), batch_size=2, shuffle=True, generator=seeded(1234))
train_odd = DataLoader(items(11), batch_size=2, shuffle=True, generator=seeded(1234))
evaluation = DataLoader(items(101), batch_size=8)
model, opt, train_even, train_odd, evaluation = disttrain.prepare(
    model, opt, train_even, train_odd, evaluation)
report["model_type"] = type(model).__name__
report["loader_facade"] = {
    "is_dataloader": isinstance(train_even, DataLoader),
    "len": len(train_even), "batch_size": train_even.batch_size,
    "dataset_len": len(train_even.dataset), "sampler": type(train_even.sampler).__name__,
    "eval_sampler": type(evaluation.sampler).__name__,
}

report["epochs"] = {}
for epoch in disttrain.epochs(3, start=1):
    report["epochs"][epoch] = {
        "even": [int(x) for (batch,) in train_even for x in batch],
        "odd": [int(x) for (batch,) in train_odd for x in batch],
    }

seen, hits = disttrain.MeanMeter(), [0, 0]
for (batch,) in evaluation:
    values = batch.float()
    seen.update(values.mean(), n=len(batch))
    logits = torch.nn.functional.one_hot(batch % 3, 3).float()
    target = torch.where(batch % 4 == 0, (batch + 1) % 3, batch % 3)  # wrong when x % 4 == 0
    for i, c in enumerate(disttrain.topk_correct(logits, target, topk=(1, 3))):
        hits[i] += c
report["eval_local_count"] = seen.count
report["eval_count"] = disttrain.reduce_sum(seen.count)
report["eval_sum"] = disttrain.reduce_sum(seen.sum)
report["eval_avg"] = seen.avg
report["eval_correct"] = [disttrain.reduce_sum(h) for h in hits]

# -- MeanMeter with unequal counts: rank 0 three samples, the others five each -----------
meter = disttrain.MeanMeter()
if ctx.rank == 0:
    for v in (1.0, 2.0, 3.0):
        meter.update(v)
else:
    meter.update(torch.tensor(10.0), n=5)
report["meter_local_avg"] = meter.local_avg
report["meter_avg"] = meter.avg

# -- a few DDP steps, then checkpoints every rank reads right away -------------------
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
paths = [checkpoint.save(ckpt_dir, step=s, keep_last=2, model=model, optimizer=opt, epoch=s)
         for s in (10, 20, 30)]
report["saved"] = [p.name if p else None for p in paths]
fresh = torch.nn.Linear(4, 2)
fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
state = checkpoint.load_latest(ckpt_dir, model=fresh, optimizer=fresh_opt)
report["loaded_step"], report["loaded_epoch"] = state["step"], state["epoch"]
report["loaded_equal"] = all(
    torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                      unwrap(model).state_dict().values()))
report["kept"] = sorted(p.name for p in ckpt_dir.iterdir())
blocker = ckpt_dir / "step_00000030" / "COMPLETE"  # a file, so no directory fits under it
try:
    checkpoint.save(blocker / "sub", step=1, value=1)
except disttrain.errors.DisttrainError as err:
    report["unwritable"] = str(err)

disttrain.print0(f"print0 from rank {ctx.rank}")
disttrain.barrier()
(out_dir / f"rank_{ctx.rank}.json").write_text(json.dumps(report))
