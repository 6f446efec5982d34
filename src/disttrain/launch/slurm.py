"""``--launcher slurm`` outside an allocation: a batch job (:class:`SlurmBatchLauncher`).

Render an sbatch script, submit it, follow it, cancel it. The script is what a user would
write by hand -- ``#SBATCH`` lines, then one command, ``disttrain batch-step``, which runs on
the allocation's first node and launches there with
:class:`~disttrain.launch.slurm_alloc.SlurmAllocationLauncher` (also what ``disttrain run``
uses inside a ``salloc`` shell). The batch step (:class:`~disttrain.wire.BatchStep`: the launch
spec as :meth:`LaunchSpec.to_json` wrote it, not re-rendered flags, and how to rebuild the
client's event sink there -- a job's runner adds its variables) travels in the job's
environment (:data:`~disttrain.launch.base.BATCH_STEP_ENV`), the way Slurm carries every variable of
a job: it may hold ``--env`` values, so it is never written to the run folder. How the batch step
ended comes back in the run folder (:class:`~disttrain.wire.BatchStepEnded`).
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from ..atomic import write_atomic
from ..config.launch import LaunchSpec
from ..errors import DisttrainError, UsageError
from ..wire import BatchStepEnded, Outcome
from .base import BATCH_STEP_ENV, BatchLauncher, Events, LaunchContext
from .local import check_entry

SLURM_TIMEOUT_S = 60  # any one sbatch/scontrol/scancel call
POLL_S = 0.5  # the output files
STATUS_EVERY_S = (0.5, 3.0)  # scontrol: often in the first minute, then gently on slurmctld
LOST_CONTROLLER_S = 120  # scontrol failing this long ends `follow` with an error
SETTLE_S = 10  # a job seen COMPLETING: how long to wait for its final state and reason
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
            if arg.startswith("--export"):
                raise UsageError(f"--sbatch-arg={arg}: disttrain carries the environment itself (every exported "
                                 "variable, see --no-forward-env and --env); drop it")


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

    @property
    def outcome(self) -> Path:
        """How the launch inside the allocation ended (:class:`~disttrain.wire.BatchStepEnded`)."""
        return self.run_dir / "outcome.json"


def with_requeue_checkpoints(spec: LaunchSpec, options: SlurmOptions, run_dir: str) -> LaunchSpec:
    """A requeued job must find the checkpoints of its first run: without ``--checkpoint-dir``
    they go to the run folder, whose path is fixed in the script."""
    if options.requeue and not spec.checkpoint_dir:
        return replace(spec, checkpoint_dir=str(SlurmPaths(Path(run_dir)).checkpoints))
    return spec


def _directive(option: str) -> str:
    # sbatch reads #SBATCH lines itself: words split on blanks, double quotes group them.
    return f'#SBATCH "{option}"' if re.search(r"\s", option) else f"#SBATCH {option}"


def render_sbatch(spec: LaunchSpec, options: SlurmOptions, *, run_dir: str, python: str, cwd: str) -> str:
    """The batch script for ``spec``; pure, so ``--dry-run`` prints exactly what is submitted.

    Its one command reads the spec from the job's environment (:data:`BATCH_STEP_ENV`), where
    :func:`submit` puts it.
    """
    paths = SlurmPaths(Path(run_dir))
    name = re.sub(r"[^\w.-]", "_", options.job_name or Path(spec.entry).stem or "disttrain")
    # An elastic range (--nnodes MIN:MAX): Slurm may start the job on MIN to MAX nodes, and keeps
    # it running when one of them fails (--no-kill): the batch step goes on with the others.
    nodes = f"{spec.min_nnodes}-{options.nodes}" if spec.elastic else str(options.nodes)
    directives = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        # the task is a node's agent; it starts the workers. (With a range, one task per node would
        # make sbatch count MIN tasks, which caps the nodes at MIN: the range gets all it can.)
        *(["--no-kill"] if spec.elastic else ["--ntasks-per-node=1"]),
        "--exclusive",  # -n auto and OMP_NUM_THREADS count the node's cores: the job takes them all
        f"--chdir={cwd}",
        f"--output={paths.stdout}",
        f"--error={paths.stderr}",
        "--open-mode=append",  # a requeued run adds to its first run's output
        "--export=ALL",  # the batch step travels in the environment, whatever SBATCH_EXPORT says
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
    command = [python, "-m", "disttrain", "batch-step"]
    lines = [
        "#!/bin/bash",
        "# Rendered by `disttrain run --launcher slurm`. Inside the allocation, the batch step finds the",
        "# nodes in Slurm's environment and starts one torch elastic agent per node with srun;",
        "# the master is the first node, at its address toward the others found on that node.",
        f"# The launch spec is in the job's environment ({BATCH_STEP_ENV}; it may hold --env values).",
        *map(_directive, directives),
        f"exec {shlex.join(command)}",
        "",
    ]
    return "\n".join(lines)


def slurm_command(argv: Sequence[str], *, timeout: float = SLURM_TIMEOUT_S, env: Mapping[str, str] | None = None,
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
        return 0 if self.state in ("COMPLETED", "COMPLETING") else 1


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
    interrupted: int | None = None  # the signal on which `follow` cancelled the job
    requeue: bool = False  # submitted with --requeue: COMPLETING may be a requeue, not the end

    def status(self) -> JobStatus | None:
        """The job's state now; None once slurmctld has forgotten it (MinJobAge after its end)."""
        result = slurm_command(["scontrol", "show", "job", "-o", self.job_id], env=self.env)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise DisttrainError(f"scontrol show job {self.job_id}: {_last_line(result.stderr)}")
        return parse_status(result.stdout)

    def cancel(self, *, wait_s: float = GONE_WAIT_S) -> bool:
        """``scancel``, then wait until the job has left the queue (its processes killed).

        False when it is still there after ``wait_s`` seconds.
        """
        slurm_command(["scancel", self.job_id], env=self.env)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            result = slurm_command(["squeue", "-h", "-j", self.job_id, "-o", "%T"], env=self.env)
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
            self.interrupted = caught[0]
            gone = self.cancel()
            for follower in followers:
                follower.pump(final=True)
            name = signal.Signals(caught[0]).name
            note = "" if gone else f" (still in the queue after {GONE_WAIT_S} s: check `squeue -j {self.job_id}`)"
            print(f"disttrain: got {name}, cancelled Slurm job {self.job_id}{note}", file=err, flush=True)
            return 128 + caught[0]
        status = self._settled(status)
        for follower in followers:
            follower.pump(final=True)
        return self._outcome(status, followers, err)

    def _settled(self, status: JobStatus | None) -> JobStatus | None:
        """The final state of a job last seen COMPLETING (its epilog running): FAILED and its reason
        come within seconds -- or after SlurmdTimeout where a node is gone, hence SETTLE_S."""
        deadline = time.monotonic() + SETTLE_S
        time.sleep(POLL_S)  # also: the last lines may reach a shared filesystem after the job's end
        while status is not None and status.state == "COMPLETING" and time.monotonic() < deadline:
            try:
                status = self.status() or status  # forgotten already: what it ended with is still known
            except DisttrainError:
                break
            time.sleep(POLL_S)
        return status

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
            if status is None or status.ended or (status.state == "COMPLETING" and not self.requeue):
                # COMPLETING: the batch script ended (its exit code is known) and Slurm cleans up the
                # nodes -- for as long as SlurmdTimeout when one of them is gone (an elastic job's).
                # A requeued job passes through COMPLETING too, on its way back to PENDING: a job
                # that may be requeued is followed until a state that is final.
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


