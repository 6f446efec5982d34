"""FSDP, mixed precision, accumulation and sharded checkpoints, for real: 2 ranks over gloo
under ``disttrain run`` (and 1 rank as plain python), driving scripts/sharded_train.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _launch import run_ranks, run_single

SCRIPT = Path(__file__).parent / "scripts" / "sharded_train.py"


# torch's FSDP2 records events on the device's streams; CPU streams can from torch 2.7 (tests/test_compat.py).
fsdp_on_cpu = pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"),
                                 reason="FSDP2 on the CPU needs torch 2.7: refused in one line (tests/test_compat.py)")


def train(nproc: int, out: Path, *args, timeout: float = 150) -> subprocess.CompletedProcess:
    argv = [out, *args]
    if nproc == 1:
        return run_single(SCRIPT, argv, timeout=timeout)
    return run_ranks(SCRIPT, nproc, argv, timeout=timeout)


def steps(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


def model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def assert_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **tol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def fsdp_one_epoch(tmp_path_factory) -> Path:
    """The output folder of 2 FSDP ranks in float32, 1 epoch without dropout: what DDP and bf16 are
    compared with (made once, read only)."""
    out = tmp_path_factory.mktemp("fsdp-one-epoch") / "out"
    assert_ok(train(2, out, "--strategy", "fsdp", "--epochs", "1", "--dropout", "0"))
    return out


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """``never_stopped(strategy)``: model.pt of 2 ranks of that strategy that never stopped (2 epochs, the
    defaults), what a killed and resumed run must equal bit for bit; made once per strategy, when first asked."""
    made: dict[str, dict[str, torch.Tensor]] = {}

    def of(strategy: str) -> dict[str, torch.Tensor]:
        if strategy not in made:
            out = tmp_path_factory.mktemp(f"reference-{strategy}")
            assert_ok(train(2, out, "--strategy", strategy))
            made[strategy] = model(out)
        return made[strategy]

    return of


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """``killed(strategy)``: the folder of a 2-rank run of that strategy saving synchronously every 3 steps,
    its rank 0 SIGKILLed after step 10 (in the second epoch): ``out`` (the ranks' logs) and ``ckpt``
    (steps 3, 6, 9, checked). Made once per strategy, when first asked; tests copy what they change."""
    made: dict[str, Path] = {}

    def of(strategy: str) -> Path:
        if strategy not in made:
            work = tmp_path_factory.mktemp(f"killed-{strategy}")
            result = train(2, work / "out", "--strategy", strategy, "--ckpt", work / "ckpt", "--every", "3",
                           "--die-at", "11")  # step 9 is saved
            assert result.returncode != 0
            assert sorted(p.name for p in (work / "ckpt").iterdir()) == [
                "step_00000003", "step_00000006", "step_00000009"]
            made[strategy] = work
        return made[strategy]

    return of


@pytest.mark.timeout(300)
def test_fsdp_and_ddp_reach_the_same_loss(tmp_path, fsdp_one_epoch):
    runs = {"ddp": tmp_path / "ddp", "fsdp": fsdp_one_epoch}
    assert_ok(train(2, runs["ddp"], "--strategy", "ddp", "--epochs", "1", "--dropout", "0"))
    ddp, fsdp = steps(runs["ddp"]), steps(runs["fsdp"])
    assert len(ddp) == len(fsdp) == 8
    for a, b in zip(ddp, fsdp):
        assert a["idx"] == b["idx"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert_close(model(runs["ddp"]), model(runs["fsdp"]), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_bf16_fsdp_trains_close_to_float32(tmp_path, fsdp_one_epoch):
    assert_ok(train(2, tmp_path / "bf16", "--strategy", "fsdp", "--epochs", "1", "--dropout", "0",
                    "--precision", "bf16"))
    full, low = steps(fsdp_one_epoch), steps(tmp_path / "bf16")
    assert all(s["dtype"] == "torch.float32" for s in low)  # outputs come back in float32
    assert [s["loss"] for s in low] != [s["loss"] for s in full]  # bf16 did compute
    for a, b in zip(full, low):
        assert b["loss"] == pytest.approx(a["loss"], abs=0.05)
    assert all(v.dtype == torch.float32 for v in model(tmp_path / "bf16").values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulating_4_steps_equals_one_step_of_4x_batch(tmp_path, strategy):
    common = ["--strategy", strategy, "--epochs", "1", "--dropout", "0", "--clip", "0.5"]
    assert_ok(train(2, tmp_path / "acc", *common, "--accumulate", "4", "--batch-size", "2"))
    assert_ok(train(2, tmp_path / "big", *common, "--batch-size", "8"))
    acc, big = steps(tmp_path / "acc"), steps(tmp_path / "big")
    assert len(acc) == 16 and len(big) == 4
    # The 4 micro-batches of each optimizer step are the big batch's samples.
    for i, step in enumerate(big):
        assert sum((s["idx"] for s in acc[4 * i:4 * i + 4]), []) == step["idx"]
        assert acc[4 * i + 3]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-4)
    assert_close(model(tmp_path / "acc"), model(tmp_path / "big"), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=fsdp_on_cpu),
                                      pytest.param("fsdp-async", marks=fsdp_on_cpu)])
def test_sigkill_mid_epoch_then_resume_is_bit_exact(tmp_path, strategy, never_stopped, killed):
    """Synchronous saves: the killed run (steps 3, 6, 9 saved) is the module's ``killed`` one, which other
    tests read too; this test resumes a copy of its checkpoints."""
    strategy, _, mode = strategy.partition("-")
    common = ["--strategy", strategy, "--ckpt", tmp_path / "ckpt", "--every", "3",
              *(["--asynchronous"] if mode == "async" else [])]
    if mode == "async":
        died = train(2, tmp_path / "run", *common, "--die-at", "11")  # step 9 is saved
        assert died.returncode != 0
        saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
        # An asynchronous save is promised done by the next save or the exit, not within two steps:
        # on a loaded machine step 9's may still be a .tmp- folder at the kill (see the held test below).
        assert saved in (["step_00000003", "step_00000006", "step_00000009"], ["step_00000003", "step_00000006"])
    else:
        shutil.copytree(killed(strategy) / "ckpt", tmp_path / "ckpt")
        saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
        assert saved == ["step_00000003", "step_00000006", "step_00000009"]
    again = train(2, tmp_path / "run", *common)
    assert_ok(again)
    assert f"resuming from step {int(saved[-1][5:])}" in again.stderr
    reference, resumed = never_stopped(strategy), model(tmp_path / "run")
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


@pytest.mark.timeout(400)
def test_an_async_save_still_being_written_at_a_kill_resumes_from_the_one_before(tmp_path, never_stopped):
    """The slow save, made certain: rank 0 never commits step 9's checkpoint before its SIGKILL at
    step 11. Nothing half-written is read; the run resumes from step 6, bit for bit."""
    common = ["--strategy", "fsdp", "--ckpt", tmp_path / "ckpt", "--every", "3", "--asynchronous"]
    died = train(2, tmp_path / "run", *common, "--die-at", "11", "--hold-async-save-at", "9")
    assert died.returncode != 0
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert [n for n in names if n.startswith("step_")] == ["step_00000003", "step_00000006"]
    assert any(n.startswith(".tmp-step_00000009-") for n in names)  # the save that was under way
    again = train(2, tmp_path / "run", *common)
    assert_ok(again)
    assert "resuming from step 6" in again.stderr
    reference, resumed = never_stopped("fsdp"), model(tmp_path / "run")
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    assert not any(p.name.startswith(".tmp-step_00000009-") for p in (tmp_path / "ckpt").iterdir())


@pytest.mark.timeout(400)
def test_one_rank_resumes_a_two_rank_fsdp_checkpoint_and_trains_every_sample_once(tmp_path, killed):
    """The 2 ranks killed after step 10 are the module's ``killed("fsdp")`` run; 1 rank resumes a copy."""
    two = killed("fsdp")
    shutil.copytree(two / "ckpt", tmp_path / "ckpt")
    common = ["--strategy", "fsdp", "--ckpt", tmp_path / "ckpt", "--every", "3"]
    one = train(1, tmp_path / "one", *common)
    assert_ok(one)
    assert "saved by 2 ranks and is resumed by 1" in one.stderr
    assert len([line for line in one.stderr.splitlines() if "cannot be bit-for-bit" in line]) == 1
    before = [s for r in (0, 1) for s in steps(two / "out", r) if s["step"] < 9]
    after = steps(tmp_path / "one")
    assert after[0]["step"] == 9
    for epoch in (0, 1):
        seen = [i for s in before + after if s["epoch"] == epoch for i in s["idx"]]
        assert sorted(seen) == list(range(64)), f"epoch {epoch}"
    assert set(model(tmp_path / "one")) >= {"inp.weight", "blocks.3.down.bias", "out.weight"}


def one_line_error(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    # One line per rank (under disttrain run each carries its "[rankN] " prefix).
    lines = {line.split("] ", 1)[-1] for line in result.stderr.splitlines()
             if line.split("] ", 1)[-1].startswith("sharded_train:")}
    lines = sorted(lines)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for word in words:
        assert word in lines[0]
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "words"), [
    (["--strategy", "zero3"], ["unknown strategy", "'fsdp'"]),
    (["--precision", "fp8"], ["unknown precision", "'bf16'"]),
    (["--precision", "fp16"], ["needs a CUDA GPU", "'bf16'"]),
])
def test_bad_options_are_one_line(tmp_path, args, words):
    one_line_error(train(1, tmp_path / "out", *args, "--epochs", "1"), 2, *words)


