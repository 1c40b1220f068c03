"""MirroredStrategy (docs/mirrored.md, docs/concepts.md) on 1, 2 and 4 logical CPUs, eager and tf.function.

Every result is compared against numpy or a single-device computation.
"""

import ast
import functools
import gc
import logging
import os
import threading

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.values import Mirrored, MirroredVariable, TowerLocalVariable
from diststrat.strategies import _tower_threads
from conftest import CPUS

TOWER_COUNTS = [1, 2, 4]
MODES = ["eager", "function"]


def run(mode, fn):
  """Runs fn eagerly or as a tf.function, returning plain tensors."""
  if mode == "eager":
    return fn()
  return tf.function(fn)()


def strategy(n):
  return ds.MirroredStrategy(CPUS[:n])


def test_default_devices_are_all_local_cpus():
  s = ds.MirroredStrategy()
  assert s.worker_devices == tuple(CPUS) == s.parameter_devices
  assert s.num_towers == 4 and not s.is_single_tower
  assert "MirroredStrategy(devices=[" in repr(s)


def test_bad_devices():
  with pytest.raises(ValueError, match=r"Each device may appear once"):
    ds.MirroredStrategy(["/cpu:0", "/device:CPU:0"])
  with pytest.raises(ValueError, match="at least one device"):
    ds.MirroredStrategy([])


@pytest.mark.parametrize("mode", MODES)
def test_merge_call_example(mode):
  s = strategy(4)

  def fn(three):
    ctx = ds.get_tower_context()
    v = three + tf.cast(ctx.tower_id, tf.float32)
    total = ctx.merge_call(lambda st, per_tower: st.reduce("sum", per_tower), v)
    return total + v

  with s.scope():
    result = run(mode, lambda: s.unwrap(s.call_for_each_tower(fn, tf.constant(3.0))))
  assert [float(x) for x in result] == [21.0, 22.0, 23.0, 24.0]


