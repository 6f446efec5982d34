"""The contract every launcher keeps, whatever its kind (disttrain.launch.base), checked on each
class with real processes wherever it starts any:

- it is an agent launcher or a batch launcher, and its name is one ``--launcher`` offers (or
  ``mpi``, a job's distribution);
- ``dry_run`` returns a DryRun (a plan, or a script with the spec it ships) and leaves no process;
- ``run`` returns an Outcome: 0 for a script that succeeds, the script's failure otherwise;
- what goes wrong before the start (a missing script, a node that cannot be reached, a
  scheduler that is not there) is a DisttrainError naming what to fix, never another exception,
  and leaves no process behind.

Every concrete launcher class in disttrain.launch must have a case here (the first test). The
ssh and Slurm launchers' runs on real hosts are in test_multinode.py and test_slurm.py (they need
the rig's namespaces); here they show their errors with the real ssh client and without Slurm.
"""

from __future__ import annotations

import importlib
import inspect
import io
import os
import pkgutil
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import disttrain.launch
from disttrain.config.hosts import Host
from disttrain.config.launch import LaunchSpec
from disttrain.errors import DisttrainError, UsageError
from disttrain.launch import (
    LAUNCHERS,
    AgentLauncher,
    BatchLauncher,
    DryRun,
    Events,
    LaunchContext,
    Launcher,
    Outcome,
)
from disttrain.launch.local import InstancesLauncher, LocalLauncher
from disttrain.launch.mpi import MpiLauncher
from disttrain.launch.slurm import SlurmBatchLauncher, SlurmOptions
from disttrain.launch.slurm_alloc import SlurmAllocationLauncher
from disttrain.launch.slurm_env import SlurmAllocation
from disttrain.launch.ssh import SshLauncher
from disttrain.plan.launch import LaunchPlan

OK = "import os\nprint('hello from rank', os.environ['RANK'], flush=True)\n"
FAIL = "import os, sys\nsys.exit(3 if int(os.environ['RANK']) == int(os.environ['WORLD_SIZE']) - 1 else 0)\n"


class Recorder(Events):
    """A client's sink: what the launcher told it, and a transcript."""

    def __init__(self) -> None:
        self.transcript = io.StringIO()
        self.started: list[LaunchPlan] = []
        self.said: list[str] = []

    def say(self, message: str) -> None:
        self.said.append(message)

    def starting(self, plan, facts, note: str = "") -> None:
        self.started.append(plan)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Case:
    """How to build a launcher here, and what it can show on this machine."""

    name: str
    build: object  # (tmp_path) -> Launcher
    runs: bool = True  # a real run here (else: its errors only)
    needs: str | None = None  # a command it needs

    def launcher(self, tmp_path: Path) -> Launcher:
        return self.build(tmp_path)


CASES = [
    Case("local", lambda tmp: LocalLauncher()),
    Case("instances", lambda tmp: InstancesLauncher(("algo-1", "algo-2"))),
    Case("mpi", lambda tmp: MpiLauncher(instances=("algo-1", "algo-2"), ranks_per_instance=1), needs="mpirun"),
    Case("ssh", lambda tmp: SshLauncher([Host(name="127.0.0.1", port=_closed_port())],
                                        options=("BatchMode=yes",)), runs=False),
    Case("slurm-allocation", lambda tmp: SlurmAllocationLauncher(
        SlurmAllocation(job_id="7", nodes=("nodeA", "nodeB"), cpus_per_node=(2, 2), this_node="nodeA")),
        runs=False),
    Case("slurm-batch", lambda tmp: SlurmBatchLauncher(SlurmOptions(nodes=2), env={**os.environ, "PATH": str(tmp)}),
         runs=False),
]


def _concrete_launchers() -> set[type]:
    for info in pkgutil.iter_modules(disttrain.launch.__path__):
        importlib.import_module(f"disttrain.launch.{info.name}")
    found, todo = set(), [Launcher]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if not inspect.isabstract(sub) and sub.__module__.startswith("disttrain.launch"):
                found.add(sub)
    return found


def test_every_launcher_class_has_a_case_and_one_kind():
    covered = {type(case.build(Path("/nonexistent"))) for case in CASES}
    assert _concrete_launchers() == covered
    for cls in covered:
        assert issubclass(cls, AgentLauncher) != issubclass(cls, BatchLauncher), cls
        assert cls.name in (*LAUNCHERS, "mpi"), cls


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "ok.py").write_text(OK)
    (tmp_path / "fail.py").write_text(FAIL)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def _ctx(project: Path, entry: str, **kw) -> LaunchContext:
    return LaunchContext(run_id="contract", run_dir=str(project / "run"), cwd=str(project), python=sys.executable,
                         paths=(entry,), environ=dict(os.environ), **kw)


