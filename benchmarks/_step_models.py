"""The models of benchmarks/mirrored_benchmark.py: plain variables and a loss, shared by
every contender there and by benchmarks/tower_schedule_benchmark.py.

An MLP 784-1024-1024-10 (global batch 256) and a small CNN (conv 32, conv 64, dense 10
on 28x28x1, global batch 128). `loss_fn` divides the summed loss by the global batch, so
the towers' gradients add up to one device's.
"""

import numpy as np
import tensorflow as tf


def mlp_spec():
  return {"name": "mlp", "batch": 256, "input": (784,), "classes": 10,
          "shapes": [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]}


def cnn_spec():
  return {"name": "cnn", "batch": 128, "input": (28, 28, 1), "classes": 10,
          "shapes": [(3, 3, 1, 32), (32,), (3, 3, 32, 64), (64,), (24 * 24 * 64, 10), (10,)]}


def initial_values(spec, seed=0):
  rng = np.random.default_rng(seed)
  values = []
  for shape in spec["shapes"]:
    fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    scale = np.sqrt(2.0 / fan_in) if len(shape) > 1 else 0.0
    values.append((rng.standard_normal(shape) * scale).astype(np.float32))
  return values


def forward(spec, variables, x):
  if spec["name"] == "mlp":
    w1, b1, w2, b2, w3, b3 = variables
    h = tf.nn.relu(x @ w1 + b1)
    h = tf.nn.relu(h @ w2 + b2)
    return h @ w3 + b3
  k1, c1, k2, c2, w, b = variables
  h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "VALID") + c1)
  h = tf.nn.relu(tf.nn.conv2d(h, k2, 1, "VALID") + c2)
  return tf.reshape(h, [tf.shape(h)[0], -1]) @ w + b


def loss_fn(spec, variables, x, y, global_batch):
  logits = forward(spec, variables, x)
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
  return tf.reduce_sum(losses) / global_batch


def make_data(spec, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((spec["batch"],) + spec["input"]).astype(np.float32)
  y = rng.integers(0, spec["classes"], spec["batch"]).astype(np.int32)
  return x, y
