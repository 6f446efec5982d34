"""The messages between disttrain's processes (disttrain.wire): each one survives its line
unchanged, and a line that is not the message its reader expects is refused in one line that
names the message (another version, a stray line, an unknown key, a wrong type)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from disttrain import wire
from disttrain.config.launch import LaunchSpec
from disttrain.errors import UsageError
from disttrain.plan.launch import NodeFacts, make_plan, plan_from_json
from disttrain.wire import (
    MESSAGES,
    Alive,
    AttemptStarted,
    BatchStep,
    BatchStepEnded,
    Beats,
    Call,
    ConnectResults,
    ConnectTargets,
    DumpRequest,
    FitRequest,
    HangReport,
    HostFacts,
    InstanceEnv,
    JobClient,
    Listening,
    NodeDone,
    Outcome,
    PlanMessage,
    ProbeFacts,
    ProbeHello,
    RankState,
    Regroup,
    RunClient,
    RunSpec,
    StopRequest,
    SyncOffer,
    SyncWanted,
    WireError,
    one_of,
)

SECRET = "s3cr3t\nwith a newline"
SPEC = LaunchSpec(entry="train.py", script_args=("--lr", "0.1"), env={"API_TOKEN": SECRET}, ranks=(0,))


def _plan():
    facts = (NodeFacts(name="a", cpus=4, address="10.0.0.1", socket_ifname="eth1"),
             NodeFacts(name="b", cpus=2, slots=1))
    return make_plan(SPEC, facts, python="/usr/bin/python3", master_port=29500, run_id="r1", run_dir="/runs/r1",
                     inherited_env={}, forwarded_env={"FORWARDED": "x"})


FACTS = HostFacts(hostname="h", address="10.0.0.2", ifname="eth1", is_master=False, cpus=8, cuda_devices=0,
                  versions={"python": "3.11", "torch": "2.13", "nccl": None, "disttrain": "0.1"},
                  paths={"train.py": True}, cwd="/w", cwd_exists=True)

EXAMPLES = [
    ProbeHello(),
    ProbeFacts(facts=FACTS, listen=Listening(ports=(29500, 41000))),
    ProbeFacts(facts=FACTS, listen=Listening(error="cannot listen on port 29500: Address already in use")),
    ConnectTargets(targets=("10.0.0.1:29500", "10.0.0.1:41000")),
    ConnectResults(results={"10.0.0.1:29500": "ok", "10.0.0.1:41000": "timed out after 3 s (packets dropped)"}),
    PlanMessage(node_rank=1, plan=_plan(), cwd="/work/my project"),
    PlanMessage(node_rank=0, plan=_plan()),
    DumpRequest(),
    Beats(host="10.0.0.2", ranks={0: (12, 0.25), 3: (11, 1.5)}),
    Beats(host="10.0.0.2", ranks={0: (12, 0.25), 3: (11, 9.0)}, stopped=(3,)),
    Regroup(lost=("10.0.0.3",)),
    StopRequest(why="the job stopped: 10.0.0.3 was lost, below the minimum of --nnodes 2:3"),
    AttemptStarted(host="10.0.0.2", attempt=2, nodes=2, world_size=4, ranks=(2, 3)),
    Alive(),
    NodeDone(host="algo-2", ranks=(2, 3)),
    HangReport(host="10.0.0.2", ranks=(
        RankState(rank=1, host="10.0.0.2", pid=42, where="train.py:12 in <module>", own_code=True,
                  calls=(Call(group="0", desc="default_pg", seq=5, op="all_reduce", backend="gloo",
                              input_sizes=((4,),), output_sizes=((4,),), input_dtypes=("Float",),
                              output_dtypes=("Float",), done=True),),
                  groups={"0": (0, 1), "1": (0, 1)}, stacks="/r/attempt_0/rank1.stacks", dump="/r/rank1.fr.json"),
        RankState(rank=3, host="10.0.0.2", state="exited", exit_code=0),
    )),
    Outcome(exit_code=1, failed=1, report="disttrain: rank 3 failed\n  exit code 1"),
    Outcome(exit_code=130, signal=2),
    BatchStep(spec=SPEC, run_id="r", run_dir="/runs/r", cwd="/w", python="/p", paths=("train.py",), nodes=2),
    BatchStep(spec=SPEC, run_id="r", run_dir="/runs/r", cwd="/w", python="/p", client=RunClient()),
    BatchStep(spec=SPEC, run_id="r", run_dir="/runs/r", cwd="/w", python="/p",
              client=JobClient(name="j-1", job_dir="/jobs/j-1", cwd="/jobs/j-1/code", spec={"name": "j", "n": [1]})),
    BatchStepEnded(outcome=Outcome(exit_code=0), where=("node0", "node1")),
    RunClient(),
    JobClient(name="j-1", job_dir="/jobs/j-1", cwd="/jobs/j-1/code", spec={}),
    RunSpec(spec=SPEC),
    FitRequest(spec={"entry_point": "train.py", "hyperparameters": {"epochs": 2}}),
    SyncOffer(files={"train.py": (120, 1700000000), "data/x.bin": (5, 1700000001)}),
    SyncWanted(paths=("data/x.bin",)),
    InstanceEnv(env={"SM_CURRENT_HOST": "algo-1", "API_TOKEN": SECRET}),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.kind)
def test_every_message_survives_its_line(message):
    line = message.to_line()
    assert "\n" not in line  # one line, whatever its strings hold
    assert type(message).from_line(line + "\n") == message
    assert type(message).from_line(line.encode()) == message  # as read from a raw descriptor


def test_every_message_is_listed_once_and_documented():
    documented = wire.__doc__
    kinds = [m.kind for m in EXAMPLES]
    assert set(kinds) == set(MESSAGES)
    for kind, cls in MESSAGES.items():
        assert cls.kind == kind
        assert f"{kind} " in documented and cls.__name__ in documented, kind


def test_a_line_that_may_be_one_of_several_kinds_is_told_apart_by_its_kind():
    assert one_of(Alive().to_line(), Alive, DumpRequest) == Alive()
    done = NodeDone(host="b", ranks=(1,))
    assert one_of(done.to_line(), Alive, DumpRequest, NodeDone) == done  # its marker too
    assert one_of(DumpRequest().to_line().encode(), Alive, DumpRequest) == DumpRequest()
    with pytest.raises(WireError, match="expected a agent.alive or agent.dump message, got 'dump'"):
        one_of("dump", Alive, DumpRequest)


def test_the_envelope_names_kind_and_version():
    data = json.loads(Outcome(exit_code=3).to_line())
    assert data == {"kind": "launch.outcome", "v": 1, "exit_code": 3, "failed": None, "report": "", "signal": None}


def test_the_plan_reaches_the_agent_with_its_values():
    """The plan message is the private channel: the user's values travel in it (only there)."""
    message = PlanMessage.from_line(PlanMessage(node_rank=1, plan=_plan()).to_line())
    assert message.plan.env_set == {"API_TOKEN": SECRET}
    assert message.plan.env_forwarded == {"FORWARDED": "x"}
    assert message.plan.nodes[1].name == "b"


