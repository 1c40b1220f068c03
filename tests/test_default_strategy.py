"""The default strategy (docs/concepts.md, "The default strategy")."""

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from conftest import CPUS


@pytest.fixture
def s():
  return ds.get_distribution_strategy()


def test_singleton(s):
  assert ds.DefaultStrategy() is s and ds.strategies.DefaultStrategy() is s
  assert s.num_towers == 1 and s.is_single_tower


@pytest.mark.parametrize("use_function", [False, True])
def test_call_for_each_tower_reduce_update(s, use_function):
  v = tf.Variable([1.0, 2.0])

  def step():
    def fn(x):
      ctx = ds.get_tower_context()
      assert ctx.tower_id == 0 and ctx.num_towers == 1 and ctx.distribution_strategy is s
      return x * 2.0
    out = s.call_for_each_tower(fn, tf.constant([3.0, 4.0]))
    total = s.reduce("sum", out, destinations=v)
    mean = s.reduce(tf.VariableAggregation.MEAN, out)
    s.update(v, lambda var, t: var.assign_add(t), total)
    return mean

  mean = tf.function(step)() if use_function else step()
  np.testing.assert_allclose(mean, [6.0, 8.0])
  np.testing.assert_allclose(v.numpy(), [7.0, 10.0])


def test_methods_run_in_default_cross_tower_context(s):
  v = tf.Variable(1.0)
  seen = s.update(v, lambda var: (ds.get_cross_tower_context(), ds.get_tower_context()))
  assert seen == (s, None)
  assert ds.get_cross_tower_context() is None  # Back in the default tower context.


def test_reduce_returns_value_unchanged(s):
  x = tf.constant([1.0, 2.0])
  assert s.reduce("sum", x) is x
  assert s.reduce("mean", x, destinations="/cpu:1") is x
  assert s.batch_reduce("sum", [(x, None), (x, "/cpu:0")]) == [x, x]
  assert s.broadcast(x) is x


def test_update_runs_colocated_with_var(s):
  with tf.device("/cpu:2"):
    v = tf.Variable(1.0)
  device, result = s.update(v, lambda var, k: (ds.get_update_device(), var.assign(k).device), 5.0)
  assert device == CPUS[2] and result == CPUS[2]
  assert v.numpy() == 5.0


@pytest.mark.parametrize("use_function", [False, True])
@pytest.mark.parametrize("sync, kind", [
    (tf.VariableSynchronization.AUTO, ds.values.MirroredVariable),
    (tf.VariableSynchronization.ON_READ, ds.values.TowerLocalVariable)],
    ids=["mirrored", "tower-local"])
def test_update_of_another_strategys_variable_writes_every_copy(s, use_function, sync, kind):
  """A variable another strategy made (mirrored or tower-local) is updated by that
  strategy, as its own `update` in its scope does (the reference): every copy gets `fn`.
  Both were updated on their first copy only (the second kept its old value)."""
  mirrored = ds.MirroredStrategy(CPUS[:2])
  with mirrored.scope():
    v, reference = (tf.Variable([1.0, 2.0], synchronization=sync,
                                aggregation=tf.VariableAggregation.SUM) for _ in range(2))
  assert isinstance(v, kind)
  devices = []  # Where fn ran (traced once per copy in a tf.function).

  def add(var, t):
    devices.append(ds.get_update_device())
    return var.assign_add(t)

  def step():
    s.update(v, add, tf.constant([10.0, 20.0]))

  tf.function(step)() if use_function else step()
  assert devices == list(v.devices)
  with mirrored.scope():
    mirrored.update(reference, add, tf.constant([10.0, 20.0]))
  for copy, expected in zip(v.values, reference.values, strict=True):
    np.testing.assert_array_equal(copy.numpy(), expected.numpy())
  np.testing.assert_array_equal(v.values[1].numpy(), [11.0, 22.0])


def test_update_non_slot_and_non_slot_devices(s):
  with tf.device("/cpu:1"):
    b = tf.Variable(1.0, name="b_var")
  a = tf.Variable(1.0, name="a_var")
  colocate = s.non_slot_devices([b, a])
  assert colocate is a
  with s.colocate_vars_with(colocate):
    power = tf.Variable(0.5, name="power")
  assert power.device == a.device
  out = s.update_non_slot(colocate, lambda x: (ds.get_update_device(), power.assign(power * x)), 0.5)
  assert out[0] == ds.values.PerDevice({a.device: 0}).devices[0]
  assert power.numpy() == 0.25


def test_non_slot_devices_needs_variables(s):
  with pytest.raises(ValueError, match=r"non_slot_devices\(\) needs at least one variable"):
    s.non_slot_devices([])


def test_unwrap_read_var_group_gather(s):
  x = tf.constant(3.0)
  assert s.unwrap(x) == [x]
  v = tf.Variable(4.0)
  assert s.read_var(v).numpy() == 4.0
  assert s.gather(x) is x
  assert s.group(x) is None
  assert s.worker_device_index == 0


def test_devices_raise(s):
  with pytest.raises(RuntimeError, match="default strategy has no worker devices"):
    _ = s.worker_devices
  with pytest.raises(RuntimeError, match="default strategy has no parameter devices"):
    _ = s.parameter_devices


def test_bad_aggregation(s):
  with pytest.raises(ValueError, match="aggregation must be one of"):
    s.reduce(tf.VariableAggregation.NONE, tf.constant(1.0))


def test_keras_variable_stands_for_its_tf_variable(s):
  import keras  # pylint: disable=g-import-not-at-top
  kv = keras.Variable(np.array([1.0, 2.0], np.float32))
  s.update(kv, lambda var: var.assign_add([1.0, 1.0]))
  np.testing.assert_allclose(np.asarray(kv.numpy()), [2.0, 3.0])
  # The Keras variable stands for the tf.Variable it holds (Keras 3 keeps it in `_value`).
  assert s.non_slot_devices([kv]) is kv._value  # pylint: disable=protected-access
  assert s.read_var(kv).numpy().tolist() == [2.0, 3.0]


def test_tower_function_gets_autograph_in_tf_function_as_under_mirrored(s):
  """Inside a tf.function the default strategy ran the tower function as written: a
  Python `if` or `for` on a tensor raised OperatorNotAllowedInGraphError, where
  MirroredStrategy (and TensorFlow's own strategies) convert it with AutoGraph."""

  def fn(x):
    total = tf.constant(0.0)
    for i in tf.range(3):  # A loop over a tensor.
      total += tf.cast(i, tf.float32)
    if x > 0:  # A tensor condition.
      total += x * 2.0
    else:
      total -= x
    return total

  def results(strategy):
    @tf.function
    def step(x):
      return strategy.unwrap(strategy.call_for_each_tower(fn, x))[0]
    with strategy.scope():
      return [float(step(tf.constant(v))) for v in (3.0, -2.0)]

  assert results(s) == results(ds.MirroredStrategy(CPUS[:1])) == [fn(3.0), fn(-2.0)]
