"""The example resumed for real: 2 ranks over gloo under ``disttrain run``, killed with
SIGKILL or preempted with SIGTERM, end with a ``model.pt`` byte-for-byte equal to the run
that never stopped. The short version of ``bench/chaos.py``, whose launcher it uses."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from _launch import kill_tree, launch_argv, run_ranks, run_single, worker_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mnist_convnet.py"


def load_chaos():
    spec = importlib.util.spec_from_file_location("disttrain_bench_chaos", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


chaos = load_chaos()
# 640 images on 2 ranks, 32 a batch: 10 steps an epoch, 20 in all; a checkpoint every 3.
CONFIG = chaos.Config(samples=640, epochs=2, batch_size=32, every=3, run_timeout_s=150)


def finished(run) -> int:
    code = run.finish()
    assert not chaos.leftovers(), "a launcher or worker outlived its run"
    return code


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    """model.pt of the run that never stopped (and wrote no checkpoints)."""
    out = tmp_path_factory.mktemp("reference")
    run = chaos.Run(CONFIG, out, None)
    assert finished(run) == 0, run.output[-3000:]
    return (out / "model.pt").read_bytes()


@pytest.mark.timeout(300)
def test_sigkilled_rank_is_restarted_and_ends_bit_exact(reference, tmp_path):
    run = chaos.Run(CONFIG, tmp_path / "out", tmp_path / "ckpt", restarts=1)
    assert run.wait_for_steps(13), run.output[-3000:]  # in the second epoch
    run.workers()[1].kill()
    assert finished(run) == 0, run.output[-3000:]
    assert chaos.resumed_from(run.output), run.output[-3000:]  # from a checkpoint, not step 0
    assert (tmp_path / "out" / "model.pt").read_bytes() == reference


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> tuple[Path, object]:
    """A run stopped by SIGTERM to the launcher, as a scheduler preempts a job."""
    work = tmp_path_factory.mktemp("preempted")
    run = chaos.Run(CONFIG, work / "out", work / "ckpt")
    assert run.wait_for_steps(5), run.output[-3000:]
    run.proc.send_signal(signal.SIGTERM)
    run.code = finished(run)
    shutil.copytree(work / "ckpt", work / "ckpt-copy")  # for the world-size test
    return work, run


@pytest.mark.timeout(300)
def test_sigterm_saves_the_step_and_the_next_run_resumes_bit_exact(reference, preempted):
    work, run = preempted
    assert run.code == 143, run.output[-3000:]
    assert "[rank0] disttrain: SIGTERM: stopped after step" in run.output
    stopped_at = int(run.output.split("SIGTERM: stopped after step ")[1].split(",")[0])
    assert (work / "ckpt" / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    again = chaos.Run(CONFIG, work / "out", work / "ckpt")
    assert finished(again) == 0, again.output[-3000:]
    assert chaos.resumed_from(again.output) == [stopped_at]
    assert (work / "out" / "model.pt").read_bytes() == reference


@pytest.mark.timeout(120)
def test_sigterm_spares_dataloader_workers_until_the_step_is_saved(tmp_path):
    """The agent signals each worker's process group; torch would let the DataLoader
    workers die of it, crashing their rank in the middle of the step."""
    config = dataclasses.replace(CONFIG, num_workers=1)
    run = chaos.Run(config, tmp_path / "out", tmp_path / "ckpt")
    assert run.wait_for_steps(5), run.output[-3000:]
    run.proc.send_signal(signal.SIGTERM)
    assert finished(run) == 143, run.output[-3000:]
    assert "[rank0] disttrain: SIGTERM: stopped after step" in run.output
    assert "DataLoader worker" not in run.output


@pytest.mark.timeout(120)
def test_other_world_size_resumes_with_a_warning(preempted, tmp_path):
    work, _ = preempted
    args = ["--samples", CONFIG.samples, "--epochs", CONFIG.epochs, "--batch-size", CONFIG.batch_size,
            "--log-every", "0", "--checkpoint-dir", work / "ckpt-copy", "--output-dir", tmp_path]
    result = run_single(EXAMPLE, args, timeout=110)  # a world of one
    assert result.returncode == 0, result.stderr[-3000:]
    assert "saved by 2 ranks and is resumed by 1" in result.stderr
    assert "cannot be bit-for-bit the run that never stopped" in result.stderr
    assert (tmp_path / "model.pt").is_file()


SHARDED_TRAIN = Path(__file__).parent / "scripts" / "sharded_train.py"


def logged_steps(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob("rank*.jsonl")) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_more_ranks_resume_the_epoch_repeating_only_padding(tmp_path):
    """1 rank saves after 40 of the epoch's 64 samples; 3 ranks train the other 24, 8 each.
    Before: each new rank started at position 40 // 3 = 13 of its shard, so rank 0 trained
    the sample at position 39 a second time, beyond the sampler's padding."""
    common = ["--strategy", "ddp", "--ckpt", tmp_path / "ckpt", "--every", "5", "--dropout", "0"]
    one = run_single(SHARDED_TRAIN, [tmp_path / "one", *common, "--die-at", "12"], timeout=150)
    assert one.returncode != 0 and checkpoint_steps(tmp_path / "ckpt") == [5, 10]
    three = run_ranks(SHARDED_TRAIN, 3, [tmp_path / "three", *common], timeout=200)
    assert three.returncode == 0, three.stderr[-3000:]
    assert "resuming from step 10" in three.stderr
    before = [s for s in logged_steps(tmp_path / "one") if s["step"] < 10]
    after = logged_steps(tmp_path / "three")
    seen = Counter(i for s in before + after if s["epoch"] == 0 for i in s["idx"])
    assert set(seen) == set(range(64))  # none skipped
    padding = -(64 - 40) % 3  # what the rest of the epoch needs to divide among 3 ranks: none here
    assert sum(seen.values()) - 64 <= padding, [i for i, n in seen.items() if n > 1]
    assert sorted(s["step"] for s in after if s["epoch"] == 0) == [10] * 3 + [11] * 3  # 8 samples each: 2 steps


