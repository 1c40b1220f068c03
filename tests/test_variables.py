"""Distributed variables used as a `tf.Variable` is: Python numbers, copies, sparse and
sliced writes, and functions saved in a SavedModel (docs/mirrored.md, "Variables").

Each is compared with a plain `tf.Variable` doing the same thing."""

import copy
import pickle

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.values import MirroredVariable, TowerLocalVariable
from conftest import CPUS

ON_READ = tf.VariableSynchronization.ON_READ
SUM, MEAN = tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN


def strategy(n):
  return ds.MirroredStrategy(CPUS[:n])


def copies(v):
  return [c.numpy().tolist() for c in v.values]


# --- Python numbers and copies ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mirrored", "tower_local"])
def test_python_numbers_are_the_value_as_for_a_plain_variable(kind):
  """float(), int(), complex() raised TypeError, and bool() was True for any value."""
  kwargs = {} if kind == "mirrored" else {"synchronization": ON_READ, "aggregation": MEAN}
  with strategy(2).scope():
    x, n = tf.Variable(2.5, **kwargs), tf.Variable(3, **kwargs)
    false, true = tf.Variable(False), tf.Variable(True)
  plain_x, plain_n = tf.Variable(2.5), tf.Variable(3)
  assert (float(x), int(n), complex(x)) == (float(plain_x), int(plain_n), complex(plain_x))
  assert type(float(x)) is float and type(int(n)) is int
  assert (bool(false), bool(true)) == (bool(tf.Variable(False)), bool(tf.Variable(True)))
  assert bool(false) is False


def test_python_numbers_of_a_tower_local_sum_are_the_sum():
  with strategy(4).scope():
    v = tf.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
  v.assign(6.0)
  assert float(v) == 6.0 and [float(c) for c in v.values] == [1.5] * 4


def test_read_value_no_copy_and_set_shape_as_for_a_plain_variable():
  """read_value_no_copy raised AttributeError, set_shape a bare NotImplementedError."""
  with strategy(2).scope():
    v = tf.Variable([1.0, 2.0])
    t = tf.Variable([0.0, 0.0], synchronization=ON_READ, aggregation=SUM)
  t.assign([4.0, 6.0])
  assert v.read_value_no_copy().numpy().tolist() == [1.0, 2.0]
  assert t.read_value_no_copy().numpy().tolist() == [4.0, 6.0]  # The aggregate.
  v.set_shape([2])
  assert v.shape == [2] and all(c.shape == [2] for c in v.values)
  with pytest.raises(ValueError):  # As a plain variable's: shapes must be compatible.
    v.set_shape([3])


def test_deepcopy_makes_new_copies_on_the_same_devices():
  s = strategy(2)
  with s.scope():
    v = tf.Variable([1.0, 2.0])
    t = tf.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
  t.assign(4.0)
  v2, t2 = copy.deepcopy(v), copy.deepcopy(t)
  assert type(v2) is MirroredVariable and type(t2) is TowerLocalVariable
  assert v2.devices == v.devices and [c.device for c in v2.values] == [c.device for c in
                                                                      v.values]
  assert v2.distribution_strategy is s
  v2.assign([5.0, 6.0])
  t2.assign_add(2.0)
  assert copies(v) == [[1.0, 2.0]] * 2 and copies(v2) == [[5.0, 6.0]] * 2
  assert float(t) == 4.0 and float(t2) == 6.0
  assert copy.copy(v) is v  # As a tf.Variable: a shallow copy is the variable.


def test_pickle_says_what_to_do():
  """It raised "cannot pickle '_thread._local' object"."""
  with strategy(2).scope():
    v = tf.Variable(1.0)
  with pytest.raises(TypeError, match=r"cannot be pickled: its copies live on its "
                     r"strategy's devices. Pickle its value \(v.numpy\(\)\)"):
    pickle.dumps(v)


# --- sparse and sliced writes -------------------------------------------------------------

