"""What does a checkpoint's digest cost? Saving and loading with and without it, beside plain torch.

A model of ``--mb`` megabytes of float32 weights, saved again and again in one process (a
world of one: the digest work of a save is rank 0's file, and each rank's own shards):

- ``torch_save``: ``torch.save`` + fsync into one file, the plain PyTorch way;
- ``disttrain_<digest>``: ``disttrain.checkpoint.save`` (temporary directory, marker,
  rename, fsyncs) with each file digested while it is fsynced: ``none`` (no hashing, the
  cost of the rest), ``sha256`` (what disttrain uses) and ``blake2b``;
- the same for loading: ``torch.load`` + ``load_state_dict`` against
  ``checkpoint.load_latest``, which also checks the digests (on a thread of its own, while
  ``torch.load`` runs);
- a sharded model (``prepare(strategy="fsdp")``): ``torch.distributed.checkpoint.save``
  (and ``load``) against ``checkpoint.save`` (``load_latest``), with and without the digest.

Variants are interleaved, ``--trials`` rounds, medians reported. The goal: the digest does
not make a save noticeably slower (``save_ratio_sha256_over_none`` close to 1).

    python bench/checkpoint_digest.py [--mb 256] [--trials 5] [--dir /tmp]

Prints one JSON object and writes it to
bench/results/checkpoint_digest-<date>-<arch>-<cpus>cpu.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def model_of(mb: int):
    import torch

    torch.manual_seed(0)
    layers = max(1, mb // 4)  # a 1024 x 1024 float32 weight is 4 MiB
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def _sync_only(path: Path, fd: int | None = None) -> dict:
    """checkpoint_layout.sync_and_digest without the digest: the cost of everything else."""
    own = os.open(path, os.O_RDONLY) if fd is None else fd
    try:
        os.fsync(own)
    finally:
        if fd is None:
            os.close(own)
    return {"sha256": "", "bytes": 0}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="model size in MiB")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temp folder)")
    args = parser.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    import disttrain
    from disttrain import checkpoint_layout
    from disttrain.runtime import checkpoint_write

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "DISTTRAIN_CHECKPOINT_DIR"):
        os.environ.pop(name, None)
    disttrain.init()
    work = Path(tempfile.mkdtemp(prefix="ckpt-digest-", dir=args.dir))
    plain_model = model_of(args.mb)
    sharded_model, _ = disttrain.prepare(model_of(args.mb), None, strategy="fsdp")
    size_mb = sum(p.numel() * p.element_size() for p in plain_model.parameters()) / 2**20
    original = checkpoint_layout.sync_and_digest

    def digesting(digest: str) -> None:
        checkpoint_layout.DIGEST = "sha256" if digest == "none" else digest
        chosen = _sync_only if digest == "none" else original
        checkpoint_layout.sync_and_digest = checkpoint_write.sync_and_digest = chosen

    def torch_save() -> None:
        with open(work / "plain.pt", "wb") as f:
            torch.save(plain_model.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())

    def disttrain_save(digest: str, model, name: str) -> Callable[[], object]:
        def save() -> None:
            digesting(digest)
            try:
                disttrain.checkpoint.save(work / f"{name}-{digest}", step=1, keep_last=1, model=model)
            finally:
                digesting("sha256")
        return save

    def dcp_save() -> None:
        shutil.rmtree(work / "dcp", ignore_errors=True)
        dcp.save({"model": sharded_model.state_dict()}, checkpoint_id=work / "dcp")

    saves = {"torch_save": torch_save, **{f"disttrain_{d}": disttrain_save(d, plain_model, "plain")
                                          for d in ("none", "sha256", "blake2b")},
             "dcp_save": dcp_save, **{f"disttrain_sharded_{d}": disttrain_save(d, sharded_model, "sharded")
                                      for d in ("none", "sha256")}}
    loads = {"torch_load": lambda: plain_model.load_state_dict(torch.load(work / "plain.pt", weights_only=True)),
             "disttrain_load_sha256": lambda: disttrain.checkpoint.load_latest(work / "plain-sha256",
                                                                               model=plain_model),
             "dcp_load": lambda: dcp.load({"model": sharded_model.state_dict()}, checkpoint_id=work / "dcp"),
             "disttrain_sharded_load_sha256": lambda: disttrain.checkpoint.load_latest(work / "sharded-sha256",
                                                                                       model=sharded_model)}
    hashes = {"sha256_only": lambda: hashlib.file_digest(open(work / "plain.pt", "rb"), "sha256"),
              "blake2b_only": lambda: hashlib.file_digest(open(work / "plain.pt", "rb"), "blake2b")}
    seconds: dict[str, list[float]] = {name: [] for name in [*saves, *loads, *hashes]}
    try:
        for fn in saves.values():  # one untimed round: files exist, caches warm
            fn()
        for _ in range(args.trials):
            for group in (saves, loads, hashes):
                for name, fn in group.items():
                    seconds[name].append(timed(fn))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}

    def ratio(a: str, b: str) -> float:
        return round(median[a] / median[b], 3)

    result = {
        "bench": "checkpoint_digest",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "model_mb": round(size_mb, 1),
        "trials": args.trials,
        "median_s": {name: round(v, 4) for name, v in median.items()},
        "mb_per_s": {name: round(size_mb / v, 1) for name, v in median.items()},
        "save_ratio_sha256_over_none": ratio("disttrain_sha256", "disttrain_none"),
        "save_ratio_blake2b_over_none": ratio("disttrain_blake2b", "disttrain_none"),
        "save_ratio_disttrain_sha256_over_torch_save": ratio("disttrain_sha256", "torch_save"),
        "sharded_save_ratio_sha256_over_none": ratio("disttrain_sharded_sha256", "disttrain_sharded_none"),
        "sharded_save_ratio_disttrain_over_dcp": ratio("disttrain_sharded_sha256", "dcp_save"),
        "load_ratio_disttrain_over_torch_load": ratio("disttrain_load_sha256", "torch_load"),
        "sharded_load_ratio_disttrain_over_dcp": ratio("disttrain_sharded_load_sha256", "dcp_load"),
    }
    out = ROOT / "bench" / "results" / (f"checkpoint_digest-{result['date']}-{platform.machine()}-"
                                        f"{result['cpus']}cpu.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
