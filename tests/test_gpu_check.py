"""`make gpu-check` (bench/gpu_check.py) without a GPU: the mode two ranks share one GPU in, chosen
from the NCCL version; every GPU step skipped with its reason; the JSON's shape; the time bounds (a
step that overruns is killed with its children and reported). The GPU itself: tests/gpu/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from disttrain.errors import UsageError
from disttrain.placement import choose_device, shared_gpu_backend
from disttrain.runtime.context import resolve
from disttrain.workerenv import WorkerEnv

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("disttrain_bench_gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


CPU_FACTS = {"torch": "2.13.0+cpu", "cuda_available": False, "nccl": None, "shared_gpu_backend": "gloo"}


def gpu_facts(nccl: tuple[int, ...]) -> dict:
    shared = shared_gpu_backend(nccl)
    return {"torch": "2.11.0+cu130", "cuda_available": True, "gpus": 1, "pytest": True,
            "nccl": ".".join(map(str, nccl)), "shared_gpu_backend": shared,
            "shared_gpu_env": {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if shared == "nccl" else {}}


def test_two_ranks_share_a_gpu_over_nccl_from_2_30_else_over_gloo():
    assert shared_gpu_backend(None) == "gloo"
    assert shared_gpu_backend((2, 27, 3)) == "gloo"
    assert shared_gpu_backend((2, 29, 9)) == "gloo"
    assert shared_gpu_backend((2, 30, 0)) == "nccl"
    assert shared_gpu_backend((3, 0, 1)) == "nccl"


def test_choose_device_lets_a_second_rank_share_the_gpu_only_where_the_backend_allows():
    assert choose_device(local_rank=1, cuda_devices=1, dist_backend="gloo") == "cuda:0"
    assert choose_device(local_rank=3, cuda_devices=2, dist_backend="gloo") == "cuda:1"
    assert choose_device(local_rank=1, cuda_devices=1, dist_backend="nccl", nccl_version=(2, 30, 1),
                         nccl_multi_rank_gpu=True) == "cuda:0"
    with pytest.raises(UsageError, match=r"NCCL_MULTI_RANK_GPU_ENABLE=1 with NCCL >= 2.30 \(here 2.30.1\)"):
        choose_device(local_rank=1, cuda_devices=1, dist_backend="nccl", nccl_version=(2, 30, 1))  # not asked for
    with pytest.raises(UsageError, match=r"here 2.27.3"):
        choose_device(local_rank=1, cuda_devices=1, dist_backend="nccl", nccl_version=(2, 27, 3),
                      nccl_multi_rank_gpu=True)


def test_the_runtime_reads_nccls_own_variable_for_the_choice():
    env = WorkerEnv.from_environ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                                  "NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert resolve(env, cuda_devices=1, nccl_version=(2, 30, 0)).device == torch.device("cuda:0")
    with pytest.raises(UsageError, match="LOCAL_RANK=1 has no GPU"):
        resolve(env, cuda_devices=1, nccl_version=(2, 28, 9))


def test_the_shared_gpu_steps_take_their_mode_from_the_nccl_version(gpu_check):
    old = {s.name: s for s in gpu_check.gpu_steps(gpu_facts((2, 27, 3)), "python3")}
    new = {s.name: s for s in gpu_check.gpu_steps(gpu_facts((2, 30, 0)), "python3")}
    old_skip = old["hang: a skipped collective, 2 ranks on one GPU over gloo"]
    new_skip = new["hang: a skipped collective, 2 ranks on one GPU over nccl"]
    assert "--dist-backend" in old_skip.argv and old_skip.env == {}
    assert "--dist-backend" not in new_skip.argv and new_skip.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    comm = "compression hooks and metric reduction on NCCL"
    assert "needs 2.30 or newer" in gpu_check.skip_reason(gpu_facts((2, 27, 3)), old[comm])
    assert gpu_check.skip_reason(gpu_facts((2, 30, 0)), new[comm]) is None
    assert all(gpu_check.skip_reason(gpu_facts((2, 30, 0)), s) is None for s in new.values())
    rerun = [s.name for s in new.values() if gpu_check.skip_reason(gpu_facts((2, 30, 0)), s, ["hang", "dcp"]) is None]
    assert rerun == ["hang: stalled stream, NCCL", "hang: a skipped collective, 2 ranks on one GPU over nccl",
                     "dcp async save of CUDA state"]  # --only: a rerun of what failed


def test_without_a_gpu_every_gpu_step_is_skipped_with_its_reason(gpu_check):
    steps = gpu_check.gpu_steps(CPU_FACTS, "python3")
    assert len(steps) == 9
    assert all(gpu_check.skip_reason(CPU_FACTS, s) == "no CUDA GPU visible (torch 2.13.0+cpu)" for s in steps)
    no_pytest = {**gpu_facts((2, 27, 3)), "pytest": False}
    assert "pytest is not installed" in gpu_check.skip_reason(no_pytest, steps[0])


def sleeper_with_a_child() -> list[str]:
    """A step whose child left its process group, as a launcher's workers do."""
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            "print('CHILD_PID', child.pid, flush=True); time.sleep(120)")
    return [sys.executable, "-c", code]