_SLICES = tf.IndexedSlices(tf.constant([[10.0, 20.0]]), tf.constant([1]))
_WRITES = {
    "scatter_add": lambda v: v.scatter_add(_SLICES),
    "scatter_sub": lambda v: v.scatter_sub(_SLICES),
    "scatter_update": lambda v: v.scatter_update(_SLICES),
    "scatter_mul": lambda v: v.scatter_mul(_SLICES),
    "scatter_div": lambda v: v.scatter_div(_SLICES),
    "scatter_max": lambda v: v.scatter_max(_SLICES),
    "scatter_min": lambda v: v.scatter_min(_SLICES),
    "batch_scatter_update": lambda v: v.batch_scatter_update(_SLICES),
    "scatter_nd_add": lambda v: v.scatter_nd_add([[0, 1], [2, 0]], [5.0, 7.0]),
    "scatter_nd_sub": lambda v: v.scatter_nd_sub([[0, 1]], [5.0]),
    "scatter_nd_update": lambda v: v.scatter_nd_update([[2, 1]], [9.0]),
    "scatter_nd_max": lambda v: v.scatter_nd_max([[0, 0]], [9.0]),
    "scatter_nd_min": lambda v: v.scatter_nd_min([[0, 0]], [-9.0]),
    "sliced assign": lambda v: v[1:, :1].assign([[-1.0], [-2.0]]),
}
_START = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def _expected(name):
  plain = tf.Variable(_START)
  _WRITES[name](plain)
  return plain.numpy().tolist()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("name", sorted(_WRITES))
def test_sparse_and_sliced_writes_write_every_mirrored_copy(name, traced):
  """They raised a bare NotImplementedError (slice assignment: AttributeError)."""
  with strategy(2).scope():
    v = tf.Variable(_START)
  write = (lambda: _WRITES[name](v))
  result = tf.function(write)() if traced else write()
  if not traced:
    assert result is v  # As a tf.Variable's: the variable.
  assert copies(v) == [_expected(name)] * 2


@pytest.mark.parametrize("aggregation", [SUM, MEAN], ids=["sum", "mean"])
@pytest.mark.parametrize("name", sorted(set(_WRITES) - {
    "scatter_max", "scatter_min", "scatter_nd_max", "scatter_nd_min"}))
def test_sparse_writes_of_a_tower_local_variable_set_its_aggregate(name, aggregation):
  """Cross-tower, as `assign*` there: the copies' sum or mean takes the written value."""
  with strategy(4).scope():
    v = tf.Variable(tf.zeros([3, 2]), synchronization=ON_READ, aggregation=aggregation)
  v.assign(_START)
  _WRITES[name](v)
  np.testing.assert_allclose(v.numpy(), _expected(name), rtol=1e-6)


