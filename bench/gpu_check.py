"""`make gpu-check`: disttrain's CUDA and NCCL paths, proven in one command of at most 8 minutes
on a lent GPU machine (no network, the image's own python and torch, ``PYTHONPATH=src``).

    python bench/gpu_check.py [--out FOLDER] [--budget-s 480] [--only WORD ...]

Steps, in order, each a subprocess with its own bound, the whole within ``--budget-s``: facts;
``pytest tests/gpu``; the launcher (``disttrain run -n auto``, ``disttrain doctor``); the hang
verdict with NCCL (a stalled stream; two ranks on the one GPU, one skipping a collective); DCP
async save of CUDA state; host-to-device copies; ``bench/gpu.py``; then, if time is left, the
gradient compression hooks and metric reduction on NCCL. The programs are in bench/gpu_probe.py.

Writes FOLDER/gpu-check.log (every step's output) and FOLDER/gpu-check.json (the figures; FOLDER is
``$OUT``, else build/gpu-check). Without a GPU every GPU step is skipped with its reason and the
exit is 0; on a GPU the exit is 1 when a step failed or ran out of time. Standard library only:
it starts before anything is known of the image.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "bench" / "gpu_probe.py")
BUDGET_S = 480
HANG_S = 15  # --hang-timeout of the hang steps: far below NCCL's own watchdog (300 s or more)
MIN_STEP_S = 10  # a step with less time left than this is skipped, not started
KILL_GRACE_S = 10  # SIGTERM to the step's process group, then SIGKILL (a launcher stops its workers first)


@dataclass(frozen=True)
class Step:
    """One bounded program: ``judge(rc, output)`` returns (ok, figures)."""

    name: str
    argv: list[str]
    bound_s: float
    judge: Callable[[int, str], tuple[bool, dict]]
    env: dict[str, str] = field(default_factory=dict)
    optional: bool = False  # run only if its whole bound fits in the time left


def last_json(output: str) -> dict:
    """The last line of ``output`` that is a JSON object (a launcher prefixes ``[rank0] ``)."""
    for line in reversed(output.splitlines()):
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


def run_bounded(argv: list[str], bound_s: float, *, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """Run ``argv`` in its own process group for at most ``bound_s``: (exit code or None when it
    was killed at its bound, stdout and stderr together, seconds). The output goes to a file, not
    a pipe: a process left behind that still holds a pipe would keep its reader waiting."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, **(env or {})})
        try:
            rc = proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
        sink.seek(0)
        return rc, sink.read(), time.monotonic() - start


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM lets a launcher stop its workers; SIGKILL after a grace. Workers run in sessions of
    their own, outside the group: what is left of the tree seen before the SIGTERM is killed too,
    so that no rank of a step holds the GPU in the next one (psutil: in the image, and disttrain's)."""
    try:
        import psutil

        tree = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing, or the step just ended
        tree = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(KILL_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    for child in tree:
        try:
            child.kill()
        except Exception:  # gone already
            pass
    if tree:
        psutil.wait_procs(tree, timeout=KILL_GRACE_S)


def run_step(step: Step, time_left: float, log) -> dict:
    """The step's record for the JSON: status ok | failed | timeout | skipped, seconds, figures."""
    record = {"name": step.name, "bound_s": step.bound_s}
    bound = min(step.bound_s, time_left - 3 * KILL_GRACE_S)  # room to stop it, within the budget
    if bound < MIN_STEP_S or (step.optional and time_left < step.bound_s):
        return {**record, "status": "skipped", "reason": f"{time_left:.0f} s of the budget left"}
    log.write(f"\n===== {step.name}: {' '.join(step.argv)} (bound {bound:.0f} s)\n")
    log.flush()
    rc, out, seconds = run_bounded(step.argv, bound, env=step.env)
    log.write(out + f"\n===== {step.name}: exit {rc}, {seconds:.1f} s\n")
    log.flush()
    record["seconds"] = round(seconds, 1)
    if rc is None:
        return {**record, "status": "timeout", "reason": f"killed at its bound of {bound:.0f} s", "tail": out[-800:]}
    try:
        ok, figures = step.judge(rc, out)
    except Exception as err:  # a judge that trips on odd output is a failed step, not a lost run
        ok, figures = False, {"judge_error": f"{type(err).__name__}: {err}"}
    record.update(status="ok" if ok else "failed", exit=rc, figures=figures)
    if not ok:
        record["tail"] = out[-800:]  # the reason, in the JSON too, for a reader without the log
    return record


# ---- the steps ------------------------------------------------------------------------------

def judge_pytest(rc: int, out: str) -> tuple[bool, dict]:
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1] if summary else "")}
    return rc == 0 and counts.get("passed", 0) > 0, counts


