"""``disttrain run --backend slurm``: render an sbatch script, submit it, follow it, cancel it.

The script is the one a user would write by hand: ``#SBATCH`` lines, then
``disttrain run --backend slurm`` inside the allocation, which finds the nodes in Slurm's
environment and starts one torch elastic agent per node with ``srun``
(:mod:`disttrain.backends.slurm_alloc`). So a submitted job and a user's own sbatch script or
``salloc`` session take the same path, and ``--dry-run`` shows all there is to it.

For callers other than the CLI (the job runner) the API is: :func:`render_sbatch` → text,
:func:`submit` → a :class:`SlurmJob` (its id), :meth:`SlurmJob.follow` → the exit code while
streaming the output, :meth:`SlurmJob.cancel`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from ..config.launch import LaunchSpec
from ..errors import DisttrainError, UsageError
from ..private import write_private

SLURM_TIMEOUT_S = 60  # any one sbatch/scontrol/scancel call
POLL_S = 0.5  # the output files
STATUS_EVERY_S = (0.5, 3.0)  # scontrol: often in the first minute, then gently on slurmctld
LOST_CONTROLLER_S = 120  # scontrol failing this long ends `follow` with an error
GONE_WAIT_S = 120  # after scancel: until the job's processes are gone (KillWait is 30 s by default)
STILL_PENDING_EVERY_S = 300
# States after which a job never runs again (REQUEUED/REQUEUE_HOLD are on the way back to PENDING).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
WHY = {
    "TIMEOUT": "hit its time limit (--time)",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "PREEMPTED": "was preempted (add --requeue to have Slurm run it again from its checkpoints)",
    "OUT_OF_MEMORY": "ran out of memory",
    "BOOT_FAIL": "could not boot its nodes",
    "DEADLINE": "missed its deadline",
    "CANCELLED": "was cancelled",
}


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """What ``#SBATCH`` asks for; validated here, naming the flag."""

    nodes: int = 1
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    requeue: bool = False
    sbatch_args: tuple[str, ...] = ()
    job_name: str | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise UsageError(f"--gpus-per-node cannot be negative, got {self.gpus_per_node}")
        for flag, value in (("--partition", self.partition), ("--time", self.time)):
            if value is not None and not re.fullmatch(r"[\w.:,+-]+", value):
                raise UsageError(f"{flag} {value!r}: use a Slurm {flag[2:]} (letters, digits, - _ . : ,)")
        for arg in self.sbatch_args:
            if not arg.startswith("-") or "\n" in arg or '"' in arg:
                raise UsageError(f"--sbatch-arg takes one sbatch option such as --sbatch-arg=--mem=8G, got {arg!r}")


@dataclass(frozen=True)
class SlurmPaths:
    """A Slurm run's files, in its run folder (on the filesystem the nodes share)."""

    run_dir: Path

    @property
    def script(self) -> Path:
        return self.run_dir / "job.sbatch"

    @property
    def stdout(self) -> Path:
        return self.run_dir / "slurm.out"

    @property
    def stderr(self) -> Path:
        return self.run_dir / "slurm.err"

    @property
    def job_id(self) -> Path:
        return self.run_dir / "slurm_job_id"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"


def with_requeue_checkpoints(spec: LaunchSpec, options: SlurmOptions, run_dir: str) -> LaunchSpec:
    """A requeued job must find the checkpoints of its first run: without ``--checkpoint-dir``
    they go to the run folder, whose path is fixed in the script."""
    if options.requeue and not spec.checkpoint_dir:
        return replace(spec, checkpoint_dir=str(SlurmPaths(Path(run_dir)).checkpoints))
    return spec


