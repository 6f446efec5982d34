"""What does a second host cost? 2 hosts x 1 process against 1 host x 2 processes.

Runs on one machine: ``tests/rig.py`` builds two network namespaces joined by a veth pair,
each with its own sshd, and the launcher runs inside the first one over real ssh, as in
``tests/test_multinode.py``. Both configurations have 2 ranks, the same per-process batch
(so the same global batch) and ``--env OMP_NUM_THREADS=1``; only where the ranks run
differs. Measured in one run, the configurations interleaved (their order rotating):

1. Training throughput of ``examples/mnist_convnet.py`` (its ``train_samples_per_s``):
   two hosts over one host. Goal >= 0.95.
2. Launch to first step: seconds from starting ``disttrain run`` to the first line a rank
   prints after its first DDP step (this file, run as the job's script with
   ``--first-step-worker``: ``disttrain.init()``, a tiny DDP model, one step, a marker
   line), split into phases by the ranks' timestamps: planning (probe and preflight over
   ssh, up to the launcher's ``disttrain: N workers ...`` banner), ranks started, torch
   imported, process group joined, DDP built, first step. Also with ``--no-preflight``, and
   the bare ssh round trips (``ssh node1 true``, ``ssh node1 python -m disttrain probe``)
   that explain the difference.

The machine may be shared, so every job also records the CPU the *rest* of the machine
used while it ran (``others_cores``: /proc/stat's busy time minus the CPU of the bench's
own process tree and of everything the nodes' sshd ran, per second of the job), and the
hypervisor's steal. Medians are over all repeats; ``quiet_*`` figures only over repeats in
which others used at most ``--quiet-cores``.

Prints one JSON object and writes it to bench/results/multinode-<date>-<arch>-<N>cpu.json
(``--out`` to choose). Exits 0 with ``{"skipped": reason}`` when the machine cannot make
network namespaces (not root, no sshd, ...; see tests/rig.py and tests/rig_setup.sh).
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
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
EXAMPLE = ROOT / "examples" / "mnist_convnet.py"
MARKER = "DISTTRAIN_BENCH_FIRST_STEP "
JOB_TIMEOUT_S = 300
TP_CONFIGS = ["one_host", "two_hosts"]
LAUNCH_CONFIGS = ["one_host", "two_hosts", "two_hosts_no_preflight"]


# --------------------------------------------------------------------------- the job's script


def first_step_worker() -> None:
    """The script the launch timing runs: init, one DDP step, a marker line, exit.

    Timestamps are ``time.monotonic()``, the machine-wide clock the bench also reads (all
    the "hosts" are namespaces of one kernel), so they place each phase on the bench's
    time line."""
    started = time.monotonic()
    import torch

    import disttrain

    imported = time.monotonic()
    ctx = disttrain.init()
    joined = time.monotonic()
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_model, optimizer = disttrain.prepare(model, optimizer)  # DDP broadcasts rank 0's weights
    prepared = time.monotonic()
    loss = ddp_model(torch.randn(16, 32)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()  # DDP's all-reduce of the gradients: every rank takes part
    optimizer.step()
    stepped = time.monotonic()
    print(MARKER + json.dumps({"rank": ctx.rank, "world_size": ctx.world_size, "started": started,
                               "imported": imported, "joined": joined, "prepared": prepared,
                               "stepped": stepped}), flush=True)


# --------------------------------------------------------------------------- noise meter

CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot (/proc/stat). Busy is user,
    nice and system time: irq/softirq time (the veth and loopback traffic of our own jobs
    among it) belongs to no process, so it is left out rather than blamed on others."""
    with open("/proc/stat") as f:
        user, nice, system, *_rest = (int(v) for v in f.readline().split()[1:9])
        steal = int(_rest[4])
    return (user + nice + system) / CLK_TCK, steal / CLK_TCK


def reaped_cpu(pid: int) -> float:
    """CPU seconds of the children ``pid`` has reaped (cutime + cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / CLK_TCK


def own_cpu() -> float:
    """CPU seconds of this process and of the children it has reaped (the launchers, and
    through them the local agents, workers and ssh clients)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def sshd_pids(cluster) -> list[int]:
    """Each node's listening sshd (the rig keeps its pid file in its workdir)."""
    return [cluster.sshd_pid(node) for node in cluster.nodes]


