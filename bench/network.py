"""Multi-host training against the wire's limit: 2 hosts x 1 process over a shaped link.

Runs on one machine: ``tests/rig.py`` makes two network namespaces joined by a veth pair and
limits what each sends with ``tc ... tbf`` (``Cluster.shape``; this kernel has no netem, so
no added latency). For each link (unshaped, 10 Gbit/s, 1 Gbit/s) and model (the ResNet-18
example at 32x32, the MNIST ConvNet), in one run with the configurations interleaved:

- ``allreduce``: one gloo all-reduce of the model's fp32 gradient size between the two
  hosts (median of repeats), against the ring bound 2(N-1)/N * S / B; also the CPU seconds
  the two processes burnt per all-reduce (the copies through the veth are CPU work, taken
  from the same 2 cores the training runs on).
- ``ideal``: the two hosts each training the same script alone, at the same time (no
  gradient sync, the same CPU contention); the sum of their samples/s.
- ``ddp``: ``disttrain run --nnodes 2`` (one process per host), DDP's defaults.
- ``fp16``, ``powersgd``: the same with ``--grad-compression``.

Throughput is the runtime's step timer (``DISTTRAIN_BENCH_STEPS`` after a warm-up), every
rank's samples over the slowest rank's time. ``recommended`` is what ``disttrain bench
--comm`` would pick from these measurements (the fastest compression when it beats plain
DDP by more than the noise threshold, else none). Every job records the CPU the rest of the
machine used meanwhile (``others_cores``).

Prints one JSON object and writes it to bench/results/network-<date>-<arch>-<N>cpu.json.
Exits 0 with ``{"skipped": reason}`` where namespaces cannot be made (not root...).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from multinode import reaped_cpu  # noqa: E402  (bench/ is on sys.path: this file's folder)

from disttrain.runtime.comm import POWERSGD_START  # noqa: E402
from disttrain.scaling.comm import recommend_compression  # noqa: E402

MODELS = {
    "resnet18": [str(ROOT / "examples" / "resnet18_stl10.py"), "--image-size", "32",
                 "--samples", "2000", "--val-samples", "32", "--batch-size", "32", "--epochs", "5",
                 "--log-every", "0"],
    "mnist_convnet": [str(ROOT / "examples" / "mnist_convnet.py"), "--samples", "20000",
                      "--batch-size", "128", "--epochs", "3", "--log-every", "0"],
}
LINKS = {"unshaped": None, "10gbit": "10gbit", "1gbit": "1gbit"}
CONFIGS = ["ideal", "ddp", "fp16", "powersgd"]
JOB_TIMEOUT_S = 400
MARKER = "disttrain-bench:"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- worker mode


def allreduce_worker(nbytes: int, repeats: int) -> None:
    """In each namespace: join a 2-rank gloo group, time ``repeats`` all-reduces."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(nbytes // 4)
    for _ in range(2):
        dist.all_reduce(tensor)
    times, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if dist.get_rank() == 0:
        print(MARKER + json.dumps({"seconds": statistics.median(times), "all": times,
                                   "cpu_s": statistics.median(cpu)}), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- measuring


def machine_busy() -> float:
    with open("/proc/stat") as f:
        user, nice, system = (int(v) for v in f.readline().split()[1:4])
    return (user + nice + system) / CLK_TCK


def own_cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def ours(cluster) -> float:
    """CPU seconds of everything the bench ran: its own children and the nodes' sshd sessions."""
    pids = [cluster.sshd_pid(n) for n in cluster.nodes]
    return own_cpu() + sum(reaped_cpu(pid) for pid in pids)


def run_pair(cluster, argvs: list[list[str]], env: dict[str, str]) -> tuple[list[str], dict]:
    """Start one command per node (node0 first) at once; wait for all; their stdout and the
    noise."""
    t0, b0, o0 = time.monotonic(), machine_busy(), ours(cluster)
    procs = [cluster.popen_in(node, argv, cwd=ROOT, env=env, text=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for node, argv in zip(("node0", "node1"), argvs)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError("a job ran past its time limit") from None
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {err[-3000:]}")
        outs.append(out)
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 15  # the remote side's processes end (and are reaped) last
    while any(cluster.processes_in(n) for n in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    others = max(0.0, (machine_busy() - b0) - (ours(cluster) - o0)) / wall
    return outs, {"wall_s": round(wall, 2), "others_cores": round(others, 2)}


def marker(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    raise RuntimeError(f"no {MARKER} line in:\n{stdout[-2000:]}")


def bench_env(steps: int, warmup: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth1", PYTHONPATH=str(ROOT / "src"),
               DISTTRAIN_BENCH_STEPS=str(steps), DISTTRAIN_BENCH_WARMUP=str(warmup))
    return env


def train_once(cluster, model: str, config: str, port: int, args) -> dict:
    steps = args.steps[model]
    # PowerSGD sends plain all-reduces for its first steps: time it after them.
    warmup = max(args.warmup, POWERSGD_START + 1) if config == "powersgd" else args.warmup
    env = bench_env(steps, warmup)
    script = MODELS[model]
    if config == "ideal":  # each host alone, a world of one, both at the same time
        argvs = [[sys.executable, *script]] * 2
        outs, noise = run_pair(cluster, argvs, env)
        results = [marker(out) for out in outs]
        return {"samples_per_s": sum(r["samples_per_s"] for r in results), **noise}
    # `disttrain run --hosts` from node0 over the rig's ssh, as a user would start it.
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
    more = [] if config == "ddp" else ["--grad-compression", config]
    ssh = cluster.cli_ssh_args()
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "-n", "1", "--ranks", "0",
            "--master-port", str(port), "--no-preflight", *ssh,
            "--env", f"DISTTRAIN_BENCH_STEPS={steps}", "--env", f"DISTTRAIN_BENCH_WARMUP={warmup}",
            "--env", "OMP_NUM_THREADS=1", *more, *script]
    outs, noise = run_pair(cluster, [argv], env)
    result = marker(outs[0])
    return {"samples_per_s": result["samples_per_s"], "gradient_bytes": result.get("gradient_bytes"),
            **noise}


def allreduce_once(cluster, nbytes: int, port: int, repeats: int) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth1", OMP_NUM_THREADS="1", MASTER_ADDR=cluster.nodes[0].ip,
               MASTER_PORT=str(port), WORLD_SIZE="2", PYTHONPATH=str(ROOT / "src"))
    argvs = [["env", f"RANK={k}", sys.executable, str(THIS), "--allreduce-worker", str(nbytes),
              str(repeats)] for k in (0, 1)]
    outs, noise = run_pair(cluster, argvs, env)
    return {**marker(outs[0]), **noise}


def ring_bound_s(nbytes: int, rate: str | None, world: int = 2) -> float | None:
    if rate is None:
        return None
    from rig import rate_bits

    return 2 * (world - 1) / world * nbytes * 8 / rate_bits(rate)


def interleaved(configs: list[str], repeats: int):
    for i in range(repeats):
        shift = i % len(configs)
        for config in configs[shift:] + configs[:shift]:
            yield i, config


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: list[float]) -> float | None:
    """(max - min) / median: how far apart the repeats were."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--resnet-steps", type=int, default=12)
    parser.add_argument("--mnist-steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    parser.add_argument("--allreduce-worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allreduce_worker:
        allreduce_worker(*args.allreduce_worker)
        return 0
    args.steps = {"resnet18": args.resnet_steps, "mnist_convnet": args.mnist_steps}

    from rig import Cluster, skip_reason

    reason = skip_reason()
    if reason:
        print(json.dumps({"bench": "network", "skipped": reason}))
        return 0
    models = args.models.split(",")
    links = args.links.split(",")
    configs = args.configs.split(",")
    import torch

    result: dict = {
        "bench": "network", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.node(),
        "arch": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(), "repeats": args.repeats, "warmup": args.warmup,
        "steps": args.steps, "hosts": 2, "processes_per_host": 1, "omp_threads": 1,
        "link": "veth pair between two network namespaces, egress limited by tc tbf on both ends",
        "models": {}, "notes": [],
    }
    port = 29600 + os.getpid() % 200
    with Cluster(2) as cluster:
        grad_bytes: dict[str, int] = {}
        raw: dict = {m: {link: {c: [] for c in configs} for link in links} for m in models}
        allreduce: dict = {m: {link: None for link in links} for m in models}
        for link in links:
            cluster.shape(LINKS[link])
            for model in models:
                for i, config in interleaved(configs, args.repeats):
                    port += 1
                    figures = train_once(cluster, model, config, port, args)
                    if figures.get("gradient_bytes"):
                        grad_bytes[model] = figures["gradient_bytes"]
                    raw[model][link][config].append(figures)
                    print(f"network bench: {model} {link} {config} #{i}: "
                          f"{figures['samples_per_s']:.1f} samples/s (others {figures['others_cores']})",
                          file=sys.stderr, flush=True)
                if model in grad_bytes:
                    port += 1
                    allreduce[model][link] = allreduce_once(cluster, grad_bytes[model], port, repeats=5)
            cluster.shape(None)
        for model in models:
            per_link = {}
            for link in links:
                runs = raw[model][link]
                rates = {c: median([r["samples_per_s"] for r in runs[c]]) for c in configs}
                ideal = rates.get("ideal")
                compressed = {c: rates[c] for c in configs if c not in ("ideal", "ddp") and rates[c]}
                choice = recommend_compression(rates.get("ddp"), compressed) if rates.get("ddp") else None
                ar = allreduce[model][link]
                bound = ring_bound_s(grad_bytes.get(model, 0), LINKS[link])
                entry = {
                    "samples_per_s": rates,
                    "of_ideal": {c: (rates[c] / ideal if ideal and rates[c] else None)
                                 for c in configs if c != "ideal"},
                    "spread": {c: spread([r["samples_per_s"] for r in runs[c]]) for c in configs},
                    "recommended": choice.name if choice else None,
                    "recommended_of_ideal": (rates[choice.name] / ideal if choice and choice.name != "none"
                                             and ideal else (rates.get("ddp") / ideal if ideal and rates.get("ddp") else None)),
                    "recommendation": choice.reason if choice else None,
                    "allreduce_s": ar["seconds"] if ar else None,
                    "allreduce_cpu_s": ar["cpu_s"] if ar else None,
                    "ring_bound_s": bound,
                    "of_bound": (bound / ar["seconds"]) if ar and bound else None,
                    "others_cores": median([r["others_cores"] for c in configs for r in runs[c]]),
                    "runs": runs,
                }
                per_link[link] = entry
            result["models"][model] = {"gradient_bytes": grad_bytes.get(model), "links": per_link}
    result["load_average_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"network-{time.strftime('%Y-%m-%d')}-{platform.machine()}-{os.cpu_count()}cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"network bench: written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