def judge_launch(rc: int, out: str) -> tuple[bool, dict]:
    found = last_json(out)
    ok = rc == 0 and found.get("world_size") == 1 and found.get("device") == "cuda:0" \
        and found.get("current_device") == 0 and found.get("launcher_backend") == "nccl"
    return ok, found


def judge_doctor(rc: int, out: str) -> tuple[bool, dict]:
    gpus = re.search(r"(\d+) GPU\(s\)", out)
    nccl = re.search(r"NCCL (\S+?),", out)
    figures = {"gpus": int(gpus[1]) if gpus else None, "nccl": nccl[1] if nccl else None}
    return rc == 0 and bool(figures["gpus"]) and figures["nccl"] not in (None, "none"), figures


def judge_verdict(*needles: str) -> Callable[[int, str], tuple[bool, dict]]:
    """Exit 124 (--hang-timeout) with a cause line holding every needle."""
    def judge(rc: int, out: str) -> tuple[bool, dict]:
        cause = next((line.strip() for line in out.splitlines() if line.strip().startswith("cause:")), None)
        return rc == 124 and cause is not None and all(n in cause for n in needles), {"cause": cause}
    return judge


def judge_json(*required: str) -> Callable[[int, str], tuple[bool, dict]]:
    def judge(rc: int, out: str) -> tuple[bool, dict]:
        found = last_json(out)
        return rc == 0 and all(k in found for k in required) and "error" not in json.dumps(found), found
    return judge


CHECKPOINT_SIDES = ("disttrain", "disttrain_sync", "dcp_async_save_pinned", "dcp_save_sync", "disttrain_url_async")


def judge_dcp(rc: int, out: str) -> tuple[bool, dict]:
    """Every side of the checkpoint comparison saved and loaded back bit for bit (a side's error fails
    the step, with the others' figures kept)."""
    found = last_json(out)
    exact = [found.get(k, {}).get("resume_bit_exact") for k in CHECKPOINT_SIDES]
    return rc == 0 and exact == [True] * len(CHECKPOINT_SIDES), found


def judge_comm(rc: int, out: str) -> tuple[bool, dict]:
    found = last_json(out)
    expected = {"reduce_mean": 0.5, "reduce_sum": 3, "reduce_max": 0.5}  # ranks 0 and 1
    ok = rc == 0 and found.get("backend") == "nccl" and all((found.get("hooks_agree") or {"": False}).values()) \
        and all(found.get(k) == v for k, v in expected.items())
    return ok, found


def judge_bench(rc: int, out: str) -> tuple[bool, dict]:
    found = last_json(out)
    return rc == 0 and "ratio" in found, found  # the ratio against its goal is a figure, not a pass