@contextmanager
def noise(cluster):
    """How much CPU the rest of the machine took while one job ran; fills the dict it yields.

    Everything a job runs is reaped either by this process (the launcher and its tree) or
    by a node's sshd (every ssh session with the remote agent and its workers): their CPU
    lands in our rusage or in sshd's cutime/cstime once they have exited, which
    ``check_clean`` waits for. The rest of /proc/stat's busy time is other people's."""
    pids = sshd_pids(cluster)

    def snapshot() -> tuple[float, float, float, float]:
        busy, steal = machine_cpu()
        return time.monotonic(), busy, steal, own_cpu() + sum(reaped_cpu(pid) for pid in pids)

    figures: dict[str, float] = {}
    start = snapshot()
    yield figures
    wall, busy, steal, ours = (b - a for a, b in zip(start, snapshot()))
    figures.update(others_cores=max(0.0, busy - ours) / wall, steal_cores=steal / wall)


# --------------------------------------------------------------------------- helpers


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in output:\n{stdout[-2000:]}")


def ssh_options(cluster) -> list[str]:
    """The rig's key and known-hosts choice, given to disttrain as --ssh-option only."""
    return cluster.cli_ssh_args()


def launcher_argv(cluster, config: str, script: list[str]) -> list[str]:
    """``disttrain run`` for one configuration, to run inside node0."""
    base = [sys.executable, "-m", "disttrain", "run", "--env", "OMP_NUM_THREADS=1"]
    if config == "one_host":  # 1 host x 2 processes, the ordinary local launcher
        return [*base, "-n", "2", *script]
    hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)  # 2 hosts x 1 process
    more = ["--no-preflight"] if config == "two_hosts_no_preflight" else []
    return [*base, "--hosts", hosts, "-n", "1", *ssh_options(cluster), *more, *script]


def check_clean(cluster) -> None:
    """Nothing of a finished job may linger on a node (it would take CPU from the next)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = {node.name: cluster.processes_in(node) for node in cluster.nodes}
        if not any(left.values()):
            return
        time.sleep(0.05)
    raise RuntimeError(f"processes left behind after a job: {left}")


def interleaved(configs: list[str], repeats: int):
    """(repeat, config) pairs; the configurations' order rotates from one repeat to the next,
    so drift on a shared machine and any first/second-in-a-round effect hit all of them."""
    for i in range(repeats):
        shift = i % len(configs)
        for config in configs[shift:] + configs[:shift]:
            yield i, config


# --------------------------------------------------------------------------- measurements


def throughput_once(cluster, config: str, args, env: dict[str, str]) -> dict:
    script = ["--ranks", "0", str(EXAMPLE), "--samples", str(args.samples), "--batch-size",
              str(args.batch_size), "--epochs", "1", "--log-every", "0", "--seed", "0"]
    with noise(cluster) as load:
        start = time.monotonic()
        proc = cluster.run_in("node0", launcher_argv(cluster, config, script), timeout=JOB_TIMEOUT_S,
                              cwd=ROOT, env=env)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{config}: disttrain run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        check_clean(cluster)
    summary = last_json(proc.stdout)
    if summary["world_size"] != 2:
        raise RuntimeError(f"{config}: world size {summary['world_size']}, expected 2")
    return {"samples_per_s": summary["train_samples_per_s"], "epoch_s": summary["epoch_seconds"][0],
            "job_wall_s": wall, "train_loss": summary["train_loss"], **load}


def launch_once(cluster, config: str, env: dict[str, str]) -> dict:
    argv = launcher_argv(cluster, config, [str(THIS), "--first-step-worker"])
    events: list[tuple[float, str, str]] = []

    def pump(stream, name: str) -> None:
        for line in iter(stream.readline, ""):
            events.append((time.monotonic(), name, line))

    with noise(cluster) as load:
        start = time.monotonic()
        proc = cluster.popen_in("node0", argv, cwd=ROOT, env=env, text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        pumps = [threading.Thread(target=pump, args=(s, n), daemon=True)
                 for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for p in pumps:
            p.start()
        try:
            code = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"{config}: no end within {JOB_TIMEOUT_S} s") from None
        end = time.monotonic()
        for p in pumps:
            p.join(timeout=5)
        text = "".join(line for _, _, line in events)
        if code != 0:
            raise RuntimeError(f"{config}: disttrain run exited {code}:\n{text[-3000:]}")
        check_clean(cluster)
    banner = next(t for t, name, line in events if name == "stderr" and line.startswith("disttrain: "))
    marks = [(t, json.loads(line.split(MARKER, 1)[1])) for t, _, line in events if MARKER in line]
    if len(marks) != 2:
        raise RuntimeError(f"{config}: expected 2 marker lines, got {len(marks)}:\n{text[-3000:]}")
    ranks = [m for _, m in marks]
    return {
        "first_step_s": marks[0][0] - start,  # a rank's first-step line reaches the terminal
        "planned_s": banner - start,          # probe (+ preflight) done, agents about to start
        "ranks_started_s": max(r["started"] for r in ranks) - start,
        "torch_imported_s": max(r["imported"] for r in ranks) - start,
        "joined_s": max(r["joined"] for r in ranks) - start,  # disttrain.init() returned
        "ddp_built_s": max(r["prepared"] for r in ranks) - start,
        "stepped_s": max(r["stepped"] for r in ranks) - start,
        "exited_s": end - start,              # disttrain run exited
        **load,
    }


def ssh_once(cluster, what: str) -> float:
    cmd = ["true"] if what == "true" else [
        sys.executable, "-m", "disttrain", "probe", "--master", cluster.nodes[0].ip, "--port", "29500"]
    start = time.monotonic()
    proc = cluster.ssh("node1", *cmd, timeout=60)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"ssh node1 {' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return elapsed


# --------------------------------------------------------------------------- summaries


def r3(value: float) -> float:
    return round(value, 3)


def medians(runs: list[dict], keys) -> dict:
    return {key: r3(statistics.median(run[key] for run in runs)) for key in keys}


def summarize(results: dict[str, list[dict]], keys: list[str], quiet_cores: float) -> dict:
    """Per configuration: every repeat's figures, medians, and medians of the quiet repeats."""
    out = {}
    for config, runs in results.items():
        quiet = [run for run in runs if run["others_cores"] <= quiet_cores]
        out[config] = {
            "per_repeat": {key: [r3(run[key]) for run in runs] for key in runs[0]},
            "median": medians(runs, keys),
            "quiet_repeats": len(quiet),
            "quiet_median": medians(quiet, keys) if quiet else None,
        }
    return out


