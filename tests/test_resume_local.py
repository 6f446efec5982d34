"""disttrain.resume() in this very process, a world of one: a run "killed" at a step (an
exception, then a fresh start in the same process) ends with the weights of the run that
never stopped; what a checkpoint holds; damaged and hostile checkpoints; SIGTERM; errors."""

import errno
import os
import random
import signal
import struct
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import disttrain
from disttrain import checkpoint
from disttrain.checkpoint_layout import MARKER, STATE_FILE, CheckpointLayout
from disttrain.errors import DisttrainError, UsageError
from disttrain.runtime import checkpoint_write, preemption, resume, rng
from disttrain.runtime import context as context_module

SAMPLES, BATCH, EPOCHS = 40, 4, 3  # 10 steps per epoch, 30 in all


@pytest.fixture
def ctx(monkeypatch):
    """A fresh world-of-one context; no resume state or SIGTERM handler outlives a test."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in os.environ if k.startswith("DISTTRAIN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(context_module, "_current", None)
    yield disttrain.init()
    if resume.current() is not None:
        resume.current().close()
    preemption.uninstall()
    disttrain.shutdown()


class Recorded(Dataset):
    """Remembers which samples were read."""

    def __init__(self):
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = torch.randint(0, 2, (SAMPLES,), generator=generator)
        self.read: list[int] = []

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        self.read.append(i)
        return self.x[i], self.y[i]


class Crash(Exception):
    """Stands for SIGKILL: the process stops between two lines of the loop."""


def train(directory, *, every=3, crash_at=None, sigterm_at=None, data=None, signals=(signal.SIGTERM,)):
    """A loop drawing from every generator (dropout, torch, python, numpy) with an
    Adam optimizer and an epoch-wise LR scheduler; the final weights."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # what a restarted process starts from
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    data = data if data is not None else Recorded()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = disttrain.prepare(model, optimizer, loader)
    state = disttrain.resume(directory, every=every, model=model, optimizer=optimizer,
                             scheduler=scheduler)
    for _epoch in disttrain.epochs(EPOCHS):
        for x, y in state.steps(loader):
            if state.step == crash_at:
                raise Crash
            noisy = x + 0.01 * torch.randn_like(x) + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = F.cross_entropy(model(noisy), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if state.step == sigterm_at:
                for signum in signals:
                    os.kill(os.getpid(), signum)
        scheduler.step()
    state.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def uninterrupted(ctx):
    return train(None)


@pytest.mark.parametrize("crash_at, every", [(7, 3), (10, 5), (13, 0), (25, 4), (2, 3)])
def test_killed_and_resumed_run_is_bit_exact(ctx, uninterrupted, tmp_path, crash_at, every):
    with pytest.raises(Crash):
        train(tmp_path, every=every, crash_at=crash_at)
    assert same_weights(train(tmp_path, every=every), uninterrupted)


def test_resumed_epoch_does_not_read_the_batches_done(ctx, uninterrupted, tmp_path):
    with pytest.raises(Crash):
        train(tmp_path, crash_at=7)  # checkpoint at step 6: 6 batches of epoch 0 done
    data = Recorded()
    assert same_weights(train(tmp_path, data=data), uninterrupted)
    assert len(data.read) == SAMPLES * EPOCHS - 6 * BATCH


def test_the_position_is_known_right_after_resume(ctx, tmp_path):
    """Before: epoch_step was 0 until the epoch's steps began."""
    with pytest.raises(Crash):
        train(tmp_path, crash_at=17)  # checkpoint at step 15: epoch 1, 5 of its 10 steps done
    state = disttrain.resume(tmp_path, model=torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)))
    assert (state.step, state.epoch, state.epoch_step, state.resumed_from) == (15, 1, 5, 15)


