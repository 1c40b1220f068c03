"""Wrapped values, regroup and select_device (docs/concepts.md, "Wrapped values")."""

import collections
import functools
import re
import types
import typing

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.values import DistributedValues, Mirrored, PerDevice, regroup, select_device
from diststrat.values import _wrapped
from conftest import CPUS

Point = collections.namedtuple("Point", ["x", "y"])


def test_device_spellings_are_one_device():
  v = PerDevice({"/cpu:1": "a", "/device:CPU:2": "b"})
  assert v.devices == (CPUS[1], CPUS[2])
  for spelling in ("/cpu:1", "/device:CPU:1", CPUS[1], "/CPU:1"):
    assert spelling in v
    assert v.get(spelling) == "a"
  assert "/cpu:3" not in v
  assert len(v) == 2 and v.values == ("a", "b") and v.primary == "a"
  assert isinstance(v, DistributedValues)


def test_duplicate_device_raises():
  with pytest.raises(ValueError, match=r"got device '/device:CPU:1' twice"):
    PerDevice({"/cpu:1": 1, "/device:CPU:1": 2})
  with pytest.raises(ValueError, match="non-empty dict from device to value"):
    Mirrored({})


def test_index_annotation_says_what_is_taken():
  """A dict (as docs/concepts.md says; another mapping is refused), keyed by device
  strings or `tf.DeviceSpec`s: the annotation said `Mapping[str, Any]`."""
  for cls in (DistributedValues, ds.values.DistributedVariable):
    hint = typing.get_type_hints(cls.__init__)["index"]
    assert typing.get_origin(hint) is dict and typing.get_args(hint) == (typing.Any, typing.Any)
  with pytest.raises(ValueError, match="non-empty dict from device to value"):
    PerDevice(types.MappingProxyType({"/cpu:0": 1}))
  assert PerDevice({tf.DeviceSpec.from_string("/cpu:1"): 1}).devices == (CPUS[1],)


def test_get_uses_tower_update_then_device_scope():
  v = PerDevice({CPUS[0]: 0, CPUS[1]: 1})
  with tf.device("/cpu:1"):
    assert v.get() == 1
  with tf.device("/cpu:0"):
    assert v.get() == 0
  s = ds.DefaultStrategy()
  with tf.device("/cpu:1"):
    var = tf.Variable(0.0)
  assert s.update(var, lambda _: v.get()) == 1


def test_get_missing_device_names_devices():
  v = PerDevice({CPUS[0]: 0})
  with pytest.raises(ValueError, match=r"has no value on device '/cpu:3'; it has values on"):
    v.get("/cpu:3")
  with tf.device("/cpu:2"):
    with pytest.raises(ValueError, match="the current device"):
      v.get()
    # A mirrored value holds copies: any copy will do.
    assert Mirrored({CPUS[0]: 5, CPUS[1]: 5}).get() == 5


def test_repr_lists_devices_and_values():
  v = PerDevice({"/cpu:0": tf.constant(1.5), "/cpu:1": 2})
  text = repr(v)
  assert text.startswith("PerDevice({")
  assert CPUS[0] in text and CPUS[1] in text and "1.5" in text and ": 2" in text
  assert repr(Mirrored({"/cpu:0": 3})).startswith("Mirrored({")


def test_regroup_nested_structures():
  shared = object()
  towers = [
      {"a": [1, (2, None)], "p": Point(x=shared, y=10), "s": shared},
      {"a": [3, (4, None)], "p": Point(x=shared, y=20), "s": shared},
  ]
  r = regroup(towers, CPUS[:2])
  assert set(r) == {"a", "p", "s"}
  assert isinstance(r["a"], list) and isinstance(r["a"][1], tuple)
  assert r["a"][0].values == (1, 3) and r["a"][1][0].values == (2, 4)
  assert r["a"][1][1] is None
  assert isinstance(r["p"], Point) and r["p"].x is shared and r["p"].y.values == (10, 20)
  assert r["s"] is shared
  assert isinstance(r["a"][0], PerDevice) and r["a"][0].devices == tuple(CPUS[:2])
  # select_device inverts regroup.
  for i, device in enumerate(CPUS[:2]):
    assert select_device(device, r) == towers[i]