@pytest.mark.timeout(400)
def test_checkpoint_of_another_strategy_or_model_is_refused_and_kept(tmp_path, killed):
    """The FSDP checkpoints are a copy of the module's ``killed("fsdp")`` run's (steps 3, 6, 9 of 2 ranks)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed("fsdp") / "ckpt", ckpt)
    saved = sorted(p.name for p in ckpt.iterdir())
    one_line_error(train(2, tmp_path / "ddp", "--strategy", "ddp", "--ckpt", ckpt), 2,
                   "strategy='fsdp'", "strategy='ddp'")
    one_line_error(train(2, tmp_path / "wide", "--strategy", "fsdp", "--model", "wide",
                         "--ckpt", ckpt), 1, "does not fit")
    assert sorted(p.name for p in ckpt.iterdir()) == saved
    assert_ok(train(2, tmp_path / "again", "--strategy", "fsdp", "--epochs", "2", "--ckpt", ckpt))


@pytest.fixture
def small_disk(tmp_path):
    """A 720 KiB filesystem: room for one small checkpoint, not two."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=720k", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, small_disk, mode):
    """Before, asynchronously: each rank printed ~100 lines of DCP's gathered tracebacks."""
    ckpt = small_disk / "ckpt"
    extra = ["--asynchronous"] if mode == "async" else []
    result = train(2, tmp_path / "out", "--strategy", "fsdp", "--ckpt", ckpt, "--every", "3", *extra)
    assert result.returncode != 0
    told = [line for line in result.stderr.splitlines()
            if line.startswith("[rank") and "No space left on device" in line]
    assert 1 <= len(told) <= 2 and "Traceback" not in result.stderr, result.stderr[-3000:]  # a line per rank
    assert all(str(ckpt) in line for line in told), told
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003"]
    resumed = train(1, tmp_path / "resumed", "--strategy", "fsdp", "--epochs", "1",
                    "--ckpt", ckpt, "--every", "0")
    assert "resuming from step 3" in resumed.stderr