def test_integer_tower_local_sum_scatter_goes_whole_to_one_copy():
  with strategy(4).scope():
    v = tf.Variable([0, 0, 0], synchronization=ON_READ, aggregation=SUM)
  v.scatter_add(tf.IndexedSlices(tf.constant([3]), tf.constant([1])))
  v.scatter_update(tf.IndexedSlices(tf.constant([7]), tf.constant([2])))
  assert v.numpy().tolist() == [0, 3, 7]
  assert copies(v) == [[0, 3, 7], [0, 0, 0], [0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("name", ["scatter_max", "scatter_nd_min"])
def test_order_writes_of_a_tower_local_variable_cross_tower_say_what_to_do(name):
  with strategy(2).scope():
    v = tf.Variable(tf.zeros([3, 2]), synchronization=ON_READ, aggregation=SUM)
  kind = name.rsplit("_", 1)[-1]
  with pytest.raises(ValueError, match=rf"Cannot {name}\(\) the tower-local variable "
                     rf".*the sum of the copies' {kind} is not the {kind} of their sum. "
                     r"Read it \(v.read_value\(\)\), compute the new value, and assign\(\)"):
    _WRITES[name](v)


def test_sparse_writes_in_a_tower_write_the_towers_copy_of_a_tower_local_variable():
  s = strategy(2)
  with s.scope():
    v = tf.Variable([0.0, 0.0, 0.0], synchronization=ON_READ, aggregation=SUM)

  def tower():
    i = ds.get_tower_context().tower_id
    v.scatter_add(tf.IndexedSlices(tf.constant([1.0 + i]), tf.constant([i])))
    v[2:].assign([5.0])

  s.call_for_each_tower(tower)
  assert copies(v) == [[1.0, 0.0, 5.0], [0.0, 2.0, 5.0]]
  assert v.numpy().tolist() == [1.0, 2.0, 10.0]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_sparse_write_of_a_mirrored_variable_in_a_tower_says_where_to_write_it(traced):
  s = strategy(2)
  with s.scope():
    v = tf.Variable([1.0, 2.0])

  def step():
    s.call_for_each_tower(lambda: v.scatter_add(
        tf.IndexedSlices(tf.constant([1.0]), tf.constant([0]))))

  with pytest.raises(ValueError, match=r"Cannot scatter_add\(\) the mirrored variable "
                     r"'Variable:0' in a tower context \(aggregation NONE\).*Only "
                     r"scatter_add and scatter_sub of tf.IndexedSlices, with aggregation SUM "
                     r"or MEAN.*Write it in cross-tower context"):
    tf.function(step)() if traced else step()
  assert copies(v) == [[1.0, 2.0]] * 2


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_scatter_add_in_towers_combines_the_towers_rows_by_the_aggregation(traced):
  s = strategy(4)
  with s.scope():
    summed = tf.Variable(tf.zeros([3]), aggregation=SUM)
    averaged = tf.Variable(tf.zeros([3]), aggregation=MEAN)

  def tower():
    i = ds.get_tower_context().tower_id
    for v in (summed, averaged):
      v.scatter_add(tf.IndexedSlices(tf.constant([float(i + 1)]), tf.constant([i % 2])))
      v.scatter_sub(tf.IndexedSlices(tf.constant([1.0]), tf.constant([2])))

  step = lambda: s.call_for_each_tower(tower)  # noqa: E731
  tf.function(step)() if traced else step()
  assert copies(summed) == [[4.0, 6.0, -4.0]] * 4
  assert copies(averaged) == [[1.0, 1.5, -1.0]] * 4


def test_keras_adagrad_on_an_embedding_matches_one_device():
  """Keras's Adagrad writes its accumulator with scatter_add for an embedding's sparse
  gradient, inside update(): it raised NotImplementedError."""
  import keras  # pylint: disable=g-import-not-at-top

  def train(s, ids):
    with s.scope():
      embedding = keras.layers.Embedding(6, 2, embeddings_initializer="ones")
      embedding.build((None,))
      optimizer = keras.optimizers.Adagrad(0.1)

    def tower(ids):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embedding(ids))
      grads = tape.gradient(loss, embedding.trainable_variables)
      assert isinstance(grads[0], tf.IndexedSlices)
      optimizer.apply_gradients(zip(grads, embedding.trainable_variables, strict=True))

    for _ in range(2):
      s.call_for_each_tower(tower, ids)
    return embedding.embeddings.value

  expected = train(ds.get_distribution_strategy(), tf.constant([1, 2, 1, 3])).numpy()
  two = strategy(2)
  got = train(two, ds.values.PerDevice({CPUS[0]: tf.constant([1, 2]),
                                        CPUS[1]: tf.constant([1, 3])}))
  for component in got.values:
    np.testing.assert_allclose(component.numpy(), expected, rtol=1e-6)


def test_strategy_update_with_a_scatter_writes_each_copy():
  """The way the error above says: `update` runs the scatter on each copy."""
  s = strategy(2)
  with s.scope():
    v = tf.Variable([1.0, 2.0, 3.0])
  delta = tf.IndexedSlices(tf.constant([10.0]), tf.constant([2]))

  def tower():
    ds.get_tower_context().merge_call(
        lambda st: st.update(v, lambda copy_, d: copy_.scatter_add(d), delta))

  s.call_for_each_tower(tower)
  assert copies(v) == [[1.0, 2.0, 13.0]] * 2


# --- functions saved in a SavedModel ------------------------------------------------------


def _save_and_load(module, tmp_path):
  path = str(tmp_path / "saved")
  tf.saved_model.save(module, path)
  return tf.saved_model.load(path)


def test_saved_functions_read_and_write_as_they_did_before_saving(tmp_path):
  """The SavedModel holds one variable for all the copies, but the traced functions read
  and wrote each copy: after loading, a mirrored assign_add added N times, a tower-local
  SUM read N times its sum, and an assign of it set 1/N of the value."""
  with strategy(4).scope():
    m = tf.Module()
    m.v = tf.Variable(1.0)
    m.total = tf.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    m.mean = tf.Variable(0.0, synchronization=ON_READ, aggregation=MEAN)
    m.rows = tf.Variable([0.0, 0.0, 0.0])
  m.total.assign(3.0)
  m.mean.assign(5.0)
  m.inc = tf.function(lambda: m.v.assign_add(1.0), input_signature=[])
  m.read = tf.function(lambda: (m.total + 0.0, tf.identity(m.mean)), input_signature=[])
  m.set_total = tf.function(lambda: m.total.assign(10.0), input_signature=[])
  m.add_total = tf.function(lambda: m.total.assign_add(1.0), input_signature=[])
  m.scatter = tf.function(lambda: m.rows.scatter_add(
      tf.IndexedSlices(tf.constant([2.0]), tf.constant([1]))), input_signature=[])
  m.read()  # Traced outside the save: the save traces again.
  loaded = _save_and_load(m, tmp_path)
  for module in (m, loaded):
    module.inc()
    assert [float(x) for x in module.read()] == [3.0, 5.0]
    module.set_total()
    module.add_total()
    module.scatter()
    assert (float(module.v), float(module.total), module.rows.numpy().tolist()) == (
        2.0, 11.0, [0.0, 2.0, 0.0])
  assert [float(c) for c in m.total.values] == [2.75] * 4  # Still spread in memory.


def test_a_saved_training_step_with_towers_trains_as_before_saving(tmp_path):
  """Tower threads trace in the save's context too (it is per thread): their reads and
  writes use the copy the SavedModel keeps, in the order the step has them."""
  s = strategy(2)
  with s.scope():
    m = tf.Module()
    m.w = tf.Variable([1.0, 2.0])
    m.seen = tf.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    opt = ds.optimizers.GradientDescent(0.1)  # Slot-free: a tf.Module saves no slots.

  @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
  def train(x):
    def tower():
      m.seen.assign_add(1.0)
      opt.minimize(lambda: tf.reduce_sum(m.w * x * x), var_list=[m.w])
    s.call_for_each_tower(tower)
    s.call_for_each_tower(tower)  # A second step reads what the first wrote.
    return m.w + m.seen

  m.train = train
  x = tf.constant([1.0, 3.0])
  m.train(x)
  loaded = _save_and_load(m, tmp_path)
  for _ in range(3):
    np.testing.assert_allclose(loaded.train(x).numpy(), m.train(x).numpy(), rtol=1e-6)
  np.testing.assert_allclose(loaded.w.numpy(), m.w.numpy(), rtol=1e-6)
  assert float(loaded.seen) == float(m.seen) == 16.0


@pytest.mark.parametrize("aggregation,after_loading", [("sum", 32.0), ("mean", 8.0)])
def test_a_signature_traced_before_the_save_reads_a_tower_local_variable_as_docs_say(
    tmp_path, aggregation, after_loading):
  """docs/keras.md, SavedModel: a concrete function given as `signatures=` is not traced
  again, so its cross-tower read adds the 4 copies, which after loading are all the one
  saved variable: `SUM` reads 4 times its aggregate, `MEAN` its aggregate."""
  s = strategy(4)
  with s.scope():
    m = tf.Module()
    m.t = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=getattr(tf.VariableAggregation, aggregation.upper()))
  m.t.assign(8.0)

  @tf.function(input_signature=[])
  def read():
    return tf.identity(m.t)

  path = str(tmp_path / "saved")
  tf.saved_model.save(m, path, signatures={"read": read.get_concrete_function()})
  loaded = tf.saved_model.load(path)
  assert float(read()) == 8.0
  assert float(loaded.signatures["read"]()["output_0"]) == after_loading