def test_checkpoint_holds_progress_and_every_generator(ctx, tmp_path):
    train(tmp_path, every=4)
    path = checkpoint.latest(tmp_path)
    assert path.name == "step_00000028"
    assert {p.name for p in path.iterdir()} == {STATE_FILE, "rank_00000.pt", MARKER}
    state = torch.load(path / STATE_FILE, weights_only=True)
    assert {"model", "optimizer", "scheduler", "progress", "step"} <= state.keys()
    assert state["progress"] == {"epoch": 2, "epoch_step": 8, "epoch_samples": 32,
                                 "epoch_done": False, "world_size": 1}
    mine = torch.load(path / "rank_00000.pt", weights_only=True)
    assert set(mine) == {"python", "numpy", "torch", "cuda", "generators"}
    assert len(mine["generators"]) == 1  # the training loader's own


def test_sigterm_stops_at_the_step_saves_and_exits_143(ctx, uninterrupted, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path, every=100, sigterm_at=4)
    assert stopped.value.code == preemption.PREEMPTED_EXIT == 143
    assert checkpoint.latest(tmp_path).name == "step_00000005"  # the step it was in finished
    assert "SIGTERM: stopped after step 5" in capsys.readouterr().err
    assert same_weights(train(tmp_path, every=100), uninterrupted)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # close() gave it back


def test_ctrl_c_stops_at_the_step_saves_and_exits_130(ctx, uninterrupted, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path, every=100, sigterm_at=4, signals=(signal.SIGINT,))
    assert stopped.value.code == 130
    assert checkpoint.latest(tmp_path).name == "step_00000005"
    assert f"Ctrl-C (SIGINT): stopped after step 5, saved in {tmp_path}; exiting with 130" in capsys.readouterr().err
    assert same_weights(train(tmp_path, every=100), uninterrupted)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # close() gave it back


def test_a_second_ctrl_c_interrupts_at_once_without_saving(ctx, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, every=100, sigterm_at=4, signals=(signal.SIGINT, signal.SIGINT))
    assert checkpoint.latest(tmp_path) is None


def test_damaged_newest_checkpoint_falls_back_to_the_previous(ctx, uninterrupted, tmp_path):
    with pytest.raises(Crash):
        train(tmp_path, every=3, crash_at=20)
    newest = checkpoint.latest(tmp_path)
    assert newest.name == "step_00000018"
    (newest / "rank_00000.pt").write_bytes(b"\x00" * 64)  # the rank file, not state.pt
    (tmp_path / ".tmp-step_00000021-4242").mkdir()  # a writer killed before its rename
    with pytest.warns(UserWarning, match="step_00000018"):
        assert same_weights(train(tmp_path, every=3), uninterrupted)


def change_a_weight(path):
    """One byte inside a tensor's data changed: torch.load still reads the file, silently."""
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 8)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[record.header_offset + 26:record.header_offset + 30])
    raw[record.header_offset + 30 + name_len + extra_len + 4] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_changed_weight_in_the_newest_checkpoint_is_found_and_skipped(ctx, uninterrupted, tmp_path):
    """Before: the run resumed from the changed weights without a word."""
    with pytest.raises(Crash):
        train(tmp_path, every=3, crash_at=20)
    newest = checkpoint.latest(tmp_path)
    change_a_weight(newest / STATE_FILE)
    torch.load(newest / STATE_FILE, weights_only=True)  # still loads
    with pytest.warns(UserWarning) as seen:
        assert same_weights(train(tmp_path, every=3), uninterrupted)  # from step 15
    skipped = [str(w.message) for w in seen if "skipping" in str(w.message)]
    assert skipped == [f"disttrain: skipping checkpoint {newest}: {STATE_FILE} does not match its sha256 "
                       "digest (changed after it was written); trying the one before"]


def test_no_whole_checkpoint_left_is_one_error(ctx, tmp_path):
    with pytest.raises(Crash):
        train(tmp_path, every=3, crash_at=8)  # steps 3 and 6
    for path in sorted(tmp_path.iterdir()):
        (path / STATE_FILE).write_bytes((path / STATE_FILE).read_bytes()[:-10])
    with pytest.warns(UserWarning, match="skipping"), \
            pytest.raises(DisttrainError, match=f"no whole checkpoint left in {tmp_path}: all 2 are damaged"):
        train(tmp_path)


