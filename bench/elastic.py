"""How fast does an elastic job go on without a lost host, and what does the loss cost?

    python bench/elastic.py                   # 2 trials of each kind, 3 -> 2 hosts
    python bench/elastic.py --trials 3 --kinds power-off --torchrun-cap 90
    python bench/elastic.py --snapshot-only   # the per-step cost of keeping the state safe

The hosts are ``tests/rig.py``'s: three network namespaces on a bridge, each with its own sshd;
the launcher runs in the first. The job is ``tests/scripts/elastic_train.py`` (a tiny model,
``disttrain.resume()`` checkpoints every few steps, every step's samples logged with wall-clock
times: all the "hosts" share this machine's clock) under ``disttrain run --hosts A,B,C --nnodes
2:3 -n 1``. Once a checkpoint exists the third host is cut off:

- ``power-off``: its link drops every packet both ways and every process in it dies (no FIN, no
  RST reaches anyone), as when a machine loses power;
- ``agent-killed``: every process in it dies (its sshd too), the network stays up;
- ``store-host-lost``: four namespaces, the first runs only the launcher (a login host) and the job
  runs on the other three; the first of those -- the host torchrun's c10d store lives on, and
  disttrain's before the launcher held it -- loses power;
- ``flapping``: as ``store-host-lost``, but the third host goes down and up every ``--flap-s``
  seconds from the cut to the job's end: the record's joins, losses and backoffs, and the job's
  training time against a run without the flaps (``--kinds`` with ``none`` measures that).

Measured per trial, from the wall-clock stamps of the launcher's record (``membership.json``)
and the workers' logs: **detection** (the cut to the launcher's verdict), **rendezvous** (the
verdict to the next round's workers starting), **worker start** (to every rank's model, optimizer and
DDP ready: interpreter, torch, ``init``, the script's setup), **checkpoint load** (``disttrain.resume()``),
**first
step** (to the first finished step), the **total** (the cut to training again) and the **steps
of work lost** (steps done after the newest checkpoint, done again). The sample accounting over
every attempt (:func:`account`) must show no sample lost or trained twice.

The plain PyTorch way, in the same run: torchrun on each host by hand, with the same script, the
c10d rendezvous and ``--max-restarts 3`` (torch's defaults otherwise), the same cut; its total is
capped at ``--torchrun-cap`` seconds (after a power-off its survivors wait in a collective).

``--snapshot``: what keeping the training state safe costs per step, on 2 local ranks with a
model of ``--snapshot-mb`` MB (weights; SGD with momentum doubles the state): nothing (``none``), a
copy of the model's and optimizer's state in the process's memory (``memory``), that copy written to
shared memory, which outlives a worker killed at a regroup (``shm``), sent to the next rank while
the next step runs (``peer``: the copy a lost host would not take along), and a ``disttrain.resume()``
checkpoint on disk after every step (``disk``).

Prints one JSON object and writes it to bench/results/elastic-<date>-<arch>-<N>cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "scripts" / "elastic_train.py"
KINDS = ("power-off", "agent-killed", "store-host-lost", "flapping", "join")
LAUNCHER_ONLY = ("store-host-lost", "flapping", "none")  # node0 runs only the launcher
SNAPSHOT_MODES = ("none", "memory", "shm", "peer", "disk")


# --------------------------------------------------------------------------- the accounting


def read_attempts(out: Path) -> dict[int, dict]:
    """Every attempt the workers logged: ``{attempt: {"ranks": {rank: [steps finished]}, "taken": {rank:
    [steps begun]}, "start": {rank: stamps}}}`` ("taken": only where the script writes it)."""
    attempts: dict[int, dict] = {}
    for suffix, key in ((".jsonl", "ranks"), (".taken", "taken")):
        for path in sorted(out.glob(f"attempt*_rank*{suffix}")):
            attempt, rank = (int(part) for part in path.stem.removeprefix("attempt").split("_rank"))
            records = []
            for line in path.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except ValueError:  # the last line of a worker killed while writing it
                    pass
            attempts.setdefault(attempt, {"ranks": {}, "taken": {}, "start": {}})[key][rank] = records
    for path in sorted(out.glob("attempt*_rank*.start")):
        attempt, rank = (int(part) for part in path.stem.removeprefix("attempt").split("_rank"))
        attempts.setdefault(attempt, {"ranks": {}, "taken": {}, "start": {}})["start"][rank] = json.loads(path.read_text())
    return attempts


def account(out: Path, samples: int) -> dict:
    """Every sample of every epoch over all attempts, counting only the steps that count.

    An attempt's steps from the step the next attempt resumed from on were done again by that
    attempt (work lost); the rest count. With every epoch's order from the same seed, no sample
    may be missing, and one may be trained twice only where the runtime says so: resuming an epoch
    part-way on another world size W re-trains ``consumed % W`` samples (DistributedSampler's
    positions are cut per rank), as padding at the epoch's end -- so only by the last attempt that
    resumed part-way into that epoch (an earlier one was cut before its end).

    A step before the cut was finished by every rank of its world, a lost one too (its gradients were
    in the reduction its peers went on from), so its samples come from the steps begun where the script
    logs them: a rank lost between the reduction and its finished line trained samples it never logged
    as finished."""
    attempts = read_attempts(out)
    order = [a for a in sorted(attempts) if any(attempts[a]["ranks"].values())]
    per_epoch: dict[int, Counter] = {}
    redone: dict[int, int] = {}
    padding: dict[int, int] = {}  # epoch -> the samples its last part-way resume trains twice
    summary = []
    for i, attempt in enumerate(order):
        records = [r for rs in attempts[attempt]["ranks"].values() for r in rs]
        world = records[0]["world_size"]
        nxt = order[i + 1] if i + 1 < len(order) else None
        cut = float("inf")
        if nxt is not None:
            cut = min(r["step"] for rs in attempts[nxt]["ranks"].values() for r in rs)
        ranks, taken = attempts[attempt]["ranks"], attempts[attempt]["taken"]
        begun = [r for rank in {*ranks, *taken} for r in taken.get(rank, ranks.get(rank, []))]
        counted = [r for r in begun if r["step"] < cut]
        redone[attempt] = len({r["step"] for r in records if r["step"] >= cut})
        if i > 0:  # this attempt resumed part-way into an epoch on (maybe) another world size
            first = min(records, key=lambda r: r["step"])
            consumed = sum(per_epoch.get(first["epoch"], Counter()).values())
            padding[first["epoch"]] = consumed % world if consumed % samples else 0
        for r in counted:
            per_epoch.setdefault(r["epoch"], Counter()).update(r["samples"])
        steps = sorted({r["step"] for r in records})
        summary.append({"attempt": attempt, "world_size": world, "first_step": steps[0], "last_step": steps[-1],
                        "redone_after": redone[attempt]})
    missing = {e: [s for s in range(samples) if counts[s] == 0] for e, counts in per_epoch.items()}
    extra = {e: sum(counts.values()) - samples + len(missing[e]) for e, counts in per_epoch.items()}
    return {"attempts": summary, "epochs": sorted(per_epoch), "missing": {e: m for e, m in missing.items() if m},
            "extra": sum(extra.values()), "expected_extra": sum(padding.values()), "redone_steps": sum(redone.values())}


# --------------------------------------------------------------------------- one trial


def step_of(out: Path) -> int:
    """The highest step any worker logged so far (-1: none)."""
    best = -1
    for path in out.glob("attempt*_rank*.jsonl"):
        lines = path.read_text().splitlines()
        for line in reversed(lines[-2:]):
            try:
                best = max(best, json.loads(line)["step"])
                break
            except ValueError:
                continue
    return best


def complete_checkpoints(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.glob("step_*") if (p / "COMPLETE").is_file())


def job_args(out: Path, ckpt: Path, args) -> list[str]:
    return [str(WORKER), "--out", str(out), "--ckpt", str(ckpt), "--samples", str(args.samples), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--every", str(args.every), "--pause", str(args.pause)]


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTTRAIN_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    return env


def job_nodes(cluster, kind: str) -> list:
    """The hosts the job runs on: all, or all but node0 (which then runs only the launcher)."""
    return cluster.nodes[1:] if kind in LAUNCHER_ONLY else cluster.nodes


def start_disttrain(cluster, out: Path, ckpt: Path, args, log: Path, kind: str = "power-off",
                    regroup: str = "in-place") -> subprocess.Popen:
    """``regroup``: "restart" has the survivors' workers restarted (DISTTRAIN_REGROUP), as before
    in-place regroups."""
    hosts = ",".join(f"root@{node.ip}" for node in job_nodes(cluster, kind))
    argv = [sys.executable, "-m", "disttrain", "run", "--hosts", hosts, "--nnodes", "2:3", "-n", "1",
            "--log-dir", str(log.parent / "run"), *cluster.cli_ssh_args(), *job_args(out, ckpt, args)]
    return cluster.popen_in("node0", argv, cwd=ROOT, env={**worker_env(), "DISTTRAIN_REGROUP": regroup},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), stdin=subprocess.DEVNULL)


def start_torchrun(cluster, out: Path, ckpt: Path, args, log: Path, kind: str = "power-off") -> list[subprocess.Popen]:
    """torchrun on each host, the by-hand recipe of PyTorch's docs (each node its address and
    interface, node 0 hosting the c10d store), torch's defaults otherwise."""
    nodes = job_nodes(cluster, kind)
    master = nodes[0].ip
    procs = []
    for node in nodes:
        remote = ["env", f"PYTHONPATH={ROOT / 'src'}", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=eth1",
                  sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:29400", "--rdzv-id", "bench",
                  "--max-restarts", "3", "--local-addr", node.ip,
                  *(["--rdzv-conf", "is_host=1"] if node is nodes[0] else []), *job_args(out, ckpt, args)]
        argv = cluster.ssh_argv(node.name, *remote, options=["-tt"])  # -tt: the remote tree dies with ssh
        with open(log.with_suffix(f".{node.name}"), "w") as out:  # -tt merges the remote stderr into stdout
            procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=out, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    return procs


