"""A plain TensorFlow script: ``model.fit`` and a custom ``strategy.run`` loop, one JSON per worker.

The strategy is picked the way TensorFlow's own tutorials do: MultiWorkerMirroredStrategy
when TF_CONFIG describes a cluster, MirroredStrategy otherwise. Each worker reports how many
replicas it saw and the weights it ended with (equal on every worker only if the gradients
were all-reduced across them).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

out_dir = sys.argv[1]
tf_config = json.loads(os.environ["TF_CONFIG"]) if "TF_CONFIG" in os.environ else None
if tf_config:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.MirroredStrategy(devices=["/cpu:0"])
replicas = strategy.num_replicas_in_sync
index = tf_config["task"]["index"] if tf_config else 0

# Every worker generates the same set; each learns from its own shard, so equal weights at
# the end mean the gradients were averaged across workers.
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 3.0, 0.5], dtype="float32") > 0).astype("float32")[:, None]
global_batch = 32 * replicas


def new_model():
    return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1, kernel_initializer="zeros")])


# 1. model.fit, as users of the seed write it.
with strategy.scope():
    fit_model = new_model()
    fit_model.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                      loss=tf.keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
history = fit_model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch), epochs=3, verbose=0)

# 2. A custom loop: strategy.run per step, the loss summed over replicas by strategy.reduce.
with strategy.scope():
    loop_model = new_model()
    optimizer = tf.keras.optimizers.SGD(0.1)
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")
dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))


@tf.function
def train_step(batch):
    def step(features, labels):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(labels, loop_model(features, training=True)),
                                              global_batch_size=global_batch)
        grads = tape.gradient(loss, loop_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, loop_model.trainable_variables))
        return loss

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=batch), axis=None)


loop_losses = []
for _epoch in range(3):
    total, steps = 0.0, 0
    for batch in dataset:
        total += float(train_step(batch))
        steps += 1
    loop_losses.append(total / steps)


def weights(model):
    return [float(v) for v in np.concatenate([w.numpy().ravel() for w in model.trainable_variables])]


record = {
    "index": index,
    "rank": os.environ.get("RANK"),
    "tf_config": tf_config,
    "replicas": replicas,
    "strategy": "MultiWorkerMirroredStrategy" if tf_config else "MirroredStrategy",
    "keras": tf.keras.__name__.split(".")[0],
    "legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS"),
    "fit_loss": [float(v) for v in history.history["loss"]],
    "fit_accuracy": float(history.history["accuracy"][-1]),
    "fit_weights": weights(fit_model),
    "loop_losses": loop_losses,
    "loop_weights": weights(loop_model),
    "pid": os.getpid(),
    "ppid": os.getppid(),
}
with open(os.path.join(out_dir, f"worker{index}.json"), "w") as fh:
    json.dump(record, fh)
print(f"worker {index}: {replicas} replicas, fit loss {record['fit_loss'][-1]:.4f}", flush=True)