def test_hostile_rank_file_is_refused(ctx, tmp_path):
    with pytest.raises(Crash):
        train(tmp_path, every=3, crash_at=4)
    torch.save({"payload": Crash()}, CheckpointLayout(tmp_path).step_dir(3) / "rank_00000.pt")
    with pytest.raises(DisttrainError, match="weights_only=False"):
        train(tmp_path)


def test_no_directory_counts_only(ctx, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    state = disttrain.resume(model=model)
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)
    for epoch in disttrain.epochs(2):
        for _ in state.steps(loader):
            assert state.epoch == epoch
    assert (state.step, state.epoch, state.resumed_from) == (6, 2, None)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="no checkpoint directory"):
        state.save()


def test_environment_gives_the_defaults(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CHECKPOINT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("DISTTRAIN_CHECKPOINT_EVERY", "7")
    # The launcher's contract is read once, by init(): a context made before the variables
    # were set does not see them.
    assert disttrain.resume(model=torch.nn.Linear(2, 2)).directory is None
    disttrain.shutdown()
    disttrain.init()
    state = disttrain.resume(model=torch.nn.Linear(2, 2))
    assert (state.directory, state.every) == (tmp_path / "ck", 7)
    assert disttrain.resume(tmp_path / "mine", every=2, model=torch.nn.Linear(2, 2)).every == 2


def test_bad_arguments_are_usage_errors(ctx, tmp_path):
    with pytest.raises(UsageError, match="every"):
        disttrain.resume(tmp_path, every=-1)
    with pytest.raises(UsageError, match=r"model=.*object has no state_dict"):
        disttrain.resume(tmp_path, model=object())
    with pytest.raises(UsageError, match="'progress' is a name the checkpoint uses"):
        disttrain.resume(tmp_path, progress=torch.nn.Linear(1, 1))
    checkpoint.save(tmp_path, step=3, model=torch.nn.Linear(1, 1))  # not resume()'s
    with pytest.raises(DisttrainError, match="not written by disttrain.resume"):
        disttrain.resume(tmp_path, model=torch.nn.Linear(1, 1))


def disk_full(path, write):
    with open(path, "wb") as f:
        f.write(b"partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_full_disk_is_one_clear_error_and_leaves_nothing(ctx, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_write, "write_durably", disk_full)
    state = disttrain.resume(tmp_path / "ck", model=torch.nn.Linear(2, 2))
    with pytest.raises(DisttrainError, match=r"cannot write checkpoint directory .*ck.*No space left"):
        state.save()
    assert list((tmp_path / "ck").iterdir()) == []  # the partial temporary directory is gone


def test_periodic_save_failing_exits_with_one_line(ctx, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(checkpoint_write, "write_durably", disk_full)
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path, every=2)
    assert stopped.value.code == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"disttrain: rank 0: cannot write checkpoint directory {tmp_path} (")
    assert line.endswith("No space left on device") and "\n" not in line


def test_stream_without_index_is_skipped_by_reading(ctx, tmp_path):
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(12))

    def run(crash_at=None):
        state = disttrain.resume(tmp_path, every=2, model=torch.nn.Linear(1, 1))
        seen = []
        for _ in disttrain.epochs(1):
            for batch in state.steps(DataLoader(Stream(), batch_size=3)):
                if state.step == crash_at:
                    raise Crash
                seen += batch.tolist()
        return seen

    with pytest.raises(Crash):
        run(crash_at=3)
    with pytest.warns(UserWarning, match="reading and dropping its first 2 batches"):
        assert run() == list(range(6, 12))


def test_rng_states_round_trip_as_plain_values(tmp_path):
    generator = torch.Generator().manual_seed(3)
    saved = rng.capture([generator])
    torch.save(saved, tmp_path / "rng.pt")
    first = (random.random(), float(np.random.rand()), torch.rand(2), torch.rand(1, generator=generator))
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True), [generator])
    again = (random.random(), float(np.random.rand()), torch.rand(2), torch.rand(1, generator=generator))
    assert first[:2] == again[:2]
    assert torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])