def ratio(summary: dict, a: str, b: str, key: str, which: str = "median") -> float | None:
    if summary[a][which] is None or summary[b][which] is None:
        return None
    return r3(summary[a][which][key] / summary[b][which][key])


def bench(cluster, args, env: dict[str, str]) -> dict:
    def log(msg: str) -> None:
        if not args.quiet:
            print(f"multinode: {msg}", file=sys.stderr, flush=True)

    ssh: dict[str, list[float]] = {"true": [], "probe": []}
    for _, what in interleaved(list(ssh), args.ssh_repeats):
        ssh[what].append(ssh_once(cluster, what))
    log(f"ssh node1 true: {statistics.median(ssh['true']):.3f} s; "
        f"ssh node1 disttrain probe: {statistics.median(ssh['probe']):.3f} s")

    for _, config in interleaved(LAUNCH_CONFIGS, args.warmup):
        launch_once(cluster, config, env)  # page cache, sshd, bytecode: not measured

    tp: dict[str, list[dict]] = {c: [] for c in TP_CONFIGS}
    order = []
    for i, config in interleaved(TP_CONFIGS, args.repeats):
        run = throughput_once(cluster, config, args, env)
        tp[config].append(run)
        order.append(config)
        log(f"throughput {i} {config}: {run['samples_per_s']:.0f} samples/s "
            f"(others used {run['others_cores']:.2f} cores)")

    launch: dict[str, list[dict]] = {c: [] for c in LAUNCH_CONFIGS}
    for i, config in interleaved(LAUNCH_CONFIGS, args.launch_repeats):
        run = launch_once(cluster, config, env)
        launch[config].append(run)
        log(f"launch {i} {config}: first step at {run['first_step_s']:.2f} s "
            f"(others used {run['others_cores']:.2f} cores)")

    tp_sum = summarize(tp, ["samples_per_s", "epoch_s", "job_wall_s", "others_cores"], args.quiet_cores)
    for config, runs in tp.items():
        tp_sum[config]["best_samples_per_s"] = round(max(run["samples_per_s"] for run in runs), 1)
    launch_keys = [k for k in launch["one_host"][0] if k.endswith("_s")] + ["others_cores"]
    launch_sum = summarize(launch, launch_keys, args.quiet_cores)
    first = {c: launch_sum[c]["median"]["first_step_s"] for c in LAUNCH_CONFIGS}
    return {
        "throughput": {
            **tp_sum,
            "order": order,
            "same_train_loss": len({run["train_loss"] for runs in tp.values() for run in runs}) == 1,
            "ratio_two_hosts_over_one_host": ratio(tp_sum, "two_hosts", "one_host", "samples_per_s"),
            "quiet_ratio": ratio(tp_sum, "two_hosts", "one_host", "samples_per_s", "quiet_median"),
            "best_ratio": r3(tp_sum["two_hosts"]["best_samples_per_s"] / tp_sum["one_host"]["best_samples_per_s"]),
            "goal": ">= 0.95",
        },
        "launch": {
            **launch_sum,
            "first_step_ratio_two_hosts_over_one_host": ratio(launch_sum, "two_hosts", "one_host", "first_step_s"),
            "first_step_extra_s_two_hosts": r3(first["two_hosts"] - first["one_host"]),
            "first_step_quiet_ratio": ratio(launch_sum, "two_hosts", "one_host", "first_step_s", "quiet_median"),
            "first_step_ratio_no_preflight_over_one_host":
                ratio(launch_sum, "two_hosts_no_preflight", "one_host", "first_step_s"),
            "first_step_extra_s_no_preflight": r3(first["two_hosts_no_preflight"] - first["one_host"]),
        },
        "ssh": {
            "true_s": [r3(v) for v in ssh["true"]],
            "probe_s": [r3(v) for v in ssh["probe"]],
            "true_median_s": r3(statistics.median(ssh["true"])),
            "probe_median_s": r3(statistics.median(ssh["probe"])),
        },
    }


