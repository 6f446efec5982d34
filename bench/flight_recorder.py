"""What does the hang diagnostics' Flight Recorder cost? Steady-state throughput of a plain DDP
script under ``disttrain run -n 2 --hang-timeout 600`` (the recorder on in every rank, torch's
worker server started by disttrain's bootstrap, the agent reading each rank's progress every
second) over the same run without ``--hang-timeout``, in one run, interleaved. Goal >= 0.99.
On a shared machine the runs' spread is wide: the ratio of each interleaved pair is given too.
And the recorder's cost per collective, which throughput cannot resolve: one process, a world
of one, a one-element all_reduce in a loop, with ``TORCH_FR_BUFFER_SIZE`` set and unset.

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


PER_CALL = """
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(1)
for _ in range(500):
    dist.all_reduce(t)
start = time.perf_counter()
for _ in range(20000):
    dist.all_reduce(t)
print((time.perf_counter() - start) / 20000 * 1e6)
dist.destroy_process_group()
"""


def per_call_us(recorder: bool) -> float:
    from disttrain.net import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PORT=str(free_port("127.0.0.1")))
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    if recorder:
        env["TORCH_FR_BUFFER_SIZE"] = "500"
    out = subprocess.run([sys.executable, "-c", PER_CALL], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.split()[-1])


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
    call_without, call_with = [], []
    for i in range(args.repeats):
        for recorder in ((False, True) if i % 2 == 0 else (True, False)):
            (call_with if recorder else call_without).append(per_call_us(recorder))
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
        "pair_ratios": [round(w / o, 3) for w, o in zip(with_fr, without)],
        "median_pair_ratio": round(statistics.median(w / o for w, o in zip(with_fr, without)), 3),
        # The fastest of the runs: the one least disturbed by the machine's other work.
        "all_reduce_us_without": round(min(call_without), 1),
        "all_reduce_us_with_recorder": round(min(call_with), 1),
        "load_1min": loads,
    }
    out = ROOT / "bench" / "results" / f"flight-recorder-{result['date']}-{platform.machine()}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
