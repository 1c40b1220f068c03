"""Training by hand on N towers matches one device; checkpoints move across tower counts."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.values import MirroredVariable
from conftest import CPUS


GLOBAL_BATCH = 16
STEPS = 4
LR = 0.1


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(STEPS, GLOBAL_BATCH, 5)).astype(np.float32)
  y = rng.normal(size=(STEPS, GLOBAL_BATCH, 3)).astype(np.float32)
  return x, y


class MLP(tf.Module):

  def __init__(self, seed):
    super().__init__()
    rng = np.random.default_rng(seed)
    self.w1 = tf.Variable(rng.normal(size=(5, 8)).astype(np.float32) * 0.3, name="w1")
    self.b1 = tf.Variable(np.zeros(8, np.float32), name="b1")
    self.w2 = tf.Variable(rng.normal(size=(8, 3)).astype(np.float32) * 0.3, name="w2")

  def __call__(self, x):
    return tf.nn.relu(x @ self.w1 + self.b1) @ self.w2


def _train(s, make_model, mode, x, y):
  """Trains with hand-written steps: tape per tower, reduce the sum of grads, update."""
  n = s.num_towers
  with s.scope():
    model = make_model()
    variables = list(model.trainable_variables)

  def tower_step(xb, yb):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(xb) - yb)) / n  # Mean over the global batch.
    return tape.gradient(loss, variables)

  def step(xs, ys):
    per_tower_x = ds.values.PerDevice({d: xs[i] for i, d in enumerate(s.worker_devices)})
    per_tower_y = ds.values.PerDevice({d: ys[i] for i, d in enumerate(s.worker_devices)})
    grads = s.call_for_each_tower(tower_step, per_tower_x, per_tower_y)
    reduced = s.batch_reduce("sum", [(g, v) for g, v in zip(grads, variables, strict=True)])
    for v, g in zip(variables, reduced, strict=True):
      s.update(v, lambda c, gc: c.assign_sub(LR * gc), g)

  if mode == "function":
    step = tf.function(step)
  with s.scope():
    for i in range(STEPS):
      xs = tf.split(tf.constant(x[i]), n)
      ys = tf.split(tf.constant(y[i]), n)
      step(xs, ys)
  return model, variables


def _reference(make_model, x, y):
  model = make_model()
  variables = list(model.trainable_variables)
  for i in range(STEPS):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(tf.constant(x[i])) - y[i]))
    for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
      v.assign_sub(LR * g)
  return [v.numpy() for v in variables]


def _keras_model():
  keras.utils.set_random_seed(3)
  layer = keras.layers.Dense(3)
  layer.build((None, 5))

  class Wrapper(tf.Module):

    def __init__(self):
      super().__init__()
      self.layer = layer

    @property
    def trainable_variables(self):
      # The TensorFlow variables Keras 3 holds (MirroredVariables inside scope()).
      return [w._value for w in layer.trainable_weights]  # pylint: disable=protected-access

    def __call__(self, x):
      return self.layer(x)

  return Wrapper()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_module_mlp_matches_one_device(n, mode):
  x, y = _data()
  expected = _reference(lambda: MLP(seed=1), x, y)
  _, variables = _train(ds.MirroredStrategy(CPUS[:n]), lambda: MLP(seed=1), mode, x, y)
  for v, e in zip(variables, expected, strict=True):
    assert isinstance(v, MirroredVariable)
    for copy in v.values:
      np.testing.assert_allclose(copy.numpy(), e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_keras_dense_matches_one_device(mode):
  x, y = _data(seed=5)
  expected = _reference(_keras_model, x, y)
  model, variables = _train(ds.MirroredStrategy(CPUS), _keras_model, mode, x, y)
  assert all(isinstance(v, MirroredVariable) for v in variables)
  for v, e in zip(variables, expected, strict=True):
    for copy in v.values:
      np.testing.assert_allclose(copy.numpy(), e, rtol=1e-5, atol=1e-6)
  # The layer itself sees the trained values.
  np.testing.assert_allclose(np.asarray(model.layer.kernel.numpy()), expected[0], rtol=1e-5,
                             atol=1e-6)


def _make_vars(seed):
  rng = np.random.default_rng(seed)
  module = tf.Module()
  module.w = tf.Variable(rng.normal(size=(4, 2)).astype(np.float32), name="w")
  module.b = tf.Variable(rng.normal(size=(2,)).astype(np.float32), name="b")
  return module


def _in(strategy, fn):
  if strategy is None:
    return fn()
  with strategy.scope():
    return fn()


@pytest.mark.parametrize("write,read", [(4, 2), (4, None), (None, 4), (2, 4), (1, 4)])
def test_checkpoint_across_tower_counts(tmp_path, write, read):
  writer = None if write is None else ds.MirroredStrategy(CPUS[:write])
  reader = None if read is None else ds.MirroredStrategy(CPUS[:read])
  saved = _in(writer, lambda: _make_vars(seed=1))
  path = tf.train.Checkpoint(model=saved).save(str(tmp_path / "ckpt"))
  restored = _in(reader, lambda: _make_vars(seed=2))
  tf.train.Checkpoint(model=restored).restore(path).assert_consumed()
  for name in ("w", "b"):
    src, dst = getattr(saved, name), getattr(restored, name)
    copies = dst.values if isinstance(dst, MirroredVariable) else [dst]
    assert len(copies) == (read or 1)
    for copy in copies:
      np.testing.assert_array_equal(copy.numpy(), src.numpy())


def test_checkpoint_keys_are_the_plain_ones(tmp_path):
  s = ds.MirroredStrategy(CPUS)
  mirrored = _in(s, lambda: _make_vars(seed=1))
  plain = _make_vars(seed=1)
  p1 = tf.train.Checkpoint(model=mirrored).save(str(tmp_path / "a"))
  p2 = tf.train.Checkpoint(model=plain).save(str(tmp_path / "b"))
  keys1 = sorted(k for k, _ in tf.train.list_variables(p1))
  keys2 = sorted(k for k, _ in tf.train.list_variables(p2))
  assert keys1 == keys2


def test_tower_local_checkpoint_saves_aggregate(tmp_path):
  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    module = tf.Module()
    module.total = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                               aggregation=tf.VariableAggregation.SUM, trainable=False)
    s.call_for_each_tower(lambda: module.total.assign_add(
        tf.cast(ds.get_tower_context().tower_id, tf.float32)))
  path = tf.train.Checkpoint(model=module).save(str(tmp_path / "c"))
  plain = tf.Module()
  plain.total = tf.Variable(-1.0)
  tf.train.Checkpoint(model=plain).restore(path).assert_consumed()
  assert plain.total.numpy() == 6.0
  two = ds.MirroredStrategy(CPUS[:2])
  with two.scope():
    back = tf.Module()
    back.total = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.SUM, trainable=False)
  tf.train.Checkpoint(model=back).restore(path).assert_consumed()
  with two.scope():
    assert float(two.read_var(back.total)) == 6.0
