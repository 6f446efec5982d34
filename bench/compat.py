"""`make compat`: every torch of the supported range runs disttrain's smoke set.

    python bench/compat.py [--versions 2.6.0,2.15.0] [--only run,hang] [--build-only] [--json FILE]

One venv per torch version under ``.compat/torch-VERSION`` (reused between runs; rebuilt when
pyproject.toml changes), all sharing one pip cache (``.compat/pip-cache``). Each is held to its own
torch by a constraints file, so no later ``pip install`` can swap the build. The pinned version
(``PINNED``) runs in the repository's own ``.venv`` when that holds it, as ``make test`` made it.
Versions other than the pin are PyPI's CUDA builds with their nvidia wheels (about 5 GB a venv);
they import and run on the CPU.

Each smoke check is a test of the suite (``CHECKS``), so it asserts what a user checks: the
numbers, files, exit codes and lines. A check that needs a newer torch than the venv holds must be
refused in one line naming the version (its test says so), not crash. Prints the version x check
table, one step at a time as it starts and ends, and writes the JSON (``--json``, default
``build/compat.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / ".compat"
PINNED = "2.13.0"  # constraints.txt's torch: the CPU build this machine installs from its disk
# The minimum: 2.6 is the oldest torch in the CUDA images of the last ~20 months (AWS's and NVIDIA's
# PyTorch containers of spring 2025 carry 2.6 or 2.7), and the first with a public FSDP2 (fully_shard).
MINIMUM = "2.6.0"
NEWEST = "2.15.0"
MATRIX = (MINIMUM, "2.11.0", PINNED, "2.14.1", NEWEST)
# What each venv needs beyond disttrain[tune]: the test runner and what the chosen tests import.
TEST_PACKAGES = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")


@dataclass(frozen=True)
class Check:
    """A smoke check: the tests that prove it (pytest node ids, or a whole module), and those that
    prove its one-line refusal on a torch without the feature (the proving tests skip there)."""

    proves: tuple[str, ...]
    refuses: tuple[str, ...] = ()


IN_COMPAT = "tests/test_compat.py::"
CHECKS: dict[str, Check] = {
    "run -n 2": Check(("tests/test_run_local.py::test_torchrun_script_runs_unchanged_with_prefixed_output_and_logs",)),
    "c10d by hand": Check(("tests/test_torchrun_run.py::test_by_hand_recipe_forms_a_job_across_two_hosts",)),
    "regroup in place": Check(("tests/test_regroup.py::test_the_survivors_go_on_in_place_as_the_same_processes[killed]",
                               "tests/test_regroup.py::test_a_decorated_main_is_entered_again_and_the_script_is_not_run_again[resume]",
                               "tests/test_regroup.py::test_a_world_dropped_with_a_collective_in_flight_is_not_waited_for")),
    "nnodes 2:3 join in place": Check(("tests/test_elastic_ssh.py::test_a_host_down_at_the_start_joins_when_it_comes_back",)),
    "hang verdict": Check(("tests/test_hangs.py::test_a_collective_mismatch_ends_in_a_verdict_naming_both_ranks_and_ops",),
                          (IN_COMPAT + "test_a_hang_watch_without_the_recorder_of_gloo_says_what_it_sees",)),
    "bit-exact resume": Check(("tests/test_sharded.py::test_sigkill_mid_epoch_then_resume_is_bit_exact[ddp]",)),
    "local SGD / DiLoCo": Check(("tests/test_periodic.py::test_sigkilled_mid_period_and_resumed_ends_bit_exact[diloco:4]",)),
    "FSDP2 + DCP": Check(("tests/test_sharded.py::test_sigkill_mid_epoch_then_resume_is_bit_exact[fsdp]",),
                         (IN_COMPAT + "test_fsdp_where_cpu_streams_cannot_record_events_is_one_line",)),
    "SageMaker v3 job": Check(("tests/test_sagemaker_v3.py::test_source_code_command_torchrun_master_addr_algo_1",)),
    "tune run": Check(("tests/test_tune_script.py::test_four_trials_two_at_a_time_best_is_the_minimum",)),
    "torchrun options": Check(("tests/test_torchrun_options.py::test_the_table_is_torch_parser_option_for_option",
                               IN_COMPAT + "test_a_field_this_torch_lacks_is_dropped_when_unused_and_refused_in_one_line_when_asked",
                               IN_COMPAT + "test_every_field_disttrain_may_set_is_this_torchs_or_has_its_release_named"),
                              (IN_COMPAT + "test_the_options_of_a_newer_torch_are_refused_in_one_line_before_anything_starts",
                               IN_COMPAT + "test_print_completion_completes_disttrain_where_this_torch_has_it")),
}


def say(line: str) -> None:
    print(f"compat {time.strftime('%H:%M:%S')} {line}", flush=True)


def recipe_digest(version: str) -> str:
    """What a venv is built from: its torch, the requirements of disttrain[tune] but torch's (the
    package itself is installed editable), and the test packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [r for r in project["dependencies"] if not r.startswith("torch")] + project["optional-dependencies"]["tune"]
    text = "\n".join([version, *wanted, *TEST_PACKAGES])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pinned_venv() -> Path | None:
    """The repository's .venv, when it holds the pinned torch and pytest (``make test`` made it)."""
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import torch, pytest; print(torch.__version__)"],
                           capture_output=True, text=True)
    return ROOT / ".venv" if probe.returncode == 0 and probe.stdout.startswith(PINNED) else None