@pytest.mark.parametrize("n", TOWER_COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_towers_run_on_their_devices_in_order(n, mode):
  s = strategy(n)
  seen = []

  def fn():
    ctx = ds.get_tower_context()
    seen.append((ctx.tower_id, ctx.num_towers, threading.current_thread().name))
    x = tf.constant(1.0) * tf.cast(ctx.tower_id, tf.float32)
    return x

  with s.scope():
    out = run(mode, lambda: s.unwrap(s.call_for_each_tower(fn)))
  assert [t[0] for t in seen] == list(range(n))
  assert all(t[1] == n for t in seen)
  assert [float(x) for x in out] == list(range(n))
  if mode == "eager":
    with s.scope():
      per_tower = s.unwrap(s.call_for_each_tower(fn))
    assert [v.device for v in per_tower] == CPUS[:n]


@pytest.mark.parametrize("n", TOWER_COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_reduce_broadcast_gather_match_numpy(n, mode):
  s = strategy(n)
  data = np.random.default_rng(n).normal(size=(n, 4, 3)).astype(np.float32)

  def step():
    per_tower = s.call_for_each_tower(lambda i: tf.constant(data)[i], s.worker_device_index)
    total = s.reduce("sum", per_tower)
    mean = s.reduce(tf.VariableAggregation.MEAN, per_tower, destinations=CPUS[0])
    sums = s.batch_reduce("sum", [(per_tower, None), (per_tower, CPUS[:1])])
    gathered = s.gather(per_tower, axis=0)
    broadcast = s.broadcast(tf.constant(7.0))
    return (s.unwrap(total), s.unwrap(mean), [s.unwrap(x) for x in sums], gathered,
            s.unwrap(broadcast))

  with s.scope():
    total, mean, sums, gathered, broadcast = run(mode, step)
  assert len(total) == n and len(mean) == 1 and len(broadcast) == n
  for t in total + sums[0] + sums[1]:
    np.testing.assert_allclose(t, data.sum(axis=0), rtol=1e-5)
  np.testing.assert_allclose(mean[0], data.mean(axis=0), rtol=1e-5)
  np.testing.assert_allclose(gathered, data.reshape(n * 4, 3))
  assert [float(b) for b in broadcast] == [7.0] * n


def test_reduce_places_results_on_destinations():
  s = strategy(4)
  with s.scope():
    v = tf.Variable(0.0)
    per_tower = s.call_for_each_tower(lambda i: tf.cast(i, tf.float32), s.worker_device_index)
    onto_var = s.reduce("sum", per_tower, destinations=v)
    onto_two = s.reduce("mean", per_tower, destinations=[CPUS[1], CPUS[3]])
  assert isinstance(onto_var, Mirrored) and onto_var.devices == tuple(CPUS)
  assert [x.device for x in onto_var.values] == CPUS
  assert onto_two.devices == (CPUS[1], CPUS[3])
  assert [float(x) for x in onto_two.values] == [1.5, 1.5]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_takes_a_structure_as_reduce_does(n, mode):
  # The default strategy returns a structure unchanged; a real strategy broadcast each
  # leaf (it raised TensorFlow's "Attempt to convert a value ({...})" ValueError).
  s = strategy(n)
  value = {"a": tf.constant([1.0, 2.0]), "b": (tf.constant(3, tf.int64), None), "c": [4.0]}
  assert ds.DefaultStrategy().broadcast(value) == value

  with s.scope():
    got = run(mode, lambda: s.broadcast(value, destinations=[CPUS[1], CPUS[0]]))
  assert set(got) == {"a", "b", "c"} and got["b"][1] is None
  for leaf, expected in [(got["a"], [1.0, 2.0]), (got["b"][0], 3), (got["c"][0], 4.0)]:
    assert isinstance(leaf, Mirrored) and leaf.devices == (CPUS[1], CPUS[0])
    if mode == "eager":  # A tf.function's outputs come back on its own device.
      assert [c.device for c in leaf.values] == [CPUS[1], CPUS[0]]
    for component in leaf.values:
      np.testing.assert_array_equal(component, expected)
  assert got["b"][0].values[0].dtype == tf.int64

@pytest.mark.parametrize("n", TOWER_COUNTS)
def test_mirrored_variable_copies_and_reads(n):
  s = strategy(n)
  with s.scope():
    v = tf.Variable(tf.random.normal([5]), name="w")
  assert isinstance(v, MirroredVariable) and isinstance(v, tf.Variable)
  assert v.devices == tuple(CPUS[:n])
  assert [c.device for c in v.values] == CPUS[:n]
  for c in v.values:  # One initial value, copied: random initializers agree.
    np.testing.assert_array_equal(c.numpy(), v.primary.numpy())
  assert v.name == "w:0" and v.shape == (5,) and v.dtype == tf.float32
  np.testing.assert_array_equal(v.numpy(), v.primary.numpy())
  np.testing.assert_allclose((v * 2.0 + 1.0).numpy(), v.primary.numpy() * 2 + 1, rtol=1e-6)
  np.testing.assert_allclose(tf.reduce_sum(v), v.primary.numpy().sum(), rtol=1e-5)
  with s.scope():
    reads = s.call_for_each_tower(lambda: (v.value(), v.device))
    updated = s.update(v, lambda c: (c.device, ds.get_update_device(), v.device))
  with s.scope():
    assert [str(d) for d in s.unwrap(reads[1])] == CPUS[:n]
    for value in s.unwrap(reads[0]):
      np.testing.assert_array_equal(value, v.primary.numpy())
    # Inside update, the component, the update device and the variable's device agree.
    columns = [s.unwrap(x) for x in updated]
  for component_device, update_device, var_device in zip(*columns, strict=False):
    assert component_device == update_device == var_device


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_variables_created_in_towers_are_shared(n, mode):
  s = strategy(n)
  created = []

  def fn():
    if not created or len(created) < n:
      v = tf.Variable(1.0, name="shared")
      created.append(v)
    return created[-1].read_value() * 2.0

  with s.scope():
    out = run(mode, lambda: s.unwrap(s.call_for_each_tower(fn)))
  assert all(c is created[0] for c in created)
  assert isinstance(created[0], MirroredVariable) and len(created[0].values) == n
  assert [float(x) for x in out] == [2.0] * n


def test_tower_variable_names_must_match():
  s = strategy(2)

  def fn():
    return tf.Variable(1.0, name=f"v{ds.get_tower_context().tower_id}")

  with s.scope():
    with pytest.raises(ValueError, match=r"Tower 1's variable number 0 is named 'v1', but "
                                         r"tower 0's is named 'v0'"):
      s.call_for_each_tower(fn)

  def more():
    for _ in range(ds.get_tower_context().tower_id + 1):
      tf.Variable(1.0)

  with s.scope():
    with pytest.raises(ValueError, match="Tower 1 created more variables than tower 0"):
      s.call_for_each_tower(more)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_tape_gives_gradient_for_tower_copy(mode):
  s = strategy(4)
  with s.scope():
    v = tf.Variable([1.0, 2.0])

  def fn():
    scale = tf.cast(ds.get_tower_context().tower_id + 1, tf.float32)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(v * v) * scale
    return tape.gradient(loss, v)

  with s.scope():
    grads = run(mode, lambda: s.unwrap(s.call_for_each_tower(fn)))
  for i, g in enumerate(grads):
    np.testing.assert_allclose(g, 2 * np.array([1.0, 2.0]) * (i + 1))


@pytest.mark.parametrize("n", TOWER_COUNTS)
@pytest.mark.parametrize("mode", MODES)
def test_assign_in_cross_tower_writes_all_copies(n, mode):
  s = strategy(n)
  with s.scope():
    v = tf.Variable([1.0, 1.0])

  def step():
    v.assign([3.0, 4.0])
    v.assign_add([1.0, 1.0])
    v.assign_sub([0.5, 0.5])

  with s.scope():
    run(mode, step)
  for c in v.values:
    np.testing.assert_allclose(c.numpy(), [3.5, 4.5])


@pytest.mark.parametrize("aggregation,expected", [
    (tf.VariableAggregation.SUM, 10.0 + (0 + 1 + 2 + 3)),
    (tf.VariableAggregation.MEAN, 10.0 + 1.5),
    (tf.VariableAggregation.ONLY_FIRST_REPLICA, 10.0 + 0.0),
])
@pytest.mark.parametrize("mode", MODES)
def test_assign_in_tower_aggregates(aggregation, expected, mode):
  s = strategy(4)
  with s.scope():
    v = tf.Variable(10.0, aggregation=aggregation)

  def fn():
    v.assign_add(tf.cast(ds.get_tower_context().tower_id, tf.float32))

  with s.scope():
    run(mode, lambda: s.call_for_each_tower(fn))
  assert [float(c.numpy()) for c in v.values] == [expected] * 4


@pytest.mark.parametrize("aggregation,expected", [
    (tf.VariableAggregation.SUM, 4),
    (tf.VariableAggregation.MEAN, 1),
    (tf.VariableAggregation.ONLY_FIRST_REPLICA, 1),
])
@pytest.mark.parametrize("dtype", [tf.float32, tf.int64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("made", ["python", "outside"])
def test_a_value_written_in_every_tower_counts_once_per_tower(aggregation, expected, dtype,
                                                             mode, made):
  """`counter.assign_add(1)` in 4 towers: the same object in every tower (a Python
  number, or a tensor made outside the towers) counted once with SUM (1, not 4, where a
  tensor made in each tower gave 4), and an int64 counter raised (1 became an int32
  tensor)."""
  s = strategy(4)
  with s.scope():
    v = tf.Variable(0, dtype=dtype, aggregation=aggregation)
  one = 1 if made == "python" else tf.constant(1, dtype)
  with s.scope():
    run(mode, lambda: s.call_for_each_tower(lambda: v.assign_add(one)))
  assert [c.numpy().item() for c in v.values] == [expected] * 4
  assert all(c.dtype == dtype for c in v.values)


def test_assign_in_tower_without_aggregation_raises(tmp_path):
  s = strategy(2)
  with s.scope():
    v = tf.Variable(1.0, name="plain")
    with pytest.raises(ValueError, match=r"Cannot assign\(\) the mirrored variable 'plain:0' "
                                         r"in a tower context with aggregation NONE"):
      s.call_for_each_tower(lambda: v.assign(2.0))
  # A checkpoint saved in a tower writes its save_counter there: the message says what
  # to do with a variable the program did not create.
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path), 1)
  with s.scope():
    with pytest.raises(ValueError, match=r"save_counter.*If a library created it \(a "
                       r"tf.train.Checkpoint's save_counter, when a tower saves\), call that "
                       r"library in cross-tower context"):
      s.call_for_each_tower(manager.save)


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
@pytest.mark.parametrize("mode", MODES)
def test_tower_local_variable(aggregation, mode, tmp_path):
  s = strategy(4)
  agg = {"sum": tf.VariableAggregation.SUM, "mean": tf.VariableAggregation.MEAN}[aggregation]
  with s.scope():
    v = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=agg, trainable=False)
  assert isinstance(v, TowerLocalVariable)

  def fn():
    v.assign_add(tf.cast(ds.get_tower_context().tower_id + 1, tf.float32))
    return v.read_value()

  with s.scope():
    own = run(mode, lambda: s.unwrap(s.call_for_each_tower(fn)))
    read = s.read_var(v)
  assert [float(x) for x in own] == [1.0, 2.0, 3.0, 4.0]
  expected = 10.0 if aggregation == "sum" else 2.5
  assert float(read) == expected
  assert float(tf.convert_to_tensor(v)) == expected
  # A checkpoint, synchronous or asynchronous, saves the aggregate (an asynchronous one
  # saved the first copy's 1.0).
  checkpoint = tf.train.Checkpoint(v=v)
  options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
  for name, written in (("sync", lambda p: checkpoint.write(p)),
                        ("async", lambda p: checkpoint.write(p, options=options))):
    path = written(str(tmp_path / name))
    checkpoint.sync()
    saved = tf.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE")
    assert float(saved) == expected, name
  with s.scope():
    v.assign(8.0)  # Cross-tower: the aggregate becomes 8.
    assert float(s.read_var(v)) == 8.0


@pytest.mark.parametrize("mode", MODES)
def test_integer_tower_local_variables_keep_their_writes_and_dtype(mode, tmp_path):
  """An integer SUM variable's cross-tower write went 1/4 to each copy, which int32 made
  0: the write (and a restore) was lost. An integer MEAN read as float64."""
  s = strategy(4)
  with s.scope():
    count = tf.Variable(0, synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM, trainable=False)
    mean = tf.Variable(0, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.MEAN, trainable=False)

  def fn():
    count.assign_add(3)
    mean.assign_add(ds.get_tower_context().tower_id * 2)  # 0, 2, 4, 6: mean 3

  with s.scope():
    count.assign(8)
    assert int(s.read_var(count)) == 8
    count.assign_add(4)
    run(mode, lambda: s.call_for_each_tower(fn))
    assert int(s.read_var(count)) == 12 + 4 * 3
    read = run(mode, lambda: s.read_var(mean))
  assert read.dtype == tf.int32 and int(read) == 3
  path = tf.train.Checkpoint(count=count).save(str(tmp_path / "c"))
  with s.scope():
    count.assign(0)
  tf.train.Checkpoint(count=count).restore(path).assert_consumed()
  with s.scope():
    assert int(s.read_var(count)) == 24


@pytest.mark.parametrize("mode", MODES)
def test_gather_takes_python_and_numpy_values(mode):
  s = strategy(4)

  def step():
    scalars = s.call_for_each_tower(lambda: float(ds.get_tower_context().tower_id))
    arrays = s.call_for_each_tower(
        lambda: np.full([2], ds.get_tower_context().tower_id, np.float32))
    return s.gather(scalars), s.gather(arrays)

  with s.scope():
    scalars, arrays = run(mode, step)
  np.testing.assert_array_equal(scalars, [0, 1, 2, 3])
  np.testing.assert_array_equal(arrays, [0, 0, 1, 1, 2, 2, 3, 3])


def test_tower_local_needs_sum_or_mean():
  s = strategy(2)
  with s.scope():
    with pytest.raises(ValueError, match="synchronization=ON_READ.*needs aggregation SUM or MEAN"):
      tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ, trainable=False)


