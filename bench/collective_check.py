"""What does the rule of collectives cost? ``disttrain.reduce_mean`` beside plain ``all_reduce``.

Every runtime collective first looks at its call site for a rank test (the source check);
``MeanMeter.avg`` and ``barrier()`` also check in with the other ranks through the job's
store (the store check), so that a call made on some ranks only fails in one line instead of
hanging (docs/runtime.md). This times, on 2 ranks, a scalar ``reduce_mean`` and a
``MeanMeter.avg`` read with their checks and without, beside a plain
``torch.distributed.all_reduce`` of a scalar; interleaved rounds, best of each.

    python bench/collective_check.py [--calls 300] [--rounds 5]

Prints one JSON object and writes it to bench/results/collective_check-<date>-<arch>-<cpus>cpu.json.
With ``--worker`` it is the measuring script itself (started by ``disttrain run -n 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import disttrain
    from disttrain.runtime import metrics

    ctx = disttrain.init()
    x = torch.tensor(1.0)
    meter = disttrain.MeanMeter()
    meter.update(1.0)
    source, store = metrics.rank_condition, metrics._store
    calls = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "reduce_mean": lambda: disttrain.reduce_mean(x),
        "reduce_mean_unchecked": lambda: disttrain.reduce_mean(x),
        "meter_avg": lambda: meter.avg,
        "meter_avg_unchecked": lambda: meter.avg,
    }
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for mode, call in calls.items():
            unchecked = mode.endswith("_unchecked")
            metrics.rank_condition = (lambda frame: None) if unchecked else source
            metrics._store = (lambda: None) if unchecked else store
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            per_call = (time.perf_counter() - start) / args.calls
            best[mode] = min(best.get(mode, per_call), per_call)
    metrics.rank_condition, metrics._store = source, store
    if ctx.is_main:
        print("RESULT " + json.dumps({mode: round(s * 1e6, 1) for mode, s in best.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "disttrain", "run", "-n", "2", __file__, "--worker",
           "--calls", str(args.calls), "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if "RESULT " in line]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench/collective_check.py: the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    us = json.loads(lines[-1].split("RESULT ", 1)[1])
    result = {
        "bench": "collective_check",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "ranks": 2,
        "calls": args.calls,
        "rounds": args.rounds,
        "us_per_call": us,
        "ratio_reduce_mean_over_all_reduce": round(us["reduce_mean"] / us["all_reduce"], 2),
        "ratio_meter_avg_over_all_reduce": round(us["meter_avg"] / us["all_reduce"], 2),
        "source_check_us": round(us["reduce_mean"] - us["reduce_mean_unchecked"], 1),
        "source_and_store_check_us": round(us["meter_avg"] - us["meter_avg_unchecked"], 1),
    }
    out = ROOT / "bench" / "results" / (f"collective_check-{result['date']}-{platform.machine()}-"
                                        f"{result['cpus']}cpu.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
