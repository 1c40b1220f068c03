"""Cross-tower reduction (docs/cross_tower_ops.md): every algorithm against numpy, the oracle."""

import functools
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from diststrat import _devices
from diststrat import cross_tower_ops
from diststrat.cross_tower_ops import (AllReduceCrossTowerOps, CrossTowerOps,
                                       ReductionToOneDevice, choose_cross_tower_ops)
from diststrat.cross_tower_ops import _collective
from diststrat.values import Mirrored, PerDevice
from conftest import CPUS

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "cross_tower_ops.md"

# (name, factory, device counts): the configurations every numeric test runs.
CONFIGS = [
    ("one_device", ReductionToOneDevice, (2, 3, 4)),
    ("one_device_on_cpu3", lambda: ReductionToOneDevice(reduce_to_device="/cpu:3"), (2,)),
    ("naive", lambda: AllReduceCrossTowerOps("naive"), (2, 3, 4)),
    ("naive_packed", lambda: AllReduceCrossTowerOps("naive", num_packs=3), (2, 3, 4)),
    ("hierarchical_copy", lambda: AllReduceCrossTowerOps("hierarchical_copy"), (2, 3, 4)),
    ("hierarchical_copy_packed",
     lambda: AllReduceCrossTowerOps("hierarchical_copy", num_packs=3), (2, 4)),
    ("collective", lambda: AllReduceCrossTowerOps("collective"), (2, 3, 4)),
    ("collective_packed", lambda: AllReduceCrossTowerOps("collective", num_packs=3), (2, 4)),
]
CASES = [pytest.param(factory, n, id=f"{name}-{n}dev")
         for name, factory, counts in CONFIGS for n in counts]
MODES = ["eager", "function"]
SHAPES = [(), (7,), (3, 4), (0, 2)]
DTYPES = [np.float32, np.float64, np.int32]


def _values(shape, dtype, n, seed):
  rng = np.random.default_rng(seed)
  if np.issubdtype(dtype, np.integer):
    return [rng.integers(-50, 50, size=shape).astype(dtype) for _ in range(n)]
  return [rng.normal(size=shape).astype(dtype) for _ in range(n)]


def _expected(arrays, aggregation):
  total = np.sum(arrays, axis=0, dtype=arrays[0].dtype)
  if aggregation == "sum":
    return total
  if np.issubdtype(arrays[0].dtype, np.integer):
    return total // arrays[0].dtype.type(len(arrays))
  return (total / len(arrays)).astype(arrays[0].dtype)


def _per_device(arrays, devices):
  index = {}
  for array, device in zip(arrays, devices, strict=True):
    with tf.device(device):
      index[device] = tf.constant(array)
  return PerDevice(index)


def _run(mode, fn, *tensors):
  """fn(*tensors) eagerly, or traced in a tf.function with the tensors as arguments."""
  if mode == "eager":
    return fn(*tensors)
  return tf.function(fn, autograph=False)(*tensors)


def _check_mirrored(result, devices, expected, mode):
  assert isinstance(result, Mirrored)
  assert result.devices == tuple(devices)
  for device, component in zip(devices, result.values, strict=True):
    np.testing.assert_allclose(component.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert component.dtype.as_numpy_dtype == expected.dtype
    if mode == "eager":
      assert component.device == device
      assert component.backing_device == device


def _reduce_in_mode(ops, mode, aggregation, pairs):
  """ops.batch_reduce(aggregation, pairs), eagerly or inside a tf.function.

  In a function, each component's device is checked while tracing, and the results come
  back as Mirrored values over the devices the traced results named.
  """
  if mode == "eager":
    return ops.batch_reduce(aggregation, pairs)
  devices = [value.devices for value, _ in pairs]
  flat = [t for value, _ in pairs for t in value.values]
  traced = {}

  def fn(*tensors):
    rebuilt, position = [], 0
    for (_, destinations), value_devices in zip(pairs, devices, strict=True):
      count = len(value_devices)
      components = tensors[position:position + count]
      rebuilt.append((PerDevice(dict(zip(value_devices, components, strict=True))),
                      destinations))
      position += count
    results = ops.batch_reduce(aggregation, rebuilt)
    for result in results:
      for device, component in zip(result.devices, result.values, strict=True):
        placed = component.values.device if isinstance(component, tf.IndexedSlices) \
            else component.device
        assert not placed or _devices.canonicalize(placed) == device
    traced["devices"] = [r.devices for r in results]
    return [list(r.values) for r in results]

  outputs = tf.function(fn, autograph=False)(*flat)
  return [Mirrored(dict(zip(d, components, strict=True)))
          for d, components in zip(traced["devices"], outputs, strict=True)]


# --- numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
@pytest.mark.parametrize("factory,n", CASES)
def test_batch_reduce_matches_numpy(factory, n, aggregation, mode):
  ops = factory()
  devices = CPUS[:n]
  arrays = [_values(shape, dtype, n, seed=i)
            for i, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in DTYPES)]
  pairs = [(_per_device(a, devices), None) for a in arrays]
  results = _reduce_in_mode(ops, mode, aggregation, pairs)
  assert len(results) == len(arrays)
  for result, a in zip(results, arrays, strict=True):
    _check_mirrored(result, devices, _expected(a, aggregation), mode)