@pytest.mark.parametrize("towers", [0, 2], ids=["no strategy", "2 towers"])
def test_a_saved_module_holding_an_optimizer_with_slots_loads_and_trains_the_same(
    tmp_path, towers):
  """It saved, then failed to load: "'_UserObject' object has no attribute 'add_slot'"
  (TensorFlow's loader rebuilds slots only for optimizers it knows)."""
  s = strategy(towers) if towers else ds.get_distribution_strategy()
  with s.scope():
    m = tf.Module()
    m.w = tf.Variable([1.0, 2.0])
    m.opt = ds.optimizers.Adam(0.1)

  @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
  def train(x):
    s.call_for_each_tower(lambda: m.opt.minimize(lambda: tf.reduce_sum(m.w * x * x),
                                                 var_list=[m.w]))
    return tf.identity(m.w)

  m.train = train
  x = tf.constant([1.0, 3.0])
  m.train(x)
  loaded = _save_and_load(m, tmp_path)
  for _ in range(2):
    np.testing.assert_allclose(loaded.train(x).numpy(), m.train(x).numpy(), rtol=1e-6)
  # Checkpoints still hold the slots as slots: a new optimizer restores them.
  assert m.opt.get_slot_names() == ["m", "v"]
  path = tf.train.Checkpoint(m=m).write(str(tmp_path / "ckpt"))
  with s.scope():
    m2 = tf.Module()
    m2.w = tf.Variable([0.0, 0.0])
    m2.opt = ds.optimizers.Adam(0.1)
  tf.train.Checkpoint(m=m2).read(path).assert_existing_objects_matched()
  for name in ("m", "v"):
    np.testing.assert_allclose(m2.opt.get_slot(m2.w, name).numpy(),
                               m.opt.get_slot(m.w, name).numpy())


