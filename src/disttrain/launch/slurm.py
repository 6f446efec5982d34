"""``--launcher slurm``: Slurm, all in one module.

Two launchers share it:

- :class:`SlurmBatchLauncher` (outside an allocation): render an sbatch script, submit it,
  follow it, cancel it. The script is what a user would write by hand -- ``#SBATCH`` lines,
  then one command, ``disttrain launch-step``, which runs on the allocation's first node.
  The step -- the launch spec as :meth:`LaunchSpec.to_json` wrote it, not re-rendered
  flags, and how to rebuild the client's event sink there (a job's runner adds its
  variables) -- travels in the job's environment (:data:`STEP_ENV`), the way Slurm carries
  every variable of a job: it may hold ``--env`` values, so it is never written to the
  run folder.
- :class:`SlurmAllocationLauncher` (inside one: the batch script, a ``salloc`` shell): one
  torch elastic agent per allocated node, each started by its own ``srun`` so that the first
  node to fail is known and the others are stopped through the shared flow.

The master is the first node, at the address that node uses toward the second node's
``NodeAddr``, found on the first node itself (a node's own hostname often resolves to
127.0.x.1). Each node reports its facts (``disttrain probe`` in one srun step) and is
planned for as ``--hosts`` are.

The environment follows the rule of every launcher (:func:`disttrain.workerenv.forwarded_env`),
not Slurm's ``--export=ALL``: the agents' srun exports only the bootstrap names, and the
forwarded values travel with the plan on the agent's stdin, as over ssh.
"""

from __future__ import annotations

import json
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

from ..atomic import write_atomic
from ..config.hosts import Host
from ..config.launch import LaunchSpec
from ..errors import DisttrainError, UsageError
from ..plan.launch import LaunchPlan, NodeFacts
from ..preflight.checks import fact_checks, first_failure
from ..preflight.facts import route_to
from ..wire import LaunchStep, StepEnded
from ..workerenv import BOOTSTRAP_NAMES, forwarded_env
from .base import Context, Events, Facts, Launcher, Outcome
from .flow import agent_argv, run_agents
from .local import check_entry
from .slurm_env import SlurmAllocation

SLURM_TIMEOUT_S = 60  # any one sbatch/scontrol/scancel call
POLL_S = 0.5  # the output files
STATUS_EVERY_S = (0.5, 3.0)  # scontrol: often in the first minute, then gently on slurmctld
LOST_CONTROLLER_S = 120  # scontrol failing this long ends `follow` with an error
GONE_WAIT_S = 120  # after scancel: until the job's processes are gone (KillWait is 30 s by default)
STILL_PENDING_EVERY_S = 300
STEP_ENV = "DISTTRAIN_LAUNCH_STEP"  # the step, in the batch job's environment (see the module's doc)
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
        """How the launch inside the allocation ended (:class:`~disttrain.wire.StepEnded`)."""
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

    Its one command reads the spec from the job's environment (:data:`STEP_ENV`), where
    :func:`submit` puts it.
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
        "--export=ALL",  # the step travels in the environment, whatever SBATCH_EXPORT says
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
    command = [python, "-m", "disttrain", "launch-step"]
    lines = [
        "#!/bin/bash",
        "# Rendered by `disttrain run --launcher slurm`. Inside the allocation, the step finds the",
        "# nodes in Slurm's environment and starts one torch elastic agent per node with srun;",
        "# the master is the first node, at its address toward the others found on that node.",
        f"# The launch spec is in the job's environment ({STEP_ENV}; it may hold --env values).",
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


def submit(script: str, run_dir: str | os.PathLike, *, step: str, env: Mapping[str, str] | None = None) -> SlurmJob:
    """``sbatch`` the script with ``step`` in its environment; keep the script and the job id
    in the run folder.

    The folder must exist before the job starts (Slurm opens the output files there, and does
    not create folders); a refused job leaves no folder behind. sbatch's refusal (a partition
    that does not exist, a time limit too long) is a UsageError with sbatch's own words.
    """
    paths = SlurmPaths(Path(run_dir))
    # The outermost folder this call creates: what to remove when sbatch says no.
    created = next((p for p in reversed((paths.run_dir, *paths.run_dir.parents)) if not p.exists()), None)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        # Values go through sbatch's environment, never its argv (which `ps` shows).
        job_env = {**(os.environ if env is None else env), STEP_ENV: step}
        job_env.pop("SBATCH_EXPORT", None)  # it would override the script's --export=ALL
        result = _slurm(["sbatch", "--parsable"], env=job_env, input=script)  # the script on stdin
        if result.returncode != 0:
            raise UsageError(f"sbatch refused the job: {_last_line(result.stderr)}")
        job_id = result.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise DisttrainError(f"sbatch answered {result.stdout.strip()!r}, not a job id")
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    write_atomic(paths.script, script)
    write_atomic(paths.job_id, job_id + "\n")
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
    interrupted: int | None = None  # the signal on which `follow` cancelled the job

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
            self.interrupted = caught[0]
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


# --- inside an allocation ------------------------------------------------------------------

PROBE_TIMEOUT_S = 180  # an srun step that imports torch on every node
_LABELLED = re.compile(r"^\s*(\d+): (.*)$")


def job_port(job_id: str) -> int:
    """The rendezvous port when none is given: fixed per job, so two jobs sharing a node
    are unlikely to meet; checked free on the master before the launch."""
    return 29500 + int(job_id) % 1000 if job_id.isdigit() else 29500


def node_address(name: str) -> str:
    """The address slurm.conf gives node ``name`` (NodeAddr; the name itself by default)."""
    result = _slurm(["scontrol", "show", "node", "-o", name])
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", result.stdout)
    return match[1] if result.returncode == 0 and match else name


def _probe(nodes: tuple[str, ...], *, python: str, master: str, port: int | None, paths: Sequence[str],
           cwd: str) -> list[dict]:
    """``disttrain probe`` on each of ``nodes`` in one srun step; their facts in node order."""
    n = len(nodes)
    argv = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
            "--label", python, "-m", "disttrain", "probe", "--master", master, "--cwd", cwd]
    if port is not None:
        argv += ["--port", str(port)]
    for path in paths:
        argv += ["--path", path]
    result = _slurm(argv, timeout=PROBE_TIMEOUT_S)
    if result.returncode != 0:
        raise DisttrainError(f"asking the nodes {','.join(nodes)} for their facts (srun ... disttrain probe) "
                             f"failed with exit {result.returncode}: {_last_line(result.stderr)}; is disttrain "
                             f"installed on every node at {python}?")
    facts: dict[int, dict] = {}
    for line in result.stdout.splitlines():
        match = _LABELLED.match(line)
        if match and match[2].startswith("{"):
            facts[int(match[1])] = json.loads(match[2])  # tasks 0..n-1 are the nodes in order
    missing = [nodes[i] for i in range(n) if i not in facts]
    if missing:
        raise DisttrainError(f"no facts from {', '.join(missing)} (srun ... disttrain probe): "
                             f"{_last_line(result.stderr) or 'no output'}")
    return [facts[i] for i in range(n)]


