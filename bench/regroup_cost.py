"""What does being ready for an in-place regroup cost when nothing fails?

    python bench/regroup_cost.py              # 3 interleaved repeats of each

``examples/mnist_convnet.py`` (its ``disttrain.resume()`` loop) under ``disttrain run -n 2``, with
and without the workers armed for an in-place regroup (``DISTTRAIN_REGROUP_SOCKETS``, which an
elastic launch's agent sets: each worker then listens on its socket, reads a flag at each step's
end and has a hook on its optimizer's step). The same command otherwise, interleaved so that a
shared machine's drift hits both. Goal: the armed throughput within 1 % of the other.

Prints one JSON object and writes it to bench/results/regroup-cost-<date>-<arch>-<N>cpu.json.
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
sys.path.insert(0, str(ROOT / "bench"))
from overhead import last_json, timed  # noqa: E402  (how a run's JSON line is read: one place)


def samples_per_s(armed: bool, args, folder: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTTRAIN_")}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))
    if armed:
        env["DISTTRAIN_REGROUP_SOCKETS"] = folder
    cmd = [sys.executable, "-m", "disttrain", "run", "-n", "2", "--ranks", "0", "examples/mnist_convnet.py",
           "--samples", str(args.samples), "--batch-size", str(args.batch_size), "--epochs", "1", "--log-every", "0"]
    return last_json(timed(cmd, env)[1])["train_samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    plain, armed = [], []
    with tempfile.TemporaryDirectory(prefix="dtrg-") as folder:
        for _ in range(args.repeats):
            plain.append(samples_per_s(False, args, folder))
            armed.append(samples_per_s(True, args, folder))
    result = {"bench": "regroup-cost", "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2), "samples": args.samples,
              "batch_size_per_process": args.batch_size,
              "not_armed_samples_per_s": [round(v, 1) for v in plain], "armed_samples_per_s": [round(v, 1) for v in armed],
              "armed_over_not": round(statistics.median(armed) / statistics.median(plain), 4)}
    out = ROOT / "bench" / "results" / f"regroup-cost-{result['date']}-{result['machine']}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
