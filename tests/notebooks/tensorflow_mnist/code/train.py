"""The get-started notebook's training script, shortened: MNIST from SM_CHANNEL_TRAINING/TESTING
(the .gz IDX files), a small Keras model, an evaluation, the model saved in SM_MODEL_DIR."""

import argparse
import gzip
import os

import numpy as np
import tensorflow as tf


def load(data_dir, train):
    prefix = "train" if train else "t10k"
    with gzip.open(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), "rb") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1).astype(np.float32) / 255.0
    with gzip.open(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), "rb") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    return images, labels


def main(args):
    x_train, y_train = load(args.train, True)
    x_test, y_test = load(args.test, False)
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(8, 3, activation="relu", input_shape=(28, 28, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(args.learning_rate, beta_1=args.beta_1, beta_2=args.beta_2),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"Test set: loss={loss:.4f} accuracy={accuracy:.4f}", flush=True)
    model.save(os.path.join(args.model_dir, "mnist.keras"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--beta_1", type=float, default=0.9)
    parser.add_argument("--beta_2", type=float, default=0.999)
    parser.add_argument("--model_dir", type=str, default=os.environ["SM_MODEL_DIR"])
    parser.add_argument("--train", type=str, default=os.environ["SM_CHANNEL_TRAINING"])
    parser.add_argument("--test", type=str, default=os.environ["SM_CHANNEL_TESTING"])
    main(parser.parse_args())
