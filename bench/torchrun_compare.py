"""``disttrain run`` against ``torchrun`` with the same options: launch to exit of a trivial job.

For each set of torchrun options below, the same argument list runs under
``python -m torch.distributed.run`` and under ``python -m disttrain run`` (the one-line move),
alternating which goes first in each repeat so that drift on a shared machine hits both.
The ratio of medians (disttrain / torchrun) is the cost of what disttrain adds; goal <= 1.05.
The machine's load average before and after is kept, to judge the numbers, with the CPU time
each launch used (launcher and workers): on a shared machine the wall time mostly measures the
other load, the CPU time what each launcher does. Each launch also gets a timeline (see
:func:`timed`): where its seconds went, to find a launcher's idle waits; ``--baseline-src`` adds a
third launcher, disttrain imported from another source tree, to time a change before and after
under the same load.

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


PHASES = ("to_first_worker_s", "workers_join_s", "workers_work_s", "last_worker_to_exit_s")


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, dict[str, float]]:
    """(wall seconds, CPU seconds of the launcher and everything it started, the timeline): the CPU
    time is what the launcher itself costs, less disturbed by the other load of a shared machine.

    The timeline, on the monotonic clock every process shares: the launcher's start to the first
    worker's first line (the launcher's start-up, the rendezvous, the workers' interpreter start),
    the workers' import of torch and group join (the last to join), their work, and the last
    worker's end to the launcher's exit (its teardown: where an idle wait at the end would show).
    """
    with tempfile.TemporaryDirectory(prefix="stamps-") as stamps:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, env={**env, "BENCH_STAMPS": stamps},
                              cwd=ROOT, timeout=600)
        end = time.monotonic()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        ranks = [tuple(map(float, path.read_text().split())) for path in Path(stamps).iterdir()]
    first, joined, last = min(r[0] for r in ranks), max(r[1] for r in ranks), max(r[2] for r in ranks)
    timeline = dict(zip(PHASES, (first - start, joined - first, last - joined, end - last)))
    return end - start, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), timeline


def summary(times: dict[str, list[float]], cpu: dict[str, list[float]],
            lines: dict[str, list[dict[str, float]]], who: str) -> dict:
    """One launcher's figures beside torchrun's: the ratio of medians, wall and CPU, and each phase's
    median over the repeats with what this launcher adds to it."""
    med = {w: statistics.median(times[w]) for w in ("torchrun", who)}
    med_cpu = {w: statistics.median(cpu[w]) for w in ("torchrun", who)}
    phases = {w: {phase: round(statistics.median(t[phase] for t in lines[w]), 3) for phase in PHASES}
              for w in ("torchrun", who)}
    return {
        f"{who}_s": [round(t, 2) for t in times[who]],
        f"{who}_median_s": round(med[who], 3),
        "ratio": round(med[who] / med["torchrun"], 3),
        f"{who}_cpu_s": [round(t, 2) for t in cpu[who]],
        "cpu_ratio": round(med_cpu[who] / med_cpu["torchrun"], 3),
        f"{who}_timeline_median_s": phases[who],
        f"{who}_timeline_extra_s": {phase: round(phases[who][phase] - phases["torchrun"][phase], 3)
                                    for phase in PHASES},
    }


def geomean(values: list[float]) -> float | None:
    return round(math.exp(sum(map(math.log, values)) / len(values)), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", action="append", default=[], help="run only these option sets")
    parser.add_argument("--baseline-src", metavar="DIR",
                        help="also time disttrain imported from DIR (the src/ of a checkout before a change), "
                             "interleaved with the others: before and after under the same load")
    args = parser.parse_args()

    py = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launchers = {"torchrun": ([py, "-m", "torch.distributed.run"], env),
                 "disttrain": ([py, "-m", "disttrain", "run"], env)}
    if args.baseline_src:
        launchers["baseline"] = ([py, "-m", "disttrain", "run"],
                                 {**env, "PYTHONPATH": os.pathsep.join(filter(None, (
                                     str(Path(args.baseline_src).resolve()), env.get("PYTHONPATH"))))})
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="torchrun-compare-") as logs:
        sets = option_sets(logs)
        for name, options in sets.items():
            if args.only and name not in args.only:
                continue
            times: dict[str, list[float]] = {who: [] for who in launchers}
            cpu: dict[str, list[float]] = {who: [] for who in launchers}
            lines: dict[str, list[dict[str, float]]] = {who: [] for who in launchers}
            for k in range(args.repeats):
                order = list(launchers) if k % 2 == 0 else list(reversed(launchers))
                for who in order:
                    command, who_env = launchers[who]
                    argv = [*command, *(o.replace("{port}", str(free_port())) for o in options)]
                    wall, used, timeline = timed(argv, who_env)
                    times[who].append(wall)
                    cpu[who].append(used)
                    lines[who].append(timeline)
            results[name] = {
                "options": options,
                "torchrun_s": [round(t, 2) for t in times["torchrun"]],
                "torchrun_median_s": round(statistics.median(times["torchrun"]), 3),
                "torchrun_cpu_s": [round(t, 2) for t in cpu["torchrun"]],
                "torchrun_timeline_median_s": {phase: round(statistics.median(t[phase] for t in lines["torchrun"]), 3)
                                               for phase in PHASES},
                **summary(times, cpu, lines, "disttrain"),
            }
            if "baseline" in launchers:
                base = summary(times, cpu, lines, "baseline")
                base["baseline_ratio"], base["baseline_cpu_ratio"] = base.pop("ratio"), base.pop("cpu_ratio")
                results[name].update(base)
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
        "ratio_geomean": geomean(ratios),
        "cpu_ratio_geomean": geomean([r["cpu_ratio"] for r in results.values()]),
        "goal": "ratio <= 1.05 and cpu_ratio <= 1.05",
        **({"baseline_src": args.baseline_src,
            "baseline_ratio_geomean": geomean([r["baseline_ratio"] for r in results.values()]),
            "baseline_cpu_ratio_geomean": geomean([r["baseline_cpu_ratio"] for r in results.values()])}
           if args.baseline_src else {}),
    }
    out = ROOT / "bench" / "results" / f"torchrun-compare-{result['date']}-{result['machine']}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