@pytest.mark.parametrize("n", TOWER_COUNTS)
def test_update_and_update_non_slot(n):
  s = strategy(n)
  with s.scope():
    v = tf.Variable(1.0, name="v")
    non_slot = s.non_slot_devices([v])
    assert non_slot == tuple(CPUS[:n])
    with s.colocate_vars_with(v):
      slot = tf.Variable(0.0, name="slot")
    assert isinstance(slot, MirroredVariable) and slot.devices == v.devices
    per_tower = s.call_for_each_tower(lambda i: tf.cast(i, tf.float32), s.worker_device_index)
    total = s.reduce("sum", per_tower, destinations=v)
    result = s.update(v, lambda c, t: c.assign_add(t).read_value(), total)
    counter = s.update_non_slot(non_slot, lambda: ds.get_update_device())
  expected = 1.0 + sum(range(n))
  assert [float(c.numpy()) for c in v.values] == [expected] * n
  assert (result is not None) and len(s.unwrap(result)) == n
  assert ds.values.select_device(CPUS[0], counter) == CPUS[0]


def test_unwrap_group_read_var():
  s = strategy(2)
  with s.scope():
    v = tf.Variable(3.0)
    assert s.unwrap(v) == list(v.values)
    assert s.unwrap(tf.constant(1.0))[0].numpy() == 1.0
    assert float(s.read_var(v)) == 3.0
    assert s.group(v) is None

    @tf.function
    def grouped():
      op = s.group(s.update(v, lambda c: c.assign_add(1.0)))
      assert isinstance(op, tf.Operation)

    grouped()
  assert [float(c.numpy()) for c in v.values] == [4.0, 4.0]