# Dtypes TensorFlow's collective kernels do not take: the collectives carry them in
# another dtype; every other algorithm adds them as they are.
OTHER_DTYPES = [np.complex64, np.complex128, np.int8, np.uint8, np.int16, np.uint16,
                np.uint32, np.uint64, np.float16]


def _other_values(dtype, n, seed):
  rng = np.random.default_rng(seed)
  if np.issubdtype(dtype, np.complexfloating):
    return [(rng.normal(size=(2, 3)) + 1j * rng.normal(size=(2, 3))).astype(dtype)
            for _ in range(n)]
  low = 0 if np.issubdtype(dtype, np.unsignedinteger) else -20
  return [rng.integers(low, 20, size=(2, 3)).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
@pytest.mark.parametrize("factory,n", [pytest.param(factory, min(counts), id=name)
                                       for name, factory, counts in CONFIGS])
def test_every_algorithm_reduces_complex_and_small_integer_dtypes(factory, n, aggregation,
                                                                  mode):
  """The collective kernels take only floats and 32/64-bit integers (complex64 raised
  TensorFlow's TypeError); every algorithm reduces the others too, as numpy adds them."""
  devices = CPUS[:n]
  arrays = [_other_values(dtype, n, seed=i) for i, dtype in enumerate(OTHER_DTYPES)]
  results = _reduce_in_mode(factory(), mode, aggregation,
                            [(_per_device(a, devices), None) for a in arrays])
  for a, result in zip(arrays, results, strict=True):
    _check_mirrored(result, devices, _expected(a, aggregation), mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factory,n", [c for c in CASES if c.id.endswith("4dev")])
def test_reduce_one_value(factory, n, mode):
  ops = factory()
  a = _values((5, 3), np.float32, n, seed=7)
  value = _per_device(a, CPUS[:n])
  if mode == "eager":
    result = ops.reduce(tf.VariableAggregation.MEAN, value)
  else:
    components = tf.function(lambda *t: list(ops.reduce(
        tf.VariableAggregation.MEAN,
        PerDevice(dict(zip(CPUS[:n], t, strict=True)))).values))(*value.values)
    result = Mirrored(dict(zip(CPUS[:n], components, strict=True)))
  _check_mirrored(result, CPUS[:n], _expected(a, "mean"), mode)


def test_repeated_calls_reuse_the_traced_function():
  ops = AllReduceCrossTowerOps("naive")
  value = _per_device(_values((4,), np.float32, 4, seed=1), CPUS)
  for _ in range(3):
    ops.reduce("sum", value)
  other = _per_device(_values((6,), np.float32, 4, seed=2), CPUS)
  ops.reduce("sum", other)
  assert ops._launcher.num_cached == 2  # pylint: disable=protected-access


def test_unknown_shapes_inside_function_go_tensor_by_tensor():
  ops = AllReduceCrossTowerOps("naive", num_packs=2)
  arrays = _values((3, 2), np.float32, 2, seed=3)

  @tf.function(input_signature=[tf.TensorSpec([None, 2])] * 2)
  def fn(x, y):
    result = ops.reduce("sum", PerDevice({CPUS[0]: x, CPUS[1]: y}))
    return list(result.values)

  graph = fn.get_concrete_function().graph
  assert not [op for op in graph.get_operations() if op.type == "ConcatV2"]
  for component in fn(*arrays):
    np.testing.assert_allclose(component.numpy(), arrays[0] + arrays[1], rtol=1e-6)


def test_packing_concatenates_into_num_packs_chunks():
  ops = AllReduceCrossTowerOps("naive", num_packs=2)
  arrays = [_values(s, np.float32, 2, seed=i) for i, s in enumerate([(3,), (2, 2), (5,)])]

  def fn(*tensors):
    pairs = [(PerDevice({CPUS[0]: tensors[2 * i], CPUS[1]: tensors[2 * i + 1]}), None)
             for i in range(3)]
    return [list(r.values) for r in ops.batch_reduce("sum", pairs)]

  flat = [tf.constant(x) for a in arrays for x in a]
  graph = tf.function(fn).get_concrete_function(*flat).graph
  add_ns = [op for op in graph.get_operations() if op.type == "AddN"]
  assert sorted(op.outputs[0].shape.as_list() for op in add_ns) == [[6], [6]]
  for component, a in zip(tf.function(fn)(*flat), arrays, strict=True):
    for c in component:
      np.testing.assert_allclose(c.numpy(), a[0] + a[1], rtol=1e-6)


def test_naive_spreads_tensors_round_robin():
  ops = AllReduceCrossTowerOps("naive")

  def fn(*tensors):
    pairs = [(PerDevice(dict(zip(CPUS, tensors[4 * i:4 * i + 4], strict=True))), None)
             for i in range(6)]
    return [list(r.values) for r in ops.batch_reduce("sum", pairs)]

  flat = [tf.ones([2]) for _ in range(24)]
  graph = tf.function(fn).get_concrete_function(*flat).graph
  homes = [op.device for op in graph.get_operations() if op.type == "AddN"]
  assert [tf.DeviceSpec.from_string(d).device_index for d in homes] == [0, 1, 2, 3, 0, 1]


def test_hierarchical_copy_adds_in_two_groups():
  ops = AllReduceCrossTowerOps("hierarchical_copy")
  fn = tf.function(lambda *t: list(
      ops.reduce("sum", PerDevice(dict(zip(CPUS[:3], t, strict=True)))).values))
  graph = fn.get_concrete_function(*[tf.ones([2])] * 3).graph
  add_ns = [op for op in graph.get_operations() if op.type == "AddN"]
  assert [len(op.inputs) for op in add_ns] == [2]  # ceil(3/2) values; the lone one is its own sum
  assert len([op for op in graph.get_operations() if op.type in ("AddV2", "Add")]) == 1


def test_mirrored_and_plain_values_and_python_numbers():
  ops = AllReduceCrossTowerOps("naive")
  mirrored = Mirrored({CPUS[0]: tf.constant(2.0), CPUS[1]: tf.constant(2.0)})
  assert [float(v) for v in ops.reduce("sum", mirrored).values] == [4.0, 4.0]
  with tf.device(CPUS[2]):
    plain = tf.constant([1.0, 2.0])
  result = ops.reduce("mean", plain)
  assert result.devices == (CPUS[2],)
  np.testing.assert_array_equal(result.values[0].numpy(), [1.0, 2.0])
  result = ops.reduce("sum", plain, destinations=CPUS[:2])
  assert [v.device for v in result.values] == CPUS[:2]
  assert float(ReductionToOneDevice().reduce("sum", 3.0, "/cpu:1").values[0]) == 3.0


def test_gradients_flow_through_eager_reduce():
  xs = [tf.constant([1.0, 2.0]) for _ in CPUS]
  with tf.GradientTape() as tape:
    for x in xs:
      tape.watch(x)
    result = AllReduceCrossTowerOps("naive").reduce(
        "mean", PerDevice(dict(zip(CPUS, xs, strict=True))))
    y = tf.reduce_sum(result.values[1] * tf.constant([1.0, 3.0]))
  for grad in tape.gradient(y, xs):
    np.testing.assert_allclose(grad.numpy(), [0.25, 0.75])


# --- IndexedSlices --------------------------------------------------------------------


def _slices(n, seed):
  rng = np.random.default_rng(seed)
  parts = []
  for i in range(n):
    rows = i + 1
    parts.append((rng.normal(size=(rows, 3)).astype(np.float32),
                  rng.integers(0, 6, size=rows).astype(np.int64)))
  return parts


def _dense(values, indices, rows=6):
  dense = np.zeros((rows, values.shape[1]), values.dtype)
  np.add.at(dense, indices, values)
  return dense


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
@pytest.mark.parametrize("factory,n", [c for c in CASES if c.id.endswith("4dev")
                                       or c.id.endswith("3dev")])
def test_indexed_slices_are_concatenated_not_densified(factory, n, aggregation, mode):
  ops = factory()
  devices = CPUS[:n]
  parts = _slices(n, seed=n)
  index = {}
  for (values, indices), device in zip(parts, devices, strict=True):
    with tf.device(device):
      index[device] = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                       tf.constant([6, 3], tf.int64))
  value = PerDevice(index)
  if mode == "eager":
    result = ops.batch_reduce(aggregation, [(value, None)])[0]
    components = result.values
  else:
    def fn(*flat):
      rebuilt = PerDevice({d: tf.IndexedSlices(flat[2 * i], flat[2 * i + 1],
                                               tf.constant([6, 3], tf.int64))
                           for i, d in enumerate(devices)})
      return list(ops.reduce(aggregation, rebuilt).values)
    flat = [t for s in value.values for t in (s.values, s.indices)]
    components = tf.function(fn, autograph=False)(*flat)
  all_values = np.concatenate([v for v, _ in parts])
  all_indices = np.concatenate([i for _, i in parts])
  scale = n if aggregation == "mean" else 1
  assert len(components) == n
  for device, component in zip(devices, components, strict=True):
    assert isinstance(component, tf.IndexedSlices)
    np.testing.assert_allclose(component.values.numpy(), all_values / scale, rtol=1e-6)
    np.testing.assert_array_equal(component.indices.numpy(), all_indices)
    np.testing.assert_array_equal(component.dense_shape.numpy(), [6, 3])
    np.testing.assert_allclose(tf.convert_to_tensor(component).numpy(),
                               _dense(all_values, all_indices) / scale, rtol=1e-5, atol=1e-6)
    if mode == "eager":
      assert component.values.device == device and component.indices.device == device


def test_indexed_slices_mixed_with_dense_tensor():
  ops = AllReduceCrossTowerOps("collective")
  values = np.arange(6, dtype=np.float32).reshape(2, 3)
  dense = np.ones((4, 3), np.float32)
  with tf.device(CPUS[1]):
    dense_t = tf.constant(dense)
  value = PerDevice({CPUS[0]: tf.IndexedSlices(tf.constant(values), tf.constant([3, 0]),
                                               tf.constant([4, 3])),
                     CPUS[1]: dense_t})
  result = ops.reduce("sum", value)
  component = result.values[1]
  assert isinstance(component, tf.IndexedSlices)
  np.testing.assert_array_equal(component.indices.numpy(), [3, 0, 0, 1, 2, 3])
  expected = dense.copy()
  expected[3] += values[0]
  expected[0] += values[1]
  np.testing.assert_allclose(tf.convert_to_tensor(component).numpy(), expected)


@pytest.mark.parametrize("mode", MODES)
def test_integer_indexed_slices_mean_floors_each_rows_total(mode):
  """The mean of integer slices is the floor of each row's total over the towers, as for
  the dense tensors they stand for. Each slice was floor-divided alone: row 2's slices
  [-7, 2], [-1, 4] and [1, 1] on 3 towers gave [-4, 1], where the floor of their total
  [-7, 7] over 3 is [-3, 2]."""
  parts = [(np.array([[1, 3], [3, 5], [-7, 2]], np.int32), np.array([0, 0, 2])),
           (np.array([[-1, 4]], np.int32), np.array([2])),
           (np.array([[6, 6], [1, 1]], np.int32), np.array([3, 2]))]
  devices = CPUS[:3]
  index = {}
  for (values, indices), device in zip(parts, devices, strict=True):
    with tf.device(device):
      index[device] = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                       tf.constant([5, 2], tf.int64))
  total = sum(_dense(values, indices, rows=5) for values, indices in parts)
  one_worker = cross_tower_ops.CrossWorkerAllReduce().bind(devices, devices, 0, 1)
  for ops in (ReductionToOneDevice(), AllReduceCrossTowerOps("naive"), one_worker):
    result = _run(mode, functools.partial(ops.reduce, "mean", PerDevice(index)))
    for component in result.values:
      assert isinstance(component, tf.IndexedSlices)
      np.testing.assert_array_equal(tf.convert_to_tensor(component).numpy(), total // 3)
    summed = _run(mode, functools.partial(ops.reduce, "sum", PerDevice(index)))
    np.testing.assert_array_equal(tf.convert_to_tensor(summed.values[0]).numpy(), total)


@pytest.mark.parametrize("mode", MODES)
def test_indexed_slices_of_different_dense_shapes_raise_value_error(mode):
  """Slices of a [3, 2] and of a [5, 2] tensor (or a dense [4, 2] one) are components of
  different shapes: they were concatenated under the first's dense_shape, rows out of its
  range, and failed only when densified (InvalidArgumentError from UnsortedSegmentSum)."""
  def slices(rows, dense_shape, device):
    with tf.device(device):
      return tf.IndexedSlices(tf.ones([len(rows), dense_shape[1]]), tf.constant(rows),
                              tf.constant(dense_shape, tf.int64))

  ops = AllReduceCrossTowerOps("naive")
  cases = [{CPUS[0]: slices([0], [3, 2], CPUS[0]), CPUS[1]: slices([4], [5, 2], CPUS[1])},
           {CPUS[0]: slices([0], [3, 2], CPUS[0]), CPUS[1]: tf.ones([4, 2])},
           {CPUS[0]: slices([0], [3, 2], CPUS[0]), CPUS[1]: slices([1], [3, 3], CPUS[1])}]
  for index in cases:
    with pytest.raises(ValueError, match=r"^batch_reduce\(\) needs components of one shape "
                       r"\(an IndexedSlices' is its dense_shape\). Received: .*CPU:0: "
                       r"IndexedSlices of \(3, 2\), .*CPU:1: (IndexedSlices of )?\((5|4|3), "
                       r"(2|3)\)\.$"):
      _run(mode, functools.partial(ops.batch_reduce, "sum", [(PerDevice(index), None)]))
  same = {CPUS[0]: slices([0], [3, 2], CPUS[0]), CPUS[1]: slices([2, 2], [3, 2], CPUS[1])}
  result = _run(mode, lambda: ops.reduce("sum", PerDevice(same)).values[1])
  np.testing.assert_allclose(tf.convert_to_tensor(result).numpy(), [[1, 1], [0, 0], [2, 2]])


def test_broadcast_indexed_slices():
  s = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 4]), tf.constant([5, 3]))
  result = AllReduceCrossTowerOps("naive").broadcast(s, CPUS[1:3])
  for device, component in zip(CPUS[1:3], result.values, strict=True):
    assert isinstance(component, tf.IndexedSlices)
    assert component.values.device == device
    np.testing.assert_array_equal(component.indices.numpy(), [0, 4])


