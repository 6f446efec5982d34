"""Kill training runs at random moments; check that each resumes to the same bits.

    python bench/chaos.py                  # 8 trials, about 2 minutes on 2 cores
    python bench/chaos.py --trials 12 --seed 3

First an uninterrupted run of ``examples/mnist_convnet.py`` (2 ranks over gloo, no
checkpoints) gives the reference ``model.pt``. Then each trial runs the same training with
``--checkpoint-dir`` under ``disttrain run --max-restarts 1`` and interrupts it once, in
turn:

- ``sigkill-rank``: SIGKILL to a random rank a random moment after a random step; the
  elastic agent restarts the group, which resumes from the newest complete checkpoint.
- ``sigkill-during-write``: SIGKILL to rank 0 (the writer) as soon as the temporary
  directory of a random checkpoint appears; the half-written one must never be loaded.
- ``sigterm-launcher``: SIGTERM to ``disttrain run`` (a preemption): the ranks finish the
  step, save it and exit (the launcher with 143); a second ``disttrain run`` resumes.
- ``sigterm-rank``: SIGTERM to one rank only: all ranks agree to stop at the same step,
  save, exit 143, and the agent restarts them.

A trial is *completed* when the last run exits 0 with a ``model.pt`` and *bit-exact* when
that file's bytes equal the reference's. Prints one JSON object and writes it to
bench/results/chaos-<date>-<machine>-<cpus>cpu.json (``--no-save`` skips that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _launch import kill_tree  # noqa: E402  (the tests' own: launcher and every worker session)

EXAMPLE = ROOT / "examples" / "mnist_convnet.py"
KINDS = ("sigkill-rank", "sigkill-during-write", "sigterm-launcher", "sigterm-rank")
PREEMPTED_EXIT = 143
_JOB_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"}
_STEP_LINE = re.compile(r"^\[rank0\] epoch (\d+) step (\d+)/(\d+) ")


@dataclass(frozen=True)
class Config:
    nproc: int = 2
    samples: int = 1200
    epochs: int = 2
    batch_size: int = 32
    every: int = 4
    num_workers: int = 0
    run_timeout_s: float = 240

    @property
    def steps_per_epoch(self) -> int:
        per_rank = -(-self.samples // self.nproc)  # DistributedSampler pads
        return -(-per_rank // self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs


class Run:
    """One ``disttrain run`` of the example, its output collected as it comes."""

    def __init__(self, cfg: Config, out: Path, ckpt: Path | None, *, restarts: int = 0) -> None:
        argv = [sys.executable, "-m", "disttrain", "run", "-n", str(cfg.nproc),
                "--max-restarts", str(restarts), str(EXAMPLE),
                "--samples", str(cfg.samples), "--epochs", str(cfg.epochs),
                "--batch-size", str(cfg.batch_size), "--num-workers", str(cfg.num_workers),
                "--log-every", "1", "--output-dir", str(out)]
        if ckpt is not None:
            argv += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(cfg.every)]
        # An outer job's placement or checkpoint settings must not leak into this one.
        env = {k: v for k, v in os.environ.items() if k not in _JOB_VARS
               and (not k.startswith("DISTTRAIN_") or k == "DISTTRAIN_HOME")}
        env.setdefault("OMP_NUM_THREADS", "1")
        self.started = time.monotonic()
        self.deadline = self.started + cfg.run_timeout_s
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.steps_done = 0  # as rank 0 last logged
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = _STEP_LINE.match(line)
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                if match:
                    epoch, step, per_epoch = map(int, match.groups())
                    self.steps_done = max(self.steps_done, epoch * per_epoch + step + 1)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_steps(self, steps: int) -> bool:
        """Block until rank 0 logged ``steps`` finished steps; False if the run ended first."""
        with self._changed:
            while self.steps_done < steps:
                if self.proc.poll() is not None or time.monotonic() > self.deadline:
                    return False
                self._changed.wait(0.2)
        return True

    def workers(self) -> dict[int, psutil.Process]:
        """The training processes by rank (the launcher's children; not their DataLoader workers)."""
        found = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None:
                found[int(rank)] = child
        return found

    def finish(self) -> int:
        """Wait for the launcher (killing its tree past the deadline); its exit code."""
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            code = self.proc.wait()
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def leftovers() -> list[int]:
    """Processes of ours still running (each trial must leave none)."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child.pid)
        except psutil.Error:
            pass
    return alive


def resumed_from(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"resuming from step (\d+)", output)]


def trial(kind: str, cfg: Config, work: Path, chooser: random.Random) -> dict:
    """Run the example once with checkpoints, interrupt it as ``kind`` says, finish it."""
    out, ckpt = work / "out", work / "ckpt"
    record: dict = {"kind": kind}
    start = time.monotonic()
    run = Run(cfg, out, ckpt, restarts=1)
    if kind in ("sigkill-rank", "sigterm-rank", "sigterm-launcher"):
        at = chooser.randint(1, cfg.total_steps - 1)
        rank = chooser.randrange(cfg.nproc)
        delay = chooser.uniform(0, 0.05)  # somewhere inside the next step
        record.update(after_step=at, delay_s=round(delay, 3))
        if run.wait_for_steps(at):
            time.sleep(delay)
            if kind == "sigterm-launcher":
                run.proc.send_signal(signal.SIGTERM)
            else:
                record["rank"] = rank
                sig = signal.SIGKILL if kind == "sigkill-rank" else signal.SIGTERM
                worker = run.workers().get(rank)
                if worker is not None:
                    worker.send_signal(sig)
                    record["signalled"] = True
    elif kind == "sigkill-during-write":
        # Not the first checkpoint: the run must fall back to the one before it.
        target = cfg.every * chooser.randint(2, max(2, cfg.total_steps // cfg.every - 1))
        record["checkpoint"] = target
        record["landed_mid_write"] = _kill_while_writing(run, ckpt, target)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    codes = [run.finish()]
    outputs = [run.output]
    if kind == "sigterm-launcher":
        record["preempted_message"] = "SIGTERM: stopped after step" in run.output
        if codes[0] == PREEMPTED_EXIT:  # the next run resumes
            again = Run(cfg, out, ckpt, restarts=1)
            codes.append(again.finish())
            outputs.append(again.output)
    output = "\n".join(outputs)
    record.update(
        exit_codes=codes,
        resumed_from=resumed_from(output),
        seconds=round(time.monotonic() - start, 1),
        model_sha256=sha256(out / "model.pt"),
        completed=codes[-1] == 0 and (out / "model.pt").is_file(),
    )
    record["output_tail"] = output[-1500:]
    return record


def _kill_while_writing(run: Run, ckpt: Path, step: int) -> bool:
    """SIGKILL rank 0 once the temporary directory of checkpoint ``step`` exists; whether
    the kill landed before the rename that would have published it."""
    prefix = f".tmp-step_{step:08d}-"
    final = ckpt / f"step_{step:08d}" / "COMPLETE"
    while run.proc.poll() is None and time.monotonic() < run.deadline:
        try:
            names = os.listdir(ckpt)
        except FileNotFoundError:
            names = []
        if any(name.startswith(prefix) for name in names):
            writer = run.workers().get(0)
            if writer is None:
                return False
            writer.kill()
            try:
                writer.wait(10)
            except psutil.Error:
                pass
            return not final.exists()
        if final.exists():  # written faster than we looked: the kill would come too late
            return False
        time.sleep(0.0005)
    return False


def plan(trials: int, chooser: random.Random) -> list[str]:
    """Every kind at least once (when there are enough trials), the rest SIGKILLs of a rank."""
    kinds = list(KINDS[:trials]) + ["sigkill-rank"] * max(0, trials - len(KINDS))
    chooser.shuffle(kinds)
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="for the kinds, steps, ranks chosen")
    parser.add_argument("--samples", type=int, default=Config.samples)
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    parser.add_argument("--batch-size", type=int, default=Config.batch_size)
    parser.add_argument("--every", type=int, default=Config.every, help="steps between checkpoints")
    parser.add_argument("--num-workers", type=int, default=Config.num_workers)
    parser.add_argument("--no-save", action="store_true", help="print only; write no result file")
    args = parser.parse_args()
    cfg = Config(samples=args.samples, epochs=args.epochs, batch_size=args.batch_size,
                 every=args.every, num_workers=args.num_workers)
    chooser = random.Random(args.seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="disttrain-chaos-") as tmp:
        reference = Run(cfg, Path(tmp) / "reference", None)
        if reference.finish() != 0:
            sys.stderr.write(reference.output[-3000:] + "\nthe uninterrupted run failed\n")
            return 1
        expected = sha256(Path(tmp) / "reference" / "model.pt")
        records = []
        for i, kind in enumerate(plan(args.trials, chooser)):
            work = Path(tmp) / f"trial{i}"
            work.mkdir()
            record = trial(kind, cfg, work, chooser)
            record["bit_exact"] = record["completed"] and record["model_sha256"] == expected
            record["leftover_pids"] = leftovers()
            for pid in record["leftover_pids"]:
                kill_tree(pid)
            if record["bit_exact"]:
                del record["output_tail"]
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "output_tail"}),
                  file=sys.stderr, flush=True)
    by_kind = {
        kind: {
            "trials": sum(r["kind"] == kind for r in records),
            "completed": sum(r["kind"] == kind and r["completed"] for r in records),
            "bit_exact": sum(r["kind"] == kind and r["bit_exact"] for r in records),
        }
        for kind in KINDS if any(r["kind"] == kind for r in records)
    }
    result = {
        "bench": "chaos",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "config": {**asdict(cfg), "steps_per_epoch": cfg.steps_per_epoch,
                   "max_restarts": 1, "seed": args.seed},
        "reference_sha256": expected,
        "trials": len(records),
        "completed": sum(r["completed"] for r in records),
        "bit_exact": sum(r["bit_exact"] for r in records),
        "kinds": by_kind,
        "write_kills_landed_mid_write": sum(bool(r.get("landed_mid_write")) for r in records),
        "processes_left_behind": sum(len(r["leftover_pids"]) for r in records),
        "seconds": round(time.monotonic() - started, 1),
        "runs": records,
    }
    if not args.no_save:
        name = f"chaos-{result['date']}-{result['machine']}-{result['cpus']}cpu.json"
        (ROOT / "bench" / "results" / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0 if result["bit_exact"] == result["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