def test_tf_module_and_keras_layer_variables():
  import keras  # pylint: disable=g-import-not-at-top
  s = strategy(2)

  class Linear(tf.Module):

    def __init__(self):
      super().__init__()
      self.w = tf.Variable(tf.ones([3, 2]), name="w")

  with s.scope():
    m = Linear()
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
  assert len(m.trainable_variables) == 1 and m.trainable_variables[0] is m.w
  assert isinstance(m.w, MirroredVariable)
  assert isinstance(layer.kernel.value, MirroredVariable) or isinstance(
      getattr(layer.kernel, "_value", None), MirroredVariable)
  x = np.ones([1, 3], np.float32)
  with s.scope():
    out = s.call_for_each_tower(lambda: layer(tf.constant(x)))
  expected = x @ layer.kernel.numpy() + layer.bias.numpy()
  for o in out.values:
    np.testing.assert_allclose(o, expected, rtol=1e-6)


# --- errors and faults (docs/mirrored.md, "Errors") ---


def test_exception_in_one_tower_stops_the_others(no_thread_leak):
  s = strategy(4)
  ran = []

  def fn():
    tid = ds.get_tower_context().tower_id
    ran.append(tid)
    if tid == 2:
      raise KeyError("boom")
    ds.get_tower_context().merge_call(lambda st: None)
    ran.append(("after merge", tid))

  with s.scope():
    with pytest.raises(KeyError, match="boom") as info:
      s.call_for_each_tower(fn)
  text = "".join(getattr(info.value, "__notes__", [])) + str(info.value)
  assert "tower 2" in text
  assert ran == [0, 1, 2]  # Tower 3 never ran; towers 0 and 1 never passed merge_call.


def test_exception_in_merge_fn_reaches_caller(no_thread_leak):
  s = strategy(2)

  def fn():
    ds.get_tower_context().merge_call(lambda st: 1 / 0)

  with s.scope():
    with pytest.raises(ZeroDivisionError) as info:
      s.call_for_each_tower(fn)
  assert "merge_fn" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)


def test_exception_in_nested_merge_fn(no_thread_leak):
  s = strategy(2)

  def inner():
    if ds.get_tower_context().tower_id == 1:
      raise TypeError("deep")

  def fn():
    ds.get_tower_context().merge_call(lambda st: st.call_for_each_tower(inner))

  with s.scope():
    with pytest.raises(TypeError, match="deep") as info:
      s.call_for_each_tower(fn)
  assert "tower 1" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)