def _spec(entry: str) -> LaunchSpec:
    return LaunchSpec(entry=entry, nproc_per_node=1, stop_grace_s=5)


def _no_process_left() -> None:
    """Nothing this test process started outlives the call (sessions closed, agents gone)."""
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]


def _skip_unless_available(case: Case) -> None:
    if case.needs and not shutil.which(case.needs):
        pytest.skip(f"{case.needs} is not installed (apt-get install openmpi-bin)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [c for c in CASES if c.runs], ids=lambda c: c.name)
def test_a_dry_run_is_the_plan_and_starts_nothing_that_stays(case, project):
    _skip_unless_available(case)
    launcher = case.launcher(project)
    dry = launcher.dry_run(_spec("ok.py"), _ctx(project, "ok.py"))
    assert type(dry) is DryRun and dry.launcher == launcher.name
    assert isinstance(dry.plan, LaunchPlan) and dry.script is None
    assert dry.text() == dry.plan.to_json() + "\n"
    _no_process_left()


@pytest.mark.timeout(60)
def test_a_batch_launchers_dry_run_is_its_script_and_the_spec_it_ships(project):
    launcher = SlurmBatchLauncher(SlurmOptions(nodes=2, requeue=True))
    spec = _spec("ok.py")
    dry = launcher.dry_run(spec, _ctx(project, "ok.py"))
    assert type(dry) is DryRun and dry.plan is None
    assert dry.text() == dry.script and dry.script.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2" in dry.script and "disttrain batch-step" in dry.script
    # The spec the step will place: the user's, with what a requeued job needs filled in.
    assert dry.spec.entry == "ok.py" and dry.spec.checkpoint_dir == str(project / "run" / "checkpoints")
    _no_process_left()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [c for c in CASES if c.runs], ids=lambda c: c.name)
def test_a_run_returns_the_outcome(case, project):
    _skip_unless_available(case)
    events = Recorder()
    ok = case.launcher(project).run(_spec("ok.py"), _ctx(project, "ok.py"), events)
    assert type(ok) is Outcome and ok.exit_code == 0, events.said
    _no_process_left()
    failed = case.launcher(project).run(_spec("fail.py"), _ctx(project, "fail.py"), Recorder())
    assert type(failed) is Outcome and failed.exit_code != 0
    _no_process_left()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_what_fails_before_the_start_is_a_disttrain_error(case, project):
    """A script that is not there is refused before anything starts, in one line naming it
    (or, where the nodes cannot be reached from here, that is the error, naming them)."""
    _skip_unless_available(case)
    for call in ("dry_run", "run"):
        launcher = case.launcher(project)
        args = (_spec("missing.py"), _ctx(project, "missing.py"))
        with pytest.raises(DisttrainError) as err:
            getattr(launcher, call)(*args, *((Recorder(),) if call == "run" else ()))
        text = str(err.value)
        assert "missing.py" in text or any(where in text for where in ("127.0.0.1", "srun", "sbatch")), text
        _no_process_left()


@pytest.mark.timeout(60)
def test_a_node_the_transport_cannot_reach_is_named(project, monkeypatch):
    launcher = SshLauncher([Host(name="127.0.0.1", port=_closed_port())], options=("BatchMode=yes",))
    with pytest.raises(DisttrainError, match=r"^127\.0\.0\.1: ssh failed: .*Connection refused"):
        launcher.run(_spec("ok.py"), _ctx(project, "ok.py"), Recorder())
    launcher = SlurmAllocationLauncher(SlurmAllocation(job_id="7", nodes=("nodeA",), cpus_per_node=(2,)))
    monkeypatch.setenv("PATH", str(project))  # no Slurm client commands here
    with pytest.raises(DisttrainError, match="^nodeA: cannot start `srun`"):
        launcher.run(_spec("ok.py"), _ctx(project, "ok.py"), Recorder())
    with pytest.raises(UsageError, match="--nodes 3: Slurm job 7 has only 1 node"):
        SlurmAllocationLauncher(SlurmAllocation(job_id="7", nodes=("nodeA",), cpus_per_node=(2,)), nodes=3)
    _no_process_left()
