"""Which communication mode pays on a link: ``disttrain bench --comm`` on the MNIST ConvNet, each
mode's throughput against the compute-only reference and its validation accuracy against plain
DDP's after the same samples, recorded with the machine's load.

    python bench/comm_modes.py --link 20mbit     # 2 namespace hosts x 1 process, tbf-shaped veth
    python bench/comm_modes.py --link loopback   # 2 processes on this machine
    python bench/comm_modes.py --busy 2          # with 2 busy loops beside the job (a loaded machine)

The comparison with the plain PyTorch way is inside the bench's own JSON: plain DDP is one of the
modes, in the same run. Prints one JSON object and writes it to
bench/results/comm-modes-<link>-<date>-<arch>-<N>cpu.json. The 20 Mbit/s run needs root for the
namespaces (tests/rig.py); without it it prints ``{"skipped": reason}``.
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
sys.path.insert(0, str(ROOT / "tests"))

MNIST = [str(ROOT / "examples" / "mnist_convnet.py")]


def bench_argv(args: argparse.Namespace, where: list[str], link_gbit: float | None) -> list[str]:
    return [sys.executable, "-m", "disttrain", "bench", *where, "--comm", "--json", "--repeat", "1",
            "--global-batch", str(args.global_batch), "--steps", str(args.steps),
            *(["--link-gbit", f"{link_gbit:g}"] if link_gbit else []),
            *MNIST, "--", "--samples", str(args.samples), "--log-every", "0"]


def run_loopback(args: argparse.Namespace) -> tuple[int, str, str]:
    proc = subprocess.run(bench_argv(args, ["-n", "2"], None), capture_output=True, text=True,
                          timeout=args.timeout, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def run_shaped(args: argparse.Namespace) -> tuple[int, str, str] | str:
    from rig import Cluster, rate_bits, skip_reason

    reason = skip_reason(install=False)
    if reason:
        return reason
    with Cluster(2) as cluster:
        cluster.shape(args.link)
        hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
        where = ["--hosts", hosts, "-n", "1", "--no-preflight", *cluster.cli_ssh_args(),
                 "--env", "OMP_NUM_THREADS=1"]
        result = cluster.run_in("node0", bench_argv(args, where, rate_bits(args.link) / 1e9),
                                timeout=args.timeout, cwd=ROOT)
        return result.returncode, result.stdout, result.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="20mbit", help="a tbf rate (20mbit, 1gbit) or loopback")
    parser.add_argument("--samples", type=int, default=12000, help="training images: the budget of every mode")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="timed steps (whole periods of localsgd/diloco:16)")
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--busy", type=int, default=0, help="busy loops to run beside the job (a loaded machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    started = time.time()
    load_before = os.getloadavg()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        outcome = run_loopback(args) if args.link == "loopback" else run_shaped(args)
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    if isinstance(outcome, str):
        print(json.dumps({"skipped": outcome}))
        return 0
    code, stdout, stderr = outcome
    record = {
        "benchmark": "comm_modes", "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "link": args.link, "model": "MNIST ConvNet (examples/mnist_convnet.py, generated digits)",
        "samples": args.samples, "global_batch": args.global_batch, "steps": args.steps,
        "arch": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "busy_loops": args.busy, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "wall_s": round(time.time() - started, 1), "exit_code": code,
    }
    try:
        record["bench"] = json.loads(stdout)
    except json.JSONDecodeError:
        record["error"] = stderr[-3000:]
    print(json.dumps(record, indent=2))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"comm-modes-{args.link}{f'-busy{args.busy}' if args.busy else ''}-{time.strftime('%Y-%m-%d', time.gmtime(started))}-"
        f"{platform.machine()}-{os.cpu_count()}cpu.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"comm_modes: written to {out}", file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
