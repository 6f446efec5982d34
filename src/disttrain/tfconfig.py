"""TensorFlow workers: their ``TF_CONFIG``, and the node's checks before they start.

torch's elastic agent starts TensorFlow workers like any others (logs, rank prefixes,
failure reports, restarts are shared with PyTorch runs), but it gives every worker of a
node the same environment, while ``TF_CONFIG`` differs per worker: its task index. So the
plan exports the cluster's worker list (``DISTTRAIN_TF_WORKERS``, ``host:port`` in task
order) and the node's first task index, and the agent starts
``python -m disttrain.tfconfig SCRIPT ARGS...``: this module adds ``TF_CONFIG`` and
``exec``s the script, so the script runs in the very process the agent started (its pid,
signals, exit code and log files stay the agent's). Standard library only: it runs before
every TensorFlow worker.

Worker ports follow one rule everywhere (local runs, ``--hosts``, jobs): task ``i`` listens
on its node's address at ``master_port + 1 + i``. A one-worker run gets no ``TF_CONFIG``,
so a script picks ``MirroredStrategy`` as TensorFlow's tutorials do. A ``TF_CONFIG`` the
user set wins.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .errors import UsageError
from .net import port_in_use
from .workerenv import TF_FIRST_TASK, TF_WORKERS

if TYPE_CHECKING:
    from typing import TextIO

SHIM = "disttrain.tfconfig"
LEGACY_KERAS = "TF_USE_LEGACY_KERAS"


def worker_addresses(nodes: Sequence[tuple[str, int]], master_port: int) -> tuple[str, ...]:
    """``host:port`` of every worker, in task order: node by node, ``master_port + 1 + task``.

    ``nodes`` are (address, processes) in node-rank order.
    """
    world = sum(n for _, n in nodes)
    if master_port + world > 65535:
        raise UsageError(
            f"--master-port {master_port} leaves no room for {world} TensorFlow workers "
            f"(they listen on master port + 1 + rank, up to {master_port + world}): pick a lower port"
        )
    addresses, task = [], 0
    for address, nproc in nodes:
        host = f"[{address}]" if ":" in address else address  # IPv6 needs brackets before :port
        for _ in range(nproc):
            addresses.append(f"{host}:{master_port + 1 + task}")
            task += 1
    return tuple(addresses)


def tf_config(workers: Sequence[str], index: int) -> str:
    """``TF_CONFIG`` of worker ``index``: the whole cluster, and which task this one is."""
    if not 0 <= index < len(workers):
        raise ValueError(f"task index {index} is outside the {len(workers)} workers")
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


def _workers(environ: Mapping[str, str]) -> list[str]:
    return [w for w in environ.get(TF_WORKERS, "").split(",") if w]


def task_index(environ: Mapping[str, str]) -> int:
    # The node's first task + LOCAL_RANK, not RANK: with c10d rendezvous torch may number
    # the nodes differently from the plan, and the worker list follows the plan.
    return int(environ.get(TF_FIRST_TASK) or 0) + int(environ.get("LOCAL_RANK") or 0)


def shim_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker gets before its script starts: ``TF_CONFIG``, unless the user set one."""
    workers = _workers(environ)
    if "TF_CONFIG" in environ or len(workers) < 2:
        return {}
    return {"TF_CONFIG": tf_config(workers, task_index(environ))}


def keras_env(environ: Mapping[str, str], *, have_tf_keras: bool) -> dict[str, str]:
    """Keras 2 (tf-keras) for TensorFlow workers when it is installed and the user did not choose.

    Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy; tf-keras's works, and
    the same Keras for one worker and for many keeps a script's behaviour the same. Without
    tf-keras the variable would break ``tf.keras`` altogether, so it is left unset.
    """
    if LEGACY_KERAS in environ or not have_tf_keras:
        return {}
    return {LEGACY_KERAS: "1"}


def have_tf_keras() -> bool:
    return importlib.util.find_spec("tf_keras") is not None


def keras2_install_hint() -> str:
    """How to get tf-keras: the extra brings it with ``tensorflow``; beside ``tensorflow-cpu`` it must
    come without its dependencies, or pip installs the full ``tensorflow`` over it."""
    return (f"pip install 'disttrain[tensorflow]' (with tensorflow-cpu installed: "
            f"pip install --no-deps tf-keras=={tensorflow_version()})")


def tensorflow_version() -> str:
    import importlib.metadata  # not at the top: the shim runs before every worker

    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "<your tensorflow version>"


def tf_node_env(node_env: Mapping[str, str], *, host: str, nproc: int, world_size: int,
                report_to: TextIO = sys.stderr) -> dict[str, str]:
    """Checks before a node starts TensorFlow workers; returns the variables to add for them.

    A port already taken would make a worker fail late, inside TensorFlow's gRPC server: it
    is named here instead, before anything starts.
    """
    environ = {**os.environ, **node_env}
    first = int(node_env.get(TF_FIRST_TASK) or 0)
    own = [] if "TF_CONFIG" in environ else _workers(node_env)[first:first + nproc]
    for task, address in enumerate(own, start=first):
        port = int(address.rsplit(":", 1)[1])
        if port_in_use("0.0.0.0", port):  # TensorFlow's server listens on every interface
            raise UsageError(
                f"port {port} on {host} is already in use, and TensorFlow worker {task} must listen there "
                f"(workers listen on master port + 1 + rank): give another --master-port"
            )
    legacy_available = have_tf_keras()
    if not legacy_available and world_size > 1 and LEGACY_KERAS not in environ:
        print(
            f"disttrain: tf-keras is not installed on {host}, so tf.keras is Keras 3, whose model.fit fails "
            "under MultiWorkerMirroredStrategy (custom strategy.run loops work); for model.fit: "
            f"{keras2_install_hint()}",
            file=report_to, flush=True,
        )
    return keras_env(environ, have_tf_keras=legacy_available)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m disttrain.tfconfig [-m] TARGET ARGS...``: add TF_CONFIG, exec the target."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m disttrain.tfconfig [-m MODULE | SCRIPT] [ARGS...]")
    os.environ.update(shim_env(os.environ))
    sys.stdout.flush()
    if "TF_CONFIG" in os.environ and os.environ.get(LEGACY_KERAS, "").lower() not in ("1", "true"):
        run_keras3_guarded(argv)  # Keras 3 across workers: its fit failure becomes one line
        return
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def run_keras3_guarded(argv: list[str]) -> None:
    """Run the target in this process; Keras 3's ``model.fit`` failure under
    MultiWorkerMirroredStrategy (a ValueError quoting every replica's tensors, ~40 lines)
    ends in one line naming the fix instead. Any other error keeps its traceback."""
    import runpy

    sys.argv = list(argv[1:]) if argv[0] == "-m" else list(argv)
    try:
        if argv[0] == "-m":
            sys.argv[0] = argv[1]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except ValueError as err:
        if "PerReplica" not in str(err):
            raise
        sys.stdout.flush()
        print(f"disttrain: Keras 3's model.fit does not work under MultiWorkerMirroredStrategy (an upstream Keras "
              f"problem); install Keras 2 and disttrain selects it: {keras2_install_hint()} "
              "(or train with a custom strategy.run loop)",
              file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