def test_divergent_merge_call(no_thread_leak):
  s = strategy(4)

  def fn():
    if ds.get_tower_context().tower_id in (1, 3):
      return None
    return ds.get_tower_context().merge_call(lambda st: 1)

  with s.scope():
    with pytest.raises(RuntimeError, match=r"Towers \[0, 2\] called merge_call\(\) but "
                                           r"towers \[1, 3\] returned without calling it"):
      s.call_for_each_tower(fn)


def test_differing_structures_raise():
  s = strategy(2)

  def fn():
    tid = ds.get_tower_context().tower_id
    return (1, 2) if tid == 0 else [1, 2]

  with s.scope():
    with pytest.raises(ValueError, match=r"tower 0 gave \(\*, \*\) and tower 1 gave \[\*, \*\]"):
      s.call_for_each_tower(fn)

  def merge_differs():
    tid = ds.get_tower_context().tower_id
    ds.get_tower_context().merge_call(lambda st, x: x, {"a": 1} if tid else {"b": 1})

  with s.scope():
    with pytest.raises(ValueError, match="tower 1 gave"):
      s.call_for_each_tower(merge_differs)


def test_tower_timeout_is_bounded():
  s = ds.MirroredStrategy(CPUS[:2], tower_timeout=0.5)
  release = threading.Event()

  def fn():
    if ds.get_tower_context().tower_id == 0:
      release.wait(10)

  with s.scope():
    with pytest.raises(RuntimeError, match=r"Tower 0 .* neither reached merge_call\(\) nor "
                                           r"returned within 0.5 s"):
      s.call_for_each_tower(fn)
  release.set()
  for thread in _tower_threads.abandoned_tower_threads():  # The blocked tower, released.
    thread.join(10)
  assert not _tower_threads.abandoned_tower_threads()


def test_a_finished_abandoned_tower_lets_go_of_its_strategy():
  """A tower abandoned by a timeout stayed listed after it finished, until someone called
  `abandoned_tower_threads()`: a long-lived process (a notebook whose steps time out or
  are interrupted) kept every such call's strategy, arguments and results. The tower
  leaves the list as it finishes now, as a tower that did not time out does."""
  import weakref  # pylint: disable=g-import-not-at-top
  release = threading.Event()

  def time_out():
    s = ds.MirroredStrategy(CPUS[:2], tower_timeout=0.2)
    result = tf.zeros([4])

    def fn():
      if ds.get_tower_context().tower_id == 1:
        release.wait(10)
      return result

    with pytest.raises(ds.errors.TowerTimeoutError):
      s.call_for_each_tower(fn)
    [left] = _tower_threads.abandoned_tower_threads()
    return left, weakref.ref(s), weakref.ref(result)

  left, strategy_ref, result_ref = time_out()
  release.set()
  left.join(10)
  assert not left.is_alive()
  gc.collect()
  assert (strategy_ref(), result_ref()) == (None, None)
  assert not _tower_threads.abandoned_tower_threads()


def test_the_abandoned_tower_warning_kept_by_a_handler_does_not_keep_the_strategy():
  """The warning passed the strategy as a logging argument: a handler that keeps records
  (pytest's, a list in a notebook) kept the strategy, and all it holds, alive."""
  import weakref  # pylint: disable=g-import-not-at-top
  release = threading.Event()

  class Keep(logging.Handler):
    def __init__(self):
      super().__init__(logging.WARNING)
      self.records = []

    def emit(self, record):
      self.records.append(record)

  keep = Keep()

  def time_out():
    s = ds.MirroredStrategy(CPUS[:2], tower_timeout=0.2)

    def fn():
      if ds.get_tower_context().tower_id == 1:
        release.wait(10)

    with pytest.raises(ds.errors.TowerTimeoutError):
      s.call_for_each_tower(fn)
    return _tower_threads.abandoned_tower_threads(), weakref.ref(s), repr(s)

  _tower_threads.logger.addHandler(keep)
  try:
    left, strategy_ref, strategy_repr = time_out()
  finally:
    _tower_threads.logger.removeHandler(keep)
  release.set()
  for thread in left:
    thread.join(10)
  [record] = keep.records
  assert record.getMessage() == (
      f"diststrat: tower(s) [1] of {strategy_repr} were still running their code when "
      "the call failed; their threads finish in the background and stop at their next "
      "merge_call or return.")
  gc.collect()
  assert strategy_ref() is None


@pytest.mark.processes
def test_a_forked_child_lists_no_abandoned_tower_threads_of_its_parent():
  s = ds.MirroredStrategy(CPUS[:2], tower_timeout=0.2)
  release = threading.Event()

  def fn():
    if ds.get_tower_context().tower_id == 1:
      release.wait(10)

  with pytest.raises(ds.errors.TowerTimeoutError):
    s.call_for_each_tower(fn)
  try:
    assert _tower_threads.abandoned_tower_threads()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # The child: only the forking thread runs here.
      listed = _tower_threads.abandoned_tower_threads()
      os.write(write, repr(([t.name for t in listed],
                            [t.name for t in listed if t.is_alive()])).encode())
      os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
      listed, alive = ast.literal_eval(f.read())
    os.waitpid(pid, 0)
    assert listed == alive == []
  finally:
    release.set()
    for thread in _tower_threads.abandoned_tower_threads():
      thread.join(10)