def find_master(alloc: SlurmAllocation, nodes: tuple[str, ...], *, python: str, cwd: str) -> str:
    """The first node's address toward the second, found on the first node."""
    if len(nodes) == 1:
        return "127.0.0.1"
    peer = node_address(nodes[1])
    if alloc.this_node == nodes[0]:  # the batch script runs on the first node
        try:
            return route_to(peer)[0]
        except OSError as err:
            raise DisttrainError(f"{nodes[0]}: no route to {nodes[1]} at {peer}: {err}") from None
    return _probe(nodes[:1], python=python, master=peer, port=None, paths=[], cwd=cwd)[0]["address"]


def agent_srun_argv(node: str, *, python: str, cpus: int | None, environ: Mapping[str, str]) -> list[str]:
    """One node's agent as a one-task job step on that node, with the node's CPUs; its plan,
    the forwarded variables' values included, comes on stdin (srun hands its stdin to the one
    task). srun exports the bootstrap names only (and Slurm's own SLURM_*), not the
    launching shell: the environment rule is applied by the plan, as for every launcher."""
    names = [name for name in BOOTSTRAP_NAMES if name in environ]
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--unbuffered",
            f"--export={','.join(names) or 'NONE'}"]
    if cpus:
        argv.append(f"--cpus-per-task={cpus}")
    return [*argv, *agent_argv(python)]


