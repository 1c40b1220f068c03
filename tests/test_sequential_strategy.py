"""A strategy written only by filling hooks works end to end, against numpy."""

import re

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from sequential_strategy import SequentialStrategy
from conftest import CPUS


@pytest.mark.parametrize("num_towers", [1, 2, 4])
@pytest.mark.parametrize("use_function", [False, True])
def test_towers_reduce_and_update(num_towers, use_function):
  s = SequentialStrategy(CPUS[:num_towers])
  rng = np.random.default_rng(0)
  data = rng.normal(size=(num_towers, 3)).astype(np.float32)
  with s.scope():
    v = tf.Variable(np.ones(3, np.float32))

  def step():
    def fn():
      tid = ds.get_tower_context().tower_id
      return tf.constant(data)[tid] * v
    per_tower = s.call_for_each_tower(fn)
    total = s.reduce("sum", per_tower, destinations=v)
    mean = s.reduce(tf.VariableAggregation.MEAN, per_tower)
    s.update(v, lambda var, t: var.assign_add(t), total)
    return s.unwrap(mean)[0]

  with s.scope():
    mean = tf.function(step)() if use_function else step()
  np.testing.assert_allclose(v.numpy(), 1 + data.sum(axis=0), rtol=1e-6)
  np.testing.assert_allclose(mean, data.mean(axis=0), rtol=1e-6)


def test_per_device_arguments_are_split():
  s = SequentialStrategy(CPUS[:2])
  arg = ds.values.PerDevice({CPUS[0]: 10, CPUS[1]: 20})
  with s.scope():
    result = s.call_for_each_tower(lambda a, b: (a + b, ds.get_tower_context().device),
                                   arg, b=ds.values.Mirrored({CPUS[0]: 1, CPUS[1]: 1}))
  assert result[0].values == (11, 21)
  assert result[1].values == tuple(CPUS[:2])


def test_worker_device_index():
  s = SequentialStrategy(CPUS[:3])
  with s.scope():
    result = s.call_for_each_tower(lambda i: i * 2, s.worker_device_index)
  assert result.values == (0, 2, 4)
  assert s.worker_devices == tuple(CPUS[:3]) and s.num_towers == 3
  assert not s.is_single_tower


def test_batch_reduce_and_gather_match_numpy():
  s = SequentialStrategy(CPUS[:4])
  rng = np.random.default_rng(1)
  a = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(4)]
  b = [rng.normal(size=(5,)).astype(np.float32) for _ in range(4)]
  with s.scope():
    pa = s.call_for_each_tower(lambda i: tf.constant(np.stack(a))[i], s.worker_device_index)
    pb = s.call_for_each_tower(lambda i: tf.constant(np.stack(b))[i], s.worker_device_index)
    ra, rb = s.batch_reduce("sum", [(pa, None), (pb, CPUS[1])])
    gathered = s.gather(pa, axis=1)
  assert ra.devices == tuple(CPUS) and rb.devices == (CPUS[1],)
  np.testing.assert_allclose(ra.get(CPUS[2]), np.sum(a, axis=0), rtol=1e-6)
  np.testing.assert_allclose(rb.primary, np.sum(b, axis=0), rtol=1e-6)
  np.testing.assert_allclose(gathered, np.concatenate(a, axis=1))


def test_update_non_slot_and_group():
  s = SequentialStrategy(CPUS[:2])
  with s.scope():
    w = tf.Variable(2.0, name="w")
    a = tf.Variable(1.0, name="a")
    colocate = s.non_slot_devices([w, a])
    assert colocate is a
    with s.colocate_vars_with(colocate):
      counter = tf.Variable(0.0)
    s.update_non_slot(colocate, lambda: counter.assign_add(1.0))
    assert s.group(s.call_for_each_tower(lambda: tf.constant(1.0))) is None  # Eager.

    @tf.function
    def grouped():
      op = s.group(s.call_for_each_tower(lambda: counter.assign_add(1.0)))
      assert isinstance(op, tf.Operation)

    grouped()
  assert counter.numpy() == 3.0 and counter.device == a.device