def spec_argv(spec: LaunchSpec) -> list[str]:
    """The ``disttrain run`` flags that reproduce ``spec`` inside the allocation.

    The node count and ranks come from the allocation there, so they are not passed;
    ``test_slurm_script`` checks that every other LaunchSpec field is.
    """
    argv = ["-n", str(spec.nproc_per_node)]
    if spec.master_addr:
        argv += ["--master-addr", spec.master_addr]
    if spec.backend:
        argv += ["--dist-backend", spec.backend]
    if spec.framework != "pytorch":
        argv += ["--framework", spec.framework]
    if spec.master_port is not None:
        argv += ["--master-port", str(spec.master_port)]
    if spec.max_restarts:
        argv += ["--max-restarts", str(spec.max_restarts)]
    if spec.ranks is not None:
        argv += ["--ranks", ",".join(map(str, spec.ranks))]
    for key, value in spec.env.items():
        argv += ["--env", f"{key}={value}"]
    if spec.rdzv_backend != "static":
        argv += ["--rdzv-backend", spec.rdzv_backend]
    if spec.rdzv_timeout_s != 120:
        argv += ["--rdzv-timeout", str(spec.rdzv_timeout_s)]
    if spec.stop_grace_s != 15:
        argv += ["--stop-grace", str(spec.stop_grace_s)]
    if spec.hang_timeout_s:
        argv += ["--hang-timeout", str(spec.hang_timeout_s)]
    if spec.checkpoint_dir:
        argv += ["--checkpoint-dir", spec.checkpoint_dir]
    if spec.checkpoint_every is not None:
        argv += ["--checkpoint-every", str(spec.checkpoint_every)]
    if spec.is_module:
        argv.append("-m")
    return [*argv, spec.entry, *spec.script_args]


def _directive(option: str) -> str:
    # sbatch reads #SBATCH lines itself: words split on blanks, double quotes group them.
    return f'#SBATCH "{option}"' if re.search(r"\s", option) else f"#SBATCH {option}"


def render_sbatch(spec: LaunchSpec, options: SlurmOptions, *, run_dir: str, python: str, cwd: str,
                  command: Sequence[str] | None = None) -> str:
    """The batch script for ``spec``; pure, so ``--dry-run`` prints exactly what is submitted.

    ``command`` replaces the ``disttrain run`` line (a job runner's own per-allocation step).
    """
    paths = SlurmPaths(Path(run_dir))
    name = re.sub(r"[^\w.-]", "_", options.job_name or Path(spec.entry).stem or "disttrain")
    directives = [
        f"--job-name={name}",
        f"--nodes={options.nodes}",
        "--ntasks-per-node=1",  # the task is a node's agent; it starts the workers
        "--exclusive",  # -n auto and OMP_NUM_THREADS count the node's cores: the job takes them all
        f"--chdir={cwd}",
        f"--output={paths.stdout}",
        f"--error={paths.stderr}",
        "--open-mode=append",  # a requeued run adds to its first run's output
    ]
    if options.requeue:
        directives.append("--requeue")
    if options.partition:
        directives.append(f"--partition={options.partition}")
    if options.time:
        directives.append(f"--time={options.time}")
    if options.gpus_per_node:
        directives.append(f"--gpus-per-node={options.gpus_per_node}")
    directives.extend(options.sbatch_args)  # last: the user's own word wins
    if command is None:
        spec = with_requeue_checkpoints(spec, options, run_dir)
        command = [python, "-m", "disttrain", "run", "--backend", "slurm", "--log-dir", run_dir,
                   *spec_argv(spec)]
    lines = [
        "#!/bin/bash",
        "# Rendered by `disttrain run --backend slurm`. Inside the allocation, `disttrain run` finds",
        "# the nodes in Slurm's environment and starts one torch elastic agent per node with srun;",
        "# the master is the first node, at its address toward the others found on that node.",
        *map(_directive, directives),
        f"exec {shlex.join(command)}",
        "",
    ]
    return "\n".join(lines)


def _slurm(argv: Sequence[str], *, timeout: float = SLURM_TIMEOUT_S, env: Mapping[str, str] | None = None,
           input: str | None = None):
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input,
                              stdin=subprocess.DEVNULL if input is None else None,
                              env=None if env is None else dict(env))
    except FileNotFoundError:
        raise DisttrainError(f"{argv[0]} not found: run on a machine with the Slurm client commands "
                             "(a login node), or install slurm-client") from None
    except subprocess.TimeoutExpired:
        raise DisttrainError(f"`{shlex.join(argv)}` got no answer from slurmctld within {timeout:.0f} s") from None


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1]