@pytest.mark.parametrize(("line", "fragment"), [
    ('{"kind": "agent.dump", "v": 1}', "got a 'agent.dump' message instead"),
    ('{"kind": "launch.outcome", "v": 2, "exit_code": 1}', "version 2, and this disttrain reads version 1"),
    ('{"kind": "launch.outcome", "v": 1, "exit_code": 1, "host": "a"}', "unknown key 'host'"),
    ('{"kind": "launch.outcome", "v": 1}', "missing key 'exit_code'"),
    ('{"kind": "launch.outcome", "v": 1, "exit_code": "1"}', "exit_code: expected int, got '1'"),
    ('{"kind": "launch.outcome", "v": 1, "exit_code": true}', "exit_code: expected int, got True"),
    ('[1, 2]', "expected a JSON object"),
    ('Traceback (most recent call last):', "not a JSON line"),
    ('', "not a JSON line"),
])
def test_a_line_that_is_not_the_message_is_refused_naming_it(line, fragment):
    with pytest.raises(WireError) as err:
        Outcome.from_line(line)
    assert str(err.value).startswith("Outcome message (launch.outcome)")
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_nested_errors_name_the_field():
    step = json.loads(BatchStep(spec=SPEC, run_id="r", run_dir="/r", cwd="/w", python="/p").to_line())
    step["spec"]["colour"] = "red"
    with pytest.raises(WireError,
                       match=r"BatchStep message \(slurm.batch_step\), spec: launch spec: unknown key 'colour'"):
        BatchStep.from_line(json.dumps(step))
    step = json.loads(BatchStep(spec=SPEC, run_id="r", run_dir="/r", cwd="/w", python="/p").to_line())
    step["client"] = {"kind": "client.notebook", "v": 1}
    with pytest.raises(WireError, match="client: a 'client.notebook' message, expected one of client.run, client.job"):
        BatchStep.from_line(json.dumps(step))
    facts = json.loads(ProbeFacts(facts=FACTS).to_line())
    facts["facts"]["gpus"] = 1
    with pytest.raises(WireError, match=r"ProbeFacts message \(probe.facts\), facts: unknown key 'gpus'"):
        ProbeFacts.from_line(json.dumps(facts))


def test_what_an_old_disttrain_wrote_is_still_read():
    """A Slurm job queued before an upgrade holds the batch step as the old version wrote it
    (old kind slurm.step, the spec's process-group backend under "backend"); a kept plan.json its
    "backend", "min_nodes" and each node's "host"."""
    step = BatchStep(spec=dataclasses.replace(SPEC, dist_backend="gloo"), run_id="r", run_dir="/r", cwd="/w",
                     python="/p", client=RunClient())
    old = step.to_dict()
    old["kind"] = "slurm.step"
    old["spec"]["backend"] = old["spec"].pop("dist_backend")
    assert BatchStep.from_line(json.dumps(old)) == step
    plan = _plan()
    data = json.loads(plan.to_private_json())
    data["backend"], data["min_nodes"] = data.pop("dist_backend"), data.pop("min_nnodes")
    for node in data["nodes"]:
        node["host"] = node.pop("name")
    assert plan_from_json(json.dumps(data)) == plan
    data["dist_backend"] = "nccl"
    with pytest.raises(UsageError, match="launch plan: 'backend' \\(the old name of 'dist_backend'\\) and "
                                         "'dist_backend' disagree"):
        plan_from_json(json.dumps(data))


def test_a_message_in_a_stream_of_text_is_found_by_its_marker():
    line = Beats(host="a", ranks={0: (1, 0.0)}).to_line()
    assert line.startswith("disttrain-beats {") and Beats.matches(line)
    assert not Beats.matches("[a rank0] disttrain-beats {}")  # a worker printing the word is not a message
    assert not Outcome.matches(Outcome(exit_code=0).to_line())  # a message owning its stream has no marker
    with pytest.raises(WireError, match="does not start with 'disttrain-beats'"):
        Beats.from_line(line.removeprefix("disttrain-beats "))
