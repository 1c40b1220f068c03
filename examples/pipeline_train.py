"""Trains a digits classifier as a 4-stage GPipe pipeline (see docs/pipeline.md).

Six Keras layers are cut into 4 stages, one per device (the GPUs, else the CPU split
into 4 logical devices); each batch of 64 flows through them as 4 micro-batches, with
re-materialization. Run: python examples/pipeline_train.py
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # pylint: disable=g-import-not-at-top

if not tf.config.list_physical_devices("GPU"):  # Before TensorFlow starts.
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4)

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from sklearn import datasets, model_selection  # pylint: disable=g-import-not-at-top

from diststrat.pipeline import GPipe  # pylint: disable=g-import-not-at-top

digits = datasets.load_digits()
x_train, x_test, y_train, y_test = model_selection.train_test_split(
    (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32),
    test_size=0.2, random_state=0)
keras.utils.set_random_seed(0)
layers = [keras.layers.Dense(n, activation="relu") for n in (128, 128, 64, 64, 32)]
pipe = GPipe(layers + [keras.layers.Dense(10)], devices=None,  # None: all local devices.
             num_micro_batches=4, recompute=True)
pipe.build((None, 64))
print("stages:", [[layer.name for layer in stage] for stage in pipe.stages])
print("estimated FLOPs per stage and micro-batch:", [int(c) for c in pipe.stage_costs])
optimizer = keras.optimizers.Adam(1e-3)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(x, y):
  with tf.GradientTape() as tape:
    loss = loss_fn(y, pipe(x, training=True))
  optimizer.apply_gradients(zip(tape.gradient(loss, pipe.trainable_variables),
                                pipe.trainable_variables, strict=True))
  return loss


batches = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2000, seed=0)
batches = batches.batch(64, drop_remainder=True)  # Every batch divisible by 4.
for epoch in range(10):
  losses = [float(train_step(x, y)) for x, y in batches]
  predictions = np.argmax(pipe(x_test).numpy(), axis=1)  # 360 examples: 4 x 90.
  print(f"epoch {epoch + 1}: loss {np.mean(losses):.3f}, "
        f"test accuracy {np.mean(predictions == y_test):.3f}")
