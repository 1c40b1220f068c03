"""Optimizers (docs/optimizers.md): textbook rules, N towers == one device, state, checkpoints."""

import contextlib
import functools
import re

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import optimizers
from diststrat.values import MirroredVariable
from conftest import CPUS

VOCAB, DIM, OUT, BATCH = 12, 4, 2, 16

OPTIMIZERS = {
    "sgd": lambda: optimizers.GradientDescent(0.1),
    "momentum": lambda: optimizers.Momentum(0.05, 0.9),
    "nesterov": lambda: optimizers.Momentum(0.05, 0.9, use_nesterov=True),
    "adam": lambda: optimizers.Adam(0.01),
}


# --- numpy references of the textbook rules ---


def np_sgd(var, grads, lr=0.1):
  for g in grads:
    var = var - lr * g
  return var


def np_momentum(var, grads, lr=0.05, mu=0.9, nesterov=False):
  accum = np.zeros_like(var)
  for g in grads:
    accum = mu * accum + g
    var = var - lr * (g + mu * accum if nesterov else accum)
  return var


def np_adam(var, grads, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
  m, v = np.zeros_like(var), np.zeros_like(var)
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    var = var - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
  return var


NUMPY = {"sgd": np_sgd, "momentum": np_momentum,
         "nesterov": lambda v, g: np_momentum(v, g, nesterov=True), "adam": np_adam}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dense_update_matches_numpy(name):
  rng = np.random.default_rng(0)
  init = rng.normal(size=(3, 2)).astype(np.float32)
  grads = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(5)]
  var = tf.Variable(init)
  opt = OPTIMIZERS[name]()
  for g in grads:
    opt.apply_gradients([(tf.constant(g), var)])
  np.testing.assert_allclose(var.numpy(), NUMPY[name](init, grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_update_matches_numpy(name):
  rng = np.random.default_rng(1)
  init = rng.normal(size=(6, 2)).astype(np.float32)
  var = tf.Variable(init)
  opt = OPTIMIZERS[name]()
  dense_grads = []
  sparse_reference = init.copy()
  for _ in range(4):
    indices = np.array([0, 3, 3, 5])  # A repeated index: its rows add up.
    values = rng.normal(size=(4, 2)).astype(np.float32)
    opt.apply_gradients([(tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                           tf.constant([6, 2])), var)])
    dense = np.zeros_like(init)
    np.add.at(dense, indices, values)
    dense_grads.append(dense)
  if name in ("sgd", "adam"):
    # SGD and this Adam treat a sparse gradient as the dense one with zero rows.
    expected = NUMPY[name](sparse_reference, dense_grads)
  else:
    # Momentum touches only the rows a gradient names.
    expected = init.copy()
    rows = [0, 3, 5]
    expected[rows] = NUMPY[name](init[rows], [g[rows] for g in dense_grads])
  np.testing.assert_allclose(var.numpy(), expected, rtol=1e-5, atol=1e-6)


# --- N towers on a global batch == one device on the whole batch ---


def _data(steps):
  rng = np.random.default_rng(7)
  ids = rng.integers(0, VOCAB, size=(steps, BATCH)).astype(np.int32)
  y = rng.normal(size=(steps, BATCH, OUT)).astype(np.float32)
  return ids, y


def _make_vars():
  rng = np.random.default_rng(3)
  emb = tf.Variable(rng.normal(size=(VOCAB, DIM)).astype(np.float32), name="emb")
  w = tf.Variable(rng.normal(size=(DIM, OUT)).astype(np.float32) * 0.5, name="w")
  return emb, w


def _loss_fn(emb, w, ids, y, sparse):
  def loss():
    if sparse:
      h = tf.gather(emb, ids)  # Its gradient is an IndexedSlices.
    else:
      h = tf.one_hot(ids, VOCAB) @ emb
    return tf.reduce_mean(tf.square(h @ w - y))
  return loss


@functools.lru_cache(maxsize=None)
def _reference(name, sparse, steps):
  """One device's emb and w after `steps` steps on `_data(steps)` (read-only arrays,
  computed once: the reference of every tower count and mode)."""
  ids, y = _data(steps)
  emb, w = _make_vars()
  opt = OPTIMIZERS[name]()
  for i in range(len(ids)):
    opt.minimize(_loss_fn(emb, w, ids[i], y[i], sparse), var_list=[emb, w])
  result = emb.numpy().copy(), w.numpy().copy()
  for array in result:
    array.setflags(write=False)
  return result


def _distributed(name, sparse, n, mode, ids, y):
  s = ds.MirroredStrategy(CPUS[:n])
  with s.scope():
    emb, w = _make_vars()
    opt = OPTIMIZERS[name]()
    step_var = tf.Variable(0, dtype=tf.int64, name="global_step")

  def tower_fn(ids_part, y_part):
    return opt.minimize(_loss_fn(emb, w, ids_part, y_part, sparse), var_list=[emb, w],
                        global_step=step_var)

  def step(ids_batch, y_batch):
    parts = tf.split(ids_batch, n), tf.split(y_batch, n)
    per_tower = [ds.values.PerDevice(dict(zip(s.worker_devices, p, strict=True))) for p in parts]
    s.call_for_each_tower(tower_fn, *per_tower)

  if mode == "function":
    step = tf.function(step)
  with s.scope():
    for i in range(len(ids)):
      step(tf.constant(ids[i]), tf.constant(y[i]))
  return s, emb, w, opt, step_var


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_towers_match_one_device(name, sparse, n, mode):
  steps = 10
  ids, y = _data(steps)
  expected_emb, expected_w = _reference(name, sparse, steps)
  s, emb, w, opt, step_var = _distributed(name, sparse, n, mode, ids, y)
  assert isinstance(emb, MirroredVariable) and len(emb.values) == n
  for copy in emb.values:
    np.testing.assert_allclose(copy.numpy(), expected_emb, rtol=2e-5, atol=2e-6)
  for copy in w.values:
    np.testing.assert_allclose(copy.numpy(), expected_w, rtol=2e-5, atol=2e-6)
  assert [int(c.numpy()) for c in step_var.values] == [steps] * n  # Once per apply.
  for slot_name in opt.get_slot_names():
    slot = opt.get_slot(emb, slot_name)
    assert isinstance(slot, MirroredVariable) and slot.devices == emb.devices


def test_adam_state_placement():
  ids, y = _data(1)
  s, emb, w, opt, _ = _distributed("adam", False, 4, "eager", ids, y)
  assert opt.get_slot_names() == ["m", "v"]
  for var in (emb, w):
    for slot_name in ("m", "v"):
      slot = opt.get_slot(var, slot_name)
      assert isinstance(slot, MirroredVariable)
      assert [c.device for c in slot.values] == [c.device for c in var.values]
  power = opt.beta1_power
  assert isinstance(power, MirroredVariable) and power.devices == s.non_slot_devices([emb, w])
  np.testing.assert_allclose(power.values[3].numpy(), 0.9**2, rtol=1e-6)
  assert len(opt.variables()) == 6
  # Inside update(), get_slot gives the copy on the update device.
  with s.scope():
    devices = s.update(emb, lambda c: opt.get_slot(c, "m").device)
  assert s.unwrap(devices) == list(emb.devices)


def test_compute_gradients_scales_mean_loss_and_drops_none():
  s = ds.MirroredStrategy(CPUS[:4])
  with s.scope():
    a = tf.Variable(1.0)
    b = tf.Variable(1.0)
    opt = optimizers.GradientDescent(1.0)
    sum_opt = optimizers.GradientDescent(1.0, loss_reduction="sum")
    grads = s.call_for_each_tower(lambda: opt.compute_gradients(lambda: 4.0 * a, [a, b]))
    sums = s.call_for_each_tower(lambda: sum_opt.compute_gradients(lambda: 4.0 * a, [a, b]))
  assert len(grads) == 1 and grads[0][1] is a  # b got no gradient.
  assert [float(g) for g in s.unwrap(grads[0][0])] == [1.0] * 4
  assert [float(g) for g in s.unwrap(sums[0][0])] == [4.0] * 4


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_compute_gradients_in_cross_tower_context_scales_by_the_strategys_tower_count(
    traced):
  """In cross-tower context a "mean" optimizer scales the loss by 1/num_towers of the
  strategy in effect, as in a tower (docs/optimizers.md); "sum" gives one device's
  gradient there (numpy's)."""
  rng = np.random.default_rng(0)
  x, y = rng.random((8, 3), np.float32), rng.random((8, 1), np.float32)
  w0 = rng.random((3, 1), np.float32)
  expected = 2.0 / len(x) * x.T @ (x @ w0 - y)  # d/dw mean((xw - y)^2)
  s = ds.MirroredStrategy(CPUS[:4])
  with s.scope():
    w = tf.Variable(w0)
    mean_opt, sum_opt = optimizers.Adam(0.1), optimizers.Adam(0.1, loss_reduction="sum")

  def grads():
    loss_fn = lambda: tf.reduce_mean(tf.square(x @ w - y))  # noqa: E731
    with tf.GradientTape() as tape:
      loss = loss_fn()
    [(g_tape, _)] = mean_opt.compute_gradients(loss, [w], tape=tape)
    return (mean_opt.compute_gradients(loss_fn, [w])[0][0], g_tape,
            sum_opt.compute_gradients(loss_fn, [w])[0][0])

  with s.scope():
    mean_callable, mean_tape, summed = tf.function(grads)() if traced else grads()
  np.testing.assert_allclose(mean_callable.numpy(), expected / 4, rtol=1e-5)
  np.testing.assert_allclose(mean_tape.numpy(), expected / 4, rtol=1e-5)
  np.testing.assert_allclose(summed.numpy(), expected, rtol=1e-5)


def test_compute_gradients_with_user_tape():
  v = tf.Variable(3.0)
  opt = optimizers.GradientDescent(1.0)
  with tf.GradientTape() as tape:
    loss = v * v
  [(g, var)] = opt.compute_gradients(loss, var_list=[v], tape=tape)
  assert float(g) == 6.0 and var is v
  with pytest.raises(ValueError, match="got a loss tensor but no tape"):
    opt.compute_gradients(loss, var_list=[v])


def test_apply_gradients_in_cross_tower_context_raises():
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(1.0)
    opt = optimizers.GradientDescent(0.1)
    with pytest.raises(RuntimeError, match=r"apply_gradients\(\) was called in the "
                                           r"cross-tower context.*_distributed_apply"):
      opt.apply_gradients([(tf.constant(1.0), v)])


def test_apply_gradients_outside_the_scope_updates_every_copy_of_mirrored_variables():
  """Outside any scope, the gradients are applied through the variables' strategy: one
  value for every copy, with mirrored state, as numpy's Adam on one variable."""
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable([1.0, 2.0])
    opt = optimizers.Adam(0.1)
  step = tf.Variable(0, dtype=tf.int64)
  grads = [np.array([0.5, -1.0], np.float32), np.array([2.0, 0.25], np.float32)]
  opt.apply_gradients([(tf.constant(grads[0]), v)], global_step=step)
  tf.function(lambda g: opt.apply_gradients([(g, v)], global_step=step))(
      tf.constant(grads[1]))
  expected = np_adam(np.array([1.0, 2.0], np.float32), grads, lr=0.1)
  for copy in v.values:
    np.testing.assert_allclose(copy.numpy(), expected, rtol=1e-6)
  assert isinstance(opt.get_slot(v, "m"), MirroredVariable)
  assert int(step.numpy()) == 2


def test_apply_gradients_errors():
  v = tf.Variable(1.0)
  opt = optimizers.GradientDescent(0.1)
  with pytest.raises(ValueError, match="got no gradients: every gradient is None"):
    opt.apply_gradients([(None, v)])
  with pytest.raises(ValueError, match=r"takes \(gradient, variable\) pairs"):
    opt.apply_gradients([tf.constant(1.0)])
  with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
    optimizers.GradientDescent(0.1, loss_reduction="avg")


def test_global_step_once_per_apply_without_strategy():
  v = tf.Variable(1.0)
  step = tf.Variable(0, dtype=tf.int64)
  opt = optimizers.Adam()
  for _ in range(3):
    opt.apply_gradients([(tf.constant(1.0), v)], global_step=step)
  assert int(step.numpy()) == 3


class SignSGD(optimizers.DistributedOptimizerMixin, optimizers.Optimizer):
  """The docs' custom optimizer: `var -= lr * sign(grad)`, with a step counter slot."""

  def __init__(self, learning_rate):
    super().__init__("SignSGD")
    self._lr = learning_rate

  def _create_slots(self, var_list):
    for var in var_list:
      self._zeros_slot(var, "count")

  def _apply_dense(self, grad, var):
    self.get_slot(var, "count").assign_add(tf.ones_like(var), read_value=False)
    return var.assign_sub(self._lr * tf.sign(grad), read_value=False)

  def _apply_sparse(self, grad, var):
    grad = self._deduplicate(grad)
    return var.scatter_sub(tf.IndexedSlices(self._lr * tf.sign(grad.values), grad.indices))


@pytest.mark.parametrize("n", [1, 4])
def test_custom_optimizer_from_hooks(n):
  s = ds.MirroredStrategy(CPUS[:n])
  target = np.array([1.0, -2.0, 3.0], np.float32)
  with s.scope():
    v = tf.Variable(np.zeros(3, np.float32))
    opt = SignSGD(0.25)

  def tower_fn():
    return opt.minimize(lambda: tf.reduce_sum(tf.square(v - target)), var_list=[v])

  with s.scope():
    for _ in range(6):
      s.call_for_each_tower(tower_fn)
  expected = np.zeros(3, np.float32)
  for _ in range(6):
    expected = expected - 0.25 * np.sign(2 * (expected - target))
  for copy in v.values:
    np.testing.assert_allclose(copy.numpy(), expected)
  assert float(opt.get_slot(v, "count").values[0].numpy()[0]) == 6.0


class PlainSignSGD(optimizers.Optimizer):
  """SignSGD without DistributedOptimizerMixin: fine with no strategy, not in towers."""

  def __init__(self, learning_rate):
    super().__init__("PlainSignSGD")
    self._lr = learning_rate

  def _apply_dense(self, grad, var):
    return var.assign_sub(self._lr * tf.sign(grad), read_value=False)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_an_optimizer_without_the_mixin_in_a_tower_says_to_add_it(traced):
  """It raised the mirrored variable's "Cannot assign_sub() ... with aggregation NONE",
  which does not say that the optimizer lacks DistributedOptimizerMixin."""
  v0 = tf.Variable(1.0)
  PlainSignSGD(0.25).minimize(lambda: 2.0 * v0, var_list=[v0])  # No strategy: applies.
  assert float(v0.numpy()) == 0.75
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(1.0)
    opt = PlainSignSGD(0.25)
    call = lambda: s.call_for_each_tower(  # noqa: E731
        lambda: opt.minimize(lambda: 2.0 * v, var_list=[v]))
    with pytest.raises(ds.errors.ContextError,
                       match=r"PlainSignSGD 'PlainSignSGD' is not distribution-aware: its "
                             r"apply_gradients\(\) was called in tower 0 of .*Put "
                             r"DistributedOptimizerMixin first in its bases"):
      tf.function(call)() if traced else call()
  assert [float(c.numpy()) for c in v.values] == [1.0, 1.0]


def test_step_graph_groups_the_updates_once():
  """A traced step's no-ops grow with the devices, not with devices x variables.

  The updates of every copy are grouped once for `_finish`; a group per variable added
  a no-op per device and variable (34 no-ops in this step then, 9 now), each one more op
  to trace and optimize.
  """
  s = ds.MirroredStrategy(CPUS[:4])
  with s.scope():
    variables = [tf.Variable(np.full([3], float(i), np.float32)) for i in range(6)]
    opt = optimizers.GradientDescent(0.1)

  def tower_fn():
    return opt.minimize(lambda: tf.add_n([tf.reduce_sum(v * v) for v in variables]),
                        var_list=variables)

  @tf.function
  def step():
    with s.scope():
      s.call_for_each_tower(tower_fn)

  graph = step.get_concrete_function().graph
  no_ops = [op for op in graph.get_operations() if op.type == "NoOp"]
  assert len(no_ops) <= 2 * 4 + 2, [op.name for op in no_ops]
  step()
  for i, v in enumerate(variables):  # d/dv sum(v^2) = 2v; the mean over towers is 2v.
    for copy in v.values:
      np.testing.assert_allclose(copy.numpy(), np.full([3], i * (1 - 0.2), np.float32))


@pytest.mark.parametrize("kind", ["mirrored", "parameter_server"])
def test_the_updates_group_sits_on_a_non_slot_device(kind):
  """The no-ops that wait for the updates are placed: the group's root on the first
  non-slot device, where `_finish` runs (unplaced, it would land on the caller's device,
  and with parameter servers add a control edge to the worker and back)."""
  if kind == "mirrored":
    s = ds.MirroredStrategy(CPUS[:2])
  else:
    s = ds.ParameterServerStrategy(worker_devices=CPUS[:2], ps_devices=CPUS[2:])
  with s.scope():
    variables = [tf.Variable(np.ones([3], np.float32), name=f"v{i}") for i in range(4)]
    step_counter = tf.Variable(0, dtype=tf.int64, name="step")
    opt = optimizers.GradientDescent(0.1)

  def tower_fn():
    return opt.minimize(lambda: tf.add_n([tf.reduce_sum(v * v) for v in variables]),
                        var_list=variables, global_step=step_counter)

  @tf.function
  def step():
    with s.scope():
      s.call_for_each_tower(tower_fn)

  graph = step.get_concrete_function().graph
  unplaced = [op.name for op in graph.get_operations() if op.type == "NoOp" and not op.device]
  assert not unplaced
  step()
  assert int(step_counter.numpy() if kind == "parameter_server" else
             step_counter.values[0].numpy()) == 1


def test_keras_model_trains_on_four_towers_like_one_device():
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(11)
  x = rng.normal(size=(4, BATCH, 6)).astype(np.float32)
  y = rng.normal(size=(4, BATCH, 2)).astype(np.float32)

  def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    return model

  ref = build()
  ref_opt = optimizers.Adam(0.01)
  for i in range(4):
    ref_opt.minimize(lambda i=i: tf.reduce_mean(tf.square(ref(x[i]) - y[i])),
                     var_list=ref.trainable_variables)

  s = ds.MirroredStrategy(CPUS)
  with s.scope():
    model = build()
    opt = optimizers.Adam(0.01)

  @tf.function
  def step(xb, yb):
    parts = [ds.values.PerDevice(dict(zip(s.worker_devices, tf.split(t, 4), strict=True)))
             for t in (xb, yb)]
    s.call_for_each_tower(lambda xp, yp: opt.minimize(
        lambda: tf.reduce_mean(tf.square(model(xp) - yp)), var_list=model.trainable_variables),
        *parts)

  with s.scope():
    for i in range(4):
      step(x[i], y[i])
  for got, want in zip(model.trainable_variables, ref.trainable_variables, strict=True):
    np.testing.assert_allclose(np.asarray(got.numpy()), np.asarray(want.numpy()),
                               rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.parametrize("reader", [1, None])
@pytest.mark.parametrize("build", [True, False], ids=["built", "deferred"])
def test_optimizer_checkpoint_four_towers_to_one(tmp_path, name, reader, build):
  ids, y = _data(5)
  # Train 3 steps on 4 towers and save; continue 2 steps there for the expected values.
  s4, emb, w, opt, _ = _distributed(name, True, 4, "eager", ids[:3], y[:3])
  path = tf.train.Checkpoint(emb=emb, w=w, opt=opt).save(str(tmp_path / "ckpt"))

  def continue_training(strategy, emb, w, opt, steps):
    for i in steps:
      if strategy is None:
        opt.minimize(_loss_fn(emb, w, ids[i], y[i], True), var_list=[emb, w])
      else:
        with strategy.scope():
          strategy.call_for_each_tower(lambda i=i: opt.minimize(
              _loss_fn(emb, w, ids[i], y[i], True), var_list=[emb, w]))

  # Restore into 1 tower (or no strategy) with fresh optimizer state.
  s1 = None if reader is None else ds.MirroredStrategy(CPUS[:reader])
  with (s1.scope() if s1 is not None else ds.DefaultStrategy().scope()):
    emb1, w1 = _make_vars()
    opt1 = OPTIMIZERS[name]()
    emb1.assign(tf.zeros_like(emb1))
    if build:
      opt1.build([emb1, w1])
  status = tf.train.Checkpoint(emb=emb1, w=w1, opt=opt1).restore(path)
  if build:
    status.assert_consumed()
  else:
    # Slots are created as they are restored; non-slot variables on the first apply.
    status.assert_existing_objects_matched()
  for slot_name in opt.get_slot_names():
    np.testing.assert_array_equal(np.asarray(opt1.get_slot(emb1, slot_name).numpy()),
                                  opt.get_slot(emb, slot_name).values[0].numpy())
  continue_training(s4, emb, w, opt, [3, 4])
  continue_training(s1, emb1, w1, opt1, [3, 4])
  if not build:
    status.assert_consumed()
  np.testing.assert_allclose(np.asarray(emb1.numpy()), emb.values[0].numpy(), rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(np.asarray(w1.numpy()), w.values[0].numpy(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("towers", [0, 2])
def test_mistaken_arguments_are_named_at_the_call(mode, towers):
  # Once: a var_list given as one variable said "every gradient is None" (eager) and
  # raised OperatorNotAllowedInGraphError (tf.function); a gradient of another shape or
  # dtype than its variable failed in TensorFlow's ResourceApplyGradientDescent
  # (InvalidArgumentError eager, ValueError/TypeError traced); a tensor global_step was
  # refused by update(); build(None) raised "'NoneType' object is not iterable".
  s = ds.MirroredStrategy(CPUS[:towers]) if towers else ds.get_distribution_strategy()
  with s.scope():
    v = tf.Variable([1.0, 2.0], name="weights")
    opt = optimizers.GradientDescent(0.1)

  def in_towers(fn):
    def step():
      with s.scope():
        return s.call_for_each_tower(fn)
    return tf.function(step)() if mode == "function" else step()

  loss = lambda: tf.reduce_sum(v * v)  # noqa: E731
  with pytest.raises(TypeError, match=r"^minimize\(\) takes var_list, a list of variables. "
                     r"Received: var_list=<variable 'weights'>, one variable, not a list. Pass "
                     r"\[variable\]"):
    in_towers(lambda: opt.minimize(loss, var_list=v))
  with pytest.raises(ValueError, match=r"^minimize\(\) got var_list=\[\], which names no "
                     r"variable to train"):
    in_towers(lambda: opt.minimize(loss, var_list=[]))
  with pytest.raises(TypeError, match=r"^compute_gradients\(\) takes var_list, a list of "
                     r"variables. Received: var_list\[1\]=<tf.Tensor.*\((Eager|Symbolic)Tensor\)"):
    in_towers(lambda: opt.compute_gradients(loss, var_list=[v, tf.constant(1.0)]))
  with pytest.raises(TypeError, match=r"^compute_gradients\(\) takes loss, a callable that "
                     r"returns the loss .*Received: loss=None"):
    in_towers(lambda: opt.compute_gradients(None, var_list=[v]))
  with pytest.raises(ValueError, match=r"^apply_gradients\(\) got a gradient of shape \(3,\) "
                     r"for variable 'weights.*' of shape \(2,\). Pair each gradient with "
                     r"its own variable"):
    in_towers(lambda: opt.apply_gradients([(tf.ones([3]), v)]))
  with pytest.raises(TypeError, match=r"^apply_gradients\(\) got a gradient of dtype float64 "
                     r"for variable 'weights.*' of dtype float32. Cast the gradient"):
    in_towers(lambda: opt.apply_gradients([(tf.ones([2], tf.float64), v)]))
  with pytest.raises(TypeError, match=r"^apply_gradients\(\) takes a variable as global_step"):
    in_towers(lambda: opt.apply_gradients([(tf.ones([2]), v)], global_step=tf.constant(0)))
  with pytest.raises(TypeError, match=r"^build\(\) takes var_list, a list of variables. "
                     r"Received: var_list=None"):
    optimizers.Adam().build(None)
  in_towers(lambda: opt.apply_gradients([(tf.ones([2]), v)]))  # Still trains: the
  step = 0.1 * max(towers, 1)  # towers' gradients are summed.
  np.testing.assert_allclose(v.numpy(), [1.0 - step, 2.0 - step], rtol=1e-6)


@pytest.mark.parametrize("make,name,received", [
    (lambda: ds.optimizers.GradientDescent("x"), "learning_rate", "'x' (str)"),
    (lambda: ds.optimizers.GradientDescent(None), "learning_rate", "None (NoneType)"),
    (lambda: ds.optimizers.Momentum(0.1, None), "momentum", "None (NoneType)"),
    (lambda: ds.optimizers.Adam(beta1="0.9"), "beta1", "'0.9' (str)"),
    (lambda: ds.optimizers.Adam(epsilon=True), "epsilon", "True (bool)"),
])
def test_hyperparameters_of_another_kind_are_refused_at_construction(make, name, received):
  """They were accepted and failed at the first apply, in TensorFlow's cast."""
  with pytest.raises(TypeError, match=rf"\({name}=\.\.\.\) takes a number, a scalar tensor "
                     rf"or variable, or a callable that returns one \(a schedule\)\. "
                     rf"Received: {re.escape(received)}"):
    make()


def test_hyperparameters_of_every_accepted_kind_train_alike():
  results = []
  for lr in (0.5, np.float32(0.5), tf.constant(0.5), tf.Variable(0.5), lambda: 0.5):
    v = tf.Variable(1.0)
    ds.optimizers.GradientDescent(lr).apply_gradients([(tf.constant(2.0), v)])
    results.append(float(v))
  assert results == [0.0] * 5


@pytest.mark.parametrize("kind", ["tensor", "variable", "callable"])
def test_adam_betas_of_every_accepted_kind_train_like_numbers(kind):
  """A callable beta1/beta2 (a schedule) failed at the first apply: the beta powers were
  made with tf.constant(callable) and advanced with tf.cast(callable)."""
  wrap = {"tensor": tf.constant, "variable": tf.Variable,
          "callable": lambda x: (lambda: x)}[kind]
  results = []
  for make in (lambda: optimizers.Adam(0.1, beta1=0.8, beta2=0.99, epsilon=1e-6),
               lambda: optimizers.Adam(wrap(0.1), beta1=wrap(0.8), beta2=wrap(0.99),
                                       epsilon=wrap(1e-6))):
    v = tf.Variable([1.0, -2.0])
    opt = make()
    for _ in range(3):
      opt.apply_gradients([(tf.constant([0.5, 1.5]), v)])
    results.append((v.numpy(), float(opt.beta1_power.numpy()), float(opt.beta2_power.numpy())))
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
  np.testing.assert_allclose(results[1][1:], [0.8**4, 0.99**4], rtol=1e-6)
  np.testing.assert_allclose(results[0][0], np_adam(np.array([1.0, -2.0]), [np.array(
      [0.5, 1.5])] * 3, lr=0.1, b1=0.8, b2=0.99, eps=1e-6), rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: optimizers.GradientDescent(0.1),
                                  lambda: optimizers.Momentum(0.1, 0.9),
                                  lambda: optimizers.Adam(0.1)], ids=["sgd", "momentum", "adam"])
@pytest.mark.parametrize("towers", [0, 2], ids=["no_strategy", "two_towers"])
def test_integer_variable_is_refused_by_name(make, towers):
  """An integer variable reached TensorFlow's kernels: 'No OpKernel was registered to
  support Op ResourceApplyGradientDescent ... T=DT_INT32' (Adam: 'Cannot convert 0.9 to
  EagerTensor of dtype int32'), naming neither the variable nor the fix."""
  s = ds.MirroredStrategy(CPUS[:towers]) if towers else None
  with s.scope() if s else contextlib.nullcontext():
    count = tf.Variable([3, 4], name="count")
    opt = make()
    message = (r"apply_gradients\(\) got variable 'count' of dtype int32.*floating-point "
               r"or complex.*trainable=False")
    with pytest.raises(TypeError, match=message):
      if s:
        s.call_for_each_tower(lambda: opt.apply_gradients([(tf.constant([1, 1]), count)]))
      else:
        opt.apply_gradients([(tf.constant([1, 1]), count)])
    with pytest.raises(TypeError, match=message.replace("apply_gradients", "build")):
      opt.build([count])


def test_adam_beta_powers_keep_float32_precision_beside_a_float16_variable():
  """The beta powers took the dtype of the variable with the smallest name: float16
  beside float32 variables, and each float32 update took a bias correction rounded to
  float16 (0.8024 for 0.8 after two steps)."""
  half = tf.Variable(tf.ones([2], tf.float16), name="a_half")
  single = tf.Variable([1.0, -1.0], name="b_single")
  opt = optimizers.Adam(0.1)
  grads = [np.array([1.0, 0.5], np.float32), np.array([0.25, -2.0], np.float32)]
  for g in grads:
    opt.apply_gradients([(tf.constant(g, tf.float16), half), (tf.constant(g), single)])
  assert opt.beta1_power.dtype == tf.float32
  np.testing.assert_allclose(single.numpy(), np_adam(np.array([1.0, -1.0]), grads, lr=0.1),
                             rtol=1e-6)
  np.testing.assert_allclose(half.numpy(), np_adam(np.ones(2), grads, lr=0.1), rtol=1e-3)


@pytest.mark.parametrize("dtype, rtol", [(tf.float16, 2e-3), (tf.bfloat16, 2e-2)],
                         ids=["float16", "bfloat16"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("towers", [0, 2], ids=["no_strategy", "two_towers"])
def test_adam_trains_half_precision_variables_as_float32_does(dtype, rtol, sparse, towers):
  """Adam in half precision broke its own formulas: in float16 epsilon (1e-8) rounds to
  0, so an element with no gradient yet became 0/0 = NaN; in bfloat16 beta2 (0.999)
  rounds to 1, so `v` stayed 0 and each step was `lr * m / 1e-8` (1.0 went to -466944
  in two steps). Slots are float32 and the update is computed in float32 now."""
  grads = [np.array([[1.0], [0.0], [0.5]]), np.array([[0.5], [0.0], [-0.25]])]
  expected = np_adam(np.ones((3, 1)), grads, lr=0.1)
  s = ds.MirroredStrategy(CPUS[:towers]) if towers else None
  with s.scope() if s else contextlib.nullcontext():
    var = tf.Variable(tf.ones([3, 1], dtype), name="half")
    opt = optimizers.Adam(0.1, loss_reduction="sum")

  def apply(g):
    grad = tf.constant(g / max(towers, 1), dtype)
    if sparse:  # Rows 0 and 2 only: row 1 is never named.
      grad = tf.IndexedSlices(tf.gather(grad, [0, 2]), tf.constant([0, 2]))
    opt.apply_gradients([(grad, var)])

  for g in grads:
    if s:
      s.call_for_each_tower(apply, g)
    else:
      apply(g)
  np.testing.assert_allclose(np.asarray(var.numpy(), np.float64), expected, rtol=rtol)
  assert var.dtype == dtype
  assert opt.get_slot(var, "m").dtype == tf.float32


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("towers", [0, 2], ids=["no_strategy", "two_towers"])
def test_momentum_trains_bfloat16_variables_with_a_float32_accumulator(nesterov, sparse,
                                                                      towers):
  """Momentum kept a bfloat16 variable's accumulator in bfloat16, with a momentum of
  0.898 for 0.9, and each gradient added to an accumulator ten times its size lost its
  low bits: after 30 steps of a constant gradient a variable was up to 3.5% off the
  formula (-4.25 for -4.41). The accumulator is float32 now; only the variable is
  rounded."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top  # TensorFlow's own dependency

  bf16 = ml_dtypes.bfloat16
  grads = [np.array([[1.0], [0.0], [0.75]])] * 30
  # The reference: the formula in float64, the variable rounded to bfloat16 each step
  # as the optimizer rounds its float32 update.
  var_ref, accum = np.full((3, 1), 4.0).astype(bf16), np.zeros((3, 1))
  for g in grads:
    accum = 0.9 * accum + g
    step = np.float32(0.05 * (g + 0.9 * accum if nesterov else accum)).astype(bf16)
    var_ref = (var_ref.astype(np.float32) - step.astype(np.float32)).astype(bf16)
  s = ds.MirroredStrategy(CPUS[:towers]) if towers else None
  with s.scope() if s else contextlib.nullcontext():
    var = tf.Variable(tf.fill([3, 1], tf.constant(4.0, tf.bfloat16)), name="half")
    opt = optimizers.Momentum(0.05, 0.9, use_nesterov=nesterov, loss_reduction="sum")

  def apply(g):
    grad = tf.constant(g / max(towers, 1), tf.bfloat16)
    if sparse:  # Rows 0 and 2 only.
      grad = tf.IndexedSlices(tf.gather(grad, [0, 2]), tf.constant([0, 2]))
    opt.apply_gradients([(grad, var)])

  for g in grads:
    if s:
      s.call_for_each_tower(apply, g)
    else:
      apply(g)
  np.testing.assert_allclose(np.asarray(var.numpy(), np.float64),
                             var_ref.astype(np.float64), rtol=1e-2)
  assert var.dtype == tf.bfloat16
  assert opt.get_slot(var, "momentum").dtype == tf.float32


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float64_variables_get_float64_hyperparameters(name):
  """Python-number hyperparameters went through float32 (tf.cast(0.1, tf.float64) is
  0.10000000149...): float64 variables drifted from the formula by about 1e-8."""
  init = np.array([1.0, -2.0, 0.5])
  grads = [np.array([0.3, -1.0, 2.0]), np.array([1.0, 0.5, -0.25])]
  var = tf.Variable(init)
  opt = OPTIMIZERS[name]()
  for g in grads:
    opt.apply_gradients([(tf.constant(g), var)])
  np.testing.assert_allclose(var.numpy(), NUMPY[name](init, grads), rtol=1e-13, atol=0)