def test_exponential_moving_average_matches_no_strategy():
  """tf.train.ExponentialMovingAverage raised AttributeError ('_save_slice_info', which
  TensorFlow reads on any tf.Variable when it makes the average's slot)."""

  def run(s):
    with s.scope():
      w = tf.Variable([1.0, 2.0])
      ema = tf.train.ExponentialMovingAverage(0.9)
      ema.apply([w])
    seen = []

    @tf.function
    def step():
      w.assign_add([1.0, 1.0])
      ema.apply([w])
      return ema.average(w).read_value()

    with s.scope():
      for _ in range(2):
        w.assign_add([1.0, 1.0])
        ema.apply([w])
        seen.append(ema.average(w).numpy().tolist())
      seen.append(step().numpy().tolist())
    s.call_for_each_tower(lambda: ds.get_tower_context().merge_call(
        lambda _: ema.apply([w])))
    seen.append(ema.average(w).numpy().tolist())
    return seen, ema.average(w)

  expected, _ = run(ds.get_distribution_strategy())
  got, average = run(strategy(2))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert type(average) is MirroredVariable and copies(average)[0] == copies(average)[1]


def test_saved_functions_use_tower_local_variables_in_towers_as_before_saving(tmp_path):
  """In the save's trace every copy is the one variable the SavedModel keeps, holding the
  aggregate: tower reads are its shares, tower writes are combined by the aggregation,
  and reductions and unwrap take the shares. Before, a MEAN assign_add in each tower
  added N times, a SUM assign in each tower kept one tower's value, and reductions of
  the variable (the usual metric pattern) added N times its sum after loading."""
  s = strategy(2)
  with s.scope():
    m = tf.Module()
    m.mean = tf.Variable(0.0, synchronization=ON_READ, aggregation=MEAN)
    m.total = tf.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    m.count = tf.Variable(0, synchronization=ON_READ, aggregation=SUM)
  m.total.assign(4.0)
  m.count.assign(5)

  def tower_add():
    m.mean.assign_add(1.0)
    m.count.assign_add(1)
    return m.total.read_value() + 0.0

  @tf.function(input_signature=[])
  def add():
    return s.reduce("sum", s.call_for_each_tower(tower_add)).primary, tf.identity(m.mean)

  @tf.function(input_signature=[])
  def reduced():
    return (s.reduce("sum", m.total).primary, s.reduce("mean", m.total).primary,
            tf.add_n(s.unwrap(m.total)), s.reduce("sum", {"n": m.count})["n"].primary)

  @tf.function(input_signature=[])
  def set_each():
    s.call_for_each_tower(lambda: m.total.assign(3.0))
    return tf.identity(m.total)

  m.add, m.reduced, m.set_each = add, reduced, set_each

  def run(module):
    out = [[float(x) for x in module.add()] for _ in range(2)]
    out.append([float(x) for x in module.reduced()])
    out.append(float(module.set_each()))
    return out, float(module.mean), int(module.count)

  loaded = _save_and_load(m, tmp_path)  # Both run from the values saved.
  expected = run(m)
  assert expected == ([[4.0, 1.0], [4.0, 2.0], [4.0, 2.0, 4.0, 9.0], 6.0], 2.0, 9)
  assert run(loaded) == expected


