"""Functions the pages of docs/ hand to cluster workers, where a page only sketches them.

tests/test_docs.py runs every Python block of the docs; a block that passes a sketched
`train` (its body elided) to `LocalCluster.run_on_workers` runs with `train` below
instead: a few real steps, whose loss comes back.
"""

import tensorflow as tf


def train(strategy, steps):
  """A few steps of a linear model on fixed data; returns the last loss (a float)."""
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  x = tf.reshape(tf.range(32, dtype=tf.float32), [8, 4]) / 32.0
  y = tf.reduce_sum(x, axis=1, keepdims=True)
  with strategy.scope():
    w = tf.Variable(tf.zeros([4, 1]), name="doc_w")
    opt = ds.optimizers.GradientDescent(0.1)

  def tower_fn():
    return opt.minimize(lambda: tf.reduce_mean(tf.square(x @ w - y)), var_list=[w])

  loss = None
  for _ in range(steps):
    strategy.call_for_each_tower(tower_fn)
    loss = float(tf.reduce_mean(tf.square(x @ tf.convert_to_tensor(w) - y)))
  return loss
