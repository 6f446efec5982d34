"""The seed article's training script, in its shape: --data from SM_CHANNEL_DATA, MirroredStrategy,
BATCH_SIZE = 16 * replicas, Keras fit, the model saved to the literal container path /opt/ml/model.

It runs unchanged on SageMaker and under ``disttrain.sagemaker`` (a private /opt/ml per instance).
"""

import argparse
import csv
import os

import numpy as np
import tensorflow as tf


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=str, default=os.environ.get("SM_CHANNEL_DATA"))
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", 4)))
    parser.add_argument("--max_len", type=int, default=12)
    return parser.parse_known_args()  # the SDK also passes --model_dir


def read(path):
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return [r["text"] for r in rows], np.array([int(r["label"]) for r in rows], dtype="float32")


def encode(texts, vocab, max_len):
    ids = np.zeros((len(texts), max_len), dtype="int32")
    for i, text in enumerate(texts):
        words = [vocab.get(w, 1) for w in text.lower().split()][:max_len]
        ids[i, :len(words)] = words
    return ids


args, _ = parse_args()
train_texts, train_y = read(os.path.join(args.data, "train.csv"))
valid_texts, valid_y = read(os.path.join(args.data, "valid.csv"))
words = sorted({w for t in train_texts for w in t.lower().split()})
vocab = {w: i + 2 for i, w in enumerate(words)}  # 0: padding, 1: unknown
train_x, valid_x = encode(train_texts, vocab, args.max_len), encode(valid_texts, vocab, args.max_len)

strategy = tf.distribute.MirroredStrategy()
BATCH_SIZE = 16 * strategy.num_replicas_in_sync
print(f"replicas: {strategy.num_replicas_in_sync}, batch size {BATCH_SIZE}", flush=True)

train_ds = tf.data.Dataset.from_tensor_slices((train_x, train_y)).shuffle(2048, seed=0).batch(BATCH_SIZE)
valid_ds = tf.data.Dataset.from_tensor_slices((valid_x, valid_y)).batch(BATCH_SIZE)

with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Embedding(len(vocab) + 2, 16),
        tf.keras.layers.GlobalAveragePooling1D(),
        tf.keras.layers.Dense(16, activation="relu"),
        tf.keras.layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])

model.fit(train_ds, validation_data=valid_ds, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(valid_ds, verbose=0)
print(f"valid_loss={loss:.4f} valid_accuracy={accuracy:.4f}", flush=True)

os.makedirs("/opt/ml/model", exist_ok=True)
model.save("/opt/ml/model/classifier.keras")
with open("/opt/ml/model/vocab.txt", "w") as fh:
    fh.write("\n".join(words) + "\n")
