"""``disttrain run --framework tensorflow``: real TensorFlow workers, real collectives.

TensorFlow takes seconds to start, so each run checks several things at once. Skipped only
when TensorFlow is not importable (``make setup`` installs tensorflow and tf-keras).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, cli_env, disttrain, read_ranks
from rig import cluster_fixture

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="tensorflow is not installed (pip install 'disttrain[tensorflow]', or make setup)",
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tf_text_classifier.py"
WORKERS = SCRIPTS / "tf_workers.py"
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}
HAVE_TF_KERAS = importlib.util.find_spec("tf_keras") is not None

cluster = cluster_fixture(2)


def tf_env(**extra: str) -> dict[str, str]:
    return cli_env(**QUIET, **extra)


def assert_trained_together(workers: dict[int, dict], addresses: list[str]) -> None:
    """Both workers were one MultiWorkerMirroredStrategy cluster and averaged their gradients."""
    assert set(workers) == {0, 1}
    for index, rec in workers.items():
        assert rec["strategy"] == "MultiWorkerMirroredStrategy" and rec["replicas"] == 2
        assert rec["tf_config"]["task"] == {"type": "worker", "index": index}
        assert [a.rsplit(":", 1)[0] for a in rec["tf_config"]["cluster"]["worker"]] == addresses
        if HAVE_TF_KERAS:
            assert rec["keras"] == "tf_keras" and rec["legacy_keras"] == "1"
        assert rec["fit_loss"][-1] < rec["fit_loss"][0]
    first, second = workers[0], workers[1]
    # Each worker learned from its own shard: equal weights mean every step was all-reduced.
    assert first["fit_weights"] == second["fit_weights"]
    assert first["loop_weights"] == second["loop_weights"]
    # model.fit and the strategy.run loop are the same computation.
    assert first["loop_weights"] == pytest.approx(first["fit_weights"], abs=1e-5)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAVE_TF_KERAS, reason="model.fit across workers needs tf-keras "
                    "(pip install --no-deps tf-keras==<tensorflow version>)")
def test_model_fit_and_a_strategy_run_loop_across_two_workers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = disttrain("run", "--framework", "tensorflow", "-n", "2", str(WORKERS), str(out),
                       env=tf_env(), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained_together(read_ranks(out, "worker"), ["127.0.0.1", "127.0.0.1"])
    assert "[rank1] worker 1: 2 replicas" in result.stdout


@pytest.mark.timeout(240)
def test_example_in_one_process_uses_mirrored_strategy_and_saves_to_model_dir(tmp_path):
    model_dir = tmp_path / "model"
    result = disttrain("run", "--framework", "tensorflow", "-n", "1", str(EXAMPLE), "--model-dir", str(model_dir),
                       "--samples", "1500", "--epochs", "2", env=tf_env(), timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["strategy"] == "MirroredStrategy" and metrics["replicas"] == 1
    assert metrics["global_batch"] == 16 and metrics["val_accuracy"] > 0.9
    # The saved model is usable on its own: an insult scores above a polite comment.
    check = (
        "import json, sys, numpy as np, tensorflow as tf\n"
        "sys.path.insert(0, sys.argv[2]); from tf_text_classifier import encode\n"
        "d = sys.argv[1]; vocab = json.load(open(d + '/vocab.json'))\n"
        "model = tf.keras.models.load_model(d + '/model.keras')\n"
        "x = encode(['thanks for the edit, you idiot', 'thanks for the edit'], vocab, 32)\n"
        "print(json.dumps([float(p) for p in model.predict(x, verbose=0).ravel()]))\n"
    )
    env = tf_env(**({"TF_USE_LEGACY_KERAS": "1"} if HAVE_TF_KERAS else {}))
    loaded = subprocess.run([sys.executable, "-c", check, str(model_dir), str(EXAMPLE.parent)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    toxic, polite = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert toxic > 0.5 > polite


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_TF_KERAS, reason="model.fit across workers needs tf-keras")
def test_example_across_two_workers_saves_to_sm_model_dir(tmp_path):
    model_dir = tmp_path / "sm-model"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = disttrain("run", "--framework", "tensorflow", "-n", "2", str(EXAMPLE), "--samples", "1500",
                       "--epochs", "2", env=tf_env(SM_MODEL_DIR=str(model_dir), TMPDIR=str(scratch)), timeout=260)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}] MultiWorkerMirroredStrategy: 2 replica(s), global batch 32" in result.stdout
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["replicas"] == 2 and metrics["val_accuracy"] > 0.9
    assert (model_dir / "model.keras").is_file()
    assert not list(scratch.glob("tf-worker-model-*"))  # worker 1's copy is not left behind


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_TF_KERAS, reason="model.fit across workers needs tf-keras")
def test_two_hosts_over_ssh(cluster, tmp_path):
    from test_multinode import run_on_node0

    out = tmp_path / "out"
    out.mkdir()
    result = run_on_node0(cluster, "--framework", "tensorflow", "--env", "TF_CPP_MIN_LOG_LEVEL=2",
                          str(WORKERS), str(out), nproc=1, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained_together(read_ranks(out, "worker"), [node.ip for node in cluster.nodes])
    assert f"[{cluster.nodes[1].ip} rank1] worker 1: 2 replicas" in result.stdout
    cluster.assert_nothing_left()