class SlurmAllocationLauncher(Launcher):
    """The first ``nodes`` nodes of the allocation this process runs in, one agent each."""

    name = "slurm"

    def __init__(self, alloc: SlurmAllocation, *, nodes: int | None = None) -> None:
        if nodes is not None and nodes > len(alloc.nodes):
            raise UsageError(f"--nodes {nodes}: Slurm job {alloc.job_id} has only {len(alloc.nodes)} node(s)")
        self.alloc = alloc
        self.names = alloc.nodes[: nodes or len(alloc.nodes)]
        self.note = f"Slurm job {alloc.job_id}"

    def facts(self, spec: LaunchSpec, ctx: Context) -> Facts:
        check_entry(spec, ctx.cwd)  # a shared filesystem is Slurm's norm: the nodes see it where we do
        alloc, names = self.alloc, self.names
        master = spec.master_addr or find_master(alloc, names, python=ctx.python, cwd=ctx.cwd)
        port = spec.master_port or job_port(alloc.job_id)
        facts = _probe(names, python=ctx.python, master=master, port=port, paths=ctx.paths, cwd=ctx.cwd)
        failed = first_failure(fact_checks([Host(name=name) for name in names], facts, master_port=port))
        if failed:
            raise UsageError(f"{failed.host}: {failed.detail}; fix: {failed.fix}")
        multi = len(names) > 1
        cpus = alloc.cpus_per_node[: len(names)] or tuple(f["cpus"] for f in facts)
        nodes = tuple(
            NodeFacts(
                hostname=name,
                cpus=cpu,
                cuda_devices=alloc.gpus_per_node if alloc.gpus_per_node is not None else f["cuda_devices"],
                # One node talks over loopback; several over the route each found to the master.
                socket_ifname=f["ifname"] if multi else None,
                address=f["address"] if multi else None,
            )
            for name, cpu, f in zip(names, cpus, facts)
        )
        return Facts(nodes=nodes, master_addr=master, master_port=port, where=names,
                     forwarded_env=forwarded_env(ctx.environ, everything=spec.forward_env))

    def launch(self, plan: LaunchPlan, events: Events, ctx: Context) -> Outcome:
        cpus = self.alloc.cpus_per_node or (None,) * len(plan.nodes)
        commands = [agent_srun_argv(node.host, python=ctx.python, cpus=cpus[i], environ=ctx.environ)
                    for i, node in enumerate(plan.nodes)]
        outcome = run_agents(plan, commands, cwd=ctx.cwd, transcript=events.transcript)
        if outcome.failed is not None and not outcome.report and not outcome.signal:
            host = plan.nodes[outcome.failed].host
            events.say(f"disttrain: the agent on {host} (srun) exited with code {outcome.exit_code}; "
                       "the other nodes were stopped")
        return outcome


# --- submitting a batch job ----------------------------------------------------------------


class SlurmBatchLauncher(Launcher):
    """sbatch, then follow. Placing happens inside the allocation (the nodes are not known
    before), so this launcher ships the spec there instead of a plan: :meth:`run` is its own."""

    name = "slurm"

    def __init__(self, options: SlurmOptions, *, no_wait: bool = False, pending_timeout_s: float | None = None,
                 stop_on_signals: bool = True, env: Mapping[str, str] | None = None) -> None:
        self.options = options
        self.no_wait = no_wait
        self.pending_timeout_s = pending_timeout_s
        self.stop_on_signals = stop_on_signals  # False: the client handles SIGTERM/SIGINT itself
        self.env = env  # for the Slurm commands (a test's cluster)

    def facts(self, spec: LaunchSpec, ctx: Context) -> Facts:
        raise UsageError("a Slurm batch job is placed inside its allocation: nothing to plan before submitting")

    def launch(self, plan: LaunchPlan, events: Events, ctx: Context) -> Outcome:
        raise UsageError("a Slurm batch job is launched inside its allocation")

    def script(self, spec: LaunchSpec, ctx: Context) -> str:
        check_entry(spec, ctx.cwd)  # a shared filesystem is Slurm's norm: the nodes see it where we do
        return render_sbatch(spec, self.options, run_dir=ctx.run_dir, python=ctx.python, cwd=ctx.cwd)

    def dry_run(self, spec: LaunchSpec, ctx: Context) -> str:
        return self.script(spec, ctx)

    def run(self, spec: LaunchSpec, ctx: Context, events: Events) -> Outcome:
        spec = with_requeue_checkpoints(spec, self.options, ctx.run_dir)
        step = LaunchStep(spec=spec, run_id=ctx.run_id, run_dir=ctx.run_dir, cwd=ctx.cwd, python=ctx.python,
                          paths=tuple(ctx.paths), nodes=self.options.nodes, client=events.step())
        job = submit(self.script(spec, ctx), ctx.run_dir, step=step.to_line(), env=self.env)
        events.submitted(job.job_id, ctx.run_dir)
        if self.no_wait:
            return Outcome(exit_code=0)
        try:
            code = job.follow(out=_Tee(sys.stdout, events.transcript), err=_Tee(sys.stderr, events.transcript),
                              pending_timeout_s=self.pending_timeout_s, stop_on_signals=self.stop_on_signals)
        except BaseException:
            gone = job.cancel()
            events.say(f"disttrain: cancelled Slurm job {job.job_id}"
                       + ("" if gone else f" (still in the queue: check `squeue -j {job.job_id}`)"))
            raise
        if job.interrupted:  # follow cancelled the job and said so; the step's own end is moot
            return Outcome(exit_code=code)
        paths = SlurmPaths(Path(ctx.run_dir))
        if paths.outcome.exists():
            ended = StepEnded.from_line(paths.outcome.read_text())
            events.ran_on(ended.where)  # the nodes the step placed the job on
            return ended.outcome
        if not code:
            return Outcome(exit_code=0)
        # The step ended before its launch did (a bad node, no disttrain there): its own words are last.
        lines = paths.stderr.read_text(errors="replace").strip().splitlines() if paths.stderr.exists() else []
        report = (f"Slurm job {job.job_id} exited with code {code} before its nodes ended: "
                  f"{lines[-1] if lines else 'no output'} (see {paths.stderr})")
        return Outcome(exit_code=code, report=report)


def record_end(run_dir: str, ended: StepEnded) -> None:
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
