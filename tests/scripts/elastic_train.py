"""A worker of an elastic job: trains on sample indices and logs, per attempt and rank, every step's
samples with the step's index, so that tests/test_elastic.py (and bench/elastic.py) can account
for every sample across attempts.

Usage: elastic_train.py --out OUT [--ckpt CKPT] --samples N --epochs E --batch-size B --every K [--pause S]
                        [--strategy fsdp] [--stop-after N] [--final WEIGHTS] [--trainer] [--entry]
                        [--hold-gil-at STEP] [--stop-at STEP:RANK]
(CKPT: default $DISTTRAIN_CHECKPOINT_DIR, a job's checkpoint folder)
Writes OUT/attempt<A>_rank<R>.jsonl: one line per finished step (the line precedes the step's
checkpoint, so a step logged may be re-done after a loss; one checkpointed is always logged);
OUT/attempt<A>_rank<R>.taken: one line per step begun, its samples, written before the step's forward
(a rank lost after its gradients were reduced, before its finished line, still trained them: its peers
went on from that step); and OUT/attempt<A>_rank<R>.start: the times this process started, loaded its
checkpoint, and so on.
"""

import time

started = time.time()  # noqa: E402  (the imports below are part of a worker's start)
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import disttrain  # noqa: E402

calls = 0  # of main() in this process: a regroup that re-enters @disttrain.elastic calls it again


def main() -> None:
    global calls
    calls += 1
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.2)
    parser.add_argument("--strategy", default="ddp", help="prepare()'s: ddp or fsdp")
    parser.add_argument("--stop-after", type=int, default=0, help="save after this step and end (0: never)")
    parser.add_argument("--final", type=Path, help="where rank 0 saves the model's weights at the end")
    parser.add_argument("--trainer", action="store_true", help="train with disttrain.Trainer (its loss logs)")
    parser.add_argument("--entry", action="store_true", help="main() is @disttrain.elastic's (read in __main__)")
    parser.add_argument("--hold-gil-at", type=int, default=0,
                        help="in the first world, every rank sleeps in native code holding the GIL before this step "
                        "(after OUT/held_rank<R>)")
    parser.add_argument("--stop-at", default="", metavar="STEP:RANK",
                        help="in the first world, RANK stops itself (SIGSTOP, after OUT/stopped_rank<R>) once STEP's "
                        "gradients are reduced and applied, before its finished line")
    args = parser.parse_args()
    stop_step, _, stop_rank = args.stop_at.partition(":")

    imported = time.time()
    if args.trainer:
        trainer_main(args, imported)
        return
    ctx = disttrain.init()
    joined = time.time()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.arange(args.samples)), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = disttrain.prepare(model, optimizer, loader, strategy=args.strategy)
    prepared = time.time()
    state = disttrain.resume(args.ckpt, every=args.every, model=model, optimizer=optimizer)
    loaded = time.time()
    attempt = int(os.environ.get("DISTTRAIN_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    name = f"attempt{attempt}_rank{ctx.rank}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.start").write_text(json.dumps({
        "started": started, "imported": imported, "joined": joined, "prepared": prepared, "loaded": loaded,
        "resumed_from": state.resumed_from, "world_size": ctx.world_size, "pid": os.getpid(), "calls": calls,
    }))
    with open(args.out / f"{name}.jsonl", "a") as log, open(args.out / f"{name}.taken", "a") as taken:
        for epoch in state.epochs(args.epochs):
            for (x,) in state.steps(loader):
                taken.write(json.dumps({"step": state.step, "epoch": epoch, "samples": x.tolist()}) + "\n")
                taken.flush()
                if args.hold_gil_at and state.step == args.hold_gil_at and attempt == 0:
                    import ctypes  # no thread of this process runs again: not its regroup's, not its watch's

                    (args.out / f"held_rank{ctx.rank}").touch()
                    # The agent's stack signal goes to another thread: on this one it would end the sleep early.
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN + 6})
                    ctypes.PyDLL(None).sleep(3600)
                if args.stop_after and state.step == args.stop_after:  # that many steps done: save, end
                    state.save()
                    disttrain.shutdown()
                    return
                loss = model(x.float().unsqueeze(1) / args.samples).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if args.stop_at and (state.step, ctx.rank, attempt) == (int(stop_step), int(stop_rank), 0):
                    (args.out / f"stopped_rank{ctx.rank}").touch()
                    os.kill(os.getpid(), signal.SIGSTOP)
                log.write(json.dumps({"step": state.step, "epoch": epoch, "world_size": ctx.world_size,
                                      "samples": x.tolist(), "time": time.time()}) + "\n")
                log.flush()
                time.sleep(args.pause)
    if args.final is not None and ctx.is_main:
        torch.save(disttrain.unwrap(model).state_dict(), args.final)
    disttrain.shutdown()


def trainer_main(args, imported: float) -> None:
    """The same job under disttrain.Trainer: its loss function logs each step's samples (before the
    step's backward: a step cut short is logged, and done again). A regroup in place goes on inside
    the same fit() call, in a new world: each attempt's log is opened at its first step."""
    from disttrain.runtime.resume import current

    disttrain.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    indices = torch.arange(args.samples)
    loader = DataLoader(TensorDataset(indices.float().unsqueeze(1) / args.samples, indices),
                        batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))
    args.out.mkdir(parents=True, exist_ok=True)
    logs = {}

    def log_of_this_attempt():
        ctx = disttrain.context()
        name = f"attempt{os.environ.get('DISTTRAIN_ATTEMPT', '0')}_rank{ctx.rank}"
        if name not in logs:
            now = time.time()
            (args.out / f"{name}.start").write_text(json.dumps({
                "started": started, "imported": imported, "joined": now, "prepared": now, "loaded": now,
                "resumed_from": current().resumed_from, "world_size": ctx.world_size, "pid": os.getpid(),
                "calls": calls}))
            logs[name] = open(args.out / f"{name}.jsonl", "a")
        return logs[name], ctx.world_size

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        state = current()
        log, world_size = log_of_this_attempt()
        log.write(json.dumps({"step": state.step, "epoch": state.epoch, "world_size": world_size,
                              "samples": target.tolist(), "time": time.time()}) + "\n")
        log.flush()
        time.sleep(args.pause)
        return output.pow(2).mean()

    disttrain.Trainer(model, optimizer, loader, loss_fn=loss_fn, checkpoint_dir=args.ckpt, metrics=(),
                      progress=False).fit(args.epochs)
    for log in logs.values():
        log.close()
    disttrain.shutdown()


if __name__ == "__main__":
    import sys

    (disttrain.elastic(main) if "--entry" in sys.argv else main)()
