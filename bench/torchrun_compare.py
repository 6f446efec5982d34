"""``disttrain run`` against ``torchrun`` with the same options: launch to exit of a trivial job.

For each set of torchrun options below, the same argument list runs under
``python -m torch.distributed.run`` and under ``python -m disttrain run`` (the one-line move),
alternating which goes first in each repeat so that drift on a shared machine hits both.
The ratio of medians (disttrain / torchrun) is the cost of what disttrain adds; goal <= 1.05.
The machine's load average before and after is kept, to judge the numbers, with the CPU time
each launch used (launcher and workers): on a shared machine the wall time mostly measures the
other load, the CPU time what each launcher does.

Prints one JSON object and writes it to bench/results/torchrun-compare-<date>-<machine>-<n>cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRIVIAL = "bench/trivial.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def option_sets(logs: str) -> dict[str, list[str]]:
    """The torchrun command lines compared (what follows ``torchrun``); ports are fresh per run."""
    return {
        "standalone": ["--standalone", "--nproc-per-node", "2", TRIVIAL],
        "c10d-endpoint": ["--nnodes", "1", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "bench", TRIVIAL],
        "static-master": ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", "{port}",
                          "--max-restarts", "1", "--monitor-interval", "0.1", TRIVIAL],
        "tee-log-dir": ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", logs,
                        "--local-ranks-filter", "0", TRIVIAL],
    }


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the launcher and everything it started): the CPU time is
    what the launcher itself costs, less disturbed by the other load of a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", action="append", default=[], help="run only these option sets")
    args = parser.parse_args()

    py = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launchers = {"torchrun": [py, "-m", "torch.distributed.run"], "disttrain": [py, "-m", "disttrain", "run"]}
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="torchrun-compare-") as logs:
        sets = option_sets(logs)
        for name, options in sets.items():
            if args.only and name not in args.only:
                continue
            times: dict[str, list[float]] = {"torchrun": [], "disttrain": []}
            cpu: dict[str, list[float]] = {"torchrun": [], "disttrain": []}
            for k in range(args.repeats):
                order = ("torchrun", "disttrain") if k % 2 == 0 else ("disttrain", "torchrun")
                for who in order:
                    argv = [*launchers[who], *(o.replace("{port}", str(free_port())) for o in options)]
                    wall, used = timed(argv, env)
                    times[who].append(wall)
                    cpu[who].append(used)
            med = {who: statistics.median(values) for who, values in times.items()}
            med_cpu = {who: statistics.median(values) for who, values in cpu.items()}
            results[name] = {
                "options": options,
                "torchrun_s": [round(t, 2) for t in times["torchrun"]],
                "disttrain_s": [round(t, 2) for t in times["disttrain"]],
                "torchrun_median_s": round(med["torchrun"], 3),
                "disttrain_median_s": round(med["disttrain"], 3),
                "ratio": round(med["disttrain"] / med["torchrun"], 3),
                "torchrun_cpu_s": [round(t, 2) for t in cpu["torchrun"]],
                "disttrain_cpu_s": [round(t, 2) for t in cpu["disttrain"]],
                "cpu_ratio": round(med_cpu["disttrain"] / med_cpu["torchrun"], 3),
            }
    ratios = [r["ratio"] for r in results.values()]
    result = {
        "bench": "torchrun-compare",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "load_avg_before": [round(v, 2) for v in load_before],
        "load_avg_after": [round(v, 2) for v in os.getloadavg()],
        "sets": results,
        "ratio_geomean": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3) if ratios else None,
        "goal": "ratio <= 1.05",
    }
    out = ROOT / "bench" / "results" / f"torchrun-compare-{result['date']}-{result['machine']}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