def cut(cluster, kind: str) -> float:
    """Cut off the kind's host (node2; node1, the store's host; node3, the flapping one); the
    wall-clock time of the cut."""
    at = time.time()
    if kind == "power-off":
        cluster.power_off("node2")
    elif kind == "agent-killed":
        cluster.kill_all("node2", include_sshd=True, grace=0)
    elif kind == "store-host-lost":
        cluster.power_off("node1")
    elif kind == "flapping":
        cluster.power_off("node3")
    elif kind == "join":  # down from the start: back now
        cluster.power_on("node2")
    return at


def flap(cluster, procs, args) -> int:
    """node3 up and down every --flap-s seconds while the job runs (it is down at the call); the flaps."""
    flaps, up = 0, False
    while any(p.poll() is None for p in procs[:1]):
        deadline = time.monotonic() + args.flap_s
        while time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        if up:
            cluster.power_off("node3")
            flaps += 1
        else:
            cluster.power_on("node3")
        up = not up
    return flaps


def parts(out: Path, record: list[dict] | None, cut_at: float) -> dict:
    """The recovery's parts from the stamps (wall clock, one machine)."""
    attempts = read_attempts(out)
    after = [a for a in sorted(attempts) if attempts[a]["start"]
             and min(s["started"] for s in attempts[a]["start"].values()) > cut_at]
    if not after:
        return {"recovered": False}
    nxt = attempts[after[0]]
    starts = list(nxt["start"].values())
    steps = [r["time"] for rs in nxt["ranks"].values() for r in rs]
    result = {"recovered": bool(steps), "world_size": starts[0]["world_size"]}
    formed = None
    if record:
        joined = next((c for c in record if c["change"] == "joined"), None)
        if joined is not None and not any(c["change"] == "left" for c in record):
            # a host back: from its answer to the preflight (the change's time) to the new world's first step
            result["answered_s"] = round(joined["time"] - cut_at, 2)
            result["join_to_training_s"] = joined["seconds"]
            result["path"] = joined.get("path")
        left = next((c for c in record if c["change"] == "left"), None)
        if left is not None:
            detected = left["time"] + (left["noticed"] or 0)
            result["detection_s"] = round(detected - cut_at, 2)
            if left.get("regrouped") is not None:
                formed = left["time"] + left["regrouped"]
                result["rendezvous_s"] = round(formed - detected, 2)
            result["path"] = left.get("path")
    began = formed if formed is not None else cut_at
    # To the script's model, optimizer and DDP ready on every rank (an interpreter, torch, the process
    # group, and torch.optim's first use, which imports torch._dynamo: seconds of their own).
    result["worker_start_s"] = round(max(s["prepared"] for s in starts) - began, 2)
    result["torch_import_s"] = round(max(s["imported"] - s["started"] for s in starts), 2)
    result["checkpoint_load_s"] = round(max(s["loaded"] - s["prepared"] for s in starts), 2)
    if steps:
        result["first_step_s"] = round(min(steps) - max(s["loaded"] for s in starts), 2)
        result["total_s"] = round(min(steps) - cut_at, 2)
    return result


