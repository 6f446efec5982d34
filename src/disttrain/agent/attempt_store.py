"""A clean store for every attempt of the worker group (``--max-restarts``).

torch's elastic agent keeps one store for the whole job and tells the workers to use it
(``TORCHELASTIC_USE_AGENT_STORE``), and ``init_process_group(env://)`` adds no per-attempt
prefix: a restarted group reads the keys its predecessor wrote -- gloo's addresses of ranks
that are gone ("Connection refused"), or a script's own notes. So each attempt's workers get
a store of their own instead: worker rank 0 hosts it (``env://``'s default without an agent
store) on a port its agent picks, and the other nodes' agents learn ``addr:port`` through the
agent store, under a key of the run and the attempt. The store ends with the attempt.

On one node the agent hosts the attempt's store itself, up before the workers start, and tells
them so (``TORCHELASTIC_USE_AGENT_STORE``: every rank a client, under a prefix of the attempt).
Hosted by worker rank 0, a rank that finished importing torch first asked before rank 0
listened, and c10d's connect backed off: 0.2-0.6 s of both ranks' ``init_process_group`` in
about half the runs of a trivial job, where torchrun's workers find its agent's store up.
"""

from __future__ import annotations

import time
from datetime import timedelta

from torch.distributed import TCPStore

from ..net import free_port
from ..plan.launch import LaunchPlan, NodePlan
from ..workerenv import GROUP_STORE

FAREWELL_S = 10.0  # the rendezvous store's host waits at most this long for the others to leave it


class AttemptStores:
    """Called with each attempt's worker environments (``RankLogs.reify``), before they start."""

    def __init__(self, plan: LaunchPlan, node: NodePlan) -> None:
        self.plan, self.node = plan, node
        self._agent_store: TCPStore | None = None
        self._hosted: TCPStore | None = None  # this attempt's store, on one node (the last one ends with it)

    def __call__(self, envs: dict[int, dict[str, str]], attempt: int) -> None:
        hosted = self.plan.nnodes == 1
        if hosted:
            self._hosted = None  # the previous attempt's store ends before the next one starts
            self._hosted = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.plan.rdzv_timeout_s))
            endpoint = f"127.0.0.1:{self._hosted.port}"
        else:
            endpoint = self._endpoint(envs, attempt)
        addr, _, port = endpoint.rpartition(":")
        for env in envs.values():
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            if hosted:
                env["TORCHELASTIC_USE_AGENT_STORE"] = str(True)
            env["MASTER_ADDR"], env["MASTER_PORT"] = addr, port
            if self.plan.elastic:  # the runtime's groups meet on the launcher's store (runtime/regroup.py)
                env[GROUP_STORE] = f"{self.plan.master_addr}:{self.plan.master_port}"

    def kept(self, ranks: tuple[int, ...], attempt: int) -> None:
        """A round whose workers here were kept (an in-place regroup that grew): the node of rank 0
        still says where the round's store is, for the new nodes' agents, which wait for it (the
        runtime's workers meet on the launcher's store: the address is for plain scripts)."""
        if self.plan.nnodes > 1 and 0 in ranks:
            self._endpoint({0: {"RANK": "0"}}, attempt)

    def _endpoint(self, envs: dict[int, dict[str, str]], attempt: int) -> str:
        hosts_rank0 = any(env.get("RANK") == "0" for env in envs.values())
        key = f"/disttrain/{self.plan.rendezvous_id}/attempt_{attempt}/store"
        store = self._store()
        if hosts_rank0:
            endpoint = f"{self.node.address or self.plan.master_addr}:{free_port('0.0.0.0')}"
            store.set(key, endpoint)
            return endpoint
        return store.get(key).decode()  # waits (up to the rendezvous timeout) for rank 0's node

    def _store(self) -> TCPStore:
        if self._agent_store is None:
            self._agent_store = TCPStore(self.plan.master_addr, self.plan.master_port, is_master=False,
                                         timeout=timedelta(seconds=self.plan.rdzv_timeout_s))
        return self._agent_store

    def farewell(self, nodes: int, *, hosts_store: bool, timeout_s: float = FAREWELL_S) -> None:
        """The end of an elastic job, once torch's agent returned: the node hosting the rendezvous
        store waits (at most ``timeout_s``) for the other ``nodes - 1`` of the last round to say they
        left, which they do once torch closed their part of the rendezvous in that store -- gone
        sooner, it makes each of them print c10d's stack trace of a store that went away."""
        key = f"/disttrain/{self.plan.rendezvous_id}/left"
        try:
            store = self._store()
            if not hosts_store:
                store.add(key, 1)
                return
            deadline = time.monotonic() + timeout_s
            while store.add(key, 0) < nodes - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        except (RuntimeError, OSError):  # a store already gone: nothing left to wait for
            pass
