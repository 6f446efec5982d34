"""A toxic-comment classifier in Keras with tf.distribute: the SageMaker quick start, in miniature.

The seed (a SageMaker + ``tf.distribute`` quick start) fine-tunes BERT on Kaggle's Jigsaw
toxic comments with ``MirroredStrategy``; this is the same program at a size a CPU trains in
seconds: embedding + average pooling + dense layers. The same file runs as one process or many:

    python examples/tf_text_classifier.py                                   # MirroredStrategy
    disttrain run --framework tensorflow -n 1 examples/tf_text_classifier.py
    disttrain run --framework tensorflow -n 2 examples/tf_text_classifier.py  # MultiWorkerMirrored
    disttrain run --framework tensorflow --hosts node0,node1 -n 1 examples/tf_text_classifier.py

The strategy follows the environment, as in TensorFlow's tutorials: with a ``TF_CONFIG``
(which ``disttrain run --framework tensorflow`` gives each of several workers)
``MultiWorkerMirroredStrategy``, else ``MirroredStrategy``. The global batch is
``--batch-size`` times ``strategy.num_replicas_in_sync``, as the seed scales it.

Data: ``--data DIR`` (default ``$SM_CHANNEL_DATA``) holding a Jigsaw-style ``train.csv``
with ``comment_text`` and ``toxic`` columns; without it, generated comments (no download).
The model goes to ``--model-dir`` (default ``$SM_MODEL_DIR``, else ``./model``):
``model.keras``, ``vocab.json`` (word → id; 0 pads, 1 is unknown) and ``metrics.json``.

``model.fit`` under MultiWorkerMirroredStrategy needs Keras 2 (``tf-keras``): Keras 3's
fails there. ``disttrain run --framework tensorflow`` sets ``TF_USE_LEGACY_KERAS=1`` when
tf-keras is installed (``pip install --no-deps tf-keras==<your TensorFlow version>``).
"""

import argparse
import csv
import json
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tensorflow as tf

CLEAN_WORDS = (
    "thanks for the edit the article looks much better now i added a source to the section "
    "please check the references before you revert could we discuss this on the talk page "
    "great work on the history part the map is useful i agree with the proposed merge"
).split()
TOXIC_WORDS = "idiot stupid moron pathetic loser dumb garbage trash clown worthless".split()
PAD, UNKNOWN = 0, 1


def generated_comments(n: int, seed: int) -> tuple[list[str], list[int]]:
    """Comments of 6-16 ordinary words; a toxic one has one to three insults mixed in."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        words = list(rng.choice(CLEAN_WORDS, size=rng.integers(6, 17)))
        toxic = int(rng.random() < 0.5)
        for _ in range(rng.integers(1, 4) if toxic else 0):
            words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(TOXIC_WORDS)))
        texts.append(" ".join(words))
        labels.append(toxic)
    return texts, labels


def read_channel(folder: str) -> tuple[list[str], list[int]]:
    with open(Path(folder) / "train.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    return [r["comment_text"] for r in rows], [int(float(r["toxic"])) for r in rows]


def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def build_vocab(texts: list[str], size: int) -> dict[str, int]:
    counts = Counter(word for text in texts for word in tokenize(text))
    return {word: i + 2 for i, (word, _) in enumerate(counts.most_common(size - 2))}


def encode(texts: list[str], vocab: dict[str, int], length: int) -> np.ndarray:
    ids = np.full((len(texts), length), PAD, dtype="int32")
    for row, text in enumerate(texts):
        tokens = [vocab.get(w, UNKNOWN) for w in tokenize(text)][:length]
        ids[row, : len(tokens)] = tokens
    return ids


def choose_strategy() -> tf.distribute.Strategy:
    if "TF_CONFIG" in os.environ:
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = tf.config.list_logical_devices("GPU")
    return tf.distribute.MirroredStrategy() if gpus else tf.distribute.MirroredStrategy(devices=["/cpu:0"])


def is_chief() -> bool:
    """The cluster's chief (worker 0 when it names none), or the only process: its model is kept."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task", {})
    if "chief" in config.get("cluster", {}):
        return task.get("type") == "chief"
    return task.get("index", 0) == 0


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.environ.get("SM_CHANNEL_DATA"),
                        help="folder with train.csv (comment_text, toxic); default $SM_CHANNEL_DATA, else generated")
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR") or "model",
                        help="where the model is saved (default $SM_MODEL_DIR, else ./model)")
    parser.add_argument("--samples", type=int, default=4000, help="generated comments (without --data)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per replica, as in the seed")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--max-len", type=int, default=32, help="tokens kept per comment")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = get_args_parser().parse_args()
    strategy = choose_strategy()
    # (its class is called CollectiveAllReduceStrategy inside TensorFlow)
    name = "MultiWorkerMirroredStrategy" if "TF_CONFIG" in os.environ else "MirroredStrategy"
    replicas = strategy.num_replicas_in_sync
    global_batch = args.batch_size * replicas

    # Every worker reads (or generates) the same set and builds the same vocabulary;
    # tf.data then gives each worker its own shard of every global batch.
    texts, labels = read_channel(args.data) if args.data else generated_comments(args.samples, args.seed)
    split = int(len(texts) * 0.8)
    vocab = build_vocab(texts[:split], args.vocab_size)
    x = encode(texts, vocab, args.max_len)
    y = np.asarray(labels, dtype="float32")
    train = tf.data.Dataset.from_tensor_slices((x[:split], y[:split])).shuffle(split, seed=args.seed)
    val = tf.data.Dataset.from_tensor_slices((x[split:], y[split:]))

    tf.keras.utils.set_random_seed(args.seed)  # the same initial weights on every worker
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((args.max_len,), dtype="int32"),
            tf.keras.layers.Embedding(len(vocab) + 2, 32),
            tf.keras.layers.GlobalAveragePooling1D(),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dense(1, activation="sigmoid"),
        ])
        model.compile(optimizer=tf.keras.optimizers.Adam(args.lr), loss="binary_crossentropy",
                      metrics=["accuracy"])

    chief = is_chief()
    print(f"{name}: {replicas} replica(s), global batch {global_batch}, "
          f"{split} training and {len(texts) - split} validation comments", flush=True)
    start = time.time()
    history = model.fit(train.batch(global_batch), validation_data=val.batch(global_batch),
                        epochs=args.epochs, verbose=2 if chief else 0)
    seconds = time.time() - start

    # Every worker saves (saving may run collectives under MultiWorkerMirroredStrategy);
    # only the chief's copy is kept, the others write to a folder they remove.
    model_dir = Path(args.model_dir) if chief else Path(tempfile.mkdtemp(prefix="tf-worker-model-"))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save(model_dir / "model.keras")
    if not chief:
        shutil.rmtree(model_dir, ignore_errors=True)
        return
    summary = {
        "strategy": name,
        "replicas": replicas,
        "global_batch": global_batch,
        "epochs": args.epochs,
        "loss": float(history.history["loss"][-1]),
        "val_accuracy": float(history.history["val_accuracy"][-1]),
        "seconds": round(seconds, 2),
    }
    (model_dir / "vocab.json").write_text(json.dumps(vocab))
    (model_dir / "metrics.json").write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
