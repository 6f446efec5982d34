"""The state of sharded models and their optimizers, through ``torch.distributed.checkpoint``.

An FSDP model's parameters and its optimizer's moments exist only as shards, one per
rank; gathering them on rank 0 to write one file would need the whole model in one
process -- what sharding avoids. DCP has every rank write its own shard, records where
each piece of each tensor lies (``.metadata``), and on loading gives every rank the
pieces its own shards need, whatever the number of ranks that wrote them: a checkpoint of
8 ranks resumes on 4. State dicts are taken with ``torch.distributed.checkpoint.state_dict``,
which keys the optimizer's state by parameter name rather than by position, so that it
reshards too.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...checkpoint_retry import retrying
from ...checkpoint_url import RemotePath
from ...errors import DisttrainError, UsageError
from ..torch_errors import FAILURES, first_line


def state_dicts(objects: dict[str, Any]) -> dict[str, Any]:
    """Each object's state dict, keyed by its name, as DCP saves and loads them."""
    owners = _owners(objects)
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            out[name] = get_model_state_dict(obj)
        else:
            out[name] = get_optimizer_state_dict(owners[name], obj)
    return out


def write(objects: dict[str, Any], directory: Path) -> None:
    """Every rank writes its shards of ``objects`` into ``directory`` (a collective).

    Not fsynced: the checkpoint's writer fsyncs each file while it digests it
    (``checkpoint_layout.sync_and_digest``), the two at once."""
    with _single_process_quiet():
        dcp.save(state_dicts(objects), storage_writer=_writer(directory))


def write_async(objects: dict[str, Any], directory: Path, group: Any) -> Any:
    """Like :func:`write`, but the files are written in the background: the state is
    copied (staged) first, so training may change it right away. Returns the future; its
    result means every rank's files and the metadata are written."""
    from ..checkpoint_stage import kept_dcp_stager

    stager = kept_dcp_stager()
    if stager is None:  # CPU state (or an older torch): the storage writer stages, as DCP does by default
        return dcp.async_save(state_dicts(objects), storage_writer=_writer(directory), process_group=group)
    states = state_dicts(objects)
    # torch's stager copies on a stream of its own, which does not wait for the training's: the
    # step's kernels must have run before its copies start.
    torch.cuda.current_stream().synchronize()
    response = dcp.async_save(states, storage_writer=_writer(directory), process_group=group, async_stager=stager)
    staged = getattr(response, "staging_completion", None)
    if staged is None:
        return response
    # The pinned copies are queued on the stager's own stream; the state may change once they ran
    # (the optimizer step writes in place).
    staged.result()
    return response.upload_completion


def _writer(directory: Path | RemotePath) -> FileSystemWriter:
    # On a store, DCP's own fsspec storage; sync_files means nothing there (the checkpoint's
    # writer reads every object back instead).
    if isinstance(directory, RemotePath):
        writer = _retrying_fsspec_writer()(str(directory), sync_files=False)
        writer.retry = directory.retry
        return writer
    return FileSystemWriter(directory, sync_files=False)


@functools.cache
def _retrying_fsspec_writer() -> type:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # imports fsspec

    class RetryingFsspecWriter(FsspecWriter):
        """DCP's fsspec writer whose store operations ride out an outage as the checkpoint's own do
        (:mod:`disttrain.checkpoint_retry`): a failed ``write_data`` writes this rank's files again
        from the start, under the same names; the state it writes is staged or the step's own."""

        retry: Any = None

        def prepare_local_plan(self, plan: Any) -> Any:
            return retrying(self.retry, super().prepare_local_plan, plan)

        def write_data(self, plan: Any, planner: Any) -> Any:
            return retrying(self.retry, super().write_data, plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            retrying(self.retry, super().finish, metadata, results)

    return RetryingFsspecWriter


def _reader(directory: Path | RemotePath) -> FileSystemReader:
    if isinstance(directory, RemotePath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(directory))
    return FileSystemReader(directory)


def extents(directory: Path | RemotePath) -> dict[str, int]:
    """The bytes each file of the checkpoint in ``directory`` must hold at least, by its
    ``.metadata``: where DCP recorded writing each item. A file shorter than that, or one
    it names that is not there, lost data after DCP wrote it (pytorch#183878)."""
    needed: dict[str, int] = {}
    storage = _reader(directory).read_metadata().storage_data or {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def read(objects: dict[str, Any], directory: Path) -> None:
    """Load ``objects`` from the shards in ``directory``, resharded for this world."""
    owners = _owners(objects)
    wanted = state_dicts(objects)
    try:
        with _single_process_quiet():
            if isinstance(directory, RemotePath):
                dcp.load(wanted, storage_reader=_reader(directory))
            else:
                dcp.load(wanted, checkpoint_id=directory)
    except FAILURES as err:
        raise DisttrainError(
            f"checkpoint {directory.parent} does not fit this run's "
            f"{'/'.join(objects)}: {first_line(err)}; resume from a checkpoint directory "
            "of this model (or start a new one)") from err
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, wanted[name])
        else:
            set_optimizer_state_dict(owners[name], obj, wanted[name])


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU of rank 0 (empty on the others); a
    collective for a sharded model."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _owners(objects: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """For each optimizer in ``objects``, the model whose parameters it steps."""
    models = [m for m in objects.values() if isinstance(m, torch.nn.Module)]
    owners = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            continue
        mine = {id(p) for group in obj.param_groups for p in group["params"]}
        owner = next((m for m in models if mine & {id(p) for p in m.parameters()}), None)
        if owner is None:
            raise UsageError(
                f"checkpoint: the optimizer {name!r} steps none of the models saved with it; "
                "a sharded checkpoint saves an optimizer together with its model")
        owners[name] = owner
    return owners


@contextlib.contextmanager
def _single_process_quiet():
    """A world of one has no process group: DCP then works in this process alone, which is
    what is meant here, and says so in a warning at every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