def ctrl_c(out: Path, *args) -> subprocess.CompletedProcess:
    """Press Ctrl-C in a terminal running 2 ranks of a long run: SIGINT to the launcher's
    process group, once rank 0 has logged a few steps."""
    argv = launch_argv(SHARDED_TRAIN, 2, [out, "--strategy", "ddp", "--epochs", "1000", *args])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        log = out / "rank0.jsonl"
        while not (log.is_file() and len(log.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.timeout(300)
def test_ctrl_c_saves_like_sigterm_and_says_so_in_one_line(tmp_path):
    """Before: each rank printed a ~40-line KeyboardInterrupt traceback, and nothing was saved."""
    ckpt = tmp_path / "ckpt"
    result = ctrl_c(tmp_path / "out", "--ckpt", ckpt, "--every", "1000")
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("[rank")]
    stopped_at = int(line.split("stopped after step ")[1].split(",")[0])
    assert line == (f"[rank0] disttrain: Ctrl-C (SIGINT): stopped after step {stopped_at}, saved in {ckpt}; "
                    "exiting with 130, the next run resumes there")
    assert checkpoint_steps(ckpt) == [stopped_at]


@pytest.mark.timeout(300)
def test_ctrl_c_without_checkpoints_is_one_line_per_rank(tmp_path):
    result = ctrl_c(tmp_path / "out")
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    lines = sorted(x for x in result.stderr.splitlines() if x.startswith("[rank"))
    assert [x.split(" at ")[0] for x in lines] == [
        f"[rank{r}] disttrain: rank {r}: interrupted by Ctrl-C (SIGINT)" for r in (0, 1)], lines
    assert all(x.endswith(", without saving a checkpoint") and "sharded_train.py:" in x for x in lines)


def checkpoint_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name[len("step_"):]) for p in ckpt.iterdir())


RESTARTS = 3


@pytest.mark.timeout(60 * RESTARTS)
def test_restarted_group_joins_again_every_time(tmp_path):
    """torch's agent keeps its store across restarts and env:// adds no per-attempt prefix,
    so a restarted group used to read the old attempt's addresses ("Connection refused")
    about every second time; disttrain.init() joins under a prefix of the attempt's own."""
    script = Path(__file__).parent / "scripts" / "restart_once.py"
    for run in range(RESTARTS):
        out = tmp_path / str(run)
        out.mkdir()
        argv = [sys.executable, "-m", "disttrain", "run", "-n", "2", "--max-restarts", "1", str(script), str(out)]
        result = subprocess.run(argv, capture_output=True, text=True, env=worker_env(), timeout=55)
        assert result.returncode == 0, f"run {run}: exit {result.returncode}\n{result.stderr[-3000:]}"
        assert sorted(p.name for p in out.iterdir()) == [
            "attempt0_rank0", "attempt0_rank1", "attempt1_rank0", "attempt1_rank1"]
    assert not chaos.leftovers()