def trial(cluster, kind: str, launcher: str, args, work: Path) -> dict:
    out, ckpt, log = work / "out", work / "ckpt", work / "launcher.log"
    for path in (out, ckpt):
        shutil.rmtree(path, ignore_errors=True)
    out.mkdir(parents=True)
    if kind == "join":
        cluster.power_off("node2")
    procs = ([start_disttrain(cluster, out, ckpt, args, log, kind, regroup="restart" if launcher.endswith("restart")
                              else "in-place")] if launcher.startswith("disttrain")
             else start_torchrun(cluster, out, ckpt, args, log, kind))
    began = time.time()
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if complete_checkpoints(ckpt) and step_of(out) >= args.cut_after:
            break
        time.sleep(0.1)
    else:
        for p in procs:
            p.kill()
        return {"kind": kind, "launcher": launcher, "error": "no checkpoint before the cut: " + log.read_text()[-2000:]}
    cut_step = step_of(out)
    cut_at = cut(cluster, kind)
    flaps = flap(cluster, procs, args) if kind == "flapping" and launcher.startswith("disttrain") else None
    cap = time.monotonic() + (args.torchrun_cap if launcher == "torchrun" else args.run_timeout)
    while time.monotonic() < cap and any(p.poll() is None for p in procs[:2]):
        time.sleep(0.2)
    ended = time.time()
    exit_codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for node in cluster.nodes:
        if node.name != "node2" or kind not in ("power-off", "agent-killed"):
            cluster.kill_all(node, grace=1)
    record = None
    if (work / "run" / "membership.json").is_file():
        record = json.loads((work / "run" / "membership.json").read_text())
    result = {"kind": kind, "launcher": launcher, "exit": exit_codes[0], "cut_after_step": cut_step,
              **parts(out, record, cut_at), "accounting": account(out, args.samples),
              "job_s": round(ended - began, 1)}
    if flaps is not None:  # what the flapping host cost: its admissions, losses and backoffs
        result["flaps"] = flaps
        result["joined"] = sum(c["change"] == "joined" for c in record or ())
        result["left"] = sum(c["change"] == "left" for c in record or ())
        result["backoffs_s"] = [c.get("backoff") for c in record or () if c["change"] == "left"]
    if launcher.startswith("disttrain"):
        line = next((ln for ln in log.read_text().splitlines() if "disttrain: membership:" in ln), None)
        result["membership_line"] = line
    shutil.rmtree(work / "run", ignore_errors=True)
    return result