# --- destinations and the fallback ----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algorithm", ["collective", "naive", "hierarchical_copy", "nccl"])
def test_destinations_other_than_the_values_devices_reduce_on_one_device(algorithm, mode):
  ops = AllReduceCrossTowerOps(algorithm)  # nccl too: it never runs, so no GPU is needed
  a = _values((3,), np.float32, 2, seed=4)
  value = _per_device(a, CPUS[:2])
  with tf.device(CPUS[3]):
    var = tf.Variable(tf.zeros([3]))
  cases = [("/cpu:2", (CPUS[2],)), (["/device:CPU:3", "/cpu:0"], (CPUS[3], CPUS[0])),
           (var, (CPUS[3],)), (CPUS[1:4], tuple(CPUS[1:4]))]
  pairs = [(value, destinations) for destinations, _ in cases]
  results = _reduce_in_mode(ops, mode, "sum", pairs)
  for result, (_, devices) in zip(results, cases, strict=True):
    _check_mirrored(result, devices, a[0] + a[1], mode)

  def fn(x, y):
    return list(ops.reduce("sum", PerDevice({CPUS[0]: x, CPUS[1]: y}), "/cpu:2").values)

  graph = tf.function(fn).get_concrete_function(*value.values).graph
  assert "CollectiveReduce" not in {op.type for op in graph.get_operations()}


