"""Checkpoints at a URL, for real: ranks under ``disttrain run`` save to ``s3://`` on a moto
server process on loopback (conftest's ``s3_endpoint``), are SIGKILLed, and resume on 1 and on 3
ranks with no shared folder in between -- the store is the only thing the runs share. The store's
own layout rules (marker last, read back, keep-last-k) are checked in-process on ``memory://`` and
``file://``, where no server is needed."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from _launch import run_ranks, run_single
from disttrain.checkpoint_layout import MARKER
from disttrain.checkpoint_url import RemoteLayout, is_url, open_url
from disttrain.errors import UsageError

SCRIPT = Path(__file__).parent / "scripts" / "sharded_train.py"
SECRET = "s3cr3t-never-logged"  # the secret key every run gets: it must appear in no output


@pytest.fixture
def store(s3, monkeypatch):
    """A fresh bucket on the moto server; the clients find it through the AWS chain alone."""
    fs, bucket = s3
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return fs, bucket


def train(nproc: int, out: Path, *args, timeout: float = 200) -> subprocess.CompletedProcess:
    argv = [out, *args]
    result = run_single(SCRIPT, argv, timeout=timeout) if nproc == 1 else run_ranks(SCRIPT, nproc, argv, timeout=timeout)
    assert SECRET not in result.stdout + result.stderr
    return result


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def steps_on(fs, prefix: str) -> dict[str, bool]:
    """The step folders under ``prefix`` on the store, and whether each holds its marker."""
    fs.invalidate_cache()
    found = {}
    for entry in fs.ls(prefix, detail=False):
        name = entry.rsplit("/", 1)[-1]
        found[name] = fs.exists(f"{entry}/{MARKER}")
    return found


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob("rank*.jsonl")) for line in path.read_text().splitlines()]


def model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def killed_once(s3_endpoint, tmp_path_factory):
    """2 ranks saved steps 3, 6, 9 to s3:// (64 samples, 8 steps an epoch), then rank 0 was SIGKILLed:
    the bucket, and the folder of the ranks' logs."""
    import s3fs

    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}.items():
            env.setenv(key, value)
        fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
        bucket = "killed-once"
        fs.mkdir(bucket)
        logs = tmp_path_factory.mktemp("two")
        result = train(2, logs, "--ckpt", f"s3://{bucket}/run", "--every", "3", "--die-at", "11", "--dropout", "0")
    assert result.returncode != 0
    assert steps_on(fs, f"{bucket}/run") == {f"step_0000000{n}": True for n in (3, 6, 9)}
    return bucket, logs


@pytest.fixture
def killed_ddp(killed_once, store, tmp_path):
    """killed_once's checkpoints, copied to this test's own bucket: (fs, bucket, URL, the logs)."""
    fs, bucket = store
    fs.copy(f"{killed_once[0]}/run", f"{bucket}/run", recursive=True)
    return fs, bucket, f"s3://{bucket}/run", killed_once[1]


@pytest.mark.timeout(600)
def test_two_ranks_save_to_s3_then_one_and_three_ranks_resume_every_sample_once(killed_ddp, tmp_path):
    fs, bucket, url, two = killed_ddp
    fs.copy(f"{bucket}/run", f"{bucket}/copy", recursive=True)  # the same checkpoints for the 3-rank run
    before = [s for s in logged(two) if s["step"] < 9]
    consumed = sum(len(s["idx"]) for s in before if s["epoch"] == 1)  # of epoch 1, when step 9 was saved
    for nproc, where in ((1, url), (3, f"s3://{bucket}/copy")):
        out = tmp_path / f"on{nproc}"
        result = train(nproc, out, "--ckpt", where, "--every", "3", "--dropout", "0")
        assert_ok(result)
        assert f"resuming from step 9 in {where}" in result.stderr
        assert f"saved by 2 ranks and is resumed by {nproc}" in result.stderr
        after = logged(out)
        assert min(s["step"] for s in after) == 9
        for epoch in (0, 1):
            seen = Counter(i for s in before + after if s["epoch"] == epoch for i in s["idx"])
            assert set(seen) == set(range(64)), f"{nproc} ranks, epoch {epoch}: a sample was skipped"
            padding = -(64 - consumed) % nproc if epoch == 1 else 0  # the rest divided among nproc ranks
            assert sum(seen.values()) - 64 <= padding, [i for i, n in seen.items() if n > 1]
        assert set(model(out)) >= {"inp.weight", "out.weight"}
    # keep_last=3 held on the store: the 1-rank run saved every 3 steps up to step 21 (16 steps an epoch).
    assert steps_on(fs, f"{bucket}/run") == {f"step_000000{n}": True for n in (15, 18, 21)}


