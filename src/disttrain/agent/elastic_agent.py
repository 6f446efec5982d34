"""torch's elastic agent for a node of an elastic job (``--nnodes MIN:MAX``), told by the launcher
when a host of the job is gone.

torch's ``LocalElasticAgent`` already restarts its workers for a new rendezvous round when a node
waits to join (scale-up: "membership changes do not count as retries"), and its c10d rendezvous
forms each round from the nodes alive. What it cannot see is a node that vanished: the survivors'
workers then wait inside a collective for a peer that will never answer (a host that lost power
sends no reset), or fail and use up ``--max-restarts``. The launcher sees it (the ssh connection
dropped, the agent killed) and sends :class:`~disttrain.wire.Regroup`; this agent then

- with the launcher's new membership (``in_place``) and workers armed for it (each listens on its
  socket: :mod:`disttrain.runtime.regroup`), tells each its new ranks and keeps it: no restart;
- otherwise stops its workers at once (SIGKILL: no step can finish without the lost peer, and a
  worker stuck in a collective would only wait out the stop grace), and joins the next round, as
  torch does for a node that joins -- a membership change, not a failure (so do workers that
  report their in-place group did not form, :data:`~disttrain.inplace.FALLBACK_EXIT`);
- when its workers failed on their own first (a peer's connection reset), waits
  :data:`SETTLE_S` for the launcher to name a lost host before counting the failure;
- when a node joins, keeps armed workers too: they are told their ranks in torch's new round,
  and the new node's workers take the state from them;
- ends a worker told a round in place that has not formed it well after its own limit (stuck where
  no thread of its own can end it: native code that holds the GIL), its stack first, as a fallback;
- when an in-place round fell back on any node (its group did not form: a member that never came,
  as a survivor stuck before it took the word), restarts its workers in the next round like every
  other node: that round keeps nobody (:data:`FELL_BACK_KEY`);
- holds the job's first round for every node started with it, and a round that grows for its
  members and newcomers (:mod:`.gathering`);
- numbers every round for the whole job (:func:`job_attempt`), the same on every node, since
  torch's restart count does not move on membership changes, and says each round's world to
  the launcher (:class:`~disttrain.wire.AttemptStarted`).

torch builds its agent inside ``launch_agent``; :func:`installed` has it build this one for the
duration of one launch in this process (the node's agent process, which disttrain owns).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from .. import torchcompat
from ..inplace import FALLBACK_EXIT, JOIN_ENV, STACKS_SIGNAL_OFFSET, Plan, formed, join_timeout_s, socket_path
from ..wire import InPlace
from ..workerenv import ROUND_COUNTER
from . import gathering
from .logs import RankLogs

SETTLE_S = 5.0  # a failure of the workers waits this long for the launcher to name a lost host
KILL_WAIT_S = 5  # for workers SIGKILLed on a regroup to be gone
GROW_JOIN_S = 120  # kept workers wait this long for a joining node's new ones (they start Python and torch)
TOLD_MARGIN_S = 15  # past a told worker's own limit: its own fallback (a line, FALLBACK_EXIT) comes first
STACKS_WAIT_S = 1  # for a stuck worker's stack to be written before it is ended
FELL_BACK_KEY = "disttrain/fell_back/{}"  # set by a node whose workers' in-place round (number) did not form


class Regroups:
    """The launcher's regroup requests, from the thread that reads stdin to the agent's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: list[str] = []
        self._in_place: InPlace | None = None
        self._event = threading.Event()

    def request(self, hosts: tuple[str, ...], in_place: InPlace | None = None) -> None:
        with self._lock:
            self._lost.extend(h for h in hosts if h not in self._lost)
            self._in_place = in_place  # the latest word decides: a later loss supersedes a plan
            self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def pending(self) -> bool:
        return self._event.is_set()

    def take(self) -> tuple[list[str], InPlace | None]:
        with self._lock:
            lost, self._lost = self._lost, []
            in_place, self._in_place = self._in_place, None
            self._event.clear()
            return lost, in_place


def _shared(store: Store) -> Store:
    """The store every round shares (torch's rendezvous prefixes each round's)."""
    return store.underlying_store if isinstance(store, PrefixStore) else store