def test_matching_destinations_use_the_all_reduce():
  ops = AllReduceCrossTowerOps("collective")
  value = _per_device(_values((3,), np.float32, 2, seed=5), CPUS[:2])
  for destinations in (None, value, ["/cpu:1", "/cpu:0"]):
    fn = tf.function(lambda x, y, d=destinations: list(
        ops.reduce("sum", PerDevice({CPUS[0]: x, CPUS[1]: y}), d).values))
    graph = fn.get_concrete_function(*value.values).graph
    assert [op.type for op in graph.get_operations()].count("CollectiveReduce") == 2
  result = ops.reduce("sum", value, ["/cpu:1", "/cpu:0"])
  assert result.devices == (CPUS[1], CPUS[0])
  assert [v.device for v in result.values] == [CPUS[1], CPUS[0]]


def test_destinations_as_wrapped_value_and_mirrored_variable_like():
  ops = ReductionToOneDevice()
  value = _per_device(_values((2,), np.float32, 2, seed=6), CPUS[:2])
  target = Mirrored({CPUS[2]: 0, CPUS[3]: 0})
  assert ops.reduce("sum", value, target).devices == (CPUS[2], CPUS[3])

  class FakeMirroredVariable:  # What a distributed variable looks like to cross_tower_ops.
    devices = (CPUS[3], CPUS[1])

    def get(self, device):
      del device

  assert ops.reduce("sum", value, FakeMirroredVariable()).devices == (CPUS[3], CPUS[1])


