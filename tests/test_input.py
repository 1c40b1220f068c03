"""distribute_dataset (docs/concepts.md): splitting rules, structures, placement, modes."""

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _input
from diststrat.values import PerDevice
from conftest import CPUS


@pytest.mark.parametrize("batch,towers,expected", [
    (8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (5, 4, [2, 1, 1, 1]), (4, 4, [1, 1, 1, 1]),
    (7, 1, [7]), (3, 2, [2, 1]),
])
def test_split_sizes(batch, towers, expected):
  assert _input.split_sizes(batch, towers) == expected
  assert sum(expected) == batch and max(expected) - min(expected) <= 1


def test_too_small_batch_names_both_numbers():
  with pytest.raises(ValueError, match="A batch of 3 examples cannot be split across 4 towers"):
    _input.split_sizes(3, 4)
  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    data = s.distribute_dataset(lambda: tf.data.Dataset.range(3).batch(3))
    with pytest.raises(ValueError, match="batch of 3 examples cannot be split across 4 towers"):
      next(iter(data))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_even_and_uneven_batches_eager(n):
  s = ds.MirroredStrategy(CPUS[:n])
  with s.scope():
    data = s.distribute_dataset(lambda: tf.data.Dataset.range(26).batch(10))
  seen = []
  for batch in data:
    assert isinstance(batch, PerDevice) and batch.devices == tuple(CPUS[:n])
    parts = [p.numpy().tolist() for p in batch.values]
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for part, device in zip(batch.values, CPUS[:n], strict=True):
      assert part.device == device
    seen.extend(x for p in parts for x in p)
  assert seen == list(range(26))  # In order, nothing lost or repeated.


def test_nested_structures_split_leaf_by_leaf():
  s = ds.MirroredStrategy(CPUS[:2])
  x = np.arange(24, dtype=np.float32).reshape(6, 4)
  y = np.arange(6, dtype=np.int32)

  def dataset_fn():
    return tf.data.Dataset.from_tensor_slices(({"a": x, "b": x * 2}, y)).batch(6)

  with s.scope():
    features, labels = next(iter(s.distribute_dataset(dataset_fn)))
  assert set(features) == {"a", "b"}
  np.testing.assert_array_equal(features["a"].values[0], x[:3])
  np.testing.assert_array_equal(features["b"].values[1], x[3:] * 2)
  np.testing.assert_array_equal(labels.values[1], y[3:])


@pytest.mark.timeout(60)
def test_a_for_loop_over_the_dataset_in_a_tf_function_is_refused_not_traced_forever():
  """In a graph `next` of a dataset iterator never raises StopIteration, so AutoGraph's
  Python loop over a PerDeviceDataset traced forever."""
  s = ds.MirroredStrategy(CPUS)
  data = s.distribute_dataset(lambda: tf.data.Dataset.range(12).batch(4))

  @tf.function
  def loop(iterable):
    total = tf.constant(0, tf.int64)
    for batch in iterable:
      total += s.unwrap(s.reduce("sum", batch))[0]
    return total

  for iterable in (data, iter(data)):
    with pytest.raises(TypeError, match=r"A for loop over a PerDevice(Dataset|Iterator) .*"
                                        r"inside a tf.function cannot end.*step\(it\)"):
      loop(iterable)

  def python_loop(iterable):
    total = 0
    for batch in iterable:
      total += int(s.unwrap(s.reduce("sum", batch))[0].numpy().sum())
    return total

  # Converted code run eagerly still loops in Python.
  assert tf.autograph.to_graph(python_loop)(data) == python_loop(data) == sum(range(12))


def test_iterate_inside_tf_function_and_one_shot_iterator():
  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    data = s.distribute_dataset(
        lambda: tf.data.Dataset.range(40).map(lambda i: tf.cast(i, tf.float32)).batch(10))
    iterator = data.make_one_shot_iterator()
    it2 = iter(data)

  @tf.function
  def step(it):
    batch = it.get_next()
    sums = s.call_for_each_tower(tf.reduce_sum, batch)
    return s.unwrap(s.reduce("sum", sums))[0], s.unwrap(batch)

  with s.scope():
    total, parts = step(iterator)
    assert float(total) == sum(range(10))
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    total, _ = step(iterator)
    assert float(total) == sum(range(10, 20))
    first = tf.function(lambda: s.unwrap(next(it2)))()
  assert [p.numpy().tolist() for p in first][0] == [0.0, 1.0, 2.0]


def test_dynamic_batch_too_small_in_tf_function():
  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    it = iter(s.distribute_dataset(lambda: tf.data.Dataset.range(6).batch(4)))

  @tf.function
  def step(it):
    return s.unwrap(it.get_next())

  with s.scope():
    assert [int(p.shape[0]) for p in step(it)] == [1, 1, 1, 1]
    # The last batch has 2 examples: the error names both numbers, as in eager mode.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"A batch of\] \[2\] \[examples cannot be split across 4 towers"):
      step(it)


def test_default_strategy_passes_batches_through():
  s = ds.DefaultStrategy()
  data = s.distribute_dataset(lambda: tf.data.Dataset.range(4).batch(2))
  assert [b.numpy().tolist() for b in data] == [[0, 1], [2, 3]]


def test_bad_dataset_fn_and_elements():
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    with pytest.raises(TypeError, match="needs dataset_fn to return a tf.data.Dataset"):
      s.distribute_dataset(lambda: [1, 2])
    data = s.distribute_dataset(lambda: tf.data.Dataset.range(4))
    with pytest.raises(ValueError, match="needs batched elements"):
      next(iter(data))


def test_per_tower_batches_feed_towers():
  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    data = s.distribute_dataset(lambda: tf.data.Dataset.range(8).batch(8))
    batch = next(iter(data))
    devices = s.call_for_each_tower(lambda b: (b.device, ds.get_tower_context().device), batch)
  batch_devices, tower_devices = devices
  assert list(tower_devices.values) == CPUS
  assert list(batch_devices.values) == CPUS  # Each part is on its own tower's device.


def test_natural_loop_traces_once():
  """`for batch in dataset: step(batch)` with a tf.function step: one trace, not one per batch."""
  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    data = s.distribute_dataset(
        lambda: tf.data.Dataset.range(48).map(lambda i: tf.cast(i, tf.float32)).batch(8))
    total = tf.Variable(0.0)

    @tf.function
    def step(batch):
      sums = s.call_for_each_tower(tf.reduce_sum, batch)
      total.assign_add(s.reduce("sum", sums).primary)
      return sums  # A PerDevice comes back out of the tf.function.

    results = [step(batch) for batch in data]
  assert step.experimental_get_tracing_count() == 1
  assert float(total.numpy()) == sum(range(48))
  assert isinstance(results[0], PerDevice) and results[0].devices == tuple(CPUS)
  assert [float(x) for x in results[0].values] == [1.0, 5.0, 9.0, 13.0]


@pytest.mark.parametrize("towers", [None, 1, 4])
def test_a_step_given_a_new_iterator_every_epoch_traces_once_as_with_tf_data(towers):
  """A `tf.function` step taking `iter(data)` (as docs/mirrored.md suggests) was traced
  again for every new iterator, so once per epoch: the iterator was an opaque Python
  object to it. A plain tf.data iterator passed the same way is traced once."""
  s = ds.DefaultStrategy() if towers is None else ds.MirroredStrategy(CPUS[:towers])

  def dataset():
    return tf.data.Dataset.range(24).map(lambda i: tf.cast(i, tf.float32)).batch(8)

  def run(strategy, data):
    @tf.function
    def step(it):
      total = tf.constant(0.0)
      for _ in tf.range(2):  # Two batches per call, from the same iterator.
        parts = strategy.call_for_each_tower(tf.reduce_sum, next(it))
        total += strategy.unwrap(strategy.reduce("sum", parts))[0]
      return total

    with strategy.scope():
      # Three epochs, each a new iterator; the first also a second call that goes on.
      totals = []
      for _ in range(3):
        it = iter(data)
        totals.append(float(step(it)))
      totals.append(float(tf.reduce_sum(next(it)[0] if towers is None else
                                        tf.concat(strategy.unwrap(next(it)), 0))))
    return totals, step.experimental_get_tracing_count()

  with s.scope():
    data = s.distribute_dataset(dataset)
  got = run(s, data)
  expected = run(ds.DefaultStrategy(), dataset())  # A plain tf.data iterator.
  assert got == expected and expected[1] == 1, (got, expected)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("towers", [None, 4])
def test_get_next_as_optional_runs_a_ragged_last_batch_and_stops_as_tf_data(towers, mode):
  """A distribute_dataset iterator had no get_next_as_optional (AttributeError), which
  tf.data's and tf.distribute's iterators have: the way to run several steps per
  tf.function call without an OutOfRangeError at the end of the data."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(22, 3)).astype(np.float32)  # Batches of 8, 8 and 6.
  w0 = rng.normal(size=(3, 1)).astype(np.float32)

  def dataset():
    return tf.data.Dataset.from_tensor_slices((x, x @ np.ones((3, 1), np.float32))).batch(8)

  def train(strategy, data):
    with strategy.scope():
      w = tf.Variable(w0)

      def tower(features, labels):
        share = ds.get_tower_context().batch_share
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.square(features @ w - labels))
          loss *= 1.0 if share is None else share  # The tower's part of the batch's mean.
        grad = tape.gradient(loss, w)
        ds.get_tower_context().merge_call(
            lambda s, g: s.update(w, lambda v, d: v.assign_sub(0.1 * d),
                                  s.reduce("sum", g, destinations=w)), grad)
        return loss

      def steps(it):
        total, count = tf.constant(0.0), tf.constant(0)
        for _ in tf.range(5):  # More steps than batches.
          optional = it.get_next_as_optional()
          if optional.has_value():
            features, labels = optional.get_value()
            losses = strategy.call_for_each_tower(tower, features, labels)
            total += strategy.unwrap(strategy.reduce("sum", losses))[0]
            count += 1
        return total, count

      total, count = (tf.function(steps) if mode == "function" else steps)(iter(data))
      return float(total), int(count), w.numpy()

  s = ds.DefaultStrategy() if towers is None else ds.MirroredStrategy(CPUS[:towers])
  with s.scope():
    data = s.distribute_dataset(dataset)
  total, count, w = train(s, data)
  expected_total, expected_count, expected_w = train(ds.DefaultStrategy(), dataset())
  assert count == expected_count == 3
  np.testing.assert_allclose(total, expected_total, rtol=1e-5)
  np.testing.assert_allclose(w, expected_w, rtol=1e-5, atol=1e-6)


def _checkpointed_dataset():
  return (tf.data.Dataset.range(48).map(lambda i: tf.cast(i, tf.float32))
          .shuffle(16, seed=3).batch(4))


def _batch_reader(strategy, towers, mode):
  """A function giving the next global batch of an iterator, as a numpy array."""
  def read(it):
    batch = next(it)
    return batch if towers is None else tf.concat(strategy.unwrap(batch), 0)
  if mode == "function":
    read = tf.function(read)
  return lambda it: read(it).numpy().tolist()


def _save_read_restore(it, read, write, restore, new_it, new_read):
  """Two batches, a save, three more, a restore, two more; then two more from a new
  iterator restored from the same save."""
  before = [read(it) for _ in range(2)]
  write(it)
  after_save = [read(it) for _ in range(3)]
  restore(it)
  resumed = [read(it) for _ in range(2)]
  restore(new_it)
  return before, after_save, resumed, [new_read(new_it) for _ in range(2)]


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("towers,new_towers", [(None, None), (2, 2), (4, 4), (2, 4), (4, None)])
def test_a_checkpointed_iterator_resumes_as_a_tf_data_iterator(towers, new_towers, mode, tmp_path):
  """`tf.train.Checkpoint(iterator=iter(data))` raised ValueError (not trackable): a
  custom loop could not save its place in the data. It now saves and restores it as a
  tf.data iterator does, also into an iterator of another strategy."""
  def strategy(n):
    return ds.DefaultStrategy() if n is None else ds.MirroredStrategy(CPUS[:n])

  def distributed(n):
    s = strategy(n)
    with s.scope():
      return s, s.distribute_dataset(_checkpointed_dataset)

  def run(it, read, new_it, new_read, prefix):
    saved = {}

    def write(it):
      saved["path"] = tf.train.Checkpoint(iterator=it).write(str(tmp_path / prefix))

    def restore(it):
      tf.train.Checkpoint(iterator=it).read(saved["path"]).assert_consumed()

    return _save_read_restore(it, read, write, restore, new_it, new_read)

  s, data = distributed(towers)
  new_s, new_data = distributed(new_towers)
  got = run(iter(data), _batch_reader(s, towers, mode), iter(new_data),
            _batch_reader(new_s, new_towers, mode), "distributed")
  plain = _batch_reader(None, None, mode)
  expected = run(iter(_checkpointed_dataset()), plain, iter(_checkpointed_dataset()), plain,
                 "plain")
  assert got == expected, (got, expected)
  assert expected[2] == expected[1][:2]  # The restore did go back.


def test_a_distributed_iterator_resumes_with_a_checkpoint_manager(tmp_path):
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    data = s.distribute_dataset(_checkpointed_dataset)

  def run(make_iterator, read, directory):
    it = make_iterator()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(iterator=it), directory, 2)
    before = [read(it) for _ in range(2)]
    manager.save()
    after_save = [read(it) for _ in range(3)]
    new_it = make_iterator()
    new_manager = tf.train.CheckpointManager(tf.train.Checkpoint(iterator=new_it), directory, 2)
    new_manager.restore_or_initialize()
    return before, after_save, [read(new_it) for _ in range(3)]

  got = run(lambda: iter(data), _batch_reader(s, 2, "eager"), str(tmp_path / "distributed"))
  expected = run(lambda: iter(_checkpointed_dataset()), _batch_reader(None, None, "eager"),
                 str(tmp_path / "plain"))
  assert got == expected and expected[2] == expected[1], (got, expected)


@pytest.mark.parametrize("towers", [None, 2, 4])
def test_a_while_loop_over_get_next_as_optional_in_a_tf_function_runs_every_batch(towers):
  """`while opt.has_value(): ...; opt = it.get_next_as_optional()` in a tf.function (the
  tf.data and tf.distribute way to run every batch left) raised TypeError ("Failed to
  convert elements of <PerDeviceOptional ...> to Tensor"): the optional was an opaque
  Python object, which cannot be a loop variable."""
  x = np.arange(22 * 3, dtype=np.float32).reshape(22, 3)  # Batches of 8, 8 and 6.

  def dataset():
    return tf.data.Dataset.from_tensor_slices(
        ({"x": x, "name": [f"e{i}" for i in range(22)]}, np.arange(22, dtype=np.int64))
    ).batch(8)

  def run(strategy, data, split):
    def whole(value):  # A batch split across towers, as one device's global batch.
      return tf.concat(strategy.unwrap(value), 0) if split else value

    @tf.function
    def loop(it):
      total, labels, count = tf.constant(0.0), tf.constant(0, tf.int64), tf.constant(0)
      names = tf.constant("")
      optional = it.get_next_as_optional()
      while optional.has_value():
        features, label = optional.get_value()
        total += tf.reduce_sum(whole(features["x"]))
        label = whole(label)  # Weighted by position: the order counts.
        labels += tf.reduce_sum(label * tf.range(1, 1 + tf.size(label, tf.int64)))
        names += tf.strings.reduce_join(whole(features["name"]), separator=",") + ";"
        count += 1
        optional = it.get_next_as_optional()
      return total, labels, names, count

    with strategy.scope():
      total, labels, names, count = loop(iter(data))
    return float(total), int(labels), names.numpy().decode(), int(count)

  s = ds.DefaultStrategy() if towers is None else ds.MirroredStrategy(CPUS[:towers])
  with s.scope():
    data = s.distribute_dataset(dataset)
  got = run(s, data, split=towers is not None)
  expected = run(ds.DefaultStrategy(), dataset(), split=False)  # A plain tf.data iterator.
  assert got == expected and expected[3] == 3, (got, expected)


def test_a_converted_loop_run_eagerly_that_breaks_takes_no_extra_batch():
  """Converted code run eagerly (`tf.autograph.to_graph`) with a `break` or `return` in
  a `for` over a distribute_dataset iterator took one batch more from the iterator than
  the loop ran (checked the stop condition only after taking the next batch), so the
  next `next(it)` skipped a batch that a tf.data iterator gives."""
  s = ds.MirroredStrategy(CPUS[:2])

  def dataset():
    return tf.data.Dataset.range(12).batch(2)

  with s.scope():
    data = s.distribute_dataset(dataset)

  def take_two_break(it):
    taken = 0
    for _ in it:
      taken += 1
      if taken == 2:
        break
    return taken

  def take_two_return(it):
    taken = 0
    for _ in it:
      taken += 1
      if taken == 2:
        return taken
    return -1

  def run(functions, iterable, whole):
    it = iter(iterable)
    return [f(it) for f in functions], whole(next(it)).numpy().tolist()

  def converted(f):
    return tf.autograph.to_graph(f)

  def concat(batch):
    return tf.concat(s.unwrap(batch), 0)

  got = run([converted(take_two_break), converted(take_two_return)], data, concat)
  # The same Python code not converted, and a plain tf.data iterator (on which AutoGraph
  # refuses a `return` in the loop).
  python = run([take_two_break, take_two_return], data, concat)
  plain = run([converted(take_two_break)] * 2, dataset(), lambda batch: batch)
  assert got == python == plain == ([2, 2], [8, 9]), (got, python, plain)


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("towers", [None, 2, 4])
def test_element_spec_is_a_signature_every_batch_fits_as_with_tf_distribute(towers,
                                                                            drop_remainder):
  """A distribute_dataset and its iterator had no `element_spec` (AttributeError), which
  tf.distribute's have: the way to give a step a `tf.function` input_signature, so that
  a partial last batch does not trace it again."""
  x = np.arange(26 * 3, dtype=np.float32).reshape(26, 3)  # Batches of 10, 10 and 6.

  def dataset():
    return tf.data.Dataset.from_tensor_slices(
        ({"x": x, "name": [f"e{i}" for i in range(26)]}, np.arange(26, dtype=np.int64))
    ).batch(10, drop_remainder=drop_remainder)

  def run(strategy, data, spec):
    @tf.function(input_signature=[spec])
    def step(batch):
      features, label = batch
      sums = strategy.call_for_each_tower(
          lambda f, y: (tf.reduce_sum(f["x"]), tf.reduce_sum(y),
                        tf.strings.reduce_join(f["name"], separator=",")), features, label)
      return ([strategy.unwrap(strategy.reduce("sum", v))[0] for v in sums[:2]],
              tf.strings.reduce_join(tf.stack(strategy.unwrap(sums[2])), separator=","))

    with strategy.scope():
      results = [step(batch) for batch in data]
    return ([[float(v) for v in sums] + [names.numpy().decode()] for sums, names in results],
            step.experimental_get_tracing_count())

  s = ds.DefaultStrategy() if towers is None else ds.MirroredStrategy(CPUS[:towers])
  with s.scope():
    data = s.distribute_dataset(dataset)
  spec = data.element_spec
  tf.nest.assert_same_structure(iter(data).element_spec, spec)  # The iterator's: the same.
  assert tf.nest.flatten(iter(data).element_spec) == tf.nest.flatten(spec)
  for batch in data:  # Every batch fits the spec, leaf by leaf.
    for leaf_spec, leaf in zip(tf.nest.flatten(spec), tf.nest.flatten(batch), strict=True):
      assert leaf_spec.is_compatible_with(leaf), (leaf_spec, leaf)
  got = run(s, data, spec)
  expected = run(ds.DefaultStrategy(), dataset(), dataset().element_spec)  # One device.
  assert got == expected and expected[1] == 1, (got, expected)
  assert len(got[0]) == 2 if drop_remainder else 3


def test_element_spec_of_a_share_of_each_batch_and_of_a_ragged_dataset():
  # One process's share of every batch (as each worker of several takes its towers'):
  # the parts, and the global batch size as a scalar.
  data = ds.PerDeviceDataset(tf.data.Dataset.range(20).batch(10), CPUS[:2], first_tower=2,
                             num_towers=4)

  @tf.function(input_signature=[data.element_spec])
  def parts(batch):
    return tf.concat(batch.values, 0), batch.global_size

  got = [(p.numpy().tolist(), int(size)) for p, size in (parts(b) for b in data)]
  assert got == [([6, 7, 8, 9], 10), ([16, 17, 18, 19], 10)]
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    ragged = s.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3]])).batch(2))
  with pytest.raises(TypeError, match="splits dense tensors .* got a RaggedTensor"):
    _ = ragged.element_spec


@pytest.mark.parametrize("mode", ["eager", "function", "signature"])
@pytest.mark.parametrize("towers", [None, 2, 4])
def test_a_none_component_goes_to_every_tower_as_with_tf_distribute(towers, mode):
  """A dataset of `(x, y, None)` (no sample weights, as Keras writes it) raised TypeError
  ("splits dense tensors ...; got a NoneType. Convert it to a dense tensor"), for a
  component there is nothing to split; tf.distribute passes it through. Each tower now
  gets None there, eagerly, in a tf.function and with the element_spec as signature."""
  x = np.arange(22 * 2, dtype=np.float32).reshape(22, 2)  # Batches of 8, 8 and 6.

  def dataset():
    return tf.data.Dataset.from_tensor_slices((x, np.arange(22, dtype=np.int64))).batch(8).map(
        lambda features, labels: (features, labels, None))

  def run(strategy, data, spec):
    def tower(features, labels, weights):
      assert weights is None
      return tf.reduce_sum(features) + tf.cast(tf.reduce_sum(labels), tf.float32)

    def step(batch):
      sums = strategy.call_for_each_tower(tower, *batch)
      return strategy.unwrap(strategy.reduce("sum", sums))[0]

    if mode != "eager":
      step = tf.function(step, input_signature=[spec] if mode == "signature" else None)
    with strategy.scope():
      return [float(step(batch)) for batch in data]

  s = ds.DefaultStrategy() if towers is None else ds.MirroredStrategy(CPUS[:towers])
  with s.scope():
    data = s.distribute_dataset(dataset)
  got = run(s, data, data.element_spec if mode == "signature" else None)
  expected = run(ds.DefaultStrategy(), dataset(), dataset().element_spec)
  assert got == expected and len(expected) == 3, (got, expected)
  assert tf.nest.flatten(data.element_spec)[-1] == dataset().element_spec[2]


@pytest.mark.parametrize("share, message", [
    (dict(first_tower=1), r"num_towers=2 parts .* first_tower=1 on, one each: parts 1 to 2"),
    (dict(first_tower=3, num_towers=4), r"num_towers=4 parts .* parts 3 to 4 do not all"),
    (dict(num_towers=1), r"num_towers=1 parts .* first_tower=0 on, one each: parts 0 to 1"),
    (dict(first_tower=-1, num_towers=4), r"first_tower must be an integer >= 0"),
])
def test_a_share_of_each_batch_that_does_not_fit_the_devices_is_refused(share, message):
  """`PerDeviceDataset(dataset, devices, first_tower=..., num_towers=...)` given a share
  with parts past the last gave wrong batches silently (`first_tower=1` of 2 devices:
  batches of one part, the second, on the first device) or failed later with an unrelated
  error; it is refused at construction, saying what fits."""
  dataset = tf.data.Dataset.range(8).batch(4)
  with pytest.raises(ValueError, match=message):
    ds.PerDeviceDataset(dataset, CPUS[:2], **share)
  # What fits: the last two of four parts, and the default (every part).
  for share, expected in ((dict(first_tower=2, num_towers=4), [[2], [3]]),
                          (dict(), [[0, 1], [2, 3]])):
    batch = next(iter(ds.PerDeviceDataset(dataset, CPUS[:2], **share)))
    assert [part.numpy().tolist() for part in batch.values] == expected
    assert batch.devices == tuple(CPUS[:2])


def test_per_device_dataset_of_something_else_names_itself():
  """`PerDeviceDataset` given something other than a dataset, directly, said that
  `distribute_dataset()` needs `dataset_fn` to return one: a call the caller never made.
  It names itself, and still says what `dataset_fn` must return for that path."""
  with pytest.raises(TypeError, match=r"^PerDeviceDataset takes a tf.data.Dataset of global "
                                      r"batches .* Received: list"):
    ds.PerDeviceDataset([1, 2], CPUS[:2])
  s = ds.MirroredStrategy(CPUS[:2])
  with pytest.raises(TypeError, match="needs dataset_fn to return a tf.data.Dataset"):
    s.distribute_dataset(lambda: [1, 2])
