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
under the same load; ``--ssh`` adds the same timeline over ssh on two namespace hosts
(:func:`over_ssh`), outside the goal's geometric mean.

Prints one JSON object and writes it to bench/results/torchrun-compare-<date>-<machine>-<n>cpu.json
(``--out`` to choose).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shlex
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


def timed(argv: list[str] | list[list[str]], env: dict[str, str]) -> tuple[float, float, dict[str, float]]:
    """(wall seconds, CPU seconds of the launcher and everything it started, the timeline): the CPU
    time is what the launcher itself costs, less disturbed by the other load of a shared machine.

    The timeline, on the monotonic clock every process shares: the launcher's start to the first
    worker's first line (the launcher's start-up, the rendezvous, the workers' interpreter start),
    the workers' import of torch and group join (the last to join), their work, and the last
    worker's end to the launcher's exit (its teardown: where an idle wait at the end would show).
    ``argv``: one command, or several started at once (torchrun by hand on each host), timed
    until the last has exited; ``{stamps}`` in an argument is the folder the workers write to.
    """
    argvs = [argv] if isinstance(argv[0], str) else argv
    with tempfile.TemporaryDirectory(prefix="stamps-") as stamps:
        os.chmod(stamps, 0o755)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        procs = [subprocess.Popen([a.replace("{stamps}", stamps) for a in one], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                  env={**env, "BENCH_STAMPS": stamps}, cwd=ROOT) for one in argvs]
        while any(proc.poll() is None for proc in procs) and not any(proc.returncode for proc in procs):
            time.sleep(0.005)  # one failed (torchrun by hand): the others would wait for it for ever
        end = time.monotonic()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        outs = [proc.communicate(timeout=600) for proc in procs]
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        for one, proc, (_, err) in zip(argvs, procs, outs):
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(one)} failed ({proc.returncode}):\n{err[-3000:]}")
        ranks = [tuple(map(float, path.read_text().split())) for path in Path(stamps).iterdir()]
    first, joined, last = min(r[0] for r in ranks), max(r[1] for r in ranks), max(r[2] for r in ranks)
    timeline = dict(zip(PHASES, (first - start, joined - first, last - joined, end - last)))
    return end - start, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), timeline


SSH_SET = "ssh-two-hosts"


def over_ssh(repeats: int, py: str, env: dict[str, str]) -> dict:
    """Two namespace hosts of tests/rig.py (needs root), one rank each: ``disttrain run --hosts`` in
    the first against torchrun started by hand on each host over ssh (torchrun has no launcher of
    several hosts; static master), interleaved, with the same timeline (the hosts share this
    machine's clock and /tmp). The CPU time is only what ran here (the ssh clients, disttrain's
    launcher), not the hosts' sshd sessions."""
    sys.path.insert(0, str(ROOT / "tests"))
    from rig import Cluster, RigError, skip_reason

    reason = skip_reason(install=False)
    if reason:
        return {"skipped": f"{reason} (as root, run tests/rig_setup.sh)"}
    try:
        cluster = Cluster(2).start()
    except RigError as err:
        return {"skipped": f"rig: the cluster did not start: {err}"}
    with cluster:
        first = cluster.nodes[0]
        path = shlex.quote(env.get("PYTHONPATH", ""))

        def torchrun() -> list[list[str]]:
            port = free_port()
            return [cluster.ssh_argv(node, f"cd {shlex.quote(str(ROOT))} && exec env OMP_NUM_THREADS=1 "
                                           f"GLOO_SOCKET_IFNAME={node.ifname} BENCH_STAMPS={{stamps}} PYTHONPATH={path} {shlex.quote(py)} -m "
                                           f"torch.distributed.run --nnodes 2 --node-rank {k} --nproc-per-node 1 "
                                           f"--master-addr {first.ip} --master-port {port} {TRIVIAL}")
                    for k, node in enumerate(cluster.nodes)]

        def disttrain() -> list[list[str]]:
            hosts = ",".join(f"root@{node.ip}" for node in cluster.nodes)
            return [cluster.ns_exec(first, [py, "-m", "disttrain", "run", "--hosts", hosts, "-n", "1",
                                            "--env", "OMP_NUM_THREADS=1", "--env", "BENCH_STAMPS={stamps}",
                                            *cluster.cli_ssh_args(), TRIVIAL])]

        launchers = {"torchrun": torchrun, "disttrain": disttrain}
        times: dict[str, list[float]] = {who: [] for who in launchers}
        cpu: dict[str, list[float]] = {who: [] for who in launchers}
        lines: dict[str, list[dict[str, float]]] = {who: [] for who in launchers}
        for k in range(repeats):
            for who in (list(launchers) if k % 2 == 0 else list(reversed(launchers))):
                wall, used, timeline = timed(launchers[who](), env)
                cluster.assert_nothing_left(timeout=20)  # and nothing of it takes CPU from the next
                times[who].append(wall)
                cpu[who].append(used)
                lines[who].append(timeline)
    figures = summary(times, cpu, lines, "disttrain")
    figures.pop("cpu_ratio")  # the hosts' work ran under their sshd, not here: not a ratio of launchers
    return {
        "options": "disttrain run --hosts node0,node1 -n 1 (preflight included) vs torchrun --nnodes 2 "
                   "--node-rank K --nproc-per-node 1 --master-addr node0 on each host over ssh",
        "torchrun_s": [round(t, 2) for t in times["torchrun"]],
        "torchrun_median_s": round(statistics.median(times["torchrun"]), 3),
        "torchrun_cpu_s": [round(t, 2) for t in cpu["torchrun"]],
        "torchrun_timeline_median_s": {phase: round(statistics.median(t[phase] for t in lines["torchrun"]), 3)
                                       for phase in PHASES},
        **figures,
    }


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
    parser.add_argument("--ssh", action="store_true",
                        help=f"also {SSH_SET}: two namespace hosts over ssh (tests/rig.py, root), "
                             "disttrain run --hosts against torchrun by hand on each")
    parser.add_argument("--out", help="the JSON file to write (default: bench/results/torchrun-compare-<date>-...)")
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
            print(f"torchrun-compare: {name} ... ({args.repeats} repeats)", file=sys.stderr, flush=True)
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
            write(args, load_before, results)  # a bound that stops the bench keeps the sets done
            print(f"torchrun-compare: {name} done: ratio {results[name].get('ratio')}", file=sys.stderr, flush=True)
    if args.ssh and (not args.only or SSH_SET in args.only):
        print(f"torchrun-compare: {SSH_SET} ...", file=sys.stderr, flush=True)
        results[SSH_SET] = over_ssh(args.repeats, py, env)
    print(json.dumps(write(args, load_before, results)))


def write(args: argparse.Namespace, load_before: tuple[float, ...], results: dict[str, dict]) -> dict:
    """The result as it stands, written to its file; returned."""
    ratios = [r["ratio"] for name, r in results.items() if name != SSH_SET]  # the goal: one host
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
        "cpu_ratio_geomean": geomean([r["cpu_ratio"] for r in results.values() if "cpu_ratio" in r]),
        "goal": "ratio <= 1.05 and cpu_ratio <= 1.05",
        **({"baseline_src": args.baseline_src,
            "baseline_ratio_geomean": geomean([r["baseline_ratio"] for r in results.values() if "baseline_ratio" in r]),
            "baseline_cpu_ratio_geomean": geomean([r["baseline_cpu_ratio"] for r in results.values()
                                                   if "baseline_cpu_ratio" in r])}
           if args.baseline_src else {}),
    }
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"torchrun-compare-{result['date']}-{result['machine']}-{result['cpus']}cpu.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
