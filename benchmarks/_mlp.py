"""The benchmark MLP (784-1024-1024-10, global batch 256) shared by the cluster benchmarks.

`ps_benchmark.py` and `multi_worker_benchmark.py` train this model in worker processes;
the same initial values, batch and loss in both, so every contender's losses agree.
Numpy only at import: a worker imports TensorFlow itself, after setting its devices.
"""

import numpy as np

BATCH = 256
LR = 0.01
SHAPES = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]


def initial_values(seed=0):
  """He-scaled weights and zero biases, as float32 numpy arrays."""
  rng = np.random.default_rng(seed)
  values = []
  for shape in SHAPES:
    scale = np.sqrt(2.0 / shape[0]) if len(shape) > 1 else 0.0
    values.append((rng.standard_normal(shape) * scale).astype(np.float32))
  return values


def make_batch(seed=1):
  """One global batch: (x [BATCH, 784] float32, y [BATCH] int32 labels)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((BATCH, 784)).astype(np.float32)
  y = rng.integers(0, 10, BATCH).astype(np.int32)
  return x, y


def loss_fn(tf, variables, x, y):
  """Softmax cross-entropy summed over `x` and divided by BATCH: towers' gradients add up."""
  w1, b1, w2, b2, w3, b3 = variables
  h = tf.nn.relu(x @ w1 + b1)
  h = tf.nn.relu(h @ w2 + b2)
  logits = h @ w3 + b3
  return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)) / BATCH