def _write_atomic(path: Path, text: str) -> None:
    write_private(path, text)  # plans and job steps hold the job's env values


def submit(script: str, run_dir: str | os.PathLike, *, env: Mapping[str, str] | None = None) -> SlurmJob:
    """``sbatch`` the script; keep it and the job id in the run folder.

    The folder must exist before the job starts (Slurm opens the output files there, and does
    not create folders); a refused job leaves no folder behind. sbatch's refusal (a partition
    that does not exist, a time limit too long) is a UsageError with sbatch's own words.
    """
    paths = SlurmPaths(Path(run_dir))
    # The outermost folder this call creates: what to remove when sbatch says no.
    created = next((p for p in reversed((paths.run_dir, *paths.run_dir.parents)) if not p.exists()), None)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = _slurm(["sbatch", "--parsable"], env=env, input=script)  # the script on stdin
        if result.returncode != 0:
            raise UsageError(f"sbatch refused the job: {_last_line(result.stderr)}")
        job_id = result.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise DisttrainError(f"sbatch answered {result.stdout.strip()!r}, not a job id")
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    _write_atomic(paths.script, script)
    _write_atomic(paths.job_id, job_id + "\n")
    return SlurmJob(job_id, paths.run_dir, env)


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    state: str
    reason: str = ""
    exit_code: int = 0
    signal: int = 0
    restarts: int = 0
    nodes: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def shell_exit_code(self) -> int:
        """``ExitCode=X:S`` → X, or 128+S for a death by signal S; 1 for a failure without either."""
        if self.exit_code:
            return self.exit_code
        if self.signal:
            return 128 + self.signal
        return 0 if self.state == "COMPLETED" else 1


def parse_status(text: str) -> JobStatus | None:
    """``scontrol show job -o ID`` → its state; None when slurmctld no longer knows the job."""
    fields = dict(re.findall(r"(?:^|\s)(JobState|Reason|ExitCode|Restarts|NodeList)=(\S*)", text))
    if "JobState" not in fields:
        return None
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobStatus(state=fields["JobState"], reason=fields.get("Reason", ""), exit_code=int(code or 0),
                     signal=int(sig or 0), restarts=int(fields.get("Restarts", "0") or 0),
                     nodes=fields.get("NodeList", ""))


