"""What does putting each worker group in a cgroup cost at start? A worker started through the
lifeline wrapper (as the agent starts every worker) with and without joining its group's cgroup
first, interleaved, in one run; the join itself (one write to ``cgroup.procs``, timed alone:
the whole start's spread on a shared machine is larger than it); and the cgroup's creation and
removal (once per worker group).

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


def interleaved(worker: list[str], group: WorkerCgroup, repeats: int) -> tuple[list[float], list[float]]:
    plain, joined = [], []
    for i in range(repeats):
        pair = [(plain, lifeline.wrap(worker, python=sys.executable)),
                (joined, lifeline.wrap(worker, python=sys.executable, join=group.join_file))]
        for out, argv in pair if i % 2 == 0 else reversed(pair):
            out.append(start_s(argv))
    return plain, joined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--torch-repeats", type=int, default=15)
    args = parser.parse_args()
    t0 = time.perf_counter()
    group = WorkerCgroup.make(f"disttrain-bench-{os.getpid()}")
    made_s = time.perf_counter() - t0
    if group is None:
        sys.exit("no writable cgroup v2 on this machine: nothing to measure (the agent uses the subreaper)")
    writes = []
    try:
        for _ in range(args.repeats):
            sleeper = subprocess.Popen(["sleep", "60"])
            t0 = time.perf_counter()
            with open(group.join_file, "w") as fh:
                fh.write(str(sleeper.pid))
            writes.append(time.perf_counter() - t0)
            sleeper.kill()
            sleeper.wait()
        plain, joined = interleaved([sys.executable, "-S", "-c", "pass"], group, args.repeats)
        torch_plain, torch_joined = interleaved([sys.executable, "-c", "import torch"], group, args.torch_repeats)
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
        "worker": "through disttrain/agent/lifeline.py: python -S -c pass; a real worker's start: python -c 'import torch'",
        "start_ms_without": round(statistics.median(plain) * 1000, 2),
        "start_ms_joining": round(statistics.median(joined) * 1000, 2),
        "start_ratio": round(statistics.median(joined) / statistics.median(plain), 3),
        "torch_start_ms_without": round(statistics.median(torch_plain) * 1000, 1),
        "torch_start_ms_joining": round(statistics.median(torch_joined) * 1000, 1),
        "torch_start_ratio": round(statistics.median(torch_joined) / statistics.median(torch_plain), 3),
        "join_write_ms_median": round(statistics.median(writes) * 1000, 3),
        "join_write_ms_max": round(max(writes) * 1000, 3),
        "cgroup_create_ms": round(made_s * 1000, 3),
        "cgroup_close_ms": round(closed_s * 1000, 3),
        "repeats": [args.repeats, args.torch_repeats],
        "load_1min": round(os.getloadavg()[0], 2),
    }
    out = ROOT / "bench" / "results" / f"worker-cgroup-{result['date']}-{platform.machine()}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