@pytest.mark.timeout(400)
def test_damaged_object_on_s3_is_skipped_for_the_checkpoint_before(killed_ddp, tmp_path):
    fs, bucket, url, _ = killed_ddp
    key = f"{bucket}/run/step_00000009/state.pt"
    raw = bytearray(fs.cat_file(key))
    raw[len(raw) // 2] ^= 0x40  # same size, one bit changed: only the digest can tell
    fs.pipe_file(key, bytes(raw))
    fs.rm_file(f"{bucket}/run/step_00000006/rank_00001.pt")
    result = train(2, tmp_path / "again", "--ckpt", url, "--every", "3", "--dropout", "0")
    assert_ok(result)
    assert "resuming from step 3" in result.stderr
    assert f"skipping checkpoint {url}/step_00000009: state.pt does not match its sha256 digest" in result.stderr
    assert f"skipping checkpoint {url}/step_00000006: rank_00001.pt is missing" in result.stderr


@pytest.mark.timeout(400)
def test_upload_killed_midway_is_never_taken_as_complete(store, tmp_path):
    """Rank 0 dies with step 6's state.pt on the store and its rank files not yet: no marker, so
    the next run resumes from step 3 -- and saving step 6 again replaces the partial folder."""
    fs, bucket = store
    url = f"s3://{bucket}/run"
    killed = train(2, tmp_path / "first", "--ckpt", url, "--every", "3", "--die-in-upload", "6")
    assert killed.returncode != 0
    assert steps_on(fs, f"{bucket}/run") == {"step_00000003": True, "step_00000006": False}
    assert fs.exists(f"{bucket}/run/step_00000006/state.pt")
    again = train(2, tmp_path / "again", "--ckpt", url, "--every", "3")
    assert_ok(again)
    assert "resuming from step 3" in again.stderr
    assert all(steps_on(fs, f"{bucket}/run").values())


@pytest.fixture(scope="module")
def fsdp_never_stopped(tmp_path_factory) -> dict[str, torch.Tensor]:
    """model.pt of 2 FSDP ranks that never stopped and saved nothing: what both modes' resumed runs must
    equal bit for bit (made once, read only)."""
    out = tmp_path_factory.mktemp("reference")
    assert_ok(train(2, out, "--strategy", "fsdp"))
    return model(out)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fsdp_to_s3_killed_and_resumed_is_bit_exact(store, tmp_path, mode, fsdp_never_stopped):
    fs, bucket = store
    url = f"s3://{bucket}/fsdp"
    common = ["--strategy", "fsdp", "--ckpt", url, "--every", "3", *(["--asynchronous"] if mode == "async" else [])]
    assert train(2, tmp_path / "run", *common, "--die-at", "11").returncode != 0
    saved = steps_on(fs, f"{bucket}/fsdp")
    # Asynchronous: step 9's upload may still be going on when rank 0 dies (then it has no marker,
    # or no object at all yet); the save of step 9 waited for step 6's.
    complete = sorted(int(name[5:]) for name, whole in saved.items() if whole)
    assert complete == [3, 6, 9] if mode == "sync" else complete in ([3, 6], [3, 6, 9])
    newest = complete[-1]
    marker = json.loads(fs.cat_file(f"{bucket}/fsdp/step_{newest:08d}/{MARKER}"))
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata", "state.pt"} <= set(marker["digests"])
    again = train(2, tmp_path / "run", *common)
    assert_ok(again)
    assert f"resuming from step {newest} in {url}" in again.stderr
    reference, resumed = fsdp_never_stopped, model(tmp_path / "run")
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


# -- in process: the store's rules, on memory:// and file:// ------------------------------------

def test_local_paths_are_not_urls_and_urls_are():
    assert not is_url("ckpt") and not is_url("/abs/ckpt") and not is_url(Path("/x"))
    assert is_url("s3://b/p") and is_url("file:///tmp/x") and is_url("memory://x")


def test_credentials_in_the_url_are_refused_without_echoing_them():
    with pytest.raises(UsageError) as info:
        open_url("s3://AKIAXX:topsecret@bucket/run")
    assert "topsecret" not in str(info.value) and "AWS_ENDPOINT_URL" in str(info.value)


def test_marker_is_written_last_and_keep_last_prunes_marker_first():
    layout = RemoteLayout.at("memory://ckpt-rules")
    for step in (1, 2, 3, 4):
        folder = layout.begin(step)
        digests = {"state.pt": layout.put(folder, "state.pt", b"x" * step)}
        assert [s for s, _ in layout.complete()] == list(range(1, step))[-2:]  # not before its marker
        layout.publish(step, digests, {})
        layout.prune(2)
    assert [s for s, _ in layout.complete()] == [3, 4]
    layout.put(layout.step_dir(5), "state.pt", b"cut short")  # an upload that never got its marker
    assert [s for s, _ in layout.complete()] == [3, 4]
    folder = layout.begin(6)
    layout.publish(6, {"state.pt": layout.put(folder, "state.pt", b"6")}, {})
    layout.prune(2)
    assert [s for s, _ in layout.complete()] == [4, 6]
    assert not layout.fs.exists(layout.step_dir(5).path)  # the leftover older than step 6 is gone


def test_object_changed_after_upload_is_named(tmp_path):
    layout = RemoteLayout.at(f"file://{tmp_path}/c")
    folder = layout.begin(1)
    digest = layout.put(folder, "state.pt", b"abcdef")
    assert layout.check(folder, "state.pt", digest) is None
    (tmp_path / "c" / "step_00000001" / "state.pt").write_bytes(b"abc")
    again = RemoteLayout.at(f"file://{tmp_path}/c")  # each load looks afresh
    assert again.check(folder, "state.pt", digest) == "state.pt has 3 bytes, 6 were written"


def test_save_and_load_latest_on_memory_url(ctx):
    import disttrain

    model = torch.nn.Linear(3, 2)
    disttrain.checkpoint.save("memory://whole", step=4, model=model, note="hi")
    assert disttrain.checkpoint.latest("memory://whole") == "memory:///whole/step_00000004"
    other = torch.nn.Linear(3, 2)
    state = disttrain.checkpoint.load_latest("memory://whole", model=other)
    assert state["step"] == 4 and state["note"] == "hi"
    assert torch.equal(other.weight, model.weight)
    disttrain.checkpoint.save("memory://whole", step=5, asynchronous=True, model=model)  # uploads meanwhile
    disttrain.checkpoint.wait()
    assert disttrain.checkpoint.latest("memory://whole").endswith("step_00000005")


def test_export_to_a_url_is_read_back_whole(ctx):
    import io

    import disttrain

    model = torch.nn.Linear(3, 2)
    assert disttrain.checkpoint.export("memory://exported/best.pt", model) == "memory://exported/best.pt"
    fs = open_url("memory://exported").fs
    saved = torch.load(io.BytesIO(fs.cat_file("/exported/best.pt")), weights_only=True)
    assert torch.equal(saved["weight"], model.weight)


def test_checkpoint_dir_url_reaches_the_workers_as_it_is_and_credentials_in_it_are_refused(tmp_path):
    from conftest import cli_env, disttrain

    script = Path(__file__).parent / "scripts" / "sleeper.py"
    plan = disttrain("run", "-n", "1", "--dry-run", "--checkpoint-dir", "s3://bucket/run", str(script),
                     env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert plan.returncode == 0, plan.stderr
    assert '"DISTTRAIN_CHECKPOINT_DIR": "s3://bucket/run"' in plan.stdout
    refused = disttrain("run", "-n", "1", "--dry-run", "--checkpoint-dir", "s3://AKIA:topsecret@bucket/run",
                        str(script), env=cli_env(DISTTRAIN_HOME=str(tmp_path)))
    assert refused.returncode == 2
    assert "topsecret" not in refused.stdout + refused.stderr
    assert "take the user and password out of the URL" in refused.stderr and "Traceback" not in refused.stderr


def test_trainer_checkpoints_and_best_model_at_a_url(ctx, tmp_path):
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from disttrain.trainer import BEST_MODEL, Trainer

    def trainer() -> Trainer:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 4, generator=g)
        y = (x[:, 0] > 0).long()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8, shuffle=True,
                           generator=torch.Generator().manual_seed(3))
        val = DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8)
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.3), train, val, F.cross_entropy,
                       checkpoint_dir=f"memory://{tmp_path.name}", run_dir=tmp_path / "run", progress=False)

    trainer().fit(2)
    again = trainer()
    assert [r["epoch"] for r in again.fit(3)] == [2]  # resumed from the store
    fs = open_url(f"memory://{tmp_path.name}").fs
    assert fs.exists(f"/{tmp_path.name}/{BEST_MODEL}") and fs.exists(f"/{tmp_path.name}/step_00000003/{MARKER}")


def test_staging_keeps_cpu_state_as_it_is():
    """The async staging copy pins only CUDA tensors (tests/gpu holds the CUDA side): CPU state is
    passed through as the same objects, nested structure and plain values untouched."""
    from disttrain.runtime.checkpoint_write_remote import on_host

    weight = torch.ones(3)
    state = {"model": {"w": weight}, "opt": [{"step": 4, "lr": 0.1}], "name": "x"}
    staged = on_host(state)
    assert staged["model"]["w"] is weight and staged["opt"] == [{"step": 4, "lr": 0.1}] and staged["name"] == "x"
