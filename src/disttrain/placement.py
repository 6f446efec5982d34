"""Where processes run and what they run on: pure choices, shared by launcher and runtime.

Everything here takes the facts (core count, CUDA devices) as arguments so that the GPU
paths are chosen by the same code on a machine without a GPU, and are unit-tested there.
"""

from __future__ import annotations

import os

from .errors import UsageError

DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def usable_cpus() -> int:
    """Cores this process may run on (cgroup/affinity aware, unlike ``os.cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


def auto_nproc(*, cuda_devices: int, cpus: int) -> int:
    """Processes per node for ``-n auto``.

    One per GPU when there are GPUs. On CPU, one per two cores: each DDP process then keeps
    a core for its compute threads and one for gloo's communication and data loading; one
    process per core oversubscribes (the seed chapter saw no gain from 4 processes on 4
    cores).
    """
    if cuda_devices > 0:
        return cuda_devices
    return max(1, cpus // 2)


def oversubscription_hint(*, nproc: int, cpus: int, host: str) -> str | None:
    """A line for the user when CPU processes outnumber cores (each then runs slower than alone)."""
    if nproc <= cpus:
        return None
    return (f"{nproc} processes on {host}'s {cpus} core{'s' if cpus != 1 else ''}: they will share cores and "
            f"each run slower; -n auto picks {auto_nproc(cuda_devices=0, cpus=cpus)} here, and "
            "`disttrain bench SCRIPT -n 1,2,4` measures which count is fastest")


def omp_threads(*, cpus: int, nproc: int) -> int:
    """Intra-op threads per process so that the node's processes share its cores exactly."""
    return max(1, cpus // max(1, nproc))


def choose_dist_backend(requested: str | None, *, cuda_available: bool) -> str:
    if requested:
        if requested not in DIST_BACKENDS:
            raise UsageError(
                f"unknown backend {requested!r}: choose one of {', '.join(DIST_BACKENDS)}"
            )
        return requested
    return "nccl" if cuda_available else "gloo"


# NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless it is 2.30 or newer and
# this variable is 1; gloo has no such rule (it reduces CUDA tensors through host memory).
NCCL_MULTI_RANK_GPU = (2, 30)
NCCL_MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"


def shared_gpu_backend(nccl_version: tuple[int, ...] | None) -> str:
    """The backend with which several ranks may share one GPU: ``nccl`` from NCCL 2.30 on
    (with :data:`NCCL_MULTI_RANK_GPU_ENV` set to 1), else ``gloo`` with CUDA tensors."""
    if nccl_version is not None and tuple(nccl_version[:2]) >= NCCL_MULTI_RANK_GPU:
        return "nccl"
    return "gloo"


def choose_device(*, local_rank: int, cuda_devices: int, dist_backend: str,
                  nccl_version: tuple[int, ...] | None = None, nccl_multi_rank_gpu: bool = False) -> str:
    """``cuda:<local_rank>`` when this node has GPUs, else ``cpu``.

    A gloo job on a GPU machine still trains on the GPU (gloo can reduce CUDA tensors);
    an explicit NCCL job without GPUs is a mistake worth naming. More ranks than GPUs share
    them in turn (``cuda:<local_rank % GPUs>``) where the backend allows it: gloo always
    (chosen explicitly: NCCL is the default with GPUs), NCCL only from 2.30 on and with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (``nccl_multi_rank_gpu``), which says the user meant it.
    """
    if cuda_devices <= 0:
        if dist_backend == "nccl":
            raise UsageError(
                "backend 'nccl' needs CUDA GPUs but none are visible: use --dist-backend gloo"
            )
        return "cpu"
    if local_rank >= cuda_devices:
        nccl_shares = nccl_multi_rank_gpu and shared_gpu_backend(nccl_version) == "nccl"
        if dist_backend == "gloo" or (dist_backend == "nccl" and nccl_shares):
            return f"cuda:{local_rank % cuda_devices}"
        version = ".".join(map(str, nccl_version)) if nccl_version else "unknown"
        raise UsageError(
            f"LOCAL_RANK={local_rank} has no GPU: only {cuda_devices} visible on this node; "
            "start at most that many processes per node (-n auto does), or let ranks share a GPU: "
            f"--dist-backend gloo, or {NCCL_MULTI_RANK_GPU_ENV}=1 with NCCL >= 2.30 (here {version})"
        )
    return f"cuda:{local_rank}"