def test_reduce_to_device_is_where_the_sum_happens():
  ops = ReductionToOneDevice(reduce_to_device="/cpu:3")
  fn = tf.function(lambda x, y: list(
      ops.reduce("sum", PerDevice({CPUS[0]: x, CPUS[1]: y})).values))
  graph = fn.get_concrete_function(tf.ones([2]), tf.ones([2])).graph
  homes = [op.device for op in graph.get_operations() if op.type == "AddN"]
  assert [tf.DeviceSpec.from_string(d).device_index for d in homes] == [3]
  assert ops.reduce_to_device == CPUS[3]


def test_accumulation_fn_is_used():
  calls = []

  def add(values):
    calls.append(len(values))
    return tf.math.add_n(values)

  ops = ReductionToOneDevice(accumulation_fn=add)
  value = _per_device([np.ones(2, np.float32)] * 3, CPUS[:3])
  np.testing.assert_array_equal(ops.reduce("sum", value).values[0].numpy(), [3.0, 3.0])
  assert calls == [3]


# --- broadcast ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factory", [ReductionToOneDevice,
                                     lambda: AllReduceCrossTowerOps("collective")])
def test_broadcast(factory, mode):
  ops = factory()
  with tf.device(CPUS[0]):
    x = tf.constant([[1, 2], [3, 4]], tf.int32)
  components = _run(mode, lambda t: list(ops.broadcast(t, CPUS[1:]).values), x)
  assert len(components) == 3
  for device, component in zip(CPUS[1:], components, strict=True):
    np.testing.assert_array_equal(component.numpy(), [[1, 2], [3, 4]])
    if mode == "eager":
      assert component.device == device


def test_broadcast_variable_and_single_device():
  with tf.device(CPUS[2]):
    var = tf.Variable([1.0, 2.0])
  result = ReductionToOneDevice().broadcast(var, var)
  assert result.devices == (CPUS[2],)
  np.testing.assert_array_equal(result.values[0].numpy(), [1.0, 2.0])
  result = ReductionToOneDevice().broadcast(3, "/cpu:1")
  assert int(result.values[0]) == 3 and result.values[0].device == CPUS[1]


# --- choosing -------------------------------------------------------------------------


def test_choose_cross_tower_ops():
  assert choose_cross_tower_ops(["/gpu:0", "/gpu:1"]).algorithm == "nccl"
  assert choose_cross_tower_ops(["/job:worker/task:0/device:GPU:0",
                                 "/job:worker/task:0/device:GPU:3"]).algorithm == "nccl"
  assert choose_cross_tower_ops(CPUS).algorithm == "naive"
  assert choose_cross_tower_ops(["/gpu:0"]).algorithm == "naive"
  assert choose_cross_tower_ops(["/gpu:0", "/cpu:0"]).algorithm == "naive"
  assert isinstance(choose_cross_tower_ops("/cpu:0"), AllReduceCrossTowerOps)


def test_public_names():
  assert set(cross_tower_ops.__all__) == {
      "CrossTowerOps", "ReductionToOneDevice", "AllReduceCrossTowerOps",
      "choose_cross_tower_ops", "MeasuredCrossTowerOps", "CrossWorkerAllReduce"}
  assert issubclass(AllReduceCrossTowerOps, CrossTowerOps)
  assert issubclass(ReductionToOneDevice, CrossTowerOps)
  ops = AllReduceCrossTowerOps("naive", num_packs=2, timeout=5)
  assert (ops.algorithm, ops.num_packs, ops.timeout) == ("naive", 2, 5.0)
  assert repr(ops) == "AllReduceCrossTowerOps(algorithm='naive', num_packs=2)"
  assert AllReduceCrossTowerOps().timeout is None  # Members launch together.
  assert AllReduceCrossTowerOps(timeout=None).timeout is None


# --- errors ---------------------------------------------------------------------------


def test_bad_algorithm_names_the_allowed_ones():
  with pytest.raises(ValueError, match=r"algorithm must be one of 'collective', 'nccl', "
                     r"'hierarchical_copy', 'naive'. Received: algorithm='ring'"):
    AllReduceCrossTowerOps("ring")


