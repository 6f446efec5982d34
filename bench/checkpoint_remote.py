"""What does a checkpoint at a URL cost? Save, load and the time a training step is blocked, on a
local folder and on ``s3://``, sync and async, beside plain ``torch.distributed.checkpoint``.

The S3 server is moto's (``moto_server``), started by this script as a process on loopback and
reached through s3fs with ``AWS_ENDPOINT_URL``, as the tests do: it measures the protocol's costs
(requests, the read-back, the marker) on this machine, not a network's bandwidth. A world of one:

- ``ddp``: a plain model (what DDP saves: rank 0's whole-state file);
- ``fsdp``: the same model prepared with ``strategy="fsdp"`` (shard files through DCP).

For each target (``local``, ``s3``) and model, interleaved over ``--trials`` rounds, medians:

- ``disttrain_sync``: ``disttrain.checkpoint.save`` (the step is blocked for all of it), then
  ``load_latest``;
- ``disttrain_async``: ``save(asynchronous=True)`` -- ``blocked_s`` until it returns (the staging
  copy), ``total_s`` until ``checkpoint.wait()`` (uploaded, read back, marker written);
- ``dcp_sync``: ``dcp.save`` with ``FsspecWriter`` on s3 (``FileSystemWriter`` locally), then ``dcp.load``;
- ``dcp_async``: ``dcp.async_save`` with the same writer: blocked until it returns, total until its
  future is done.

Local async saves of a whole-state model are not offered by disttrain (a local save is one
rename-committed write), so that cell is absent. Ratios: disttrain over dcp for the same cell.

    python bench/checkpoint_remote.py [--mb 64] [--trials 3]

Prints one JSON object and writes it to bench/results/checkpoint_remote-<date>-<arch>-<cpus>cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_moto(log: Path) -> tuple[subprocess.Popen, str]:
    """``moto_server`` on a free loopback port; the process and its endpoint once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Path(sys.executable).with_name("moto_server")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"moto_server exited with {proc.returncode}: {log.read_text()[-500:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"moto_server did not listen on 127.0.0.1:{port} within 60 s")


def model_of(mb: int):
    import torch

    torch.manual_seed(0)
    layers = max(1, mb // 4)  # a 1024 x 1024 float32 weight is 4 MiB
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="model size in MiB")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "DISTTRAIN_CHECKPOINT_DIR"):
        os.environ.pop(name, None)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    work = Path(tempfile.mkdtemp(prefix="ckpt-remote-"))
    proc, endpoint = start_moto(work / "moto.log")
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        result = measure(args, work)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    out = ROOT / "bench" / "results" / f"checkpoint_remote-{result['date']}-{platform.machine()}-{result['cpus']}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def measure(args: argparse.Namespace, work: Path) -> dict:
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import disttrain

    fsspec.filesystem("s3").mkdir("bench")
    disttrain.init()
    models = {"ddp": model_of(args.mb), "fsdp": disttrain.prepare(model_of(args.mb), None, strategy="fsdp")[0]}
    size_mb = sum(p.numel() * p.element_size() for p in models["ddp"].parameters()) / 2**20
    targets = {"local": str(work / "local"), "s3": "s3://bench"}
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    def writer(url: str):
        return FsspecWriter(url, sync_files=False) if url.startswith("s3://") else FileSystemWriter(url)

    def reader(url: str):
        return FsspecReader(url) if url.startswith("s3://") else FileSystemReader(url)

    def one_round(step: int) -> None:
        for target, root in targets.items():
            for kind, model in models.items():
                cell = f"{target}.{kind}"
                folder = f"{root}/disttrain-{kind}"
                start = time.perf_counter()
                disttrain.checkpoint.save(folder, step=step, keep_last=1, model=model)
                record(f"{cell}.disttrain_sync.total_s", time.perf_counter() - start)
                start = time.perf_counter()
                disttrain.checkpoint.load_latest(folder, model=model)
                record(f"{cell}.disttrain_sync.load_s", time.perf_counter() - start)
                if target == "s3" or kind == "fsdp":
                    start = time.perf_counter()
                    disttrain.checkpoint.save(folder, step=step + 1, keep_last=1, model=model, asynchronous=True)
                    record(f"{cell}.disttrain_async.blocked_s", time.perf_counter() - start)
                    disttrain.checkpoint.wait()
                    record(f"{cell}.disttrain_async.total_s", time.perf_counter() - start)
                plain = f"{root}/dcp-{kind}-{step}"
                start = time.perf_counter()
                dcp.save({"model": model.state_dict()}, storage_writer=writer(plain))
                record(f"{cell}.dcp_sync.total_s", time.perf_counter() - start)
                start = time.perf_counter()
                dcp.load({"model": model.state_dict()}, storage_reader=reader(plain))
                record(f"{cell}.dcp_sync.load_s", time.perf_counter() - start)
                start = time.perf_counter()
                future = dcp.async_save({"model": model.state_dict()}, storage_writer=writer(plain + "-async"))
                record(f"{cell}.dcp_async.blocked_s", time.perf_counter() - start)
                future.result()
                record(f"{cell}.dcp_async.total_s", time.perf_counter() - start)
                fs, path = fsspec.core.url_to_fs(plain)
                fs.rm(path, recursive=True)
                fs.rm(path + "-async", recursive=True)

    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        one_round(1)  # untimed: imports, connections, first allocations
        times.clear()
        for trial in range(args.trials):
            one_round(10 * (trial + 2))
    median = {name: round(statistics.median(values), 4) for name, values in sorted(times.items())}

    ratios = {}
    for name, value in median.items():
        target, kind, variant, measure_ = name.split(".")
        if not variant.startswith("disttrain_"):
            continue
        plain = median.get(f"{target}.{kind}.dcp_{variant.split('_', 1)[1]}.{measure_}")
        if plain:
            ratios[f"{target}.{kind}.{variant}.{measure_}_over_dcp"] = round(value / plain, 2)
    return {
        "bench": "checkpoint_remote",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "model_mb": round(size_mb, 1),
        "trials": args.trials,
        "s3_server": "moto_server on loopback (a process of its own)",
        "median_s": median,
        "ratios": ratios,
    }


if __name__ == "__main__":
    main()