def test_thousand_calls_leave_no_threads_and_no_memory(no_thread_leak):
  s = strategy(4)
  double = tf.function(lambda x: 2 * x)

  def fn():
    double(tf.constant(1.0))
    return ds.get_tower_context().merge_call(lambda st, x: x, 1)

  with s.scope():
    s.call_for_each_tower(fn)
    before = threading.active_count()
    gc.collect()
    objects = len(gc.get_objects())
    for _ in range(1000):
      s.call_for_each_tower(fn)
    gc.collect()
    # TensorFlow keeps some objects of every thread that ran an op (4,000 tower threads
    # here) unless the thread lets go of them as it ends.
    assert len(gc.get_objects()) - objects < 400
  assert threading.active_count() == before


def test_tower_i_runs_in_the_same_pooled_thread_on_every_call(no_thread_leak):
  s = strategy(4)
  seen = []

  def fn():
    seen.append((ds.get_tower_context().tower_id, threading.current_thread()))

  def threads_of(call):
    seen.clear()
    call()
    return [thread for _, thread in sorted(seen, key=lambda e: e[0])]

  first = threads_of(lambda: s.call_for_each_tower(fn))
  idle = set(_tower_threads.idle_tower_threads())
  assert len(set(first)) == 4 and set(first) <= idle
  for _ in range(3):  # Eager and traced: the same threads, in the same tower order.
    assert threads_of(lambda: s.call_for_each_tower(fn)) == first
    assert threads_of(tf.function(lambda: s.call_for_each_tower(fn))) == first
  assert set(_tower_threads.idle_tower_threads()) == idle  # The pool did not grow.
  # A tower left behind by a failed call does not go back to the pool: it ends.
  release = threading.Event()

  def stuck():
    if ds.get_tower_context().tower_id == 1:
      release.wait(10)

  slow = ds.MirroredStrategy(CPUS[:2], tower_timeout=0.2)
  with pytest.raises(ds.errors.TowerTimeoutError):
    slow.call_for_each_tower(stuck)
  [left] = _tower_threads.abandoned_tower_threads()
  release.set()
  left.join(10)
  assert not left.is_alive() and left not in _tower_threads.idle_tower_threads()
  after = threads_of(lambda: s.call_for_each_tower(fn))  # A new thread stands in for it.
  assert left in first and left not in after and len(set(after) - set(first)) == 1


def test_a_tower_thread_that_cannot_start_keeps_the_idle_ones_in_the_pool(monkeypatch):
  fn = lambda: ds.get_tower_context().tower_id
  s = strategy(4)
  expected = s.call_for_each_tower(fn).values  # With the process's pool.
  pool = _tower_threads._Pool()  # Empty, so the 4-tower call must start threads.
  monkeypatch.setattr(_tower_threads, "_pool", pool)
  strategy(2).call_for_each_tower(fn)
  idle = set(_tower_threads.idle_tower_threads())
  start = threading.Thread.start

  def refuse(thread):
    if thread.name.startswith("diststrat-tower"):
      raise RuntimeError("can't start new thread")
    start(thread)

  with monkeypatch.context() as patch:
    patch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="could not start a tower thread .*limit on threads"):
      s.call_for_each_tower(fn)
  # The two idle threads were not lost with the call: the next call reuses them.
  assert set(_tower_threads.idle_tower_threads()) == idle
  assert s.call_for_each_tower(fn).values == expected
  assert idle <= set(_tower_threads.idle_tower_threads())
  for worker in pool.take(4):  # This test's pool ends with it.
    worker.give(lambda: False, "retired")
    worker.thread.join(10)


def test_op_callbacks_reach_eager_towers_as_on_one_device():
  def fn():
    return tf.math.log(tf.constant(-1.0))

  s = strategy(2)
  tf.debugging.enable_check_numerics()
  try:
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN"):
      ds.get_distribution_strategy().call_for_each_tower(fn)  # The reference: one device.
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN"):
      s.call_for_each_tower(fn)
  finally:
    tf.debugging.disable_check_numerics()
  assert np.isnan(s.unwrap(s.call_for_each_tower(fn))).all()  # Off again in the towers.


def test_tower_threads_inherit_name_scope_and_creator_scopes():
  s = strategy(2)
  created = []

  def creator(next_creator, **kwargs):
    created.append(kwargs.get("name"))
    return next_creator(**kwargs)

  def fn():
    return tf.get_current_name_scope(), tf.Variable(1.0, name="inner").name

  with s.scope():
    with tf.variable_creator_scope(creator), tf.name_scope("outer"):
      scopes = s.call_for_each_tower(fn)
  assert s.unwrap(scopes[0]) == ["outer", "outer"]
  assert scopes[1] == "outer/inner:0"  # One shared variable: the same name object.
  assert created.count("inner") >= 1


def test_towers_build_one_tf_function_graph():
  s = strategy(4)

  @tf.function
  def step(x):
    def fn(x):
      return x * tf.cast(ds.get_tower_context().tower_id, tf.float32)
    return s.unwrap(s.reduce("sum", s.call_for_each_tower(fn, x)))

  with s.scope():
    out = step(tf.constant(2.0))
    out2 = step(tf.constant(3.0))
  assert [float(o) for o in out] == [12.0] * 4
  assert [float(o) for o in out2] == [18.0] * 4
  assert step.experimental_get_tracing_count() == 1