@pytest.mark.parametrize("num_packs", [0, -1, 1.5, True, "2"])
def test_bad_num_packs(num_packs):
  with pytest.raises(ValueError, match=r"num_packs must be an integer >= 1 \(1: no packing\)"
                     rf". Received: num_packs={re.escape(repr(num_packs))}"):
    AllReduceCrossTowerOps("naive", num_packs=num_packs)


@pytest.mark.parametrize("timeout", [0, -5, "60"])
def test_bad_timeout(timeout):
  with pytest.raises(ValueError, match="timeout must be a positive number of seconds, or None"):
    AllReduceCrossTowerOps(timeout=timeout)


def test_nccl_on_cpus_says_gpus_only():
  ops = AllReduceCrossTowerOps("nccl")
  value = _per_device(_values((2,), np.float32, 2, seed=8), CPUS[:2])
  with pytest.raises(ValueError, match=r"AllReduceCrossTowerOps\(algorithm='nccl'\) runs on "
                     r"GPUs only, but the values live on \['/job:localhost/replica:0/task:0/"
                     r"device:CPU:0', .*Use algorithm='collective' or 'naive'"):
    ops.reduce("sum", value)


def test_bad_aggregation():
  value = _per_device(_values((2,), np.float32, 2, seed=9), CPUS[:2])
  with pytest.raises(ValueError, match=r"aggregation must be one of .*'sum' or 'mean'. "
                     r"Received: aggregation='max'"):
    ReductionToOneDevice().reduce("max", value)
  with pytest.raises(ValueError, match=r"Received: aggregation=<VariableAggregation(V2)?.NONE"):
    AllReduceCrossTowerOps("naive").batch_reduce(tf.VariableAggregation.NONE, [(value, None)])


def test_bad_arguments():
  ops = ReductionToOneDevice()
  value = _per_device(_values((2,), np.float32, 2, seed=10), CPUS[:2])
  with pytest.raises(ValueError, match=r"batch_reduce\(\) takes value_destination_pairs, a "
                     r"list of \(value, destinations\) pairs such as \[\(per_tower, None\)\]. "
                     r"Received: value_destination_pairs=PerDevice.*\(PerDevice\). To reduce "
                     r"one value, call reduce\(aggregation, value, destinations\)."):
    ops.batch_reduce("sum", value)
  with pytest.raises(ValueError, match=r"Received: value_destination_pairs\[0\]=PerDevice"):
    ops.batch_reduce("sum", [value])
  with pytest.raises(ValueError, match=r"destinations must be None, a device string"):
    ops.reduce("sum", value, destinations=[])

  @tf.function
  def onto_a_tensor_without_a_device():
    ops.reduce("sum", value, destinations=tf.constant(1.0))

  with pytest.raises(ValueError, match=r"destinations is a tensor with no device \(in a "
                     r"tf.function, a tensor gets one only when it is made under "
                     r"tf.device\(...\)\)"):
    onto_a_tensor_without_a_device()
  with pytest.raises(ValueError, match=r"reduce\(\) needs a value. Received: None"):
    ops.reduce("sum", None)
  with pytest.raises(ValueError, match=r"broadcast\(\) needs destinations"):
    ops.broadcast(tf.constant(1.0), None)
  with pytest.raises(ValueError, match=r"broadcast\(\) takes one tensor, not a wrapped value"):
    ops.broadcast(value, CPUS[0])
  mixed = PerDevice({CPUS[0]: tf.constant(1.0), CPUS[1]: tf.constant(1, tf.int32)})
  with pytest.raises(ValueError, match=r"reduce\(\) needs components of one dtype. Received: "
                     r".*'float32'.*'int32'.*Cast them to one dtype first"):
    ops.reduce("sum", mixed)
  shapes = PerDevice({CPUS[0]: tf.ones([2]), CPUS[1]: tf.ones([3])})
  with pytest.raises(ValueError, match=r"needs components of one shape"):
    ops.reduce("sum", shapes)
  assert ops.batch_reduce("sum", []) == []


def test_subclass_mistakes():
  value = _per_device([np.ones(2, np.float32)] * 2, CPUS[:2])

  class Empty(CrossTowerOps):
    pass

  with pytest.raises(NotImplementedError, match=r"Empty must implement _reduce\(\)"):
    Empty().reduce("sum", value)

  class ReturnsTensor(CrossTowerOps):

    def _reduce(self, aggregation, per_device_value, destinations):
      return per_device_value.primary

  with pytest.raises(TypeError, match=r"ReturnsTensor._reduce\(\) must return a Mirrored. "
                     r"Received: "):
    ReturnsTensor().reduce("sum", value)
  with pytest.raises(ValueError, match=r"accumulation_fn must be a callable that adds a list "
                     r"of tensors, such as tf.math.add_n. Received: accumulation_fn='add'"):
    ReductionToOneDevice(accumulation_fn="add")


def test_runtime_error_names_the_ops_and_method():

  class Failing(CrossTowerOps):

    def _reduce(self, aggregation, per_device_value, destinations):
      with tf.device(destinations[0]):
        checked = tf.debugging.assert_equal(per_device_value.primary, -1.0,
                                            message="values must be -1")
      with tf.control_dependencies([checked]):
        return self._broadcast(tf.identity(per_device_value.primary), destinations)

  value = _per_device([np.ones(2, np.float32)] * 2, CPUS[:2])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"Failing\(\).reduce\(\) failed \(InvalidArgumentError\). "
                     r"TensorFlow's message: (?s:.*)values must be -1"):
    Failing().reduce("sum", value)


