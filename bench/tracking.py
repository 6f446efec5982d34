"""What does --track cost a step? The MNIST example's step with and without ``disttrain.log``.

Two ranks (gloo, this machine) train ``examples/mnist_convnet.py``'s ConvNet with DDP on batches
of MNIST's shape (the example's per-process batch, 128), in interleaved blocks of steps:

- ``plain``: the step alone;
- ``log``: the step and ``disttrain.log({"loss": ..., "lr": ...}, step=...)`` under
  ``DISTTRAIN_TRACK=reduced`` (one small all-reduce, rank 0 prints a track line);
- ``log_ranks``: the same under ``DISTTRAIN_TRACK=ranks`` (every rank prints its own line too).

The workers' stdout goes to a file, as a launcher's pipe would take it. Then, in this process, the
launcher's side: what one track line costs the launcher's writer (parse, ``track.jsonl``, the
tracker's ``metrics`` call) for each tracker installed -- W&B offline, Trackio's local store, MLflow
on a SQLite file -- which runs beside the training, in the launcher, not in a step.
Goal: ``log`` and ``log_ranks`` within 1 % of a step: the median time inside a ``disttrain.log()``
call over the median plain step (the blocks' ratio is printed too; on a loaded machine it is
noise). Prints one JSON object and writes it to bench/results/tracking-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "log", "log_ranks")


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str, logs: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads))
    sys.stdout = open(f"{logs}/rank{rank}.stdout", "w", buffering=1)  # the launcher's pipe
    import torch
    import torch.nn.functional as F

    import disttrain
    from disttrain.runtime import track

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_convnet import ConvNet

    torch.set_num_threads(args.threads)
    disttrain.init()
    torch.manual_seed(0)
    plain = ConvNet()
    model, optimizer = disttrain.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.01))
    x, y = torch.randn(args.batch_size, 1, 28, 28), torch.randint(0, 10, (args.batch_size,))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    inside: dict[str, list[float]] = {m: [] for m in MODES}  # seconds in each disttrain.log() call
    step = 0
    for block in range(args.blocks):
        for mode in MODES if block % 2 == 0 else reversed(MODES):  # interleaved, order alternating
            os.environ["DISTTRAIN_TRACK"] = {"plain": "", "log": "reduced", "log_ranks": "ranks"}[mode]
            track._reset()
            disttrain.barrier()
            began = time.perf_counter()
            for _ in range(args.steps):
                optimizer.zero_grad()
                loss = F.nll_loss(model(x), y)
                loss.backward()
                optimizer.step()
                called = time.perf_counter()
                disttrain.log({"loss": loss, "lr": 0.01}, step=step)  # nothing at all under "plain"
                inside[mode].append(time.perf_counter() - called)
                step += 1
            disttrain.barrier()
            times[mode].append((time.perf_counter() - began) / args.steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"blocks": times, "inside": inside}))
    disttrain.shutdown()


def launcher_side(records: int) -> dict[str, float | str]:
    """Microseconds the launcher's writer spends on one track line, per tracker installed."""
    from disttrain import trackline
    from disttrain.tracking.follower import RunTracker

    result: dict[str, float | str] = {}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # MLflow on a SQLite file keeps its artifacts in ./mlruns
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=f"{tmp}/wb", WANDB_SILENT="true", TRACKIO_DIR=f"{tmp}/tk",
                          MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db")
        lines = [trackline.encode("metrics", rank=0, step=s, values={"loss": 1.0 / (s + 1), "lr": 0.01}, reduced=True)
                 for s in range(records)]
        for tracker in (None, "wandb", "trackio", "mlflow"):
            name = tracker or "records_only"
            try:
                run = RunTracker(Path(tmp) / name, tracker=tracker, name=name, params={}, say=lambda _line: None)
            except Exception as err:  # a tracker not installed here
                result[name] = f"not measured: {type(err).__name__}: {err}"
                continue
            run.starting(1)
            began = time.perf_counter()
            for line in lines:
                run.line(f"[rank0] {line}")
            run.flush()  # until the tracker's thread took every record
            result[name] = round((time.perf_counter() - began) / records * 1e6, 1)
            run.finish(0)
        os.chdir(here)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="per process (the example's default)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--records", type=int, default=200, help="track lines for the launcher's side")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from disttrain.net import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.json"
        mp.spawn(worker, args=(2, free_port(), args, out, tmp), nprocs=2, join=True)
        measured = json.loads(Path(out).read_text())
        times, inside = measured["blocks"], measured["inside"]
        lines = Path(f"{tmp}/rank0.stdout").read_text().count("disttrain-track:")
    step = {mode: statistics.median(values) for mode, values in times.items()}
    result = {
        "bench": "tracking",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
        "setup": {"world_size": 2, "batch_per_process": args.batch_size, "steps_per_block": args.steps,
                  "blocks": args.blocks, "threads_per_rank": args.threads, "rank0_track_lines": lines},
        "step_ms": {mode: round(value * 1e3, 3) for mode, value in step.items()},
        "step_ms_per_block": {mode: [round(v * 1e3, 2) for v in values] for mode, values in times.items()},
        # The call's own time (its all-reduce, its line), median over every logged step: steady where the
        # blocks' step times swing with the machine's load.
        "log_call_ms": {mode: round(statistics.median(inside[mode]) * 1e3, 4) for mode in MODES},
        "cost_of_a_step": {mode: round(statistics.median(inside[mode]) / step["plain"], 5)
                           for mode in ("log", "log_ranks")},
        "cost_of_a_step_by_blocks": {mode: round(step[mode] / step["plain"] - 1, 4) for mode in ("log", "log_ranks")},
        "goal": "cost_of_a_step <= 0.01 for log and log_ranks",
        "launcher_us_per_record": launcher_side(args.records),
    }
    print(json.dumps(result, indent=2))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    name = f"tracking-{time.strftime('%Y%m%d')}-{platform.node()}.json"
    (results / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
