"""What does disttrain cost? Two ratios, measured in one run with interleaved repeats.

1. Training throughput of ``examples/mnist_convnet.py`` under ``disttrain run`` over the
   seed's plain ``mp.spawn`` + DDP script (same model, data, processes, per-process batch,
   and the same OMP_NUM_THREADS, so only the launcher and runtime differ). Goal >= 0.98.
2. Wall time of a trivial 2-rank job under ``disttrain run`` over ``torchrun``. Goal <= 1.05.

Prints one JSON object and writes it to bench/results/overhead-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in output:\n{stdout[-2000:]}")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return elapsed, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launch-repeats", type=int, default=5)
    args = parser.parse_args()

    py = sys.executable
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    common = ["--samples", str(args.samples), "--batch-size", str(args.batch_size), "--epochs", "1"]
    plain_cmd = [py, "bench/plain_mp_spawn.py", "--num-processes", str(args.nproc), *common]
    dt_cmd = [py, "-m", "disttrain", "run", "-n", str(args.nproc), "--ranks", "0",
              "examples/mnist_convnet.py", *common]

    plain, ours = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        plain.append(last_json(timed(plain_cmd, env)[1])["train_samples_per_s"])
        ours.append(last_json(timed(dt_cmd, env)[1])["train_samples_per_s"])

    torchrun_cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "bench/trivial.py"]
    dt_launch_cmd = [py, "-m", "disttrain", "run", "-n", "2", "bench/trivial.py"]
    t_torchrun, t_ours = [], []
    for _ in range(args.launch_repeats):
        t_torchrun.append(timed(torchrun_cmd, env)[0])
        t_ours.append(timed(dt_launch_cmd, env)[0])

    result = {
        "bench": "overhead",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "nproc": args.nproc,
        "samples": args.samples,
        "batch_size_per_process": args.batch_size,
        "omp_num_threads": threads,
        "plain_samples_per_s": [round(v, 1) for v in plain],
        "disttrain_samples_per_s": [round(v, 1) for v in ours],
        "throughput_ratio": round(statistics.median(ours) / statistics.median(plain), 3),
        "torchrun_launch_s": [round(v, 2) for v in t_torchrun],
        "disttrain_launch_s": [round(v, 2) for v in t_ours],
        "launch_latency_ratio": round(statistics.median(t_ours) / statistics.median(t_torchrun), 3),
    }
    out = ROOT / "bench" / "results" / f"overhead-{result['date']}-{platform.machine()}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