def say_fell_back(store: Store, attempt: int, host: str) -> None:
    """This node's workers' in-place round ``attempt`` did not form (their exit code says so).

    TCPStore's set is not answered; the check after it is, once the server holds the key, so every
    node that asks after this returns reads it, whichever connection it asks on."""
    shared = _shared(store)
    shared.set(FELL_BACK_KEY.format(attempt), host)
    shared.check([FELL_BACK_KEY.format(attempt)])


def round_fell_back(store: Store, attempt: int) -> bool:
    """Whether a node said that round ``attempt`` fell back: the round after it keeps no workers.
    ``store`` is any round's; a node says it before its next rendezvous, so it is there once that
    round has formed."""
    return _shared(store).check([FELL_BACK_KEY.format(attempt)])


def job_attempt(store: Store, group_rank: int) -> int:
    """The job-wide number of the round ``store`` belongs to: 0, 1, 2... on every node alike.

    ``store`` is the round's own (torch's rendezvous prefixes it with the round); the counter
    lives in the store under it, which every round shares. Group rank 0 counts, the others read.
    """
    if group_rank == 0:
        attempt = _shared(store).add(ROUND_COUNTER, 1) - 1
        store.set("disttrain/attempt", str(attempt))
        return attempt
    return int(store.get("disttrain/attempt"))


class ElasticNodeAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that regroups when the launcher says hosts were lost (see the module)."""

    def __init__(self, *, regroups: Regroups, on_attempt: Callable[[int, WorkerGroup, bool, str], None],
                 host: str = "", sockets: str | None = None, store: str = "", settle_s: float = SETTLE_S,
                 gather: tuple[str, int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._host = host  # as the launcher names it (the keys of InPlace.group_ranks)
        self._meet_at = store  # host:port of the launcher's store, where in-place rounds meet
        self._gather = gather  # the launcher's store and the nodes started with the job: its first round waits for them
        self._attempt = 0  # the current round's job-wide number
        self._in_place_round = False  # the round being formed keeps this node's workers
        self._restart_why = ""  # the round being formed restarts workers a regroup meant to keep: why
        self._regroups = regroups
        self._on_attempt = on_attempt
        self._sockets = sockets  # where armed workers listen for an in-place regroup
        self._settle_s = settle_s
        self._peer_lost = False
        self._told: tuple[int, float, float] | None = None  # round, deadline, limit: workers told to form it
        self._closed = False  # the rendezvous closed while this node met a node that waits (see _restart_workers)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.SUCCEEDED:
            return result  # done: a regroup asked meanwhile has nothing left to restart
        fell_back = result.state == WorkerState.FAILED and result.failures and all(
            f.exitcode == FALLBACK_EXIT for f in result.failures.values()) or self._stuck(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and not self._regroups.pending() \
                and not fell_back:
            # A peer's death may end our workers (a connection reset) before the launcher has
            # named the host: wait for that word before counting a failure against --max-restarts.
            self._regroups.wait(self._settle_s)
        if not self._regroups.pending() and not fell_back:
            return result
        if fell_back:  # before this node's next rendezvous: the others read it once the round formed
            say_fell_back(worker_group.store, self._attempt, self._host)
        _, in_place = self._regroups.take()  # the launcher says which hosts left, once for all
        if in_place is not None and result.state == WorkerState.HEALTHY and not fell_back \
                and self._told_in_place(worker_group, in_place):
            return RunResult(state=WorkerState.HEALTHY)
        self._peer_lost = True
        self._restart_why = "the in-place group did not form" if fell_back else \
            self._not_kept(worker_group) if in_place is not None else ""
        try:
            self._restart_workers(worker_group)  # stop (below), rendezvous, start: what torch does to grow
        finally:
            self._peer_lost, self._restart_why = False, ""
        return RunResult(state=WorkerState.HEALTHY)

    def _stuck(self, worker_group: WorkerGroup) -> bool:
        """Whether a worker told to form a round in place has not, well after its limit: then its stack
        is said (its stderr), and it is taken for one that fell back (ended at the restart)."""
        if self._told is None:
            return False
        attempt, deadline, limit = self._told
        late = [w for w in worker_group.workers if formed(self._sockets, w.local_rank) != attempt]
        if not late:
            self._told = None
            return False
        if time.monotonic() < deadline:
            return False
        self._told = None
        for worker in late:
            print(f"disttrain: rank {worker.global_rank} on {self._host}: its in-place group (round {attempt}) did "
                  f"not form within {limit:g} s, and the worker did not end itself: its stack follows, then it is "
                  "ended and the round restarts from the newest checkpoint", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError, TypeError):
                os.kill(worker.id, signal.SIGRTMIN + STACKS_SIGNAL_OFFSET)
        time.sleep(STACKS_WAIT_S)
        return True

    def _exit_barrier(self) -> None:
        """Not waited. torch's agents wait here for each other so that the one hosting the rendezvous
        store outlives the rest; an elastic job's store is the launcher's (rendezvous_store.py). The
        wait would only keep a node whose workers are done from ending while another host's agent is
        stuck (its round's barrier never fills): the launcher would then take the job's end for a
        regroup that never forms."""

    def _not_kept(self, worker_group: WorkerGroup) -> str:
        """Why this node's workers cannot stay for a new round."""
        if self._sockets is None:
            return "DISTTRAIN_REGROUP=restart"
        if not self._armed(worker_group):
            return f"its workers on {self._host} are not armed (no disttrain.resume() yet, or a script without it)"
        return f"its workers on {self._host} could not be told"

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """A node waits to join (torch's agent restarts the workers for the round with it): workers
        armed for it stay, told their ranks in the new round; its new workers take the state from them."""
        growing = not self._peer_lost and worker_group.state == WorkerState.HEALTHY  # not a failure's restart
        if growing and self._closed:
            return
        if not growing or not self._meet_at or not self._armed(worker_group):
            if growing:
                self._restart_why = self._not_kept(worker_group)
            try:
                super()._restart_workers(worker_group)
            finally:
                if growing:
                    self._restart_why = ""
            return
        pids = {worker.local_rank: worker.id for worker in worker_group.workers}
        self._in_place_round = True
        waiting = worker_group.spec.rdzv_handler.num_nodes_waiting()
        try:  # the round with the new node: this node's new ranks
            self._rendezvous(worker_group, expected=worker_group.group_world_size + waiting)
            kept = self._in_place_round
        except RendezvousClosedError:
            # Another node's agent ended (its workers done: the job finished there) while this one met
            # the node that waits: nobody is left to meet it. The workers, untold, stay as they are,
            # and their own end says how this node ends (done, or failed without their peers).
            self._closed = True
            return
        finally:
            self._in_place_round = False
        for worker in worker_group.workers:
            worker.id = pids.get(worker.local_rank)
        host, port = self._meet_at.rsplit(":", 1)
        if not kept or not all(self._tell(worker, worker_group, self._attempt, host, port)
                               for worker in worker_group.workers):
            # One was not told, or the last in-place round fell back: all start again, as torch would.
            # After a fallback at once: a worker that missed the round's word will not take SIGTERM's.
            self._peer_lost = not kept
            try:
                self._stop_workers(worker_group)
            finally:
                self._peer_lost, self._restart_why = False, ""
            for local_rank, pid in self._start_workers(worker_group).items():
                worker_group.workers[local_rank].id = pid
        worker_group.state = WorkerState.HEALTHY

    def _armed(self, worker_group: WorkerGroup) -> bool:
        return self._sockets is not None and all(
            os.path.exists(socket_path(self._sockets, w.local_rank)) for w in worker_group.workers)

    def _tell(self, worker, worker_group: WorkerGroup, attempt: int, host: str, port: str, *, lost: bool = False) -> bool:
        """Worker ``worker`` (its new ranks set) hears them on its socket; False when it cannot."""
        # A node joins: its workers start (Python, torch) before the group forms.
        limit = join_timeout_s(os.environ) if lost else GROW_JOIN_S
        env = {"RANK": str(worker.global_rank), "WORLD_SIZE": str(worker.world_size),
               "ROLE_RANK": str(worker.role_rank), "ROLE_WORLD_SIZE": str(worker.role_world_size),
               "GROUP_RANK": str(worker_group.group_rank), "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
               "DISTTRAIN_ATTEMPT": str(attempt), "MASTER_ADDR": host, "MASTER_PORT": port,
               "TORCHELASTIC_USE_AGENT_STORE": "True", JOIN_ENV: str(limit)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(Plan(attempt=attempt, env=env).to_bytes(), socket_path(self._sockets, worker.local_rank))
            except OSError:
                return False
        self._told = (attempt, time.monotonic() + limit + TOLD_MARGIN_S, limit)
        return True

    def _told_in_place(self, worker_group: WorkerGroup, in_place: InPlace) -> bool:
        """Every worker of this node hears its new ranks on its socket (see disttrain.runtime.regroup);
        False when one cannot (not armed: a script without disttrain.resume(), one not that far yet):
        the workers are then restarted, and those told fall back when their group does not form."""
        host, port = in_place.store.rsplit(":", 1)
        group_rank = in_place.group_ranks.get(self._host)
        if group_rank is None or not self._armed(worker_group):
            return False
        told = []
        for worker in worker_group.workers:
            new_rank = in_place.ranks.get(worker.global_rank)
            if new_rank is None:
                return False
            told.append((worker, new_rank))
        for worker, new_rank in told:
            worker.global_rank = worker.role_rank = new_rank
            worker.world_size = worker.role_world_size = in_place.world_size
        worker_group.group_rank = group_rank
        worker_group.group_world_size = len(in_place.group_ranks)
        if not all(self._tell(worker, worker_group, in_place.attempt, host, port, lost=True) for worker, _ in told):
            return False
        self._attempt = in_place.attempt
        if isinstance(self._logs_specs, RankLogs):
            self._logs_specs.attempt = in_place.attempt
        self._on_attempt(in_place.attempt, worker_group, True, "")
        return True

    def _stop_workers(self, worker_group: WorkerGroup, *args, **kwargs) -> None:  # torch < 2.11: is_restart
        self._told = None
        if self._peer_lost:
            wait = {"timeout": KILL_WAIT_S} if torchcompat.takes(self._shutdown, "timeout") else {}
            self._shutdown(death_sig=signal.SIGKILL, **wait)
        else:  # torch's stop (SIGTERM, then the grace): a round that grows lets disttrain.resume() save
            super()._stop_workers(worker_group, *args, **kwargs)

    def _rendezvous(self, worker_group: WorkerGroup, expected: int | None = 0) -> None:
        """torch's rendezvous, for a round that waits for ``expected`` nodes (:mod:`.gathering`; 0:
        torch's own round, None: as many as come): the job's first waits for the nodes gathered, a
        node's first in a running job for as many as come, one that grows for its members and the
        nodes waiting."""
        if self._gather is not None:
            with contextlib.suppress(RuntimeError):  # the store not answering: torch's rendezvous says so itself
                expected = gathering.gather_at_start(*self._gather) or None
            self._gather = None
        previous = self._attempt
        with gathering.expecting(worker_group.spec.rdzv_handler, expected):
            super()._rendezvous(worker_group)
        attempt = self._attempt = job_attempt(worker_group.store, worker_group.group_rank)
        if self._in_place_round and round_fell_back(worker_group.store, previous):
            self._in_place_round = False
            self._restart_why = f"the in-place round {previous} fell back"
        if isinstance(self._logs_specs, RankLogs):
            self._logs_specs.attempt = attempt
        self._on_attempt(attempt, worker_group, self._in_place_round, self._restart_why)


@contextlib.contextmanager
def installed(**agent_args) -> Iterator[list[ElasticNodeAgent]]:
    """torch's ``launch_agent`` builds an :class:`ElasticNodeAgent` (with ``agent_args``) instead of
    its ``LocalElasticAgent``, until the block ends; the list yielded holds the agent built, and
    with it the rendezvous store this node may host, alive after ``elastic_launch`` returns (for
    :meth:`~disttrain.agent.attempt_store.AttemptStores.farewell`). torch offers no other way to
    choose the agent of ``elastic_launch``; the name is checked by the tests, so a torch that
    renames it fails there."""
    from torch.distributed.launcher import api

    built: list[ElasticNodeAgent] = []

    def build(**kwargs) -> ElasticNodeAgent:
        built.append(ElasticNodeAgent(**agent_args, **kwargs))
        return built[-1]

    original = api.LocalElasticAgent
    api.LocalElasticAgent = build
    try:
        yield built
    finally:
        api.LocalElasticAgent = original
