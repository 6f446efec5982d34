"""``distribution={'mpi': {...}}``: Open MPI's ``mpirun`` across a job's instances.

Self-contained until the launch layer lands (then :func:`mpirun_argv` is that launcher's
plan step and :func:`run_mpirun` its launch step): a pure function turns the placed plan
into one ``mpirun`` argv — one application context per instance, ``processes_per_host``
ranks each — and a small wrapper (``python -m disttrain.jobs.mpi ENV.json -- ...``) gives
every rank its instance's environment (the ``SM_*`` contract) before ``exec``ing the script,
inside the instance's private ``/opt/ml`` when one is made. As SageMaker's toolkit does,
``custom_mpi_options`` are added to mpirun's own arguments.

Needs Open MPI (``apt-get install openmpi-bin``; mpi4py for the script: ``disttrain[mpi]``).
Runs the instances of backend ``local``; other backends are refused before anything runs.
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

from ..errors import UsageError

STOP_GRACE_S = 15
WRAPPER = "disttrain.jobs.mpi"


def find_mpirun() -> str:
    path = shutil.which("mpirun")
    if not path:
        raise UsageError("distribution mpi needs Open MPI's mpirun: apt-get install -y openmpi-bin libopenmpi-dev "
                         "(and pip install 'disttrain[mpi]' for mpi4py)")
    return path


def mpirun_argv(*, mpirun: str, ranks_per_instance: int, instance_envs: Sequence[Path],
                prefixes: Sequence[Sequence[str]], worker_argv: Sequence[str], custom_mpi_options: str,
                as_root: bool) -> list[str]:
    """One mpirun for the whole job: an application context per instance (MPMD, ``:``-separated)."""
    argv = [mpirun, "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if as_root:
        argv.append("--allow-run-as-root")
    argv += shlex.split(custom_mpi_options)
    for index, (env_file, prefix) in enumerate(zip(instance_envs, prefixes)):
        if index:
            argv.append(":")
        argv += ["-np", str(ranks_per_instance), *prefix,
                 sys.executable, "-m", WRAPPER, str(env_file), "--", *worker_argv]
    return argv


def write_instance_env(path: Path, env: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(env))
    return path


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


def run_mpirun(argv: list[str], *, cwd: str, transcript: TextIO | None, hosts: Sequence[str],
               ranks_per_instance: int):
    """Run mpirun to the end, relaying its output (to the terminal and the job's transcript);
    SIGINT/SIGTERM stop it (mpirun forwards the signal to every rank)."""
    from ..backends.ssh_launch import AgentsOutcome

    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lock = threading.Lock()
    untag = Untag(hosts, ranks_per_instance)

    def emit(lines: list[str]) -> None:
        with lock:
            for line in lines:
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
        return AgentsOutcome(exit_code=128 + interrupted[0], signal=interrupted[0])
    code = code if code >= 0 else 128 - code
    return AgentsOutcome(exit_code=code, report="" if code == 0 else f"disttrain: mpirun exited with code {code}")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m disttrain.jobs.mpi ENV.json -- COMMAND...``: one rank, its instance's environment."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m disttrain.jobs.mpi ENV.json -- COMMAND...")
    with open(argv[0]) as fh:
        os.environ.update(json.load(fh))
    # torchrun-style names too, so a script that reads RANK/WORLD_SIZE runs under mpi as well
    for mpi_name, name in (("OMPI_COMM_WORLD_RANK", "RANK"), ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"),
                           ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"),
                           ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")):
        if mpi_name in os.environ:
            os.environ.setdefault(name, os.environ[mpi_name])
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main()