def test_tower_function_gets_autograph_in_tf_function():
  s = strategy(2)

  def fn(x):
    if x > 0:  # A tensor condition: needs AutoGraph inside tf.function.
      y = x * 2.0
    else:
      y = -x
    return y

  @tf.function
  def step(x):
    return s.unwrap(s.call_for_each_tower(fn, x))

  with s.scope():
    assert [float(v) for v in step(tf.constant(3.0))] == [6.0, 6.0]
    assert [float(v) for v in step(tf.constant(-2.0))] == [2.0, 2.0]


class _ScaleOrNegate:
  """A callable object whose `__call__` branches on a tensor."""

  def __init__(self, scale):
    self.scale = scale

  def __call__(self, x):
    if tf.reduce_sum(x) > 0:  # A tensor condition: needs AutoGraph inside tf.function.
      y = x * self.scale
    else:
      y = -x
    for i in tf.range(2):  # A loop over a tensor.
      y += tf.cast(i, tf.float32)
    return y


def _scale_or_negate(x, scale):
  if tf.reduce_sum(x) > 0:  # A tensor condition: needs AutoGraph inside tf.function.
    return x * scale
  return -x


@pytest.mark.parametrize("kind", ["callable object", "functools.partial"])
@pytest.mark.parametrize("towers", [None, 2, 4])
def test_a_callable_object_or_partial_as_tower_function_gets_autograph(kind, towers):
  """A callable object or a functools.partial given to call_for_each_tower in a
  tf.function was not converted by AutoGraph (a function or a bound method was): its
  `if` on a tensor raised OperatorNotAllowedInGraphError. A tf.function calling it
  converts it."""
  fn = (_ScaleOrNegate(3.0) if kind == "callable object"
        else functools.partial(_scale_or_negate, scale=3.0))
  s = ds.DefaultStrategy() if towers is None else strategy(towers)

  @tf.function
  def step(x):
    return s.unwrap(s.call_for_each_tower(fn, x))

  @tf.function
  def plain(x):
    return fn(x)

  with s.scope():
    for v in (2.0, -2.0):
      got = [float(t) for t in step(tf.constant(v))]
      assert got == [float(plain(tf.constant(v)))] * (towers or 1)


def _native_threads():
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_a_long_run_of_the_default_reduction_keeps_native_threads_flat():
  """2,000 steps with MirroredStrategy's default reduction (collective on CPUs): a
  timeout on its collectives would hold a native thread per run for that long (8 per
  step here, 16,000 threads at the end on the commit before)."""
  strategy = ds.MirroredStrategy(CPUS)
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(8, 4)).astype(np.float32))
  y = tf.constant(rng.normal(size=(8, 1)).astype(np.float32))
  with strategy.scope():
    w, b = tf.Variable(tf.zeros([4, 1])), tf.Variable(tf.zeros([1]))
    opt = ds.optimizers.GradientDescent(0.01)

  @tf.function
  def step():
    strategy.call_for_each_tower(lambda: opt.minimize(
        lambda: tf.reduce_mean(tf.square(x @ w + b - y)), var_list=[w, b]))

  for _ in range(100):
    step()
  before = _native_threads()
  for _ in range(1900):
    step()
  assert _native_threads() - before <= 50, (before, _native_threads())


_FAILING_MEMBER = """
import sys
sys.path.insert(0, {root!r})
import conftest  # Four logical CPUs.
import tensorflow as tf
import diststrat as ds
CPUS = conftest.CPUS
ops = ds.cross_tower_ops.AllReduceCrossTowerOps("collective")  # No timeout.

@tf.function
def reduce_with_a_failing_member(x):
  with tf.device(CPUS[1]):
    bad = tf.debugging.check_numerics(x / 0.0 * 0.0, "tower 1 made a nan")
  with tf.device(CPUS[0]):
    good = x * 2.0
  return ops.batch_reduce("sum", [(ds.values.PerDevice({{CPUS[0]: good, CPUS[1]: bad}}),
                                   None)])[0].values

try:
  reduce_with_a_failing_member(tf.constant(1.0))
except tf.errors.InvalidArgumentError as e:
  print("RAISED", "tower 1 made a nan" in str(e))
"""


@pytest.mark.processes
def test_an_error_in_one_member_ends_the_collective_without_a_timeout():
  """In a fresh process: TensorFlow then aborts every later collective of the process
  (docs/cross_tower_ops.md), which would break the tests that follow."""
  import pathlib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-import
  root = str(pathlib.Path(__file__).resolve().parents[1])
  out = subprocess.run([sys.executable, "-c", _FAILING_MEMBER.format(root=root)],
                       capture_output=True, text=True, timeout=240).stdout
  assert "RAISED True" in out, out


