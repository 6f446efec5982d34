"""Does disttrain cost anything on a GPU? ResNet-18 at 224x224, images/s under
``disttrain run -n 1`` (prepare(): device, pinned memory, non-blocking copies) over the same
loop in plain PyTorch (``.cuda()``, ``pin_memory=True``, ``non_blocking=True`` by hand), one
GPU, the same synthetic images, batch and precision; runs interleaved. Goal: ratio >= 0.98.

    python bench/gpu.py [--steps 50] [--warmup 10] [--batch-size 64] [--mixed-precision bf16]

Prints one JSON object and writes it to bench/results/gpu-<date>-<gpu>.json. Without CUDA
it says so and exits 2. ``--worker plain|disttrain`` is the training script itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resnet18():
    spec = importlib.util.spec_from_file_location("resnet18_stl10", ROOT / "examples" / "resnet18_stl10.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model()[0]


def images(n: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 224, 224, generator=g), torch.randint(0, 10, (n,), generator=g))


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader

    torch.backends.cudnn.benchmark = True
    data = images(args.batch_size * 8)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.num_workers, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = {"bf16": torch.bfloat16, None: None}[args.mixed_precision]
    if args.worker == "disttrain":
        import disttrain

        ctx = disttrain.init()
        device = ctx.device
        model, opt, loader = disttrain.prepare(model, opt, loader, mixed_precision=args.mixed_precision)
        move = lambda x, y: (x, y)  # noqa: E731 -- prepare()'s loader delivers on the device
        autocast = None
    else:
        device = torch.device("cuda:0")
        model = model.to(device)
        loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                            num_workers=args.num_workers, pin_memory=True,
                            generator=torch.Generator().manual_seed(0))
        move = lambda x, y: (x.to(device, non_blocking=True), y.to(device, non_blocking=True))  # noqa: E731
        autocast = dtype
    model.train()
    done, start = 0, None
    while done < args.warmup + args.steps:
        for x, y in loader:
            if done == args.warmup:
                torch.cuda.synchronize(device)
                start = time.perf_counter()
            x, y = move(x, y)
            if autocast is not None:
                with torch.autocast("cuda", dtype=autocast):
                    out = model(x)
                out = out.float()
            else:
                out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == args.warmup + args.steps:
                break
    torch.cuda.synchronize(device)
    rate = args.steps * args.batch_size / (time.perf_counter() - start)
    print(json.dumps({"images_per_s": rate, "device": torch.cuda.get_device_name(device)}), flush=True)


def measure(kind: str, args: argparse.Namespace) -> tuple[float, str]:
    common = [__file__, "--worker", kind, "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--batch-size", str(args.batch_size), "--num-workers", str(args.num_workers)]
    if args.mixed_precision:
        common += ["--mixed-precision", args.mixed_precision]
    cmd = ([sys.executable, "-m", "disttrain", "run", "-n", "1", *common] if kind == "disttrain"
           else [sys.executable, *common])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"bench/gpu.py: the {kind} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.splitlines()):
        line = line.split("] ", 1)[-1]
        if line.startswith("{"):
            found = json.loads(line)
            return found["images_per_s"], found["device"]
    raise SystemExit(f"bench/gpu.py: no result from the {kind} run:\n{proc.stdout[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["plain", "disttrain"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mixed-precision", choices=["bf16"], default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU visible; run it on a machine with one", file=sys.stderr)
        raise SystemExit(2)
    if args.worker:
        worker(args)
        return
    plain, ours, device = [], [], ""
    for _ in range(args.repeats):  # interleaved, so drift hits both
        rate, device = measure("plain", args)
        plain.append(rate)
        ours.append(measure("disttrain", args)[0])
    result = {
        "bench": "gpu",
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "device": device,
        "model": "resnet18", "image_size": 224, "batch_size": args.batch_size,
        "mixed_precision": args.mixed_precision, "steps": args.steps,
        "plain_images_per_s": [round(v, 1) for v in plain],
        "disttrain_images_per_s": [round(v, 1) for v in ours],
        "ratio": round(statistics.median(ours) / statistics.median(plain), 3),
        "goal": 0.98,
    }
    name = "".join(c if c.isalnum() else "-" for c in device).strip("-").lower()
    out = ROOT / "bench" / "results" / f"gpu-{result['date']}-{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    main()
