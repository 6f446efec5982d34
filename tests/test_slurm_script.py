"""The Slurm side that needs no Slurm: the rendered sbatch script (golden), what a process
learns from a Slurm environment, the flags that carry a run into the allocation, bad input."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from test_cli_input import assert_usage_error

from conftest import SCRIPTS, cli_env, disttrain
from disttrain.cli import launchers as slurm_run
from disttrain.config.launch import AgentOptions, LaunchSpec
from disttrain.errors import UsageError
from disttrain.launch import slurm as slurm_launch
from disttrain.launch.slurm import SlurmJob, SlurmOptions, parse_status, render_sbatch, with_requeue_checkpoints
from disttrain.launch.slurm_env import SlurmAllocation, expand_counts, expand_hostlist, gpus_from

GOLDEN = "\n".join([
    "#!/bin/bash",
    "# Rendered by `disttrain run --launcher slurm`. Inside the allocation, the batch step finds the",
    "# nodes in Slurm's environment and starts one torch elastic agent per node with srun;",
    "# the master is the first node, at its address toward the others found on that node.",
    "# The launch spec is in the job's environment (DISTTRAIN_BATCH_STEP; it may hold --env values).",
    "#SBATCH --job-name=train",
    "#SBATCH --nodes=2",
    "#SBATCH --ntasks-per-node=1",
    "#SBATCH --exclusive",
    "#SBATCH --chdir=/home/me/project",
    "#SBATCH --output=/shared/runs/r1/slurm.out",
    "#SBATCH --error=/shared/runs/r1/slurm.err",
    "#SBATCH --open-mode=append",
    "#SBATCH --export=ALL",
    "#SBATCH --requeue",
    "#SBATCH --partition=gpu",
    "#SBATCH --time=2:00:00",
    "#SBATCH --gpus-per-node=4",
    "#SBATCH --mem=64G",
    '#SBATCH "--comment=two words"',
    "exec /opt/venv/bin/python -m disttrain batch-step",
    "",
])


def golden_inputs():
    spec = LaunchSpec(entry="train.py", script_args=("--epochs", "3", "a b", "c'd", "$(touch x)"),
                      max_restarts=2, env={"NCCL_DEBUG": "WARN"}, checkpoint_every=100)
    options = SlurmOptions(nodes=2, partition="gpu", time="2:00:00", gpus_per_node=4, requeue=True,
                           sbatch_args=("--mem=64G", "--comment=two words"))
    return spec, options


def test_rendered_sbatch_script_is_golden():
    spec, options = golden_inputs()
    script = render_sbatch(spec, options, run_dir="/shared/runs/r1", python="/opt/venv/bin/python",
                           cwd="/home/me/project")
    assert script == GOLDEN


def test_requeue_keeps_the_users_checkpoint_dir_and_plain_runs_get_none():
    spec, options = golden_inputs()
    mine = with_requeue_checkpoints(dataclasses.replace(spec, checkpoint_dir="/shared/ckpt"), options, "/r")
    assert mine.checkpoint_dir == "/shared/ckpt"
    assert with_requeue_checkpoints(spec, options, "/r").checkpoint_dir == "/r/checkpoints"
    plain = dataclasses.replace(options, requeue=False)
    assert with_requeue_checkpoints(spec, plain, "/r").checkpoint_dir is None
    assert "--requeue" not in render_sbatch(spec, plain, run_dir="/r", python="py", cwd="/c")


def test_every_launch_spec_field_survives_json():
    """The spec travels to the allocation as JSON (one serialiser, no re-rendered flags): a
    field added to LaunchSpec arrives there without anyone writing a flag for it."""
    spec = LaunchSpec(
        entry="pkg.train", is_module=True, script_args=("--lr", "0.1", "a b", "$(x)"), nproc_per_node=3,
        dist_backend="gloo", nnodes=2, node_rank=1, log_dir="/l",
        master_addr="10.0.0.1", master_port=23456, max_restarts=1, ranks=(0, 2), env={"A": "1", "B": "x y"},
        rdzv_backend="c10d", rdzv_timeout_s=30, stop_grace_s=5, hang_timeout_s=60, checkpoint_dir="/ck",
        checkpoint_every=0, framework="tensorflow", forward_env=False, grad_compression="powersgd:4", bucket_mb=8.0,
        track="ranks", checkpoint_retry_s=7.5,
        min_nnodes=1, rdzv_id="JOB", rdzv_conf={"last_call_timeout": "5"}, local_addr="10.0.0.2",
        agent=AgentOptions(role="trainer", tee="3", local_ranks_filter=(1,), duplicate_stdout_filters=("loss",),
                           torchrun_log_dir="/l", log_line_prefix_template="${rank}| "),
    )
    # the torchrun options that a TensorFlow module cannot have, in a second spec
    program = dataclasses.replace(spec, is_module=False, framework="pytorch", no_python=True, run_path=True)
    for f in dataclasses.fields(LaunchSpec):
        if f.default is f.default_factory is dataclasses.MISSING:  # entry: required
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert getattr(spec, f.name) != default or getattr(program, f.name) != default, \
            f"give {f.name} a non-default value in this test"
    assert LaunchSpec.from_json(spec.to_json()) == spec
    assert LaunchSpec.from_json(program.to_json()) == program
    with pytest.raises(UsageError, match="unknown key 'bogus'"):
        LaunchSpec.from_json(json.dumps({**json.loads(spec.to_json()), "bogus": 1}))


@pytest.mark.parametrize(("hostlist", "names"), [
    ("node[0-1]", ("node0", "node1")),
    ("gpu[01-03,7],login", ("gpu01", "gpu02", "gpu03", "gpu7", "login")),
    ("r[1-2]-n[1-2]", ("r1-n1", "r1-n2", "r2-n1", "r2-n2")),
    ("vm", ("vm",)),
])
def test_slurm_host_lists(hostlist, names):
    assert expand_hostlist(hostlist) == names


def test_slurm_counts_and_gpus():
    assert expand_counts("2(x3),4") == (2, 2, 2, 4)
    assert (gpus_from("a100:2"), gpus_from("4"), gpus_from(None)) == (2, 4, None)


BATCH = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
         "SLURMD_NODENAME": "node0", "SLURM_NTASKS": "2", "SLURM_CPUS_ON_NODE": "8"}


def test_detects_no_slurm_a_batch_script_a_salloc_shell_and_a_step():
    assert SlurmAllocation.from_environ({"PATH": "/bin"}) is None
    batch = SlurmAllocation.from_environ(BATCH)
    assert batch.job_id == "12" and batch.nodes == ("node0", "node1") and batch.cpus_per_node == (8, 8)
    assert batch.on_first_node and not batch.in_job_step and batch.restart_count == 0
    salloc = SlurmAllocation.from_environ({k: v for k, v in BATCH.items() if k != "SLURMD_NODENAME"})
    assert not salloc.on_first_node and not salloc.in_job_step  # a login node: the master is asked for over srun
    step = SlurmAllocation.from_environ({**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1",
                                         "SLURM_CPUS_ON_NODE": "3", "SLURM_RESTART_COUNT": "2"})
    assert step.in_job_step and step.cpus_on_node == 3 and step.restart_count == 2
    assert slurm_run.job_step_cpus(step) == 3 and slurm_run.job_step_cpus(batch) is None
    interactive = SlurmAllocation.from_environ({**BATCH, "SLURM_STEP_ID": "4294967290"})
    assert not interactive.in_job_step  # LaunchParameters=use_interactive_step: a shell, not a task
    with pytest.raises(UsageError, match="one of 4 tasks of a Slurm job step"):
        slurm_run.job_step_cpus(dataclasses.replace(step, job_step_tasks=4))


def test_unreadable_slurm_environment_is_named():
    with pytest.raises(UsageError, match=r"Slurm job 12: cannot read the Slurm host list 'node\[a-b\]'"):
        SlurmAllocation.from_environ({**BATCH, "SLURM_JOB_NODELIST": "node[a-b]"})
    odd = SlurmAllocation.from_environ({**BATCH, "SLURM_JOB_CPUS_PER_NODE": "8"})
    assert odd.cpus_per_node == ()  # not one count per node: each node is asked at launch


def test_scontrol_status_lines():
    line = ("JobId=7 JobName=train UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
            "Requeue=1 Restarts=1 BatchFlag=1 ExitCode=3:0 NodeList=node[0-1] WorkDir=/a b/c")
    status = parse_status(line)
    assert (status.state, status.reason, status.restarts, status.nodes) == ("FAILED", "NonZeroExitCode", 1, "node[0-1]")
    assert status.ended and status.shell_exit_code() == 3
    cancelled = parse_status("JobId=7 JobState=CANCELLED Reason=None ExitCode=0:15")
    assert cancelled.shell_exit_code() == 143
    assert parse_status("") is None


@pytest.mark.timeout(60)
def test_inside_a_job_step_the_plan_uses_the_steps_cpus(tmp_path):
    """No Slurm needed: the environment alone makes a step's run local on its CPUs."""
    env = cli_env(DISTTRAIN_HOME=str(tmp_path), SLURM_JOB_ID="5", SLURM_JOB_NODELIST="vm", SLURM_STEP_ID="0",
                  SLURM_STEP_NUM_TASKS="1", SLURM_CPUS_ON_NODE="1", SLURM_JOB_CPUS_PER_NODE="1")
    env.pop("OMP_NUM_THREADS")
    result = disttrain("run", "--dry-run", str(SCRIPTS / "sleeper.py"), env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["world_size"] == 1 and plan["nodes"][0]["env"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "fragments"), [
    (["--launcher", "slurm", "--sbatch-arg", "mem=1G"], ["--sbatch-arg takes one sbatch option", "'mem=1G'"]),
    (["--launcher", "slurm", "--sbatch-arg=--export=NONE"], ["disttrain carries the environment itself", "drop it"]),
    (["--launcher", "slurm", "--nodes", "0"], ["--nodes must be in 1..65536"]),
    (["--launcher", "slurm", "--partition", "a b"], ["--partition 'a b'"]),
    (["--launcher", "slurm", "--hosts", "a,b"], ["--launcher slurm runs no ssh"]),
    (["--partition", "gpu"], ["--partition is a Slurm flag: add --launcher slurm"]),
])
def test_bad_slurm_input_is_one_line_and_exit_2(tmp_path, args, fragments):
    result = disttrain("run", *args, "--dry-run", str(SCRIPTS / "sleeper.py"), env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert_usage_error(result, *fragments)
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(120)
def test_on_slurm_nnodes_is_the_number_of_nodes_as_nodes_is(tmp_path):
    """torchrun's word and Slurm's for one count: --nnodes N asks Slurm for N nodes, as --nodes N does."""
    env = cli_env(DISTTRAIN_HOME=str(tmp_path))
    for flags in (["--nnodes", "2"], ["--nodes", "2"], ["--nnodes", "2", "--nodes", "2"]):
        result = disttrain("run", "--launcher", "slurm", *flags, "--dry-run", str(SCRIPTS / "sleeper.py"), env=env)
        assert result.returncode == 0, result.stderr
        assert "#SBATCH --nodes=2\n" in result.stdout and "--nnodes" not in result.stderr, flags
    result = disttrain("run", "--launcher", "slurm", "--nnodes", "2", "--nodes", "3", "--dry-run",
                       str(SCRIPTS / "sleeper.py"), env=env)
    assert_usage_error(result, "--nnodes 2 and --nodes 3 disagree: on Slurm both are the number of nodes")


@pytest.mark.timeout(60)
def test_a_job_queued_before_the_batch_step_had_its_name_still_reads_its_step(tmp_path):
    """Each old name is still read: its script's `disttrain launch-step` (the old command),
    its environment's DISTTRAIN_LAUNCH_STEP (the old variable), holding the old kind slurm.step
    (this one lacks its spec, which the error names)."""
    old_env = {"DISTTRAIN_LAUNCH_STEP": '{"kind": "slurm.step", "v": 1}'}
    env = cli_env(DISTTRAIN_HOME=str(tmp_path), SLURM_JOB_ID="12", SLURM_JOB_NODELIST="node0", **old_env)
    result = disttrain("launch-step", env=env)  # the old name of batch-step
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == \
        "disttrain: error: BatchStep message (slurm.batch_step): missing key 'spec' (written by another disttrain " \
        "version?)", result.stderr


@pytest.mark.timeout(60)
def test_without_slurm_commands_submitting_says_so(tmp_path):
    result = disttrain("run", "--launcher", "slurm", str(SCRIPTS / "sleeper.py"),
                       env=cli_env(DISTTRAIN_HOME=str(tmp_path), PATH=str(tmp_path)))
    assert result.returncode == 1
    assert result.stderr.strip() == ("disttrain: error: sbatch not found: run on a machine with the Slurm client "
                                     "commands (a login node), or install slurm-client")
    assert not (tmp_path / "runs").exists()  # nothing half-made


class _ScriptedJob(SlurmJob):
    """A job whose `scontrol show job` answers come from a list: the last one repeats."""

    def __init__(self, run_dir, states):
        super().__init__(job_id="7", run_dir=run_dir)
        self.states = list(states)

    def status(self):
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def test_a_job_seen_completing_is_reported_with_its_final_state_and_reason(tmp_path, monkeypatch):
    """Under load, `scontrol` may catch a job whose launch failed in COMPLETING (its epilog runs):
    the one line names the state and reason it ends with."""
    monkeypatch.setattr(slurm_launch, "POLL_S", 0.01)
    monkeypatch.setattr(slurm_launch, "STATUS_EVERY_S", (0.01, 0.01))
    failed = parse_status("JobState=FAILED Reason=JobLaunchFailure ExitCode=0:53 NodeList=node0")
    completing = dataclasses.replace(failed, state="COMPLETING")
    job = _ScriptedJob(tmp_path, [parse_status("JobState=RUNNING Reason=None"), completing, completing, failed])
    err = io.StringIO()
    assert job.follow(out=io.StringIO(), err=err, stop_on_signals=False) == 128 + 53
    assert "Slurm job 7 ended FAILED (JobLaunchFailure) without any output in" in err.getvalue()

    monkeypatch.setattr(slurm_launch, "SETTLE_S", 0.05)  # a node gone: COMPLETING for SlurmdTimeout
    err = io.StringIO()
    assert _ScriptedJob(tmp_path, [completing]).follow(out=io.StringIO(), err=err, stop_on_signals=False) == 181
    assert "Slurm job 7 ended COMPLETING (JobLaunchFailure)" in err.getvalue()