@pytest.mark.processes
def test_collectives_run_when_one_result_is_used_and_time_out_with_advice():
  # An aborted collective breaks every later one in its process: run them in their own.
  code = textwrap.dedent("""
      import os, sys
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
      import tensorflow as tf
      cpu, = tf.config.list_physical_devices("CPU")
      tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
      from diststrat.cross_tower_ops import _collective
      from diststrat.cross_tower_ops import AllReduceCrossTowerOps
      from diststrat.values import PerDevice

      # Only the first device's result is used: the other member must not be pruned.
      ops = AllReduceCrossTowerOps("collective", timeout=10)
      @tf.function
      def first_only(x):
        with tf.device("/cpu:1"):
          y = x * 2
        return ops.batch_reduce("sum", [(PerDevice({"/cpu:0": x, "/cpu:1": y}), None)])[0].values[0]
      print("FIRST", float(first_only(tf.constant(1.0))))

      real = _collective._reduce_op
      def one_member_missing(t, group_size, *args, **kwargs):
        return real(t, group_size + 1, *args, **kwargs)
      _collective._reduce_op = one_member_missing
      ops = AllReduceCrossTowerOps("collective", timeout=0.5)
      try:
        ops.reduce("sum", PerDevice({"/cpu:1": tf.constant(1.0), "/cpu:2": tf.constant(2.0)}))
      except tf.errors.OpError as e:
        print("ERROR", str(e).replace("\\n", " "))
      """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=pathlib.Path(__file__).resolve().parents[1]).stdout
  assert out.startswith("FIRST 3.0\nERROR AllReduceCrossTowerOps(algorithm='collective', "
                        "num_packs=1).reduce() failed (DeadlineExceededError).")
  assert "timeout=0.5 s" in out
  assert "restart the process" in out
  assert "AllReduceCrossTowerOps(algorithm='naive') or ReductionToOneDevice()" in out
  assert "timed out" in out



@pytest.mark.processes
def test_collective_reduces_empty_tensors_of_unknown_size_without_crashing():
  """TensorFlow's collective kernels (V1 and V2) crashed the process (SIGSEGV) on an empty
  tensor that a function got from outside, such as numpy's; with a static size of 0 the
  algorithm skips the collective, but inside a function traced for unknown sizes it
  cannot know. Run in its own process: before the fix it died."""
  code = textwrap.dedent("""
      import os
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
      import numpy as np
      import tensorflow as tf
      cpu, = tf.config.list_physical_devices("CPU")
      tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      from diststrat.cross_tower_ops import AllReduceCrossTowerOps
      from diststrat.values import PerDevice

      ops = AllReduceCrossTowerOps("collective")
      devices = ["/cpu:0", "/cpu:1"]

      @tf.function(input_signature=[[tf.TensorSpec([None, 3], tf.float32)] * 2,
                                    [tf.TensorSpec(None, tf.int32)] * 2])
      def reduce(x, y):
        pairs = [(PerDevice(dict(zip(devices, x))), None),
                 (PerDevice(dict(zip(devices, y))), None)]
        return [[c for c in r.values] for r in ops.batch_reduce("mean", pairs)]

      @tf.function(input_signature=[[tf.TensorSpec([None], tf.float32)] * 2])
      def in_a_loop(x):  # V2 collectives
        def body(i, total):
          r = ops.reduce("sum", PerDevice(dict(zip(devices, x))))
          return i + 1, total + tf.reduce_sum(r.values[0]) + tf.reduce_sum(r.values[1])
        return tf.while_loop(lambda i, _: i < 2, body, (0, 0.0))[1]

      for rows in (0, 2):
        x = [tf.constant(np.full((rows, 3), k + 1.0, np.float32)) for k in range(2)]
        y = [tf.constant(np.full((rows,), 2 * k + 1, np.int32)) for k in range(2)]
        (x0, x1), (y0, y1) = reduce(x, y)
        print(rows, x0.shape, x1.numpy().tolist(), y0.shape, y1.numpy().tolist())
      print("LOOP", float(in_a_loop([tf.constant(np.zeros(0, np.float32))] * 2)))
      """)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines() == [
      "0 (0, 3) [] (0,) []",
      "2 (2, 3) [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5]] (2,) [2, 2]",
      "LOOP 0.0"]

# --- collective keys ------------------------------------------------------------------


def test_collective_keys_are_deterministic_and_never_reused():
  first, second = _collective._Keys(), _collective._Keys()  # pylint: disable=protected-access
  requests = [("group", CPUS[:2]), ("instance",), ("group", CPUS), ("instance",),
              ("group", CPUS[1::-1]), ("instance",)]
  answers = []
  for keys in (first, second):
    answer = []
    for r in requests:
      answer.append(keys.group_key(r[1]) if r[0] == "group" else keys.instance_key(answer[-1]))
    answers.append(answer)
  assert answers[0] == answers[1]
  groups, instances = answers[0][0::2], answers[0][1::2]
  assert groups[0] == groups[2] != groups[1]  # a device set keeps its key, in any order
  assert len(set(instances)) == 3

  ops = AllReduceCrossTowerOps("collective")
  keys = []
  for shape in ([2], [3]):
    fn = tf.function(lambda x, y: list(
        ops.reduce("sum", PerDevice({CPUS[0]: x, CPUS[1]: y})).values))
    graph = fn.get_concrete_function(tf.ones(shape), tf.ones(shape)).graph
    keys.append({op.get_attr("instance_key") for op in graph.get_operations()
                 if op.type == "CollectiveReduce"})
  assert len(keys[0]) == len(keys[1]) == 1 and not keys[0] & keys[1]