def test_regroup_single_tower_returns_structure_unchanged():
  t = tf.constant(1.0)
  assert regroup([(t, [2])], CPUS[:1]) == (t, [2])


def test_regroup_tensors_match_numpy():
  parts = [tf.constant(np.full((2,), i, np.float32)) for i in range(4)]
  r = regroup(parts, CPUS)
  np.testing.assert_array_equal(np.stack([x.numpy() for x in r.values]),
                                np.repeat(np.arange(4, dtype=np.float32)[:, None], 2, 1))


@pytest.mark.parametrize("towers,message", [
    ([(1, 2), (1, 2, 3)], r"tower 0 gave \(\*, \*\) and tower 1 gave \(\*, \*, \*\)"),
    ([[1], (1,)], r"tower 0 gave \[\*\] and tower 1 gave \(\*,\)"),
    ([{"a": 1}, {"b": 1}], r"tower 0 gave \{'a': \*\} and tower 1 gave \{'b': \*\}"),
    ([None, 1], r"tower 0 gave None and tower 1 gave \*"),
    ([Point(1, 2), (1, 2)], r"tower 0 gave Point\(x=\*, y=\*\) and tower 1 gave \(\*, \*\)"),
])
def test_regroup_structure_mismatch(towers, message):
  with pytest.raises(ValueError, match=message):
    regroup(towers, CPUS[:2])
  with pytest.raises(ds.errors.StructureMismatchError):
    regroup(towers, CPUS[:2])


def test_regroup_mismatch_names_the_differing_tower():
  with pytest.raises(ValueError, match="tower 2 gave"):
    regroup([[1], [2], [3, 4]], CPUS[:3])


def test_regroup_count_mismatch():
  with pytest.raises(ValueError, match="one structure per device: got 1 structures for 2"):
    regroup([1], CPUS[:2])


def test_select_device_leaves_plain_values():
  x = tf.constant(1.0)
  m = Mirrored({CPUS[0]: "m0", CPUS[1]: "m1"})
  assert select_device("/cpu:1", {"k": [x, m, None]}) == {"k": [x, "m1", None]}


def test_tf_nest_sees_components_of_wrapped_values_not_variables():
  m = Mirrored({CPUS[0]: tf.constant(1.0), CPUS[1]: tf.constant(1.0)})
  doubled = tf.nest.map_structure(lambda t: t * 2, {"m": m})
  assert isinstance(doubled["m"], Mirrored) and doubled["m"].devices == m.devices
  assert [float(x) for x in doubled["m"].values] == [2.0, 2.0]
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(1.0)
  flat = tf.nest.flatten([v])  # A distributed variable is one leaf, not its copies.
  assert len(flat) == 1 and flat[0] is v


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_wrapped_value_used_as_a_tensor_says_what_to_do(traced):
  """TensorFlow's own error was ValueError "Attempt to convert a value (...) with an
  unsupported type" in eager mode, and inside a tf.function TypeError "Expected any
  non-tensor type, but got a tensor instead" (tf.nest opens wrapped values)."""
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    per_tower = s.call_for_each_tower(
        lambda i: tf.constant(float(i + 1)), s.worker_device_index)
    total = s.reduce("sum", per_tower)
  cases = [(per_tower, r"A PerDevice \(one value per tower, on \[.*CPU:0', .*CPU:1'\]\) is "
            r"not a tensor. Reduce it first \(strategy.reduce\(aggregation, value\)\), or "
            r"take one tower's value: value.get\(device\)"),
           (total, r"A Mirrored \(copies of one value, on \[.*CPU:0', .*CPU:1'\]\) is not a "
            r"tensor. Take one copy: value.get\(device\), or value.get\(\) for the current "
            r"device's \(else the first\)")]
  for value, message in cases:
    with pytest.raises(ValueError, match=message):
      if traced:
        tf.function(lambda value=value: tf.reduce_sum(value))()  # noqa: B023
      else:
        tf.reduce_sum(value)
    with pytest.raises(ValueError, match=message):
      tf.convert_to_tensor(value)
  # Still structures to tf.nest and tf.function, and what the messages say works.
  assert float(tf.function(lambda t: t.get(CPUS[1]))(total)) == 3.0
  assert float(tf.reduce_sum(per_tower.get(CPUS[1]))) == 2.0
  assert [float(x) for x in tf.nest.flatten(per_tower)] == [1.0, 2.0]