class _Follower:
    """Copies what a file gains to a stream, whole lines at a time."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out = path, out
        self.offset, self.partial, self.seen = 0, b"", False

    def pump(self, final: bool = False) -> bool:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return False
        self.offset += len(data)
        self.seen = self.seen or bool(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = b"" if final else lines.pop()
        text = b"\n".join(lines).decode(errors="replace")
        if text:
            self.out.write(text if final else text + "\n")
            self.out.flush()
        return bool(data)


@dataclass
class SlurmJob:
    """A submitted batch job and its run folder."""

    job_id: str
    run_dir: Path
    env: Mapping[str, str] | None = field(default=None, repr=False)  # for the Slurm commands

    def status(self) -> JobStatus | None:
        """The job's state now; None once slurmctld has forgotten it (MinJobAge after its end)."""
        result = _slurm(["scontrol", "show", "job", "-o", self.job_id], env=self.env)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise DisttrainError(f"scontrol show job {self.job_id}: {_last_line(result.stderr)}")
        return parse_status(result.stdout)

    def cancel(self, *, wait_s: float = GONE_WAIT_S) -> bool:
        """``scancel``, then wait until the job has left the queue (its processes killed).

        False when it is still there after ``wait_s`` seconds.
        """
        _slurm(["scancel", self.job_id], env=self.env)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            result = _slurm(["squeue", "-h", "-j", self.job_id, "-o", "%T"], env=self.env)
            if not result.stdout.strip() and result.returncode == 0 or "Invalid job id" in result.stderr:
                return True
            time.sleep(POLL_S)
        return False

    def follow(self, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
               pending_timeout_s: float | None = None, stop_on_signals: bool = True) -> int:
        """Stream the job's output while it runs and return its exit code.

        SIGINT/SIGTERM (with ``stop_on_signals``) cancel the job: 128+signal. A job pending
        longer than ``pending_timeout_s`` is cancelled with an error naming Slurm's reason.
        """
        paths = SlurmPaths(self.run_dir)
        followers = [_Follower(paths.stdout, out), _Follower(paths.stderr, err)]
        caught: list[int] = []
        previous = {}
        if stop_on_signals:
            previous = {s: signal.signal(s, lambda signum, _f: caught.append(signum))
                        for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = self._watch(followers, caught, err, pending_timeout_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if caught:
            gone = self.cancel()
            for follower in followers:
                follower.pump(final=True)
            name = signal.Signals(caught[0]).name
            note = "" if gone else f" (still in the queue after {GONE_WAIT_S} s: check `squeue -j {self.job_id}`)"
            print(f"disttrain: got {name}, cancelled Slurm job {self.job_id}{note}", file=err, flush=True)
            return 128 + caught[0]
        time.sleep(POLL_S)  # the last lines may reach a shared filesystem after the job's end
        for follower in followers:
            follower.pump(final=True)
        return self._outcome(status, followers, err)

    def _watch(self, followers, caught: list[int], err: TextIO, pending_timeout_s: float | None) -> JobStatus | None:
        pending_since = said_at = started = time.monotonic()
        said = ""
        restarts = 0
        last_answer = next_status = time.monotonic()
        while not caught:
            for follower in followers:
                follower.pump()
            if time.monotonic() < next_status:
                time.sleep(POLL_S)
                continue
            next_status = time.monotonic() + STATUS_EVERY_S[time.monotonic() - started > 60]
            try:
                status = self.status()
                last_answer = time.monotonic()
            except DisttrainError as error:
                if time.monotonic() - last_answer > LOST_CONTROLLER_S:
                    raise DisttrainError(f"lost slurmctld while following Slurm job {self.job_id}: {error}; "
                                         f"the job may still run (`squeue -j {self.job_id}`)") from None
                time.sleep(POLL_S)
                continue
            if status is None or status.ended:
                return status
            if status.restarts > restarts:
                restarts = status.restarts
                print(f"disttrain: Slurm requeued job {self.job_id} (restart {restarts}); "
                      "it starts again from its newest checkpoint", file=err, flush=True)
            now = time.monotonic()
            if status.state != "PENDING":
                pending_since, said = now, ""
            else:
                if pending_timeout_s is not None and now - pending_since > pending_timeout_s:
                    self.cancel()
                    raise DisttrainError(
                        f"Slurm job {self.job_id} was still pending after {pending_timeout_s:g} s "
                        f"(reason: {status.reason}); cancelled it. Ask for fewer or other resources "
                        "(--nodes, --partition, --time), or raise --pending-timeout")
                # "None": merely not scheduled yet; anything else is worth a line.
                if status.reason not in (said, "None") or now - said_at > STILL_PENDING_EVERY_S:
                    print(f"disttrain: Slurm job {self.job_id} pending ({status.reason})", file=err, flush=True)
                    said, said_at = status.reason, now
            time.sleep(POLL_S)
        return None

    def _outcome(self, status: JobStatus | None, followers, err: TextIO) -> int:
        if status is None:
            print(f"disttrain: slurmctld no longer knows Slurm job {self.job_id}: its exit code is lost; "
                  f"its output is in {self.run_dir}", file=err, flush=True)
            return 1
        code = status.shell_exit_code()
        if status.state in WHY:
            print(f"disttrain: Slurm job {self.job_id} {WHY[status.state]} (exit {code})", file=err, flush=True)
        if not any(f.seen for f in followers) and status.state != "COMPLETED":
            print(f"disttrain: Slurm job {self.job_id} ended {status.state} ({status.reason}) without any output "
                  f"in {followers[0].path} or {followers[1].path}: see `scontrol show job {self.job_id}` "
                  f"and the slurmd log of {status.nodes or 'its node'}", file=err, flush=True)
        return code
