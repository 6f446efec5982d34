"""Every message between disttrain's processes: one frozen type each, one line each, versioned.

A launch crosses several processes -- the launcher, each host's probe session that becomes
its agent, a Slurm batch step, ``disttrain run-spec``, an estimator's job process -- and
each hop carries one of the types below. Each is a frozen dataclass with
:meth:`~Message.to_line` / :meth:`~Message.from_line`; on the wire it is one JSON object,
an envelope naming its kind and version with the fields beside them::

    {"kind": "agent.plan", "v": 1, "node_rank": 1, "cwd": "/work", "plan": {...}}

The reading side refuses, in one line naming the message, a line that is not one: another
kind, another version, an unknown or missing key, a field of the wrong type (a host running
another disttrain version says so instead of failing somewhere later). Messages that share a
stream with other text (an agent's stderr) start with a marker (:attr:`Message.marker`).

This module sits below both sides (the launchers in :mod:`disttrain.launch`, the node side
in :mod:`disttrain.agent` and :mod:`disttrain.preflight`) and above the types it carries
(:class:`~disttrain.plan.launch.LaunchPlan`, :class:`~disttrain.config.launch.LaunchSpec`,
each serialised by its own methods).

=================  ===============  ======================================================
kind               type             hop
=================  ===============  ======================================================
probe.hello        ProbeHello       a host's probe session -> the launcher: started (before torch's import)
probe.facts        ProbeFacts       a host's probe session -> the launcher (facts, listeners)
probe.connect      ConnectTargets   launcher -> probe session (what to connect to)
probe.reached      ConnectResults   probe session -> launcher (what it reached)
agent.plan         PlanMessage      launcher -> agent (stdin): the plan, values included
agent.dump         DumpRequest      launcher -> agent (stdin): no progress anywhere, dump stacks
agent.alive        Alive            launcher -> agent (stdin), every few seconds: still there
agent.beats        Beats            agent -> launcher (stderr): the ranks' steps, each second
agent.hang         HangReport       agent -> launcher (stderr): its ranks at a hang (recorders, stacks)
agent.failed       RankFailed       agent -> launcher (stderr): its first failed rank, timed on its worker
agent.done         NodeDone         agent -> launcher (stderr) -> every other agent (stdin): its ranks exited 0
agent.regroup      Regroup          launcher -> agent (stdin): hosts were lost, join the next round
agent.stop         StopRequest      launcher -> agent (stdin), before EOF: why the job stops
agent.attempt      AttemptStarted   agent -> launcher (stderr): a round's workers are starting
launch.outcome     Outcome          how a launch ended (a batch step's, read by the submitter)
slurm.batch_step   BatchStep        submitter -> the batch job's batch step (its environment)
slurm.ended        BatchStepEnded   the batch step -> the submitter (a file)
client.run         RunClient        inside slurm.batch_step: rebuild ``disttrain run``'s events
client.job         JobClient        inside slurm.batch_step: rebuild a job's events
run.spec           RunSpec          ``disttrain bench`` -> ``disttrain run-spec`` (stdin)
sagemaker.fit      FitRequest       an estimator's ``fit`` -> its job process (a 0600 file)
sync.offer         SyncOffer        ``--sync``: launcher -> ``disttrain receive``
sync.wanted        SyncWanted       ``--sync``: ``disttrain receive`` -> launcher
mpi.env            InstanceEnv      the mpi launcher -> each rank's wrapper (a 0600 file)
=================  ===============  ======================================================
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from .config.launch import LaunchSpec
from .errors import DisttrainError
from .plan.launch import LaunchPlan, plan_from_json
from .trackline import MARKER as TRACK_MARKER

VERSION = 1

M = TypeVar("M", bound="Message")


class WireError(DisttrainError):
    """A line that is not the message its reader expects (another version, a stray line)."""


# Types that own their serialisation: carried as the JSON object their own methods write.
_CODECS: dict[type, tuple[Any, Any]] = {
    LaunchPlan: (lambda plan: json.loads(plan.to_private_json()), lambda data: plan_from_json(json.dumps(data))),
    LaunchSpec: (lambda spec: json.loads(spec.to_json()), lambda data: LaunchSpec.from_json(json.dumps(data))),
}


class Record:
    """A frozen dataclass carried inside a message (no envelope of its own)."""

    def to_dict(self) -> dict:
        return {f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: object, *, where: str | None = None):
        where = where or cls.__name__
        if not isinstance(data, Mapping):
            raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - set(known) - _ENVELOPE)
        if extra:
            raise WireError(f"{where}: unknown key {extra[0]!r} (written by another disttrain version?)")
        missing = [name for name, f in known.items() if name not in data and _required(f)]
        if missing:
            raise WireError(f"{where}: missing key {missing[0]!r} (written by another disttrain version?)")
        values = {name: _decode(hints[name], data[name], f"{where}, {name}") for name in known if name in data}
        return cls(**values)


_ENVELOPE = frozenset({"kind", "v"})


class Message(Record):
    """One line between two processes: ``{"kind": ..., "v": 1, ...fields}``."""

    kind: ClassVar[str]
    marker: ClassVar[str] = ""  # the line's prefix when it shares a stream with other text
    # Kinds an older disttrain wrote for this message, still read (the same fields: a queued job's
    # environment holds what the disttrain before an upgrade wrote).
    old_kinds: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "v": VERSION, **super().to_dict()}

    def to_line(self) -> str:
        """The message as one line (no newline at the end)."""
        return self.marker + json.dumps(self.to_dict())

    @classmethod
    def matches(cls, line: str) -> bool:
        """Whether ``line`` carries this kind of message (by its marker: no decoding)."""
        return bool(cls.marker) and line.startswith(cls.marker)

    @classmethod
    def from_line(cls: type[M], line: str | bytes) -> M:
        """The message ``line`` carries; a WireError naming it when the line is not one."""
        text = line.decode(errors="replace") if isinstance(line, bytes) else line
        text = text.strip()
        where = f"{cls.__name__} message ({cls.kind})"
        if cls.marker:
            if not text.startswith(cls.marker.strip()):
                raise WireError(f"{where}: the line does not start with {cls.marker.strip()!r}: {text[:120]!r}")
            text = text[len(cls.marker.strip()):].strip()
        try:
            data = json.loads(text)
        except ValueError:
            raise WireError(f"{where}: not a JSON line: {text[:120]!r}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls: type[M], data: object, *, where: str | None = None) -> M:
        where = where or f"{cls.__name__} message ({cls.kind})"
        if not isinstance(data, Mapping):
            raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
        kind, version = data.get("kind"), data.get("v")
        if kind != cls.kind and kind not in cls.old_kinds:
            raise WireError(f"{where}: got a {kind!r} message instead")
        if version != VERSION:
            raise WireError(f"{where}: version {version!r}, and this disttrain reads version {VERSION} "
                            "(the other side runs another disttrain version)")
        return super().from_dict(data, where=where)


def one_of(line: str | bytes, *types: type[Message]) -> Message:
    """The message ``line`` carries when it may be any of ``types`` (told apart by their kind)."""
    text = (line.decode(errors="replace") if isinstance(line, bytes) else line).strip()
    for cls in types:
        if cls.marker and text.startswith(cls.marker.strip()):
            return cls.from_line(text)
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    kind = data.get("kind") if isinstance(data, Mapping) else None
    for cls in types:
        if kind in (cls.kind, *cls.old_kinds):
            return cls.from_dict(data)
    raise WireError(f"expected a {' or '.join(t.kind for t in types)} message, got {text[:120]!r}")


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _encode(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    codec = _CODECS.get(type(value))
    if codec is not None:
        return codec[0](value)
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(hint: Any, value: Any, where: str) -> Any:
    """``value`` (from JSON) as the type ``hint`` names: tuples, int keys, nested records."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        messages = [a for a in options if isinstance(a, type) and issubclass(a, Message)]
        if messages and isinstance(value, Mapping):  # several kinds may come: pick by the envelope
            chosen = next((m for m in messages if value.get("kind") in (m.kind, *m.old_kinds)), None)
            if chosen is None:
                raise WireError(f"{where}: a {value.get('kind')!r} message, expected one of "
                                f"{', '.join(m.kind for m in messages)}")
            return chosen.from_dict(value, where=where)
        if len(options) == 1:
            return _decode(options[0], value, where)
        return value
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value, where=where)
    if hint in _CODECS:
        try:
            return _CODECS[hint][1](value)
        except (DisttrainError, TypeError, ValueError, KeyError) as err:
            raise WireError(f"{where}: {err}") from None
    if origin is tuple:
        _expect(value, list, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, where) for v in value)
        if len(args) != len(value):
            raise WireError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_decode(a, v, where) for a, v in zip(args, value))
    if origin is dict or hint is dict:
        _expect(value, dict, where)
        if not args:
            return dict(value)
        key, item = args
        return {_key(key, k, where): _decode(item, v, where) for k, v in value.items()}
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint in (int, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise WireError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    return value


def _expect(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        raise WireError(f"{where}: expected a JSON {'array' if kind is list else 'object'}, got {value!r}")


def _key(hint: Any, key: str, where: str) -> Any:
    if hint is int:
        try:
            return int(key)
        except ValueError:
            raise WireError(f"{where}: key {key!r} is not a number") from None
    return key


# --- how a launch ended ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Outcome(Message):
    """How a launch ended; the same for every launcher (and a batch step's, recorded)."""

    kind: ClassVar[str] = "launch.outcome"

    exit_code: int
    failed: int | None = None  # node rank of the agent that failed first
    report: str = ""  # that agent's own root-cause block, as it printed it
    signal: int | None = None  # SIGINT/SIGTERM that made the launcher stop every node


# --- a host's probe session, then its agent ----------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HostFacts(Record):
    """What a host says about itself (its probe session; ``doctor`` compares them)."""

    hostname: str
    address: str  # this host's source address toward the master (from its routes)
    ifname: str | None  # the interface of that route
    is_master: bool
    cpus: int
    cuda_devices: int
    versions: dict[str, str | None]  # python, torch, nccl, disttrain
    paths: dict[str, bool]  # the paths asked about: present?
    cwd: str
    cwd_exists: bool
    port_free: bool | None = None  # on the master only: the rendezvous port


@dataclass(frozen=True, kw_only=True)
class Listening(Record):
    """The ports a probe session listens on for the reachability checks, or why it cannot."""

    ports: tuple[int, ...] = ()
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class ProbeHello(Message):
    """A probe session's first line, said before anything slow: the host was reached and its
    Python runs disttrain. Its facts follow once torch is imported (seconds; a minute or more on
    a loaded host), so an unreachable host and a slow one are told apart."""

    kind: ClassVar[str] = "probe.hello"


@dataclass(frozen=True, kw_only=True)
class ProbeFacts(Message):
    kind: ClassVar[str] = "probe.facts"

    facts: HostFacts
    listen: Listening = field(default_factory=Listening)


@dataclass(frozen=True, kw_only=True)
class ConnectTargets(Message):
    kind: ClassVar[str] = "probe.connect"

    targets: tuple[str, ...]  # "addr:port" of every other host's listeners


@dataclass(frozen=True, kw_only=True)
class ConnectResults(Message):
    kind: ClassVar[str] = "probe.reached"

    results: dict[str, str]  # "addr:port" -> "ok" or why not


@dataclass(frozen=True, kw_only=True)
class PlanMessage(Message):
    """What an agent reads first: its node rank, the whole plan (values of the user's variables
    included: only ever on a private channel, stdin), and the folder to work in when its
    command did not start there (a probe session turning agent)."""

    kind: ClassVar[str] = "agent.plan"

    node_rank: int
    plan: LaunchPlan
    cwd: str | None = None


@dataclass(frozen=True, kw_only=True)
class DumpRequest(Message):
    """No rank on any host made progress: dump this node's stacks, then stop."""

    kind: ClassVar[str] = "agent.dump"


@dataclass(frozen=True, kw_only=True)
class Alive(Message):
    """The launcher is still there: sent to every agent every :data:`ALIVE_EVERY_S` seconds. An
    agent that hears nothing (this, or any other line) for :data:`CUT_OFF_S` seconds is cut off
    from its launcher -- a network dropped, where no EOF ever comes -- and stops on its own."""

    kind: ClassVar[str] = "agent.alive"


ALIVE_EVERY_S = 5.0
CUT_OFF_S = 20.0


@dataclass(frozen=True, kw_only=True)
class Beats(Message):
    """Each second, on an agent's stderr: every live rank's steps and the age of its last
    progress (ages, not times: the hosts' clocks need not agree)."""

    kind: ClassVar[str] = "agent.beats"
    marker: ClassVar[str] = "disttrain-beats "

    host: str
    ranks: dict[int, tuple[int, float]]  # rank -> (steps, seconds since its last progress)
    stopped: tuple[int, ...] = ()  # ranks whose process is stopped by a signal (SIGSTOP, SIGTSTP), not running


@dataclass(frozen=True, kw_only=True)
class InPlace(Record):
    """The new membership of an in-place regroup, decided by the launcher: the survivors' workers
    stay and meet on the launcher's store (:mod:`disttrain.runtime.regroup`)."""

    attempt: int  # the new round's number, job-wide
    ranks: dict[int, int]  # every surviving worker's global rank -> its new one
    group_ranks: dict[str, int]  # host -> its node's new group rank
    world_size: int
    store: str  # host:port of the launcher's store


@dataclass(frozen=True, kw_only=True)
class Regroup(Message):
    """An elastic job (``--nnodes MIN:MAX``) lost hosts. Without ``in_place``: stop this node's workers
    at once (no step can finish without the lost peers) and join the rendezvous' next round with the
    others. With it: tell the workers armed for it their new ranks; those not armed restart as without."""

    kind: ClassVar[str] = "agent.regroup"

    lost: tuple[str, ...]  # the hosts, for the agent's own line
    in_place: InPlace | None = None


@dataclass(frozen=True, kw_only=True)
class StopRequest(Message):
    """The launcher stops this node (its stdin closes next): ``why``, for the node's last line --
    not "got SIGTERM", which reads as if the user had sent it."""

    kind: ClassVar[str] = "agent.stop"

    why: str


@dataclass(frozen=True, kw_only=True)
class AttemptStarted(Message):
    """An elastic node's agent, after each rendezvous round, as its workers start: the launcher
    learns each round's world (which the rendezvous, not the launcher, decided)."""

    kind: ClassVar[str] = "agent.attempt"
    marker: ClassVar[str] = "disttrain-attempt "

    host: str
    attempt: int  # the job-wide attempt (one per round, the same on every node)
    nodes: int  # nodes in this round
    world_size: int
    ranks: tuple[int, ...]  # this node's global ranks in this round
    in_place: bool = False  # its workers stayed (an in-place regroup), else they were started
    why: str = ""  # a regroup asked to keep them, but they were started: why


@dataclass(frozen=True, kw_only=True)
class Call(Record):
    """One collective (or send/recv) of one rank, as its Flight Recorder saw it."""

    group: str  # the process group's name ("0": the default group)
    desc: str  # its description ("default_pg", a user's group_desc, or "undefined")
    seq: int  # its number within the group (collective_seq_id; p2p_seq_id for send/recv)
    op: str  # "all_reduce", "send 0->1"...
    backend: str  # "gloo", "nccl"
    input_sizes: tuple[tuple[int, ...], ...] = ()
    output_sizes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    output_dtypes: tuple[str, ...] = ()
    done: bool = False
    p2p: bool = False


@dataclass(frozen=True, kw_only=True)
class RankState(Record):
    """One rank at a hang: what its agent saw, what its recorder and its stack said."""

    rank: int
    host: str
    state: str = "running"  # "running", "exited", "stopped" (SIGSTOP), "silent" (did not answer)
    pid: int | None = None
    exit_code: int | None = None
    where: str = ""  # the main thread's innermost frame (and the script's own call site)
    own_code: bool = False  # that frame is in the script's own code, not torch's or Python's
    calls: tuple[Call, ...] = ()  # each group's frontier (disttrain.agent.verdict.calls_from_recorder)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # group name -> its global ranks
    stacks: str = ""  # where its full stacks were written, on its host
    dump: str = ""  # where its recorder's dump was written, on its host


@dataclass(frozen=True, kw_only=True)
class HangReport(Message):
    """An agent's answer to :class:`DumpRequest`: its ranks as they were, for the launcher's verdict."""

    kind: ClassVar[str] = "agent.hang"
    marker: ClassVar[str] = "disttrain-hang "

    host: str
    ranks: tuple[RankState, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RankFailed(Message):
    """An agent's first failed rank and when it failed on its worker's own clock (``at``). The
    launcher puts first, among several agents' failures, the one that happened first -- and one
    that lost its peer after the others -- not the one it happened to hear of first."""

    kind: ClassVar[str] = "agent.failed"
    marker: ClassVar[str] = "disttrain-failed "

    host: str
    rank: int
    exit_code: int
    at: float
    lost_peer: bool = False


@dataclass(frozen=True, kw_only=True)
class NodeDone(Message):
    """A node's workers all exited 0 (its agent now waits for the others). The launcher passes it
    on to every other agent: a rank that then fails because it lost its peer names these ranks,
    not itself, as the cause -- on any number of hosts, as on one."""

    kind: ClassVar[str] = "agent.done"
    marker: ClassVar[str] = "disttrain-done "

    host: str
    ranks: tuple[int, ...]


# --- a Slurm batch job: its batch step inside the allocation ---------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunClient(Message):
    """``disttrain run``'s events, rebuilt inside the allocation."""

    kind: ClassVar[str] = "client.run"


@dataclass(frozen=True, kw_only=True)
class JobClient(Message):
    """A job's events, rebuilt inside the allocation (the job spec as the job layer wrote it)."""

    kind: ClassVar[str] = "client.job"

    name: str
    job_dir: str
    cwd: str
    spec: dict  # whole, not masked: the batch step runs it


@dataclass(frozen=True, kw_only=True)
class BatchStep(Message):
    """What a batch job's one command, its batch step (``disttrain batch-step``), launches on
    its allocation.

    It travels in the job's environment (it may hold ``--env`` values), never in a file."""

    kind: ClassVar[str] = "slurm.batch_step"
    old_kinds: ClassVar[tuple[str, ...]] = ("slurm.step",)  # before the batch step had its own word

    spec: LaunchSpec
    run_id: str
    run_dir: str
    cwd: str
    python: str
    paths: tuple[str, ...] = ()
    nodes: int = 1
    client: RunClient | JobClient | None = None


@dataclass(frozen=True, kw_only=True)
class BatchStepEnded(Message):
    """The batch step's end, for the submitting side: how the launch ended and on which nodes."""

    kind: ClassVar[str] = "slurm.ended"

    outcome: Outcome
    where: tuple[str, ...] = ()


# --- other processes that carry a request --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunSpec(Message):
    """``disttrain run-spec``'s stdin: the spec of one ``disttrain bench`` count."""

    kind: ClassVar[str] = "run.spec"

    spec: LaunchSpec


@dataclass(frozen=True, kw_only=True)
class FitRequest(Message):
    """An estimator's ``fit``, for the process that runs the job (the job spec as a mapping,
    checked again there by the job layer)."""

    kind: ClassVar[str] = "sagemaker.fit"

    spec: dict


@dataclass(frozen=True, kw_only=True)
class SyncOffer(Message):
    """``--sync``: every file of the working directory, by relative path: (size, whole seconds of mtime)."""

    kind: ClassVar[str] = "sync.offer"

    files: dict[str, tuple[int, int]]


@dataclass(frozen=True, kw_only=True)
class SyncWanted(Message):
    """``--sync``: the offered paths the host lacks or holds in another version."""

    kind: ClassVar[str] = "sync.wanted"

    paths: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class InstanceEnv(Message):
    """The mpi launcher's instance environment, for each rank's wrapper."""

    kind: ClassVar[str] = "mpi.env"

    env: dict[str, str]


MESSAGES: dict[str, type[Message]] = {m.kind: m for m in (
    ProbeHello, ProbeFacts, ConnectTargets, ConnectResults, PlanMessage, DumpRequest, Alive, Beats, HangReport, NodeDone,
    Regroup, StopRequest, AttemptStarted, Outcome, BatchStep, BatchStepEnded,
    RunClient, JobClient, RunSpec, FitRequest, SyncOffer, SyncWanted, InstanceEnv)}


# Every marker a message for a process, not a person, starts with (the workers' track lines included).
WIRE_MARKERS: tuple[str, ...] = (*(m.marker.strip() for m in (Beats, HangReport, RankFailed, NodeDone, AttemptStarted)),
                                 TRACK_MARKER)
_RANK_PREFIX = re.compile(r"^\[[^\]]*\] ")  # "[rank0] " (torch's tail) or "[host rank0] " (the relay)


def for_people(line: str) -> bool:
    """Whether ``line`` may reach a terminal: False for a wire message (with or without a rank's
    prefix). Those are read by the launcher and the tracker, from the run folder's logs; a user's
    terminal shows only what is meant for people."""
    text = _RANK_PREFIX.sub("", line.lstrip("\r"), count=1).lstrip()
    return not text.startswith(WIRE_MARKERS)