def test_saved_model_load_inside_the_scope_says_to_load_outside(tmp_path):
  """TensorFlow's loader makes variables with no initial value (it restores them after):
  inside the scope that was a raw "Attempt to convert a value (None)" error."""
  module = tf.Module()
  module.v = tf.Variable([1.0, 2.0])
  module.f = tf.function(lambda: module.v * 2.0, input_signature=[])
  tf.saved_model.save(module, str(tmp_path / "saved"))
  s = strategy(2)
  with s.scope():
    with pytest.raises(ValueError, match=r"is created without an initial value \(as "
                       r"tf.saved_model.load does\) inside a diststrat strategy's scope.*"
                       r"Call tf.saved_model.load outside the scope"):
      tf.saved_model.load(str(tmp_path / "saved"))
  loaded = tf.saved_model.load(str(tmp_path / "saved"))  # Outside: works, as documented.
  np.testing.assert_allclose(loaded.f().numpy(), [2.0, 4.0])


def test_a_checkpoint_of_another_shape_is_refused_as_tensorflow_says_it(tmp_path):
  """Under a strategy the restore reached each copy's assign, whose message ("Cannot
  assign value to variable ...") did not say a restore failed."""
  path = tf.train.Checkpoint(w=tf.Variable([1.0, 2.0, 3.0])).write(str(tmp_path / "c"))
  s = strategy(2)
  with s.scope():
    w = tf.Variable([0.0, 0.0])
  with pytest.raises(ValueError, match=r"Received incompatible tensor with shape \(3,\) when "
                     r"attempting to restore variable with shape \(2,\)"):
    tf.train.Checkpoint(w=w).read(path)
  assert [c.numpy().tolist() for c in w.values] == [[0.0, 0.0]] * 2


def test_a_tape_around_eager_towers_raises_instead_of_a_none_gradient():
  """A tf.GradientTape entered around an eager call_for_each_tower (or the tf.distribute
  bridge's run) recorded nothing the towers computed, each in its own thread:
  tape.gradient gave None where the default strategy gives the gradient."""
  x = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])

  def gradient(s, call):
    with s.scope():
      w = tf.Variable([[1.0], [2.0]])
      with tf.GradientTape() as tape:
        total = call(s, lambda part: tf.reduce_sum(part @ w))
      return tape.gradient(total, w)

  def own_api(s, fn):
    return s.unwrap(s.reduce("sum", s.call_for_each_tower(fn, x)))[0]

  def bridge(s, fn):
    adapter = tf.distribute.get_strategy()
    return adapter.reduce("sum", adapter.run(fn, args=(x,)), axis=None)

  expected = gradient(ds.DefaultStrategy(), own_api)
  np.testing.assert_allclose(expected, [[16.0], [20.0]])
  for towers in (1, 4):
    for call in (own_api, bridge):
      with pytest.raises(ds.errors.ContextError, match="Enter the tape inside the tower function"):
        gradient(strategy(towers), call)
  s = strategy(4)
  with s.scope():  # A paused tape records nothing in any thread: the call runs.
    with tf.GradientTape() as tape:
      with tape.stop_recording():
        assert float(own_api(s, tf.reduce_sum)) == 4 * 36.0  # x is every tower's.


def test_an_accumulator_or_minimize_around_eager_towers_is_named_in_the_error():
  """The error for a recording tape around eager towers named only a tf.GradientTape the
  caller entered, with its fix: also raised for a tf.autodiff.ForwardAccumulator (whose
  jvp of the towers' results is None as well) and for an optimizer's minimize(loss_fn)
  whose loss_fn calls the towers (its own tape), where there is no tape to move."""
  s = strategy(2)
  with s.scope():
    v = tf.Variable(1.0)
    with pytest.raises(ds.errors.ContextError, match="tf.autodiff.ForwardAccumulator"):
      with tf.autodiff.ForwardAccumulator(v, tf.constant(1.0)):
        s.call_for_each_tower(lambda: v * 2.0)
    optimizer = ds.optimizers.GradientDescent(0.1)
    with pytest.raises(ds.errors.ContextError, match="minimize"):
      optimizer.minimize(lambda: s.unwrap(s.reduce("sum", s.call_for_each_tower(
          lambda: v * 2.0)))[0], var_list=[v])


@pytest.mark.parametrize("mode", MODES)
def test_a_strategy_that_reduced_is_freed_without_a_garbage_collection(mode):
  """A dropped strategy waited for a garbage collection: it and its default reduction
  formed reference cycles (the measurement budget was a method of the strategy, and each
  reduction's eager launcher held a method of the reduction). Reference counting frees
  them now, as soon as nothing holds the strategy."""
  import weakref  # pylint: disable=g-import-not-at-top

  def reduce_and_drop():
    s = strategy(2)
    x = ds.values.PerDevice({d: tf.constant(1.0) for d in s.worker_devices})
    with s.scope():
      total = run(mode, lambda: s.reduce("sum", x))
    assert [float(v) for v in total.values] == [2.0, 2.0]
    s.cross_tower_ops.batch_reduce("mean", [(x, None)])  # Eagerly: a launch.
    return weakref.ref(s), weakref.ref(s.cross_tower_ops)

  gc.collect()
  gc.disable()
  try:
    s, ops = reduce_and_drop()
    assert s() is None
    assert ops() is None
  finally:
    gc.enable()