def test_unwrap_accepts_keras_variables():
  import keras  # pylint: disable=g-import-not-at-top
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert len(s.unwrap(layer.kernel)) == 2


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_group_of_a_structure_with_plain_values_runs_its_ops_in_a_graph(strategy):
  # A tower result such as {"loss": ..., "mode": "train", "n": 32} grouped inside a
  # tf.function raised TensorFlow's TypeError ("'inputs' should be zero or more (nested)
  # Tensors") for its Python values, where eager mode returned None.
  import keras  # pylint: disable=g-import-not-at-top
  s = ds.DefaultStrategy() if strategy == "default" else ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)
    kv = keras.Variable(0.0)

  @tf.function
  def step():
    with s.scope():
      result = s.call_for_each_tower(
          lambda: {"write": v.assign_add(1.0), "mode": "train", "n": 32, "none": None,
                   "array": np.ones(2), "keras": kv, "variable": v})
      return isinstance(s.group(result), tf.Operation)

  with s.scope():
    assert s.group({"mode": "train", "n": 32}) is None  # Eagerly, as always.
  assert bool(step())
  assert float(v.numpy()) == 1.0  # The grouped write ran (the towers' mean of 1).


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("kind", ["mirrored", "ps"])
def test_gather_concatenates_in_tower_order_whatever_the_dict_order(kind, mode):
  # gather() concatenated a PerDevice's components in its own order: one built with
  # tower 1's device first gave tower 1's value first.
  s = (ds.MirroredStrategy(CPUS[:2]) if kind == "mirrored" else
       ds.ParameterServerStrategy(worker_devices=CPUS[:2], ps_devices=CPUS[2:3]))

  def gather():
    value = PerDevice({CPUS[1]: tf.constant([2.0, 3.0]), CPUS[0]: tf.constant([1.0])})
    return s.gather(value), s.gather({"x": value}, destinations=CPUS[3])["x"]

  with s.scope():
    on_first, mirrored = tf.function(gather)() if mode == "function" else gather()
  assert on_first.numpy().tolist() == [1.0, 2.0, 3.0]
  assert [c.numpy().tolist() for c in mirrored.values] == [[1.0, 2.0, 3.0]]


def test_regroup_select_device_and_pack_as_keep_the_dict_type():
  # They made a plain dict of an OrderedDict or a defaultdict: a tower function's
  # OrderedDict came back a dict under MirroredStrategy, and as itself under the
  # default strategy.
  devices = CPUS[:2]
  counts = collections.defaultdict(list, {"b": 1, "a": 2})
  towers = [collections.OrderedDict([("b", i), ("a", None)]) for i in range(2)]
  merged = regroup(towers, devices)
  assert type(merged) is collections.OrderedDict and list(merged) == ["b", "a"]
  back = select_device(devices[1], merged)
  assert type(back) is collections.OrderedDict and back == towers[1]
  same = regroup([counts, counts], devices)
  assert type(same) is collections.defaultdict and same.default_factory is list
  assert same == counts and type(select_device(devices[0], same)) is collections.defaultdict
  packed = _wrapped.pack_as(counts, ["x", "y"])
  assert type(packed) is collections.defaultdict and packed == {"b": "x", "a": "y"}
  with ds.MirroredStrategy(devices[:1]).scope() as s:
    assert type(s.call_for_each_tower(lambda: towers[0])) is collections.OrderedDict


def test_regroup_of_no_towers_names_the_problem():
  with pytest.raises(ValueError, match=r"regroup\(\) needs at least one tower's structure"):
    regroup([], [])


def test_flatten_and_pack_as_round_trip():
  pair = collections.namedtuple("Pair", ["a", "b"])
  structure = {"x": [1, (2, pair(3, None))], "y": 4}
  leaves = _wrapped.flatten(structure)
  assert leaves == [1, 2, 3, 4]
  assert _wrapped.pack_as(structure, [10 * v for v in leaves]) == {
      "x": [10, (20, pair(30, None))], "y": 40}
  with pytest.raises(ValueError, match=r"pack_as\(\) got more leaves than the structure has"):
    _wrapped.pack_as(structure, leaves + [5])


