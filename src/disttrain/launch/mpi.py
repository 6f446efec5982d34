"""``distribution={'mpi': {...}}``: Open MPI's ``mpirun`` across a job's instances.

:class:`MpiLauncher` places like the instances launcher (a job's instances on this machine) and
launches with Open MPI instead of torch's agents: a pure function turns the placed plan
into one ``mpirun`` argv — one application context per instance, ``processes_per_host``
ranks each — and a small wrapper (``python -m disttrain.launch.mpi ENV.json -- ...``) gives
every rank its instance's environment (the ``SM_*`` contract) before ``exec``ing the script,
inside the instance's private ``/opt/ml`` (the same :mod:`disttrain.agent.optml` prefix a
node's agent puts before its workers). As SageMaker's toolkit does,
``custom_mpi_options`` are added to mpirun's own arguments.

Needs Open MPI (``apt-get install openmpi-bin``; mpi4py for the script: ``disttrain[mpi]``).
Runs the instances of launcher ``local``; other launchers are refused before anything runs.
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
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..agent.optml import instance_prefix
from ..atomic import write_atomic
from ..config.launch import LaunchSpec
from ..errors import UsageError
from ..plan.launch import LaunchPlan
from ..preflight.facts import local_facts
from ..wire import InstanceEnv, Outcome
from .base import AgentLauncher, Events, Facts, LaunchContext
from .local import choose_port, instance_nodes, own_gpus

STOP_GRACE_S = 15
WRAPPER = "disttrain.launch.mpi"


def find_mpirun() -> str:
    path = shutil.which("mpirun")
    if not path:
        raise UsageError("distribution mpi needs Open MPI's mpirun: apt-get install -y openmpi-bin libopenmpi-dev "
                         "(and pip install 'disttrain[mpi]' for mpi4py)")
    return path


def mpirun_argv(*, mpirun: str, ranks_per_instance: int, instance_envs: Sequence[Path],
                prefixes: Sequence[Sequence[str]], worker_argv: Sequence[str], custom_mpi_options: str,
                as_root: bool) -> list[str]:
    """One mpirun for the whole job: an application context per instance (MPMD, ``:``-separated).

    ``custom_mpi_options`` go into every context: mpirun applies per-context options such as
    ``-x NAME=VALUE`` to the one context they stand in, and takes global ones given again."""
    argv = [mpirun, "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if as_root:
        argv.append("--allow-run-as-root")
    custom = shlex.split(custom_mpi_options)
    for index, (env_file, prefix) in enumerate(zip(instance_envs, prefixes)):
        if index:
            argv.append(":")
        argv += ["-np", str(ranks_per_instance), *custom, *prefix,
                 sys.executable, "-m", WRAPPER, str(env_file), "--", *worker_argv]
    return argv


def write_instance_env(path: Path, env: dict[str, str]) -> Path:
    return write_atomic(path, InstanceEnv(env=env).to_line() + "\n", mode=0o600)  # the job's env values: owner only


class Untag:
    """mpirun's ``--tag-output`` stream → ``[algo-K rankN] line`` lines.

    mpirun tags every *write* of a rank, not every line (``[1,0]<stdout>:text[1,0]<stdout>:\n``
    for one ``print``), so text is gathered per rank until its newline.
    """

    def __init__(self, hosts: Sequence[str], ranks_per_instance: int) -> None:
        self.hosts, self.per = hosts, ranks_per_instance
        self.pending: dict[int, str] = {}

    def prefix(self, rank: int) -> str:
        host = self.hosts[min(rank // self.per, len(self.hosts) - 1)]
        return f"[{host} rank{rank}] "

    def feed(self, raw: str) -> list[str]:
        parts = TAG.split(raw)
        lines = [parts[0]] if parts[0].strip() else []  # mpirun's own words
        for rank_text, text in zip(parts[1::2], parts[2::2]):
            rank = int(rank_text)
            buffer = self.pending.get(rank, "") + text
            *done, self.pending[rank] = buffer.split("\n")
            lines += [self.prefix(rank) + line + "\n" for line in done]
        return lines

    def flush(self) -> list[str]:
        left = [self.prefix(r) + text + "\n" for r, text in sorted(self.pending.items()) if text]
        self.pending.clear()
        return left


TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:")
# What mpirun says of the first rank to fail (Open MPI 4 and 5): a name and an exit code on two lines,
# or one line for a signal.
FAILED_NAME = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]")
FAILED_CODE = re.compile(r"Exit code:\s*(\d+)")
FAILED_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)(?: \(([^)]*)\))?")


class FirstFailure:
    """The rank mpirun names as the first to fail, read from its own lines as they are relayed."""

    def __init__(self, untag: Untag) -> None:
        self.untag = untag
        self.rank: int | None = None
        self.what = ""

    def feed(self, line: str) -> None:
        if self.what:
            return
        if (found := FAILED_SIGNAL.search(line)):
            name = f" ({found.group(3)})" if found.group(3) else ""
            self.rank, self.what = int(found.group(1)), f"was killed by signal {found.group(2)}{name}"
        elif (found := FAILED_NAME.search(line)):
            self.rank = int(found.group(1))
        elif self.rank is not None and (found := FAILED_CODE.search(line)):
            self.what = f"exited with code {found.group(1)}"

    def report(self, code: int) -> str:
        if not self.what:
            return f"disttrain: mpirun exited with code {code}"
        where = self.untag.prefix(self.rank).strip()[1:-1]  # "algo-2 rank1"
        return f"disttrain: {where} {self.what}, the first to fail; mpirun stopped the others (exit code {code})"


def run_mpirun(argv: list[str], *, cwd: str, transcript: TextIO | None, hosts: Sequence[str],
               ranks_per_instance: int):
    """Run mpirun to the end, relaying its output (to the terminal and the job's transcript);
    SIGINT/SIGTERM stop it (mpirun forwards the signal to every rank)."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lock = threading.Lock()
    untag = Untag(hosts, ranks_per_instance)
    first = FirstFailure(untag)

    def emit(lines: list[str]) -> None:
        with lock:
            for line in lines:
                first.feed(line)
                sys.stdout.write(line)
                if transcript is not None:
                    transcript.write(line)
            sys.stdout.flush()
            if transcript is not None:
                transcript.flush()

    def pump() -> None:
        for raw in iter(proc.stdout.readline, ""):
            emit(untag.feed(raw))
        emit(untag.flush())

    relay = threading.Thread(target=pump, daemon=True)
    relay.start()
    interrupted: list[int] = []

    def on_signal(signum, _frame) -> None:
        interrupted.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait(timeout=STOP_GRACE_S if interrupted else None)
                break
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.join(timeout=5)
    if interrupted:
        return Outcome(exit_code=128 + interrupted[0], signal=interrupted[0])
    code = code if code >= 0 else 128 - code
    return Outcome(exit_code=code, report="" if code == 0 else first.report(code))


class MpiLauncher(AgentLauncher):
    """A job's instances on this machine, started by one ``mpirun`` (``distribution={'mpi': ...}``)."""

    name = "mpi"

    def __init__(self, *, instances: tuple[str, ...], ranks_per_instance: int,
                 custom_mpi_options: str = "") -> None:
        self.instances = tuple(instances)
        self.ranks_per_instance = ranks_per_instance
        self.custom_mpi_options = custom_mpi_options

    def facts(self, spec: LaunchSpec, ctx: LaunchContext) -> Facts:
        """This machine, shared by the instances as :class:`~disttrain.launch.local.InstancesLauncher`
        shares it (mpirun starts the ranks: no agent process asks)."""
        missing = [path for path in ctx.paths if not (Path(ctx.cwd) / path).exists()]
        if missing:
            raise UsageError(f"{missing[0]} not found in {ctx.cwd}")
        here = local_facts()
        return Facts(nodes=instance_nodes(self.instances, cpus=here.cpus, gpus=here.cuda_devices),
                     master_addr="127.0.0.1", master_port=choose_port(spec),
                     where=(here.name,) * len(self.instances))

    def place(self, spec: LaunchSpec, facts: Facts, ctx: LaunchContext) -> LaunchPlan:
        return own_gpus(super().place(spec, facts, ctx), facts.nodes[0].cuda_devices)

    def launch(self, plan: LaunchPlan, events: Events, ctx: LaunchContext) -> Outcome:
        folder = Path(ctx.run_dir) / "mpi"
        envs = [write_instance_env(folder / f"{host}.env.json", plan.worker_env(node))
                for host, node in zip(self.instances, plan.nodes)]
        prefixes = [instance_prefix(node.opt_ml, required=node.opt_ml_required, host=node.name, say=events.say)
                    if node.opt_ml else [] for node in plan.nodes]  # the ranks run here, on this machine
        argv = mpirun_argv(mpirun=find_mpirun(), ranks_per_instance=self.ranks_per_instance, instance_envs=envs,
                           prefixes=prefixes,
                           worker_argv=plan.argv, custom_mpi_options=self.custom_mpi_options,
                           as_root=os.geteuid() == 0)
        write_atomic(folder / "mpirun.json", json.dumps(argv, indent=1))  # what ran, for `jobs show`
        return run_mpirun(argv, cwd=ctx.cwd, transcript=events.transcript, hosts=self.instances,
                          ranks_per_instance=self.ranks_per_instance)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m disttrain.launch.mpi ENV.json -- COMMAND...``: one rank, its instance's environment."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m disttrain.launch.mpi ENV.json -- COMMAND...")
    with open(argv[0]) as fh:
        os.environ.update(InstanceEnv.from_line(fh.read()).env)
    # torchrun-style names too, so a script that reads RANK/WORLD_SIZE runs under mpi as well
    for mpi_name, name in (("OMPI_COMM_WORLD_RANK", "RANK"), ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
                           ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"),
                           ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")):
        if mpi_name in os.environ:
            os.environ.setdefault(name, os.environ[mpi_name])
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main()
