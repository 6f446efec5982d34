"""What does putting each worker group in a cgroup cost at start? A worker started through the
lifeline wrapper (as the agent starts every worker) with and without joining its group's cgroup
first, interleaved, in one run; and the cgroup's creation and removal (once per worker group).

Prints one JSON object and writes it to bench/results/worker-cgroup-<date>-<arch>-<n>cpu.json.
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

from disttrain.agent import lifeline
from disttrain.agent.cgroup import WorkerCgroup

ROOT = Path(__file__).resolve().parent.parent


def start_s(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    t0 = time.perf_counter()
    group = WorkerCgroup.make(f"disttrain-bench-{os.getpid()}")
    made_s = time.perf_counter() - t0
    if group is None:
        sys.exit("no writable cgroup v2 on this machine: nothing to measure (the agent uses the subreaper)")
    worker = [sys.executable, "-S", "-c", "pass"]
    plain, joined = [], []
    try:
        for i in range(args.repeats):
            pair = [(plain, lifeline.wrap(worker, python=sys.executable)),
                    (joined, lifeline.wrap(worker, python=sys.executable, join=group.join_file))]
            for out, argv in pair if i % 2 == 0 else reversed(pair):
                out.append(start_s(argv))
    finally:
        t0 = time.perf_counter()
        group.close()
        closed_s = time.perf_counter() - t0
    result = {
        "bench": "worker-cgroup",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "worker": "python -S -c pass, through disttrain/agent/lifeline.py",
        "start_ms_without": round(statistics.median(plain) * 1000, 2),
        "start_ms_joining": round(statistics.median(joined) * 1000, 2),
        "start_ratio": round(statistics.median(joined) / statistics.median(plain), 3),
        "cgroup_create_ms": round(made_s * 1000, 3),
        "cgroup_close_ms": round(closed_s * 1000, 3),
        "repeats": args.repeats,
        "load_1min": round(os.getloadavg()[0], 2),
    }
    out = ROOT / "bench" / "results" / f"worker-cgroup-{result['date']}-{platform.machine()}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