def test_sparse_reads_of_a_tower_local_variable_cross_tower_read_the_aggregate():
  """sparse_read, gather_nd and tf.gather read the first copy's share of a SUM."""
  with strategy(2).scope():
    t = tf.Variable([0.0, 0.0], synchronization=ON_READ, aggregation=SUM)
  t.assign([4.0, 6.0])
  assert t.sparse_read([1, 0]).numpy().tolist() == [6.0, 4.0]
  assert t.gather_nd([[1]]).numpy().tolist() == [6.0]
  assert tf.gather(t, [1]).numpy().tolist() == [6.0]
  assert tf.function(lambda: tf.gather(t, [0, 1]))().numpy().tolist() == [4.0, 6.0]


def test_integer_scatter_div_of_a_tower_local_sum_cross_tower_says_what_to_do():
  """Each copy's floored quotient does not add up to the sum's: [1,3]+[1,3] by 2 gave
  [0, 2], where a plain variable [2, 6] gives [1, 3]."""
  with strategy(2).scope():
    t = tf.Variable([0, 0], synchronization=ON_READ, aggregation=SUM)
  with pytest.raises(ValueError, match=r"Cannot scatter_div\(\) the integer tower-local "
                     r"variable .*floored quotients"):
    t.scatter_div(tf.IndexedSlices(tf.constant([2, 2]), tf.constant([0, 1])))