def test_bad_aggregation_and_pairs():
  s = SequentialStrategy(CPUS[:2])
  with s.scope():
    with pytest.raises(ValueError, match=r"aggregation must be one of .*'sum' or 'mean'. "
                                         r"Received: aggregation='max'"):
      s.reduce("max", tf.constant(1.0))
    with pytest.raises(ValueError, match=r"list of \(value, destinations\) pairs.*Received: "
                       r"value_destination_pairs\[0\]=<tf.Tensor"):
      s.batch_reduce("sum", [tf.constant(1.0)])
    with pytest.raises(ValueError, match="destinations must be None, a device string"):
      s.reduce("sum", tf.constant(1.0), destinations=42)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_keras_model_built_in_the_scope_trains_and_evaluates(run_eagerly):
  # The strategy keeps plain variables; they are still its own (it made them in its
  # scope), so Keras's fit and evaluate run under it as under the shipped strategies.
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  x = rng.normal(size=(8, 3)).astype(np.float32)
  y = rng.normal(size=(8, 1)).astype(np.float32)

  def results(strategy):
    with strategy.scope():
      keras.utils.set_random_seed(3)
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
      model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"],
                    run_eagerly=run_eagerly)
    evaluated = model.evaluate(x, y, batch_size=8, verbose=0)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    return evaluated, [v.numpy() for v in model.trainable_variables]

  reference_eval, reference_weights = results(ds.DefaultStrategy())
  # evaluate sums every tower's metrics: one device's, on any number of towers.
  np.testing.assert_allclose(results(SequentialStrategy(CPUS[:2]))[0], reference_eval,
                             rtol=1e-6)
  # One tower trains as one device (with more, each tower's merge_call applies its own
  # part's gradient in turn: the strategy's design).
  one_eval, one_weights = results(SequentialStrategy(CPUS[:1]))
  np.testing.assert_allclose(one_eval, reference_eval, rtol=1e-6)
  for got, want in zip(one_weights, reference_weights, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("use_function", [False, True])
def test_tf_distribute_replica_context_and_a_keras_optimizer_in_a_custom_loop(use_function):
  # The base TowerContext._merge_call hands merge_fn's result back as it is; the
  # tf.distribute bridge gives each tower its part, as tf.distribute does (all_reduce
  # got a Mirrored and failed to convert it to a tensor).
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(4)
  x = tf.constant(rng.normal(size=(6, 3)).astype(np.float32))
  y = tf.constant(rng.normal(size=(6, 1)).astype(np.float32))

  def results(strategy):
    with strategy.scope():
      keras.utils.set_random_seed(5)
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      optimizer = keras.optimizers.Adam(0.1)

    def tower(x, y):
      ctx = tf.distribute.get_replica_context()
      with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
      merged = ctx.merge_call(lambda s, v: s.extended.reduce_to("sum", v, v), args=(loss,))
      return ctx.all_reduce("sum", loss), merged, ctx.all_gather(x, axis=0)

    def step():
      if isinstance(strategy, ds.DefaultStrategy):
        return tower(x, y)
      return tf.distribute.get_strategy().run(tower, args=(x, y))

    with strategy.scope():
      outputs = [tf.function(step)() if use_function else step() for _ in range(2)]
    return [[np.asarray(t) for t in o] for o in outputs], [v.numpy() for v in model.weights]

  expected_outputs, expected_weights = results(ds.DefaultStrategy())
  outputs, weights = results(SequentialStrategy(CPUS[:1]))
  for got, want in zip(outputs + [weights], expected_outputs + [expected_weights],
                       strict=True):
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("use_function", [False, True])
def test_towers_get_their_share_of_a_split_batch(use_function):
  # The example gave its towers no batch_share: Keras losses and diststrat's optimizers
  # then weighed each tower 1/N, not one device's weights on a ragged batch.
  data = np.arange(7, dtype=np.float32)
  shares = {}
  for name, strategy in (("sequential", SequentialStrategy(CPUS[:3])),
                         ("mirrored", ds.MirroredStrategy(CPUS[:3]))):
    with strategy.scope():
      batches = strategy.distribute_dataset(
          lambda: tf.data.Dataset.from_tensor_slices(data).batch(7))
      step = lambda batch, s=strategy: s.call_for_each_tower(  # noqa: E731
          lambda x: tf.constant(1.0) * ds.get_tower_context().batch_share, batch)
      for batch in batches:
        per_tower = tf.function(step)(batch) if use_function else step(batch)
        shares[name] = [float(v) for v in strategy.unwrap(per_tower)]
  assert shares["sequential"] == shares["mirrored"]
  np.testing.assert_allclose(shares["sequential"],
                             [len(part) / 7 for part in np.array_split(data, 3)], rtol=1e-6)


@pytest.mark.parametrize("use_function", [False, True])
@pytest.mark.parametrize("returned", [None, "copies"])
def test_create_variable_must_return_the_variable(use_function, returned):
  # A _create_variable that forgot to return (or returned the copies it made) failed in
  # TensorFlow with a bare NotImplementedError, naming neither the hook nor the fix.
  class Forgetful(SequentialStrategy):

    def _create_variable(self, next_creator, kwargs, colocate_with):
      made = super()._create_variable(next_creator, kwargs, colocate_with)
      return None if returned is None else {self._devices[-1]: made}

  s = Forgetful(CPUS[:2])
  created = []

  def make():
    if not created:  # tf.function creates variables on its first trace only.
      created.append(tf.Variable(1.0, name="w"))
    return created[0].read_value()

  kind = r"None \(NoneType\)" if returned is None else r"\{'/job:.* \(dict\)"
  with s.scope(), pytest.raises(TypeError, match=(
      r"Forgetful._create_variable\(\) must return the variable it created .*Received: "
      rf"{kind} for the variable 'w'\. Return what next_creator\(\*\*kwargs\) gives")):
    tf.function(make)() if use_function else make()


class _NoTowerScope(SequentialStrategy):
  """Runs fn on each device, but forgets to enter the tower's context."""

  def _call_for_each_tower(self, fn, args, kwargs):
    results = []
    for device in self._devices:
      with tf.device(device):
        results.append(fn(*ds.values.select_device(device, args),
                          **ds.values.select_device(device, kwargs)))
    return ds.values.regroup(results, self._devices)


_NO_TOWER = (r"_NoTowerScope._call_for_each_tower\(\) ran no tower: it must run fn inside "
             r"`with tf.device\(device\), self._tower_scope\(ds.TowerContext\(self, tower_id, "
             r"num_towers, device\)\):`, once per tower")


@pytest.mark.parametrize("use_function", [False, True])
def test_a_call_for_each_tower_hook_that_enters_no_tower_is_named(use_function):
  # A hook that ran fn outside _tower_scope went unnoticed: fn ran in the cross-tower
  # context (get_tower_context() None; Keras's fit ran as if there were no towers), or
  # failed far from the cause (an optimizer's apply_gradients "must be called from a
  # tower (inside call_for_each_tower)", where it was).
  s = _NoTowerScope(CPUS[:2])
  step = lambda: s.call_for_each_tower(lambda: tf.constant(1.0))  # noqa: E731
  with s.scope(), pytest.raises(ds.errors.ContextError, match=_NO_TOWER):
    tf.function(step)() if use_function else step()

  with s.scope():
    w = tf.Variable(1.0)
    optimizer = ds.optimizers.GradientDescent(0.1)
    step = lambda: s.call_for_each_tower(  # noqa: E731
        lambda: optimizer.minimize(lambda: w * w, var_list=[w]))
    with pytest.raises(ds.errors.ContextError, match="must be called from a tower") as info:
      tf.function(step)() if use_function else step()
  assert re.search(_NO_TOWER, "\n".join(getattr(info.value, "__notes__", [])))


class _OneTowerContexts(SequentialStrategy):
  """Gives every tower a TowerContext that leaves num_towers at its default, 1."""

  def _call_for_each_tower(self, fn, args, kwargs):
    results = []
    for tower_id, device in enumerate(self._devices):
      with tf.device(device), self._tower_scope(ds.TowerContext(self, tower_id,
                                                                device=device)):
        results.append(fn(*ds.values.select_device(device, args),
                          **ds.values.select_device(device, kwargs)))
    return ds.values.regroup(results, self._devices)


@pytest.mark.parametrize("use_function", [False, True])
def test_a_tower_context_must_count_the_strategys_towers(use_function):
  # A TowerContext left at num_towers=1 on 2 towers trained silently with twice one
  # device's gradient (diststrat's optimizers weigh each tower by 1/num_towers), and one
  # given the device as its third argument failed in the optimizer with "unsupported
  # operand type(s) for /: 'float' and 'str'".
  s = _OneTowerContexts(CPUS[:2])
  with s.scope():
    w = tf.Variable(1.0)
    optimizer = ds.optimizers.GradientDescent(0.1)
    step = lambda: s.call_for_each_tower(  # noqa: E731
        lambda: optimizer.minimize(lambda: w * w, var_list=[w]))
    with pytest.raises(ValueError, match=(
        r"_OneTowerContexts._tower_scope\(\) takes this strategy's TowerContext for one of "
        r"its 2 towers .*Received: TowerContext\(tower_id=0, num_towers=1, ")):
      tf.function(step)() if use_function else step()
  assert w.numpy() == 1.0

  with pytest.raises(ValueError, match=r"takes the number of towers of the call as "
                     r"num_towers, an integer >= 1. Received: num_towers='/cpu:1'. Pass the "
                     r"device by name"):
    ds.TowerContext(s, 1, "/cpu:1")
  with pytest.raises(ValueError, match=r"tower_id, an integer from 0 to num_towers - 1 "
                     r"\(1\). Received: tower_id=2"):
    ds.TowerContext(s, 2, 2)