def test_errors_of_wrapped_values_and_device_names_keep_their_message_in_a_tf_function():
  """Raised in code AutoGraph converts (a wrapped value's get(), its constructor,
  regroup, canonicalize_device) or through a tensor conversion, these errors reached a
  tf.function's caller rewritten: "in user code:", the file and line, then the message."""
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    per_tower = s.call_for_each_tower(
        lambda i: tf.constant(float(i + 1)), s.worker_device_index)
    total = s.reduce("sum", per_tower)

  def as_tensor():
    return tf.reduce_sum(per_tower) + tf.convert_to_tensor(total)

  def mirrored_as_tensor():
    return tf.reduce_sum(total)

  def get_from_no_device():
    return per_tower.get()

  def get_from_a_missing_device():
    return total.get("/cpu:3")

  def empty():
    return PerDevice({})

  def one_device_twice():
    return Mirrored({"/cpu:0": 1.0, "/device:CPU:0": 1.0})

  def too_few_towers():
    return regroup([tf.constant(1.0)], ["/cpu:0", "/cpu:1"])

  def wildcard():
    return ds.canonicalize_device("/cpu:*")

  def unordered_devices():
    return regroup([1.0], {"/cpu:0"})

  for fn in (as_tensor, mirrored_as_tensor, get_from_no_device, get_from_a_missing_device,
             empty, one_device_twice, too_few_towers, wildcard, unordered_devices):
    with pytest.raises(ValueError) as eager:
      fn()
    with pytest.raises(ValueError) as traced:
      tf.function(fn)()
    assert str(traced.value) == str(eager.value), fn.__name__


def _constants(devices, values):
  return PerDevice({d: tf.constant(v) for d, v in zip(devices, values, strict=True)})


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_reduce_refuses_a_per_device_that_is_not_over_the_towers(traced):
  """A PerDevice over 3 devices on 2 towers, over another strategy's devices, or over one
  of the two was summed as it was (7.0, 3.0, 1.0)."""
  s = ds.MirroredStrategy(CPUS[:2])
  towers = re.escape(str(list(s.worker_devices)))
  cases = [_constants(CPUS[:3], [1.0, 2.0, 4.0]), _constants(CPUS[2:], [1.0, 2.0]),
           _constants(CPUS[:1], [1.0])]
  for value in cases:
    for method, call in [("reduce", lambda v: s.reduce("sum", v)),
                         ("reduce", lambda v: s.reduce("sum", {"a": [v]})),
                         ("batch_reduce", lambda v: s.batch_reduce("sum", [(v, None)]))]:
      run = functools.partial(call, value)
      with s.scope(), pytest.raises(ValueError, match=(
          rf"^{method}\(\) of MirroredStrategy.* got a PerDevice over "
          rf"{re.escape(str(list(value.devices)))}, but its towers are on {towers}")):
        tf.function(run)() if traced else run()
  # The towers' devices in another order are the towers' values: numpy's sum.
  with s.scope():
    total = s.reduce("sum", _constants([CPUS[1], CPUS[0]], [2.0, 1.0]))
  assert [float(t) for t in total.values] == [np.sum([1.0, 2.0])] * 2


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_call_for_each_tower_refuses_a_per_device_that_is_not_over_the_towers(traced):
  """A PerDevice over 3 devices on 2 towers ran the towers on the first two components,
  silently dropping the third; one over other devices or fewer named only the missing
  tower device."""
  s = ds.MirroredStrategy(CPUS[:2])
  towers = re.escape(str(list(s.worker_devices)))
  for value in (_constants(CPUS[:3], [1.0, 2.0, 4.0]), _constants(CPUS[2:], [1.0, 2.0]),
                _constants(CPUS[:1], [1.0])):
    run = functools.partial(s.call_for_each_tower, lambda a: a["x"][0] + 1.0, {"x": [value]})
    with s.scope(), pytest.raises(ValueError, match=(
        rf"^An argument of call_for_each_tower\(\) is a PerDevice over "
        rf"{re.escape(str(list(value.devices)))}, but the towers of .* are on {towers}")):
      tf.function(run)() if traced else run()
  # Over the towers' devices, in any order: each tower gets its own component.
  with s.scope():
    got = s.call_for_each_tower(lambda x: x + 1.0, _constants([CPUS[1], CPUS[0]], [2.0, 1.0]))
  assert [float(t) for t in got.values] == list(np.array([1.0, 2.0]) + 1.0)