# --------------------------------------------------------------------------- the snapshot cost

SNAPSHOT_WORKER = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
import disttrain
mode, mb, steps, ckpt = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ctx = disttrain.init()
width = int((mb * 1e6 / 4 / 4) ** 0.5)  # 4 square layers of float32: mb MB of weights
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
data = DataLoader(TensorDataset(torch.randn(steps * 8 * ctx.world_size, width)), batch_size=8, shuffle=True)
ddp, opt, data = disttrain.prepare(model, opt, data)
# disk: disttrain.resume()'s checkpoint after every step (its own save, atomic, rank 0 writes).
state = disttrain.resume(ckpt if mode == "disk" else None, every=1, keep_last=2, model=model, optimizer=opt)
peer, source, pending, kept = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size, [], None
snap = f"disttrain-bench-snapshot-{os.getpid()}.pt"
times, t0 = [], time.perf_counter()
for (x,) in state.steps(data):
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if mode == "memory":  # this rank's own copy of the state (a host lost takes it along)
        kept = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                 for k, v in opt.state_dict()["state"].items()})
    elif mode == "shm":  # this rank's copy in shared memory (tmpfs): it outlives the worker, not the host
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"/dev/shm/{snap}.tmp")
        os.replace(f"/dev/shm/{snap}.tmp", f"/dev/shm/{snap}")
    elif mode == "peer":  # the same, sent to the next rank, while the next step runs
        for work in pending:
            work.wait()
        tensors = [p.detach().reshape(-1) for p in model.parameters()]
        tensors += [opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()
                    if opt.state[p].get("momentum_buffer") is not None]
        flat = torch.cat(tensors)
        inbox = torch.empty_like(flat)
        pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, peer), dist.P2POp(dist.irecv, inbox, source)])
    now = time.perf_counter()  # the step, its snapshot and (disk) the checkpoint of the step before
    times.append(now - t0)
    t0 = now