def gpu_steps(facts: dict, python: str) -> list[Step]:
    """The steps after facts, for this image: two ranks share the GPU over NCCL where its version
    allows it (>= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1), else over gloo with CUDA tensors."""
    run = [python, "-m", "disttrain", "run"]
    shared = facts.get("shared_gpu_backend", "gloo")
    shared_args = [] if shared == "nccl" else ["--dist-backend", "gloo"]
    shared_env = facts.get("shared_gpu_env") or {}
    return [
        Step("pytest tests/gpu", [python, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"], 180,
             judge_pytest),
        Step("launcher -n auto", [*run, "-n", "auto", PROBE, "launch"], 60, judge_launch),
        Step("doctor", [python, "-m", "disttrain", "doctor"], 45, judge_doctor),
        Step("hang: stalled stream, NCCL", [*run, "-n", "1", "--hang-timeout", str(HANG_S), PROBE, "stall"],
             HANG_S + 60, judge_verdict("all_reduce")),
        Step(f"hang: a skipped collective, 2 ranks on one GPU over {shared}",
             [*run, "-n", "2", *shared_args, "--hang-timeout", str(HANG_S), PROBE, "skip"], HANG_S + 60,
             judge_verdict("rank 1 never entered", "all_reduce"), env=shared_env),
        Step("dcp async save of CUDA state", [python, PROBE, "dcp"], 150, judge_dcp),
        Step("host-to-device copy", [python, PROBE, "h2d"], 60, judge_json("pinned_gb_s", "pageable_gb_s")),
        Step("bench/gpu.py resnet18 bf16",
             [python, "bench/gpu.py", "--mixed-precision", "bf16", "--repeats", "2", "--steps", "30"], 180,
             judge_bench),
        Step("compression hooks and metric reduction on NCCL", [*run, "-n", "2", PROBE, "comm"], 90,
             judge_comm, env=shared_env, optional=True),
    ]


def skip_reason(facts: dict, step: Step, only: list[str] | None = None) -> str | None:
    """Why ``step`` cannot (or is not to) run on this machine, or None."""
    if not facts.get("cuda_available"):
        return f"no CUDA GPU visible (torch {facts.get('torch', 'not importable')})"
    if step.name.startswith("pytest") and not facts.get("pytest"):
        return "pytest is not installed in this python: run the tests/gpu files elsewhere"
    if step.name.startswith("compression") and facts.get("shared_gpu_backend") != "nccl":
        return f"two ranks cannot share the GPU over NCCL {facts.get('nccl')} (needs 2.30 or newer)"
    if only and not any(word in step.name for word in only):
        return f"not among --only {' '.join(only)}"
    return None


def line(step: dict) -> str:
    return (f"{step['status']:8} {step.get('seconds', 0):6.1f} s  {step['name']}"
            + (f"  ({step['reason']})" if step.get("reason") else ""))


def check(out_dir: Path, *, budget_s: float = BUDGET_S, only: list[str] | None = None, say=print) -> dict:
    """Run the steps; ``say`` gets a line as each starts and as it ends (the facts' first: the NCCL
    version). The JSON is written again after every step, so a bound that stops the check keeps
    every figure taken before it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    left = lambda: budget_s - (time.monotonic() - start)  # noqa: E731
    python = sys.executable
    facts: dict = {}
    two_ranks = ""
    steps: list[dict] = []

    def record() -> dict:
        result = {
            "check": "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
            "budget_s": budget_s, "seconds": round(time.monotonic() - start, 1), "facts": facts,
            "two_ranks_on_one_gpu": two_ranks,
            "steps": steps,
            "ok": bool(steps) and all(s["status"] in ("ok", "skipped") for s in steps),
        }
        (out_dir / "gpu-check.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    with open(out_dir / "gpu-check.log", "w") as log:
        say("gpu-check: facts ... (bound 60 s)")
        first = run_step(Step("facts", [python, PROBE, "facts"], 60, judge_json("torch")), left(), log)
        facts = first.pop("figures", {})
        if facts:
            facts["pytest"] = importlib.util.find_spec("pytest") is not None
        shared = facts.get("shared_gpu_backend", "gloo")
        two_ranks = (f"over NCCL {facts.get('nccl')} with NCCL_MULTI_RANK_GPU_ENABLE=1" if shared == "nccl"
                     else f"over gloo with CUDA tensors: NCCL {facts.get('nccl') or '(none here)'} refuses a GPU "
                          "shared by two ranks before 2.30")
        say(line(first))
        say(f"gpu-check: torch {facts.get('torch')}, CUDA {facts.get('cuda')}, NCCL {facts.get('nccl')}, "
            f"{facts.get('gpu')}; two ranks on one GPU {two_ranks}")
        steps.append(first)
        record()
        for step in gpu_steps(facts, python):
            reason = skip_reason(facts, step, only)
            if not reason:
                say(f"gpu-check: {step.name} ... (bound {min(step.bound_s, max(0.0, left())):.0f} s)")
            steps.append({"name": step.name, "bound_s": step.bound_s, "status": "skipped", "reason": reason}
                         if reason else run_step(step, left(), log))
            say(line(steps[-1]))
            record()
    return record()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "build" / "gpu-check"))
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--only", action="append", metavar="WORD",
                        help="run only the steps whose name holds WORD (a rerun of those that failed); repeatable")
    args = parser.parse_args(argv)
    result = check(args.out, budget_s=args.budget_s, only=args.only, say=lambda text: print(text, flush=True))
    print(json.dumps(result), flush=True)
    print(f"gpu-check: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s; "
          f"log and JSON in {args.out}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