# --------------------------------------------------------------------------- main


def versions() -> dict:
    import torch

    import disttrain

    def git(*argv: str) -> str | None:  # read-only: no index refresh, no lock taken
        try:
            proc = subprocess.run(["git", "--no-optional-locks", *argv], capture_output=True, text=True,
                                  cwd=ROOT, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else None

    modified = git("status", "--porcelain", "--", "src", "examples")
    return {"python": platform.python_version(), "torch": torch.__version__,
            "disttrain": disttrain.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_src": None if modified is None else [line[3:] for line in modified.splitlines()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12000, help="generated training images (12000)")
    parser.add_argument("--batch-size", type=int, default=128, help="per process (128)")
    parser.add_argument("--repeats", type=int, default=3, help="throughput jobs per configuration (3)")
    parser.add_argument("--launch-repeats", type=int, default=5, help="launch timings per configuration (5)")
    parser.add_argument("--ssh-repeats", type=int, default=5, help="ssh round trips of each kind (5)")
    parser.add_argument("--warmup", type=int, default=0, help="unmeasured launches per configuration first (0)")
    parser.add_argument("--quiet-cores", type=float, default=0.25,
                        help="a repeat is quiet when the rest of the machine used at most this many cores (0.25)")
    parser.add_argument("--out", help="result file (default bench/results/multinode-<date>-<arch>-<N>cpu.json; "
                        "'-' writes none)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--first-step-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step_worker:
        first_step_worker()
        return 0
    if min(args.repeats, args.launch_repeats, args.ssh_repeats, args.samples, args.batch_size) < 1 or args.warmup < 0:
        parser.error("--repeats, --launch-repeats, --ssh-repeats, --samples and --batch-size must be at least 1")

    sys.path.insert(0, str(ROOT / "tests"))
    from rig import Cluster, RigError, skip_reason

    head = {"bench": "multinode", "date": time.strftime("%Y-%m-%d")}
    reason = skip_reason(install=False)
    if reason:
        print(json.dumps({**head, "skipped": f"{reason} (as root, run tests/rig_setup.sh)"}))
        return 0

    head.update({
        "host": platform.node(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        **versions(),
        "loadavg_at_start": [round(v, 2) for v in os.getloadavg()],
        "config": {
            "one_host": "disttrain run -n 2: 1 host x 2 processes over loopback (inside node0)",
            "two_hosts": "disttrain run --hosts node0,node1 -n 1: 2 hosts x 1 process, ssh, veth",
            "two_hosts_no_preflight": "the same with --no-preflight (launch timing only)",
            "samples": args.samples,
            "batch_size_per_process": args.batch_size,
            "global_batch_size": 2 * args.batch_size,
            "omp_num_threads": 1,
            "repeats": args.repeats,
            "launch_repeats": args.launch_repeats,
            "ssh_repeats": args.ssh_repeats,
            "warmup": args.warmup,
            "quiet_cores": args.quiet_cores,
        },
    })
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="disttrain-bench-") as home:
        env = dict(os.environ, DISTTRAIN_HOME=home)  # run folders go away with the bench
        for key in ("DISTTRAIN_CHECKPOINT_DIR", "DISTTRAIN_CHECKPOINT_EVERY"):
            env.pop(key, None)  # the example would checkpoint (and resume) from there
        try:
            cluster = Cluster(2).start()
        except RigError as err:
            print(json.dumps({**head, "skipped": f"rig: the cluster did not start: {err}"}))
            return 0
        with cluster:
            head["rig_up_s"] = r3(cluster.timings["up_s"])
            result = {**head, **bench(cluster, args, env)}
    result["bench_wall_s"] = round(time.monotonic() - started, 1)
    result["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]

    if args.out != "-":
        out = Path(args.out) if args.out else (
            ROOT / "bench" / "results" / f"multinode-{result['date']}-{result['machine']}-{result['cpus']}cpu.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