def test_a_step_that_overruns_its_bound_is_killed_with_its_children_and_reported(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0)
    # A bound of 3 s: the step has its child and has said so within a fraction of a second, then sleeps 120 s.
    step = gpu_check.Step("sleeper", sleeper_with_a_child(), 3, lambda rc, out: (True, {}))
    with open(tmp_path / "log", "w") as log:
        record = gpu_check.run_step(step, 100, log)
    assert record["status"] == "timeout" and record["reason"] == "killed at its bound of 3 s"
    child = int((tmp_path / "log").read_text().split("\nCHILD_PID ")[1].split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_the_budget_bounds_the_steps_and_skips_what_does_not_fit(gpu_check, tmp_path):
    step = gpu_check.Step("sleeper", sleeper_with_a_child(), 60, lambda rc, out: (True, {}))
    with open(tmp_path / "log", "w") as log:
        assert gpu_check.run_step(step, 5, log) == {"name": "sleeper", "bound_s": 60, "status": "skipped",
                                                   "reason": "5 s of the budget left"}
        optional = gpu_check.Step("extra", [sys.executable, "-c", "pass"], 60, lambda rc, out: (True, {}),
                                  optional=True)
        assert gpu_check.run_step(optional, 59, log)["status"] == "skipped"  # its whole bound must fit
        done = gpu_check.run_step(optional, 61, log)
    assert done["status"] == "ok" and done["exit"] == 0


def test_a_judge_that_trips_is_a_failed_step_not_a_lost_run(gpu_check, tmp_path):
    step = gpu_check.Step("odd", [sys.executable, "-c", "print('x')"], 30, lambda rc, out: 1 / 0)
    with open(tmp_path / "log", "w") as log:
        record = gpu_check.run_step(step, 100, log)
    assert record["status"] == "failed" and record["figures"] == {"judge_error": "ZeroDivisionError: division by zero"}
    assert record["tail"] == "x\n"  # a failed step's output travels in the JSON too


def test_the_judges_read_what_the_programs_print(gpu_check):
    assert gpu_check.judge_pytest(0, "....s\n5 passed, 1 skipped in 41.20s\n") == (True, {"passed": 5, "skipped": 1})
    assert gpu_check.judge_pytest(1, "1 failed, 4 passed in 3s")[0] is False
    doctor = ("ok    versions     h  python 3.12.3, torch 2.11.0+cu130, NCCL 2.27.7, disttrain 0.2.0\n"
              "ok    gpus         h  1 GPU(s), 16 CPU(s)\n")
    assert gpu_check.judge_doctor(0, doctor) == (True, {"gpus": 1, "nccl": "2.27.7"})
    assert gpu_check.judge_doctor(0, doctor.replace("NCCL 2.27.7", "NCCL none"))[0] is False
    launched = '[rank0] {"world_size": 1, "device": "cuda:0", "current_device": 0, "launcher_backend": "nccl"}'
    assert gpu_check.judge_launch(0, "disttrain: 1 worker (nccl)\n" + launched)[0]
    assert not gpu_check.judge_launch(0, launched.replace("nccl", "gloo"))[0]
    comm = {"backend": "nccl", "hooks_agree": {"fp16": True, "powersgd": True}, "reduce_mean": 0.5, "reduce_sum": 3, "reduce_max": 0.5}
    assert gpu_check.judge_comm(0, "[rank0] " + json.dumps(comm))[0]
    assert not gpu_check.judge_comm(0, "[rank0] " + json.dumps({**comm, "hooks_agree": {"fp16": False}}))[0]
    assert not gpu_check.judge_comm(0, "[rank0] " + json.dumps({**comm, "backend": "gloo"}))[0]
    assert gpu_check.judge_dcp(0, json.dumps({"disttrain": {"resume_bit_exact": True},
                                              "dcp_async_save_pinned": {"error": "AttributeError"}}))[0] is False


@pytest.mark.timeout(120)
def test_the_verdict_step_passes_on_a_real_hang_over_gloo(gpu_check, tmp_path, monkeypatch):
    """The shared-GPU hang step's program and judge, for real on CPU (gloo): rank 1 skips the collective."""
    # --hang-timeout 5 s, not the GPU's 15: what the hang tests give the same kind of hang on CPU
    # (tests/test_hangs.py); the watchdog is armed only once a rank moved, so start-up cannot trip it.
    monkeypatch.setattr(gpu_check, "HANG_S", 5)
    (step,) = [s for s in gpu_check.gpu_steps(CPU_FACTS, sys.executable) if s.name.startswith("hang: a skipped")]
    assert step.argv[step.argv.index("--hang-timeout") + 1] == "5"
    with open(tmp_path / "log", "w") as log:
        record = gpu_check.run_step(step, 100, log)
    assert record["status"] == "ok", (tmp_path / "log").read_text()[-3000:]
    assert record["figures"]["cause"].startswith("cause: rank 1 never entered collective #6 of the default group")


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the check; on a GPU it runs every step")
def test_make_gpu_check_on_a_cpu_machine_skips_every_gpu_step_and_exits_0(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}", f"OUT={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((out / "gpu-check.json").read_text())
    assert set(result) == {"check", "date", "host", "budget_s", "seconds", "facts", "two_ranks_on_one_gpu", "steps",
                           "ok"}
    assert result["ok"] is True and result["budget_s"] == 480
    assert result["facts"]["torch"] == torch.__version__ and result["facts"]["cuda_available"] is False
    facts, *rest = result["steps"]
    assert facts == {"name": "facts", "bound_s": 60, "status": "ok", "exit": 0, "seconds": facts["seconds"]}
    assert len(rest) == 9
    assert all(s["status"] == "skipped" and s["reason"].startswith("no CUDA GPU visible") for s in rest)
    assert "===== facts" in (out / "gpu-check.log").read_text()
    assert proc.stdout.rstrip().endswith(f"gpu-check: ok in {result['seconds']} s; log and JSON in {out}")


@pytest.mark.timeout(120)
def test_the_checkpoint_probe_resumes_bit_exact_on_cpu_too(gpu_check):
    """The DCP step's program with a small model on CPU (no pinned staging): both saves load back exactly."""
    rc, out, _ = gpu_check.run_bounded([sys.executable, gpu_check.PROBE, "dcp", "small"], 100, env={"OMP_NUM_THREADS": "1"})
    ok, figures = gpu_check.judge_dcp(rc, out)
    assert ok, out[-3000:]
    assert len(figures["disttrain"]["blocked_ms"]) == len(figures["dcp_async_save_pinned"]["blocked_ms"]) == 3
    assert len(figures["disttrain_sync"]["blocked_ms"]) == len(figures["dcp_save_sync"]["blocked_ms"]) == 2
    assert figures["disttrain_url_async"]["resume_bit_exact"] is True
    assert figures["staging"] == {"host": "as-is", "dcp": "writer"}  # CPU: the plain path, chosen by itself
    assert all(figures[side]["blocked_ms_per_gb_after_first"] >= 0 for side in gpu_check.CHECKPOINT_SIDES)