@pytest.fixture(scope="module")
def killed_fsdp(killed) -> Path:
    """The checkpoints (steps 3, 6, 9) of a 2-rank FSDP run killed at step 11."""
    return killed("fsdp") / "ckpt"


def change_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def skipped(stderr: str) -> list[str]:
    """The warnings that skipped a checkpoint (rank 0 says it, once per checkpoint; the
    launcher's failure report may quote them again, without the rank prefix)."""
    return [line.split("disttrain: skipping ", 1)[1] for line in stderr.splitlines()
            if line.startswith("[rank") and "disttrain: skipping " in line]


@pytest.mark.timeout(300)
def test_damaged_sharded_checkpoints_are_skipped_for_the_one_before(tmp_path, killed_fsdp):
    """Before: refused with "does not fit this run's model/optimizer", exit 1, no fallback
    (or, for a changed byte, resumed from the changed weights without a word)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed_fsdp, ckpt)
    change_a_byte(ckpt / "step_00000009" / "sharded" / "__1_0.distcp")  # inside a weight, same size
    (ckpt / "step_00000006" / "sharded" / ".metadata").unlink()
    result = train(2, tmp_path / "out", "--strategy", "fsdp", "--ckpt", ckpt, "--every", "3")
    assert_ok(result)
    assert "resuming from step 3" in result.stderr
    assert skipped(result.stderr) == [
        f"checkpoint {ckpt / 'step_00000009'}: sharded/__1_0.distcp does not match its sha256 digest "
        "(changed after it was written); trying the one before",
        f"checkpoint {ckpt / 'step_00000006'}: sharded/.metadata is missing; trying the one before"]


@pytest.mark.timeout(300)
def test_no_whole_sharded_checkpoint_left_is_one_line_and_exit_1(tmp_path, killed_fsdp):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed_fsdp, ckpt)
    for step_dir in sorted(ckpt.iterdir()):
        shard = step_dir / "sharded" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])  # cut short
    result = train(2, tmp_path / "out", "--strategy", "fsdp", "--ckpt", ckpt, "--every", "3")
    line = one_line_error(result, 1, "no whole checkpoint left", str(ckpt))
    assert "does not fit" not in result.stderr
    assert len(skipped(result.stderr)) == 3 and "has 100 bytes" in skipped(result.stderr)[0]
    assert line.endswith("move them out of the folder to start afresh")


@pytest.mark.timeout(300)
def test_a_rank_file_damaged_on_one_rank_makes_every_rank_skip(tmp_path, killed):
    """Only rank 1 reads rank_00001.pt: the ranks agree, and all resume from the one before. The checkpoints
    are a copy of the module's ``killed("ddp")`` run's (2 ranks, killed after step 10)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed("ddp") / "ckpt", ckpt)
    common = ["--strategy", "ddp", "--ckpt", ckpt, "--every", "3"]
    change_a_byte(ckpt / "step_00000009" / "rank_00001.pt")
    result = train(2, tmp_path / "again", *common)
    assert_ok(result)
    assert "resuming from step 6" in result.stderr
    assert skipped(result.stderr) == [f"checkpoint {ckpt / 'step_00000009'}: rank_00001.pt does not match its "
                                      "sha256 digest (changed after it was written); trying the one before"]


@pytest.mark.timeout(120)
def test_unwritable_checkpoint_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = train(1, tmp_path / "out", "--strategy", "fsdp", "--epochs", "1",
                   "--ckpt", blocker / "ckpt", "--every", "2")
    assert result.returncode == 1, result.stderr[-3000:]
    # Found when resume() first looks into it, before any training.
    lines = [line for line in result.stderr.splitlines()
             if "checkpoint directory" in line and "Not a directory" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(blocker) in lines[0]
