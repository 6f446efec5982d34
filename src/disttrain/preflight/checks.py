"""``doctor``'s checks, also run before every multi-host launch: each a CheckResult (ok / warn /
fail, what was seen, the fix), from what the hosts' probe sessions said (:mod:`disttrain.wire`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from ..config.hosts import Host
from ..errors import DisttrainError, UsageError
from ..wire import HostFacts, Listening

CONNECT_ROUND_S = 20


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    check: str
    host: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def fact_checks(hosts: Sequence[Host], facts: Sequence[HostFacts | Exception], *,
                master_port: int) -> list[CheckResult]:
    """What each host said about itself, compared with the first host."""
    out: list[CheckResult] = []
    base = facts[0] if isinstance(facts[0], HostFacts) else None
    for host, fact in zip(hosts, facts):
        if isinstance(fact, Exception):
            out.append(CheckResult(check="ssh", host=host.name, status="fail", detail=str(fact),
                                   fix="check the host name, your ssh key (--ssh-option IdentityFile=...) "
                                       "and that disttrain is installed there"))
            continue
        out.append(CheckResult(check="ssh", host=host.name, status="ok", detail=f"reached; hostname {fact.hostname}"))
        if not fact.cwd_exists:
            out.append(CheckResult(
                check="path", host=host.name, status="fail",
                detail=f"the working directory {fact.cwd} does not exist there",
                fix="`disttrain run --sync` copies it, or create it (a shared filesystem)",
            ))
        for path, present in fact.paths.items():
            out.append(CheckResult(
                check="path", host=host.name, status="ok" if present else "fail",
                detail=f"{path} {'present' if present else 'not found'} in {fact.cwd}",
                fix="" if present else "`disttrain run --sync` copies the working directory, "
                                       "or copy it yourself (or use a shared filesystem)",
            ))
        if base is not None and fact is not base:
            diffs = [f"{k} {v} (vs {base.versions[k]} on {hosts[0].name})"
                     for k, v in fact.versions.items() if v != base.versions[k]]
            out.append(CheckResult(
                check="versions", host=host.name, status="fail" if diffs else "ok",
                detail="; ".join(diffs) or "same python, torch, NCCL and disttrain as the master",
                fix="install the same versions on every host" if diffs else "",
            ))
        out.append(CheckResult(
            check="interface", host=host.name, status="ok" if fact.ifname else "warn",
            detail=f"reaches the master from {fact.address} via {fact.ifname or 'an unknown interface'}",
            fix="" if fact.ifname else "set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME yourself",
        ))
        out.append(CheckResult(check="gpus", host=host.name, status="ok", detail=f"{fact.cuda_devices} GPU(s), {fact.cpus} CPU(s)"))
        if fact.port_free is not None:
            out.append(CheckResult(
                check="master port", host=host.name, status="ok" if fact.port_free else "fail",
                detail=f"port {master_port} {'free' if fact.port_free else 'already in use'}",
                fix="" if fact.port_free else "pick another --master-port",
            ))
    return out


def local_checks(fact: HostFacts, *, master_port: int) -> list[CheckResult]:
    """``disttrain doctor`` without hosts: can this machine run a job on its own?"""
    host = Host(name=fact.hostname)
    rows = [replace(r, fix="check the path: it is looked up from the current folder") if r.fix and r.check == "path"
            else r for r in fact_checks((host,), (fact,), master_port=master_port) if r.check not in ("ssh", "interface")]
    v = fact.versions
    rows.insert(0, CheckResult(
        check="versions", host=host.name, status="ok",
        detail=f"python {v['python']}, torch {v['torch']}, NCCL {v['nccl'] or 'none'}, disttrain {v['disttrain']}"))
    return rows


def reach_targets(facts: Sequence[HostFacts], answers: Sequence[Listening]) -> dict[str, tuple[int, str]]:
    """``{"addr:port": (host index, "rendezvous" | "mesh")}``: every host's listeners."""
    targets: dict[str, tuple[int, str]] = {}
    for j, answer in enumerate(answers):
        if answer.error is not None or not answer.ports:
            continue
        addr = facts[j].address
        if j == 0:
            targets[f"{addr}:{answer.ports[0]}"] = (0, "rendezvous")
        targets[f"{addr}:{answer.ports[-1]}"] = (j, "mesh")
    return targets


def targets_for(targets: dict[str, tuple[int, str]], i: int) -> list[str]:
    """What host ``i`` connects to: every other host's listeners."""
    return [t for t, (j, _) in targets.items() if j != i]


def listen_ports(i: int, master_port: int) -> list[int]:
    """The master also listens on the master port; everyone on a free one (the mesh)."""
    return [master_port, 0] if i == 0 else [0]


def reach_results(hosts: Sequence[Host], answers: Sequence[Listening], targets: dict[str, tuple[int, str]],
                  seen: Sequence[dict[str, str]]) -> list[CheckResult]:
    """What the listeners and the connects say, as checks naming each pair."""
    out: list[CheckResult] = []
    for j, answer in enumerate(answers):
        if answer.error is not None:
            out.append(CheckResult(check="listen", host=hosts[j].name, status="fail",
                                   detail=answer.error, fix="free the port or pick another --master-port"))
    for i, results in enumerate(seen):
        for target, why in results.items():
            j, kind = targets[target]
            port = target.rpartition(":")[2]
            if kind == "rendezvous":
                out.append(CheckResult(
                    check="rendezvous port", host=hosts[i].name, status="ok" if why == "ok" else "fail",
                    detail=f"{hosts[i].name} -> {hosts[j].name}:{port}: {why}",
                    fix="" if why == "ok" else f"open TCP port {port} on {hosts[j].name} to the other hosts "
                                              "(firewall / security group)",
                ))
            else:
                out.append(CheckResult(
                    check="host to host", host=hosts[i].name, status="ok" if why == "ok" else "fail",
                    detail=f"{hosts[i].name} -> {hosts[j].name} on port {port} (not the master port): {why}",
                    fix="" if why == "ok" else "gloo/NCCL connect every pair of ranks on random ports: allow "
                                               "all TCP between the hosts (AWS: a security-group rule allowing "
                                               "all traffic from the group itself)",
                ))
    return out


def first_failure(results: Sequence[CheckResult]) -> CheckResult | None:
    return next((r for r in results if r.status == "fail"), None)


def raise_on_failure(results: Sequence[CheckResult]) -> None:
    failed = first_failure(results)
    if failed:
        raise DisttrainError(f"preflight ({failed.check}, {failed.host}): {failed.detail}; fix: {failed.fix}")


def check_facts(hosts: Sequence[Host], facts: Sequence[HostFacts | Exception], *, master_port: int) -> None:
    """What would make the job fail or hang later (doctor's own checks), raised before launch."""
    for fact in facts:
        if isinstance(fact, Exception):
            raise fact
    failed = first_failure(fact_checks(hosts, facts, master_port=master_port))
    if failed:
        raise UsageError(f"{failed.host}: {failed.detail}; fix: {failed.fix}")
