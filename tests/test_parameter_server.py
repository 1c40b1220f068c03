"""ParameterServerStrategy in one process: placement, reductions, optimizers (docs/parameter_server.md)."""

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.strategies._parameter_server import VariablePlacer
from conftest import CPUS
import test_optimizers as opt_tests

PS = CPUS[2:4]
WORKERS = CPUS[:2]


def _strategy(placement="least_loaded", workers=WORKERS, ps=PS):
  return ds.ParameterServerStrategy(worker_devices=workers, ps_devices=ps,
                                    variable_placement=placement)


def test_least_loaded_placement():
  s = _strategy()
  with s.scope():
    a = tf.Variable(tf.zeros([100]), name="a")   # ps0 (both empty: the first)
    b = tf.Variable(tf.zeros([10]), name="b")    # ps1 (0 < 100)
    c = tf.Variable(tf.zeros([50]), name="c")    # ps1 (10 < 100)
    d = tf.Variable(tf.zeros([45]), name="d")    # ps1 (60 < 100)
    e = tf.Variable(tf.zeros([1]), name="e")     # ps0 (100 < 105)
  assert [v.device for v in (a, b, c, d, e)] == [PS[0], PS[1], PS[1], PS[1], PS[0]]
  assert s.placer.loads == {PS[0]: 101, PS[1]: 105}
  assert isinstance(a, tf.Variable) and not isinstance(a, ds.values.DistributedValues)


def test_round_robin_placement():
  s = _strategy("round_robin")
  with s.scope():
    devices = [tf.Variable(tf.zeros([i + 1])).device for i in range(5)]
  assert devices == [PS[0], PS[1], PS[0], PS[1], PS[0]]


def test_callable_placement_and_errors():
  calls = []

  def place(name, shape, dtype):
    calls.append((name, tuple(shape), dtype))
    return "/cpu:3" if name == "big" else "/cpu:2"

  s = _strategy(place)
  with s.scope():
    big = tf.Variable(tf.zeros([3, 4]), name="big")
    small = tf.Variable(1.0, name="small")
  assert (big.device, small.device) == (PS[1], PS[0])
  assert calls == [("big", (3, 4), tf.float32), ("small", (), tf.float32)]
  with pytest.raises(ValueError, match=r"variable_placement returned '/cpu:0' for variable "
                                       r"'x'; it must return one of the parameter devices"):
    with _strategy(lambda *a: "/cpu:0").scope():
      tf.Variable(1.0, name="x")
  with pytest.raises(ValueError, match="variable_placement must be 'least_loaded', "
                                       "'round_robin' or a callable"):
    _strategy("random")
  with pytest.raises(TypeError, match="variable_placement must be 'least_loaded', "
                                      r"'round_robin' or a callable.*Received: "
                                      r"variable_placement=5 of type int"):
    _strategy(5)


def test_callable_placement_gets_the_name_the_variable_gets():
  # It got tf.Variable's `name` argument: None for an unnamed variable (a callable
  # testing `"embedding" in name` raised TypeError from inside tf.Variable) and no name
  # scope (every Keras layer's kernel was "kernel").
  import keras  # pylint: disable=g-import-not-at-top
  names = []

  def place(name, shape, dtype):
    names.append(name)
    return "/cpu:3" if name.endswith("dense_b/kernel") else "/cpu:2"

  s = _strategy(place)
  with s.scope():
    with tf.name_scope("scope"):
      a = tf.Variable(1.0, name="a")
    unnamed = tf.Variable(1.0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense_a"),
                              keras.layers.Dense(2, name="dense_b")])
  assert names[:2] == [a.name[:-2], unnamed.name[:-2]] == ["scope/a", "Variable"]
  kernels = [v for v in model.trainable_variables if v.name == "kernel"]
  assert names[2:] == [v.value.name[:-2] for v in model.trainable_variables]
  assert [k.value.device for k in kernels] == [PS[0], PS[1]]


def test_placement_is_deterministic_by_creation_order():
  def run():
    placer = VariablePlacer(PS, "least_loaded")
    shapes = [tf.TensorShape([n]) for n in (7, 3, 9, 1, 4, 4, 2)]
    return [placer.place(f"v{i}", shape, tf.float32) for i, shape in enumerate(shapes)]
  assert run() == run()


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_reduce_onto_variable_sums_on_its_device(mode):
  s = _strategy()
  with s.scope():
    v = tf.Variable(tf.zeros([3]), name="v")

  def step():
    per_tower = s.call_for_each_tower(
        lambda i: tf.fill([3], tf.cast(i + 1, tf.float32)), s.worker_device_index)
    total = s.reduce("sum", per_tower, destinations=v)
    s.update(v, lambda var, t: var.assign_add(t), total)
    return s.unwrap(total)

  with s.scope():
    total = step() if mode == "eager" else tf.function(step)()
  assert len(total) == 1
  if mode == "eager":
    assert total[0].device == v.device
  np.testing.assert_allclose(v.numpy(), [3.0, 3.0, 3.0])