for work in pending:
    work.wait()
if os.path.exists(f"/dev/shm/{snap}"):
    os.remove(f"/dev/shm/{snap}")
if ctx.is_main:
    rest = sorted(times[5:])
    print("SNAPSHOT " + json.dumps({"mode": mode, "step_s": rest[len(rest) // 2]}), flush=True)
disttrain.shutdown()
'''


def snapshot_cost(args, work: Path) -> dict:
    """Median step time per mode on 2 local ranks (``disttrain run -n 2``), the modes interleaved."""
    script = work / "snapshot_worker.py"
    script.write_text(SNAPSHOT_WORKER)
    times: dict[str, list[float]] = {}
    for _ in range(args.snapshot_repeats):
        for mode in SNAPSHOT_MODES:
            ckpt = work / "snapshot_ckpt"
            shutil.rmtree(ckpt, ignore_errors=True)
            argv = [sys.executable, "-m", "disttrain", "run", "-n", "2", str(script), mode, str(args.snapshot_mb),
                    str(args.snapshot_steps), str(ckpt)]
            res = subprocess.run(argv, capture_output=True, text=True, env=worker_env(), timeout=600, cwd=work)
            line = next((ln for ln in res.stdout.splitlines() if "SNAPSHOT " in ln), None)
            if line is None:
                raise SystemExit(f"snapshot {mode} failed: {res.stderr[-2000:]}")
            times.setdefault(mode, []).append(json.loads(line.split("SNAPSHOT ", 1)[1])["step_s"])
    base = statistics.median(times["none"])
    return {"model_mb": args.snapshot_mb, "steps": args.snapshot_steps,
            "step_s": {m: round(statistics.median(t), 4) for m, t in times.items()},
            "ratio_to_none": {m: round(statistics.median(t) / base, 3) for m, t in times.items()}}


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--launchers", default="disttrain,disttrain-restart,torchrun",
                        help="disttrain (in place), disttrain-restart (DISTTRAIN_REGROUP=restart), torchrun (by hand)")
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.2)
    parser.add_argument("--cut-after", type=int, default=10, help="cut once a checkpoint exists and this step ran")
    parser.add_argument("--start-timeout", type=float, default=180)
    parser.add_argument("--run-timeout", type=float, default=300)
    parser.add_argument("--torchrun-cap", type=float, default=120)
    parser.add_argument("--flap-s", type=float, default=10, help="the flapping host's period up, then down")
    parser.add_argument("--snapshot", action="store_true", help="also measure the per-step cost of snapshots")
    parser.add_argument("--snapshot-only", action="store_true")
    parser.add_argument("--snapshot-mb", type=float, default=16)
    parser.add_argument("--snapshot-steps", type=int, default=40)
    parser.add_argument("--snapshot-repeats", type=int, default=2)
    parser.add_argument("--out", help="result file (default bench/results/elastic-<date>-<arch>-<N>cpu.json)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from rig import Cluster, skip_reason

    result: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
                    "load_before": os.getloadavg()[0], "config": {k: v for k, v in vars(args).items() if k != "out"}}
    with tempfile.TemporaryDirectory(prefix="disttrain-elastic-bench-") as tmp:
        work = Path(tmp)
        if not args.snapshot_only:
            reason = skip_reason()
            if reason:
                print(json.dumps({"skipped": reason}))
                return 0
            trials = []
            for n in range(args.trials):
                for kind in args.kinds.split(","):
                    for launcher in args.launchers.split(","):
                        if kind in ("flapping", "join") and launcher == "torchrun":
                            continue  # torchrun admits nothing back by itself
                        with Cluster(4 if kind in LAUNCHER_ONLY else 3, bridge=True) as cluster:
                            res = trial(cluster, kind, launcher, args, work / f"{launcher}-{kind}-{n}")
                        res["load"] = os.getloadavg()[0]
                        print(json.dumps(res), file=sys.stderr, flush=True)
                        trials.append(res)
            result["trials"] = trials
            result["summary"] = summarize(trials)
        if args.snapshot or args.snapshot_only:
            result["snapshot"] = snapshot_cost(args, work)
    print(json.dumps(result, indent=1))
    path = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"elastic-{result['date']}-{result['machine']}-{result['cpus']}cpu.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def summarize(trials: list[dict]) -> dict:
    """Medians per kind and launcher; disttrain's total over torchrun's (capped) in the same run."""
    out: dict = {}
    keys = ("detection_s", "rendezvous_s", "worker_start_s", "torch_import_s", "checkpoint_load_s", "first_step_s",
            "total_s", "answered_s", "join_to_training_s", "job_s")
    for kind in {t["kind"] for t in trials}:
        for launcher in {t["launcher"] for t in trials}:
            runs = [t for t in trials if t["kind"] == kind and t["launcher"] == launcher and "error" not in t]
            if not runs:
                continue
            entry = {k: round(statistics.median(t[k] for t in runs if k in t), 2) for k in keys
                     if any(k in t for t in runs)}
            entry["recovered"] = sum(bool(t.get("recovered")) for t in runs)
            entry["trials"] = len(runs)
            entry["redone_steps"] = [t["accounting"]["redone_steps"] for t in runs]
            entry["paths"] = [t.get("path") for t in runs]
            out[f"{launcher}/{kind}"] = entry
        d, t = out.get(f"disttrain/{kind}"), out.get(f"torchrun/{kind}")
        if d and t and "total_s" in d:
            out[f"ratio/{kind}"] = {"disttrain_total_over_torchrun": round(d["total_s"] / t["total_s"], 3)
                                    if t.get("total_s") else None}
    return out


if __name__ == "__main__":
    sys.exit(main())