def test_a_saved_function_taking_and_returning_wrapped_values_loads_with_tuples(tmp_path):
  """A step traced on `distribute_dataset`'s batches (a `BatchParts`) and returning
  `reduce`'s `Mirrored` and `call_for_each_tower`'s `PerDevice` saves (it raised
  TensorFlow's NotEncodableError): loaded, it takes the tower parts as a tuple, returns
  tuples of the components and writes the variable as the original does."""
  s = strategy(2)
  with s.scope():
    m = tf.Module()
    m.w = tf.Variable([1.0, 2.0], aggregation=SUM)

  @tf.function
  def step(batch):
    def tower(x):
      m.w.assign_add(tf.reduce_sum(x, 0))
      return tf.reduce_sum(x)
    sums = s.call_for_each_tower(tower, batch)
    return s.reduce("sum", sums), sums

  m.step = step
  m.bump = tf.function(lambda: s.update(m.w, lambda copy, d: copy.assign_add(d),
                                        tf.constant([1.0, 1.0])), input_signature=[])
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  with s.scope():
    first, second = list(s.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices(x).batch(4)))
    m.step(first)
  loaded = _save_and_load(m, tmp_path)
  with s.scope():
    total, sums = m.step(second)
  got_total, got_sums = loaded.step(tuple(second.values))
  assert [float(t) for t in got_total] == [float(t) for t in total.values]
  assert [float(t) for t in got_sums] == [float(t) for t in sums.values]
  np.testing.assert_array_equal(loaded.w.numpy(), m.w.numpy())
  # update() runs on the one saved copy while the save traces: one tensor, not a tuple.
  np.testing.assert_array_equal(loaded.bump().numpy(), m.bump().primary.numpy())
  np.testing.assert_array_equal(loaded.w.numpy(), m.w.numpy())


def test_variable_errors_keep_their_message_in_a_tf_function():
  """Raised under tf.Variable() (the strategy's variable creator) or a write of a
  distributed variable called from the user's code, these errors reached a
  tf.function's caller rewritten by AutoGraph ("in user code:", files and lines)."""
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    total = tf.Variable(_START, synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM)
    count = tf.Variable([4, 6], synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM)

  def tower_local_without_aggregation():
    tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ)

  def colocated_with_what_is_no_variable():
    with s.colocate_vars_with(3.0):
      tf.Variable(1.0)

  def order_write_cross_tower():
    return total.scatter_max(_SLICES)

  def integer_scatter_div_cross_tower():
    return count.scatter_div(tf.IndexedSlices(tf.constant([2]), tf.constant([0])))

  def pickled():
    return pickle.dumps(total)

  for fn in (tower_local_without_aggregation, colocated_with_what_is_no_variable,
             order_write_cross_tower, integer_scatter_div_cross_tower, pickled):
    with s.scope():
      with pytest.raises((ValueError, TypeError), match="aggregation|colocate|destinations|"
                         "Cannot|cannot be pickled") as eager:
        fn()
      with pytest.raises((ValueError, TypeError)) as traced:
        tf.function(fn)()
    assert (type(traced.value), str(traced.value)) == (type(eager.value), str(eager.value)), (
        fn.__name__)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_mirrored_variable_refuses_one_value_per_tower_in_cross_tower_context(traced):
  """`v.assign(per_tower)` outside the towers wrote each copy with its own tower's
  value: the copies of a mirrored variable differed ([0.0, 1.0]), silently."""
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(5.0)
    per_tower = s.call_for_each_tower(
        lambda i: tf.constant(float(i)), s.worker_device_index)

    def write(method):
      fn = lambda: getattr(v, method)(per_tower)  # noqa: E731
      return tf.function(fn)() if traced else fn()

    for method in ("assign", "assign_add", "assign_sub"):
      with pytest.raises(ValueError, match=rf"Cannot {method}\(\) the mirrored variable "
                         r"'Variable:0' in cross-tower context with one value per tower"
                         r".*strategy.reduce\('sum' or 'mean', value, destinations=var\)"):
        write(method)
    assert [float(c) for c in s.unwrap(v)] == [5.0, 5.0]
    # What the message says works, and a mirrored value is still written to every copy.
    v.assign(s.reduce("sum", per_tower, destinations=v))
    v.assign_add(per_tower.get(CPUS[1]))
    assert [float(c) for c in s.unwrap(v)] == [2.0, 2.0]