def test_towers_share_variables_and_run_on_workers():
  s = _strategy()
  seen = []

  def fn():
    v = tf.Variable(2.0, name="w")
    seen.append(v)
    return ds.get_tower_context().device, v * 1.0

  with s.scope():
    devices, values = s.call_for_each_tower(fn)
  assert seen[0] is seen[1] and seen[0].device in PS
  assert list(devices.values) == WORKERS
  assert [float(x) for x in values.values] == [2.0, 2.0]


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_variable_with_an_aggregation_passes_to_towers_and_out_of_merge_fn(mode):
  # Such a variable is a one-copy MirroredVariable on its PS device, which no tower
  # device holds: call_for_each_tower(fn, v) raised ValueError ("no component on the
  # tower device"), and so did a merge_fn returning it. Each tower gets the variable.
  s = _strategy()
  with s.scope():
    v = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN, name="v")

  def fn(var, x):
    var.assign_add(x)  # Tower writes are merged, as by the variable itself.
    back = ds.get_tower_context().merge_call(lambda strategy, w: w, var)
    return back is v

  def step():
    return s.call_for_each_tower(fn, v, s.call_for_each_tower(
        lambda i: tf.cast(i + 1, tf.float32), s.worker_device_index))

  if mode == "function":
    step = tf.function(step)
  with s.scope():
    assert bool(step())  # In a tf.function the Python True comes back as a tensor.
  assert float(v.numpy()) == 1.5  # The mean of the towers' 1 and 2.


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_colocate_vars_with_holds_in_the_towers_it_encloses(mode):
  # The colocation was kept per thread and tower threads did not get it: a variable
  # created in a tower inside `colocate_vars_with(anchor)` went where the placement
  # policy put it.
  s = _strategy("round_robin")
  with s.scope():
    anchor = tf.Variable(1.0, name="anchor")  # PS[0]; round robin puts the next on PS[1].
    made = []

    def fn():
      if not made:
        made.append(tf.Variable(2.0, name="in_tower"))
      return made[0].read_value()

    call = lambda: s.call_for_each_tower(fn)
    with s.colocate_vars_with(anchor):
      (tf.function(call) if mode == "function" else call)()
  assert anchor.device == PS[0]
  assert made[0].device == PS[0]


def test_non_slot_variables_on_one_ps_device():
  s = _strategy()
  with s.scope():
    a = tf.Variable(tf.zeros([5]), name="a")
    b = tf.Variable(tf.zeros([5]), name="b")
    opt = ds.optimizers.Adam(0.1)
    s.call_for_each_tower(lambda: opt.minimize(lambda: tf.reduce_sum(a * b + a), var_list=[a, b]))
  assert opt.beta1_power.device == a.device  # The variable with the smallest name.
  assert opt.get_slot(a, "m").device == a.device and opt.get_slot(b, "v").device == b.device
  assert a.device != b.device


@pytest.mark.parametrize("name", sorted(opt_tests.OPTIMIZERS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_towers_match_one_device(name, sparse, mode):
  steps = 10
  ids, y = opt_tests._data(steps)
  expected_emb, expected_w = opt_tests._reference(name, sparse, steps)
  s = _strategy(workers=CPUS[:4])
  with s.scope():
    emb, w = opt_tests._make_vars()
    opt = opt_tests.OPTIMIZERS[name]()
    step_var = tf.Variable(0, dtype=tf.int64, name="global_step")

  def tower_fn(ids_part, y_part):
    return opt.minimize(opt_tests._loss_fn(emb, w, ids_part, y_part, sparse),
                        var_list=[emb, w], global_step=step_var)

  def step(ids_batch, y_batch):
    parts = tf.split(ids_batch, 4), tf.split(y_batch, 4)
    per_tower = [ds.values.PerDevice(dict(zip(s.worker_devices, p, strict=True))) for p in parts]
    s.call_for_each_tower(tower_fn, *per_tower)

  if mode == "function":
    step = tf.function(step)
  with s.scope():
    for i in range(steps):
      step(tf.constant(ids[i]), tf.constant(y[i]))
  np.testing.assert_allclose(emb.numpy(), expected_emb, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(w.numpy(), expected_w, rtol=2e-5, atol=2e-6)
  assert int(step_var.numpy()) == steps


def test_is_chief_as_in_multi_worker():
  # docs/launch.md tells custom loops to write checkpoints `if strategy.is_chief`; it was
  # an AttributeError under ParameterServerStrategy. One process: the chief.
  # (tests/test_cluster.py checks worker 0 and worker 1 of a cluster.)
  assert _strategy().is_chief is True
  from diststrat._cluster_runtime import _cluster_spec  # pylint: disable=import-outside-toplevel
  spec = {"ps": ["a:1"], "worker": ["b:1", "b:2"]}
  assert [_cluster_spec.is_chief_task(spec, "worker", i) for i in (0, 1)] == [True, False]
  with_chief = dict(spec, chief=["c:1"])
  assert _cluster_spec.is_chief_task(with_chief, "chief", 0)
  assert not _cluster_spec.is_chief_task(with_chief, "worker", 0)