# --- submitting a batch job ----------------------------------------------------------------


class SlurmBatchLauncher(BatchLauncher):
    """sbatch, then follow. The nodes are placed inside the allocation, by the batch step the script
    runs (:func:`disttrain.launch.slurm_alloc.run_batch_step`)."""

    name = "slurm"

    def __init__(self, options: SlurmOptions, *, no_wait: bool = False, pending_timeout_s: float | None = None,
                 stop_on_signals: bool = True, env: Mapping[str, str] | None = None) -> None:
        self.options = options
        self.nodes = options.nodes
        self.no_wait = no_wait
        self.pending_timeout_s = pending_timeout_s
        self.stop_on_signals = stop_on_signals  # False: the client handles SIGTERM/SIGINT itself
        self.env = env  # for the Slurm commands (a test's cluster)

    def script(self, spec: LaunchSpec, ctx: LaunchContext) -> str:
        check_entry(spec, ctx.cwd)  # a shared filesystem is Slurm's norm: the nodes see it where we do
        return render_sbatch(spec, self.options, run_dir=ctx.run_dir, python=ctx.python, cwd=ctx.cwd)

    def shipped(self, spec: LaunchSpec, ctx: LaunchContext) -> LaunchSpec:
        return with_requeue_checkpoints(spec, self.options, ctx.run_dir)

    def submission_argv(self) -> list[str]:
        return ["sbatch", "--parsable"]  # the script on stdin

    def job_id_from(self, output: str) -> str:
        job_id = output.strip().split(";")[0]
        if not job_id.isdigit():
            raise DisttrainError(f"sbatch answered {output.strip()!r}, not a job id")
        return job_id

    def command(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                input: str | None = None) -> subprocess.CompletedProcess:
        return slurm_command(argv, env=env, input=input)

    def job_env(self, env: dict[str, str]) -> dict[str, str]:
        env.pop("SBATCH_EXPORT", None)  # it would override the script's --export=ALL
        return env

    def keep(self, run_dir: Path, script: str, job_id: str) -> None:
        paths = SlurmPaths(run_dir)
        write_atomic(paths.script, script)
        write_atomic(paths.job_id, job_id + "\n")

    def follow(self, job_id: str, events: Events, ctx: LaunchContext) -> Outcome:
        job = SlurmJob(job_id, Path(ctx.run_dir), self.env, requeue=self.options.requeue)
        try:
            code = job.follow(out=_Tee(sys.stdout, events.transcript), err=_Tee(sys.stderr, events.transcript),
                              pending_timeout_s=self.pending_timeout_s, stop_on_signals=self.stop_on_signals)
        except BaseException:
            gone = job.cancel()
            events.say(f"disttrain: cancelled Slurm job {job.job_id}"
                       + ("" if gone else f" (still in the queue: check `squeue -j {job.job_id}`)"))
            raise
        if job.interrupted:  # follow cancelled the job and said so; the batch step's own end is moot
            return Outcome(exit_code=code)
        paths = SlurmPaths(Path(ctx.run_dir))
        if paths.outcome.exists():
            ended = BatchStepEnded.from_line(paths.outcome.read_text())
            events.ran_on(ended.where)  # the nodes the batch step placed the job on
            return ended.outcome
        if not code:
            return Outcome(exit_code=0)
        # The batch step ended before its launch did (a bad node, no disttrain there): its own words are last.
        lines = paths.stderr.read_text(errors="replace").strip().splitlines() if paths.stderr.exists() else []
        report = (f"Slurm job {job.job_id} exited with code {code} before its nodes ended: "
                  f"{lines[-1] if lines else 'no output'} (see {paths.stderr})")
        return Outcome(exit_code=code, report=report)


def record_end(run_dir: str, ended: BatchStepEnded) -> None:
    """Inside the allocation: how the launch ended, for the submitting side to read."""
    write_atomic(SlurmPaths(Path(run_dir)).outcome, ended.to_line() + "\n")


class _Tee:
    """The job's output to the terminal and to the client's transcript (``jobs logs``)."""

    def __init__(self, stream: TextIO, transcript: TextIO | None) -> None:
        self.streams = (stream,) if transcript is None else (stream, transcript)

    def write(self, text: str) -> None:
        for stream in self.streams:
            stream.write(text if text.endswith("\n") else text + "\n")

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