def test_collective_keys_across_processes_do_not_count_local_collectives():
  """Keys of groups within one process came from the counters of the groups across
  processes: a worker that ran a local collective (its measured default timed one, the
  other worker's did not) built its next collective across workers with other keys."""
  other_task = "/job:worker/replica:0/task:1/device:CPU:0"

  def keys_of(fn, *args):
    graph = tf.function(fn).get_concrete_function(*args).graph
    return sorted({(op.get_attr("group_key"), op.get_attr("instance_key"))
                   for op in graph.get_operations() if op.type == "CollectiveReduce"})

  def across(x):  # This process's member of a group with another task's device.
    return _collective.all_reduce([x], CPUS[:1], mean=False, timeout=0,
                                  group=(CPUS[0], other_task))

  ops = AllReduceCrossTowerOps("collective")
  [(group, first)] = keys_of(across, tf.ones([2]))
  local = keys_of(lambda x, y: list(ops.reduce("sum", PerDevice({CPUS[0]: x, CPUS[1]: y}))
                                    .values), tf.ones([2]), tf.ones([2]))
  assert keys_of(across, tf.ones([3])) == [(group, first + 1)]  # Next, as if none between.
  assert len(local) == 1 and local[0][0] != group and local[0][1] != first + 1
  # The group leader resolves every group of a cluster, a local one too: two processes'
  # local groups get different keys, and neither takes a key of the groups across them.
  own = [[f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for i in (0, 1)] for t in (0, 1)]
  plain, busy = _collective._Keys(), _collective._Keys()  # pylint: disable=protected-access
  busy_local = busy.group_key(own[0])
  assert plain.group_key(own[1]) != busy_local
  assert plain.group_key(CPUS[:1] + [other_task]) == busy.group_key([other_task, CPUS[0]])
  assert busy.group_key(list(reversed(own[0]))) == busy_local


# --- docs -----------------------------------------------------------------------------


def _doc_blocks():
  return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)


def test_docs_first_example_runs():
  namespace = {}
  exec(_doc_blocks()[0], namespace)  # pylint: disable=exec-used
  np.testing.assert_array_equal([v.numpy() for v in namespace["total"].values],
                                [[2.0, 2.0], [2.0, 2.0]])


@pytest.mark.parametrize("mode", MODES)
def test_docs_custom_algorithm(mode):
  namespace = {}
  exec(next(b for b in _doc_blocks() if "class BFloat16Sum" in b), namespace)  # pylint: disable=exec-used
  ops = namespace["BFloat16Sum"]()
  assert isinstance(ops, CrossTowerOps)
  arrays = [_values((4, 3), np.float32, 4, seed=i) for i in range(3)]
  pairs = [(_per_device(a, CPUS), None) for a in arrays]
  results = _reduce_in_mode(ops, mode, "mean", pairs)
  for result, a in zip(results, arrays, strict=True):
    assert result.devices == tuple(CPUS)
    for component in result.values:
      np.testing.assert_allclose(component.numpy(), np.mean(a, axis=0), rtol=0.05, atol=0.05)


def test_collectives_are_v2_in_a_while_loop_and_v1_elsewhere():
  """V1 collectives fail intermittently across processes when rerun in a tf.while_loop
  body; V2 hold twice the threads: _collective picks by where the op is built."""
  @tf.function
  def inner(i):
    values = [tf.stack([tf.cast(i, tf.float32), float(k + 1)]) for k in range(2)]
    outputs = _collective.all_reduce(values, CPUS[:2], mean=False, timeout=30)
    return outputs[0] + outputs[1]

  @tf.function
  def loop():
    return tf.while_loop(lambda i, _: i < 3, lambda i, t: (i + 1, t + inner(i)),
                         (0, tf.zeros([2])))[1]

  @tf.function
  def once():
    # Every member's result returned: a member whose result is unused would be pruned.
    return _collective.all_reduce([tf.ones([2]), tf.ones([2])], CPUS[:2], mean=True,
                                  timeout=30)

  # Each run: [2i, 3] on both devices, added: [4i, 6]; over i = 0, 1, 2: [12, 18].
  np.testing.assert_allclose(loop().numpy(), [12.0, 18.0])
  for output in once():
    np.testing.assert_allclose(output.numpy(), [1.0, 1.0])

  def op_types(function):
    return {op.type for f in function._list_all_concrete_functions()  # pylint: disable=protected-access
            for op in f.graph.get_operations()}

  assert "CollectiveReduceV2" in op_types(inner) and "CollectiveReduce" not in op_types(inner)
  assert "CollectiveReduce" in op_types(once) and "CollectiveReduceV2" not in op_types(once)


def test_mirrored_strategy_measures_with_the_choosers_candidates():
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  for devices in (CPUS[:1], CPUS[:2], CPUS):
    ops = ds.MirroredStrategy(devices).cross_tower_ops
    assert isinstance(ops, cross_tower_ops.MeasuredCrossTowerOps)
    expected = choose_cross_tower_ops(devices)  # The instant heuristic's pick comes first.
    assert repr(ops.candidates[0]) == repr(expected)