def build(version: str) -> tuple[Path, float]:
    """The venv of one torch version, made or reused: (its folder, seconds spent building)."""
    if version == PINNED and (venv := pinned_venv()):
        return venv, 0.0
    venv = COMPAT / f"torch-{version}"
    ready = venv / ".compat-ready"
    if ready.exists() and ready.read_text().strip() == recipe_digest(version):
        return venv, 0.0
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={version}\n")
    # PIP_CONSTRAINT replaces any machine-wide constraint (a cap on torch, say): this venv's torch is its own.
    env = {**os.environ, "PIP_CONSTRAINT": str(constraints), "PIP_CACHE_DIR": str(COMPAT / "pip-cache"),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--progress-bar", "off"]
    subprocess.run([*pip, f"torch=={version}"], check=True, env=env)
    subprocess.run([*pip, "-e", f"{ROOT}[tune]", *TEST_PACKAGES], check=True, env=env)
    ready.write_text(recipe_digest(version))
    return venv, time.monotonic() - start


def junit_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed | failed | skipped, the message) from pytest's JUnit XML."""
    outcomes: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                state = "skipped" if kind == "skipped" else "failed"
                outcomes[node] = (state, (found.get("message") or "").splitlines()[0][:200] if found.get("message") else "")
                break
        else:
            outcomes[node] = ("passed", "")
    return outcomes


def check_state(check: Check, outcomes: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """passed: every proving test passed; refused: they skipped and the refusal's tests passed;
    failed: any test failed, or the check is not proven either way (a message says why)."""
    def states(ids: tuple[str, ...]) -> list[tuple[str, str]]:
        return [outcomes.get(i, ("failed", "did not run")) for i in ids]

    proved, refused = states(check.proves), states(check.refuses)
    failed = [s for s in proved + refused if s[0] == "failed"]
    if failed:
        return "failed", failed[0][1]
    if all(s[0] == "passed" for s in proved):
        return "passed", ""
    skipped = next(s[1] for s in proved if s[0] == "skipped")
    if refused and any(s[0] == "passed" for s in refused):
        return "refused", skipped
    return "failed", f"not proven: {skipped}"


def smoke(venv: Path, checks: list[str], bound_s: float) -> tuple[dict[str, dict], str]:
    """Run the checks' tests in one pytest process of ``venv``; every check's state and the output tail."""
    ids = list(dict.fromkeys(node for check in checks for node in (*CHECKS[check].proves, *CHECKS[check].refuses)))
    with tempfile.TemporaryDirectory(prefix="dtcompat-") as tmp:
        xml = Path(tmp) / "junit.xml"
        argv = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                f"--junitxml={xml}", *ids]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        env.pop("VIRTUAL_ENV", None)
        try:
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=bound_s, env=env)
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as stopped:
            tail = f"stopped after {bound_s:.0f} s\n" + str(stopped.stdout or "")[-3000:]
        outcomes = junit_outcomes(xml)
    result = {}
    for check in checks:
        state, message = check_state(CHECKS[check], outcomes)
        result[check] = {"state": state, "message": message}
    return result, tail


def torch_of(venv: Path) -> str:
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    return probe.stdout.strip() or probe.stderr.strip().splitlines()[-1]


def table(results: dict[str, dict], checks: list[str]) -> str:
    mark = {"passed": "ok", "failed": "FAIL", "refused": "refused"}
    head = ["torch", *checks]
    rows = [[version, *(mark[results[version]["checks"].get(c, {}).get("state", "failed")] for c in checks)]
            for version in results]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [head, *rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=",".join(MATRIX), help="torch versions, comma-separated")
    parser.add_argument("--only", default="", help="checks to run, comma-separated (default: all)")
    parser.add_argument("--build-only", action="store_true", help="make the venvs, run nothing")
    parser.add_argument("--bound-s", type=float, default=900, help="the most one version's smoke set may take")
    parser.add_argument("--json", default=str(ROOT / "build" / "compat.json"))
    args = parser.parse_args()
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    checks = [c.strip() for c in args.only.split(",") if c.strip()] or list(CHECKS)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        print(f"compat: no check {unknown[0]!r}; the checks are: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    for version in versions:
        say(f"torch {version}: venv ...")
        venv, built_s = build(version)
        say(f"torch {version}: venv {venv.relative_to(ROOT)} ({'reused' if not built_s else f'built in {built_s:.0f} s'})")
        results[version] = {"venv": str(venv.relative_to(ROOT)), "build_s": round(built_s, 1), "torch": torch_of(venv)}
        if args.build_only:
            continue
        say(f"torch {version}: smoke set ({len(checks)} checks) ...")
        start = time.monotonic()
        results[version]["checks"], tail = smoke(venv, checks, args.bound_s)
        results[version]["smoke_s"] = round(time.monotonic() - start, 1)
        failed = [c for c, r in results[version]["checks"].items() if r["state"] == "failed"]
        say(f"torch {version}: smoke set done in {results[version]['smoke_s']:.0f} s, "
            f"{'failed: ' + ', '.join(failed) if failed else 'every check passed or refused in one line'}")
        if failed:
            print(tail, flush=True)
    record = {"date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0], "checks": checks, "versions": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    if not args.build_only:
        print(table(results, checks), flush=True)
    print(json.dumps(record), flush=True)
    return 1 if any(r["state"] == "failed" for v in results.values() for r in v.get("checks", {}).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
