"""What does the hang diagnostics' Flight Recorder cost? Steady-state throughput of a plain DDP
script under ``disttrain run -n 2 --hang-timeout 600`` (the recorder on in every rank, torch's
worker server started by disttrain's bootstrap, the agent reading each rank's progress every
second) over the same run without ``--hang-timeout``, in one run, interleaved. Goal >= 0.99.

Prints one JSON object and writes it to bench/results/flight-recorder-<date>-<arch>-<n>cpu.json.
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


def steps_per_s(cmd: list[str], env: dict[str, str]) -> float:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.strip().splitlines()):
        line = line.split("] ", 1)[-1]
        if line.startswith("{"):
            return json.loads(line)["steps_per_s"]
    raise RuntimeError(f"no result in:\n{proc.stdout[-2000:]}")


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "disttrain", "run", "-n", "2", "--ranks", "0"]
    workload = ["bench/fr_workload.py", "--steps", str(args.steps)]
    without, with_fr, loads = [], [], []
    for i in range(args.repeats):  # interleaved, and alternating which goes first: drift hits both
        loads.append(round(load(), 2))
        pair = [("without", [*base, *workload]), ("with", [*base, "--hang-timeout", "600", *workload])]
        for name, cmd in pair if i % 2 == 0 else reversed(pair):
            (with_fr if name == "with" else without).append(steps_per_s(cmd, env))
    loads.append(round(load(), 2))
    result = {
        "bench": "flight-recorder",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "workload": "bench/fr_workload.py: 2 ranks (gloo), DDP of 4 Linear(256) layers + head, batch 32, "
                    f"{args.steps} steps after 30 of warm-up, OMP_NUM_THREADS=1",
        "without_steps_per_s": [round(v, 1) for v in without],
        "with_steps_per_s": [round(v, 1) for v in with_fr],
        "ratio": round(statistics.median(with_fr) / statistics.median(without), 3),
        "load_1min": loads,
    }
    out = ROOT / "bench" / "results" / f"flight-recorder-{result['date']}-{platform.machine()}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
