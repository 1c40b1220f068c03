"""Keras 3 in diststrat towers (docs/keras.md), in custom loops; model.fit is in test_keras_fit.py.

Every case runs under the default strategy, MirroredStrategy and ParameterServerStrategy,
eagerly and inside `tf.function`, and is compared with one device on the same global
batch: stateful layers (BatchNormalization, Dropout), Keras optimizers called in towers,
nested reductions, what `apply_gradients` returns, SavedModels served without
diststrat, and the bridge's error messages.
"""

import collections
import functools
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from conftest import CPUS
from keras_cases import (STRATEGIES, TOL, assert_all_close, assert_copies_equal, copies,
                         frozen)


MODES = ["eager", "function"]


def _in_mode(fn, mode):
  return tf.function(fn) if mode == "function" else fn


def _batches(strategy, data):
  """Per-tower parts of each global batch in `data` (a tf.data.Dataset of batches)."""
  with strategy.scope():
    return list(strategy.distribute_dataset(lambda: data))


# --- BatchNormalization and Dropout in towers ---------------------------------------------

BN_STEPS, BN_BATCH, BN_MOMENTUM = 3, 32, 0.9


def _bn_inputs():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(BN_STEPS, BN_BATCH, 4)) * [1, 2, 3, 4] + [0, 1, 2, 3]).astype(
      np.float32)


def _variance_bound(x, towers):
  """How much lower unsynchronized BN's moving variance is than one device's.

  The mean of the towers' (biased) batch variances is the batch's variance minus the
  variance of the towers' means; the moving average carries that difference along.
  """
  bound = np.zeros(x.shape[-1])
  for batch in x:
    means = np.stack([part.mean(0) for part in np.split(batch, towers)])
    bound = BN_MOMENTUM * bound + (1 - BN_MOMENTUM) * means.var(0)
  return bound


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("synchronized", [False, True])
@pytest.mark.parametrize("name", ["mirrored1", "mirrored2", "mirrored4", "ps4"])
def test_batch_normalization_moving_statistics(name, synchronized, mode):
  x = _bn_inputs()
  reference = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, synchronized=synchronized)
  for batch in x:
    reference(batch, training=True)
  strategy = STRATEGIES[name]()
  with strategy.scope():
    bn = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, synchronized=synchronized)
    bn.build((None, 4))
  step = _in_mode(lambda b: strategy.call_for_each_tower(
      lambda part: bn(part, training=True), b), mode)
  with strategy.scope():
    for batch in _batches(strategy, tf.data.Dataset.from_tensor_slices(x)):
      step(batch)
      assert_copies_equal(bn.weights)  # After every step, never diverging copies.
  np.testing.assert_allclose(bn.moving_mean.numpy(), reference.moving_mean.numpy(), **TOL)
  lower_by = reference.moving_variance.numpy() - bn.moving_variance.numpy()
  expected = 0.0 if synchronized else _variance_bound(x, strategy.num_towers)
  np.testing.assert_allclose(lower_by, expected, rtol=1e-4, atol=2e-6)
  if strategy.num_towers > 1 and not synchronized:
    assert np.all(lower_by > 1e-3)  # The bound is not vacuous here.


@pytest.mark.parametrize("mode", MODES)
def test_a_keras_variable_given_one_tensor_by_every_tower_gets_one_devices_value(mode):
  """Towers writing the same tensor object (one made outside the towers) to a Keras
  variable merged only tower 0's weighted part: `assign(five)` on 2 towers gave 2.5."""
  five = tf.constant([5.0, 5.0, 5.0])
  reference = keras.layers.BatchNormalization()
  reference.build((None, 3))
  reference.moving_mean.assign(five)
  reference.moving_mean.assign_add(five)
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    bn = keras.layers.BatchNormalization()
    bn.build((None, 3))

  def write():
    bn.moving_mean.assign(five)
    bn.moving_mean.assign_add(five)

  with strategy.scope():
    _in_mode(lambda: strategy.call_for_each_tower(write), mode)()
  assert_copies_equal([bn.moving_mean])
  np.testing.assert_array_equal(bn.moving_mean.numpy(), reference.moving_mean.numpy())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored4", "ps4"])
def test_dropout_masks_differ_across_towers(name, mode):
  calls = 3
  reference = keras.layers.Dropout(0.5, seed=7)
  for _ in range(calls):
    reference(tf.ones((4, 16)), training=True)
  strategy = STRATEGIES[name]()
  with strategy.scope():
    dropout = keras.layers.Dropout(0.5, seed=7)
  step = _in_mode(lambda: strategy.call_for_each_tower(
      lambda: dropout(tf.ones((4, 16)), training=True)), mode)
  with strategy.scope():
    for _ in range(calls):
      masks = [np.asarray(m) != 0 for m in step().values]
      assert len({m.tobytes() for m in masks}) == strategy.num_towers, "one mask repeated"
      assert_copies_equal([dropout.seed_generator.state])
  # The state advances once per call, as on one device (tower 0 draws its stream).
  np.testing.assert_array_equal(copies(dropout.seed_generator.state)[0],
                                reference.seed_generator.state.numpy())
  with strategy.scope():
    first_tower = strategy.call_for_each_tower(
        lambda: dropout(tf.ones((4, 16)), training=True)).values[0]
  np.testing.assert_array_equal(first_tower, reference(tf.ones((4, 16)), training=True))


@pytest.mark.parametrize("mode", MODES)
def test_unseeded_keras_random_in_towers_repeats_after_set_random_seed(mode):
  # `keras.random.*` without a seed draws from Keras's global seed generator, which
  # Keras keeps per thread. Each pooled tower thread kept its own across calls and
  # strategies: after `keras.utils.set_random_seed` a second run drew other numbers (the
  # default strategy repeats), and a strategy on other devices reused the first one's
  # state variable (ValueError: no component on tower 0's device). The towers draw from
  # the calling thread's generator now.
  def run(strategy, calls=2):
    keras.utils.set_random_seed(3)
    step = _in_mode(lambda: strategy.call_for_each_tower(lambda: keras.random.normal((3,))),
                    mode)
    with strategy.scope():
      return [[np.asarray(v) for v in strategy.unwrap(step())] for _ in range(calls)]

  reference = run(ds.DefaultStrategy())
  assert _same(reference, run(ds.DefaultStrategy()))  # What a program expects.
  first = run(ds.MirroredStrategy(CPUS[:2]))
  again = run(ds.MirroredStrategy(CPUS[:2]))
  elsewhere = run(ds.MirroredStrategy(CPUS[2:]))
  assert _same(first, again) and _same(first, elsewhere)
  # Tower 0 draws one device's stream; tower 1 its own.
  assert _same([call[:1] for call in first], reference)
  assert not np.array_equal(first[0][0], first[0][1])


def test_layers_created_in_towers_are_named_as_in_the_calling_thread():
  # Keras numbers default names per thread. A layer created in a tower was named by the
  # counters of the pooled thread that ran the tower, which every earlier call from any
  # thread had advanced: another thread's program got other names (and two threads
  # calling at once got names that varied from run to run). Tower 0 counts in the
  # calling thread's counters now, as the default strategy does, and each other tower
  # in a copy, so it names its layer as tower 0 does.
  import threading  # pylint: disable=g-import-not-at-top

  def program(strategy):
    keras.layers.Dense(1)  # The calling thread's own "dense".
    names = []

    def fn():
      layer = keras.layers.Dense(2)
      layer(tf.ones([1, 3]))
      names.append((ds.get_tower_context().tower_id, layer.name))

    with strategy.scope():
      for _ in range(3):
        strategy.call_for_each_tower(fn)
    return names

  def in_a_new_thread(make_strategy):
    got = []
    thread = threading.Thread(target=lambda: got.append(program(make_strategy())))
    thread.start()
    thread.join(timeout=120)
    return got[0]

  reference = in_a_new_thread(ds.DefaultStrategy)  # Named in the calling thread.
  assert [name for _, name in reference] == ["dense_1", "dense_2", "dense_3"]
  for make in (lambda: ds.MirroredStrategy(CPUS[:2]), lambda: ds.MirroredStrategy(CPUS[1:])):
    names = in_a_new_thread(make)
    towers = {tower for tower, _ in names}
    assert [name for tower, name in names if tower == 0] == [n for _, n in reference]
    for tower in towers:
      assert [name for t, name in names if t == tower] == [n for _, n in reference]


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_created_in_a_tower_follows_the_calling_threads_dtype_policy(mode):
  # Keras keeps the global dtype policy per thread: a layer created in a tower took the
  # tower thread's default, float32, where the default strategy's computes in the
  # policy the program set.
  def run(strategy):
    made = []

    def fn(x):
      if not made:
        made.append(keras.layers.Dense(2, kernel_initializer="ones"))
      return made[0](x)

    step = _in_mode(lambda x: strategy.call_for_each_tower(fn, x), mode)
    with strategy.scope():
      out = step(tf.ones([2, 3]))
    return made[0].dtype_policy.name, [o.dtype for o in strategy.unwrap(out)]

  before = keras.config.dtype_policy()
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    reference = run(ds.DefaultStrategy())
    got = run(ds.MirroredStrategy(CPUS[:2]))
  finally:
    keras.config.set_dtype_policy(before)
  assert reference == ("mixed_bfloat16", [tf.bfloat16])
  assert got == ("mixed_bfloat16", [tf.bfloat16] * 2)


def _same(a, b):
  return len(a) == len(b) and all(
      len(x) == len(y) and all(np.array_equal(u, v) for u, v in zip(x, y, strict=True))
      for x, y in zip(a, b, strict=True))


def test_plain_variables_keep_the_aggregation_none_error():
  strategy = STRATEGIES["mirrored2"]()
  with strategy.scope():
    v = tf.Variable(1.0)
    with pytest.raises(ValueError, match=r"Cannot assign\(\) the mirrored variable .* "
                                         r"aggregation NONE"):
      strategy.call_for_each_tower(lambda: v.assign(2.0))


# --- Keras optimizers called in towers (custom loop) ---------------------------------------

OPT_STEPS = 4
KERAS_OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
}


def _regression_data(batch=32, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(OPT_STEPS * batch, 6)).astype(np.float32),
          rng.normal(size=(OPT_STEPS * batch, 1)).astype(np.float32))


def _small_model(weights=None):
  keras.utils.set_random_seed(3)
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(1)])
  if weights is not None:
    model.set_weights(weights)
  return model


def _keras_custom_loop(strategy, make_optimizer, mode, batch=32):
  """Trains with a Keras loss and a Keras optimizer called in every tower."""
  x, y = _regression_data(batch)
  with strategy.scope():
    model = _small_model(_small_model().get_weights())
    optimizer = make_optimizer()
  loss_fn = keras.losses.MeanSquaredError()  # Divides by the towers, as under tf.distribute.

  def tower_fn(xb, yb):
    with tf.GradientTape() as tape:
      loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

  returned = _run_steps(strategy, tower_fn, mode, (x, y), batch,
                        lambda: assert_copies_equal(model.weights + optimizer.variables))
  return model, optimizer, returned


def _run_steps(strategy, tower_fn, mode, data, batch, after_step=None):
  """Runs `tower_fn` in every tower on each global batch of `data`; returns each result."""
  step = _in_mode(lambda *parts: strategy.call_for_each_tower(tower_fn, *parts), mode)
  returned = []
  with strategy.scope():
    for parts in _batches(strategy, tf.data.Dataset.from_tensor_slices(data).batch(batch)):
      returned.append(_read_now(step(*parts)))
      if after_step is not None:
        after_step()
  return returned


def _read_now(value):
  """What a step returned, read now (a variable returned eagerly changes later)."""
  return None if value is None else np.asarray(tf.convert_to_tensor(value))


@functools.lru_cache(maxsize=None)
def _one_device_keras_loop(optimizer, batch=32):
  """One device's weights and step count after the loop with KERAS_OPTIMIZERS[optimizer]:
  the reference of every strategy and mode, computed once."""
  model, opt, _ = _keras_custom_loop(ds.DefaultStrategy(), KERAS_OPTIMIZERS[optimizer],
                                     "eager", batch)
  return frozen(model.get_weights()), int(opt.iterations.numpy())


# Every optimizer on 4 towers in a tf.function; some eagerly, and on 2 towers.
OPTIMIZER_CASES = [(o, s, "function") for o in sorted(KERAS_OPTIMIZERS)
                   for s in ("mirrored4", "ps4")] + [
                       ("sgd_momentum", "mirrored2", "eager"), ("adam", "mirrored4", "eager"),
                       ("adamw", "ps4", "eager"), ("rmsprop", "ps2", "function")]


@pytest.mark.parametrize("optimizer,name,mode", OPTIMIZER_CASES)
def test_keras_optimizer_in_towers_matches_one_device(optimizer, name, mode):
  expected_weights, expected_iterations = _one_device_keras_loop(optimizer)
  model, opt, returned = _keras_custom_loop(STRATEGIES[name](), KERAS_OPTIMIZERS[optimizer],
                                            mode)
  assert_all_close(model.get_weights(), expected_weights)
  assert int(opt.iterations.numpy()) == expected_iterations == OPT_STEPS
  # apply_gradients returns the step count; the tf.function step returned it.
  assert [int(np.asarray(r)) for r in returned] == list(range(1, OPT_STEPS + 1))


def test_keras_optimizer_on_a_ragged_batch_matches_one_device():
  expected_weights, _ = _one_device_keras_loop("sgd_momentum", batch=41)
  model, _, _ = _keras_custom_loop(STRATEGIES["mirrored4"](), KERAS_OPTIMIZERS["sgd_momentum"],
                                   "function", batch=41)
  assert_all_close(model.get_weights(), expected_weights)


# --- diststrat's own optimizers: ragged batches, what apply_gradients returns -------------


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored4", "ps4"])
def test_a_keras_optimizer_created_outside_the_scope_is_refused_in_towers(name, mode,
                                                                          optimizer_name):
  # SGD applied once per tower: the weights were one device's, but `iterations` (a
  # learning-rate schedule, Adam's bias correction) counted every tower's apply.
  # Adam failed in TensorFlow's "Mixing" error, with a note about tf.distribute.
  strategy = STRATEGIES[name]()
  x, y = _regression_data()
  optimizer = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer_name](0.1)
  with strategy.scope():
    model = _small_model()

  def tower_fn(xb, yb):
    with tf.GradientTape() as tape:
      loss = keras.losses.MeanSquaredError()(yb, model(xb, training=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables, strict=True))

  with pytest.raises((ds.errors.ContextError, RuntimeError)) as raised:
    _run_steps(strategy, tower_fn, mode, (x, y), 32)
  said = " ".join([str(raised.value)] + getattr(raised.value, "__notes__", []))
  assert "reate the optimizer inside `with strategy.scope():`" in said, said
  assert "tf.distribute strategy's scope outside" not in said, said
  assert int(optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_keras_optimizer_of_the_scope_building_outside_it_names_the_build_and_the_fix(
    mode):
  """Created in the scope, not built, first applied outside it: the ContextError named
  `colocate_vars_with()`, Keras's internal call. The fix it names (build in the scope,
  apply anywhere) gives one device's weights, every copy equal."""
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    model = _small_model()
    optimizer = keras.optimizers.Adam(0.1)

  def apply_to(opt, variables):
    opt.apply_gradients(zip([tf.ones_like(v) for v in variables], variables, strict=True))

  apply = _in_mode(lambda opt: apply_to(opt, model.trainable_variables), mode)
  before = model.get_weights()
  with pytest.raises(ds.errors.ContextError, match=(
      r"^A Keras optimizer created in the scope of MirroredStrategy.* is creating its "
      r"variables \(its state for '.*kernel.*'\) in the default tower context \(no "
      r"strategy entered\), outside that scope: .* Build the optimizer inside "
      r"`with strategy.scope\(\):` \(optimizer.build\(model.trainable_variables\)\), or "
      r"make its first apply_gradients\(\) there.$")):
    apply(optimizer)
  for got, expected in zip(model.get_weights(), before, strict=True):
    np.testing.assert_array_equal(got, expected)
  with strategy.scope():
    built = keras.optimizers.Adam(0.1)
    built.build(model.trainable_variables)
  apply(built)
  one_device = _small_model(before)
  apply_to(keras.optimizers.Adam(0.1), one_device.trainable_variables)
  assert_all_close(model.get_weights(), one_device.get_weights())
  assert_copies_equal(model.weights)


def _ds_custom_loop(strategy, mode, batch, global_step=False):
  x, y = _regression_data(batch, seed=1)
  with strategy.scope():
    model = _small_model(_small_model().get_weights())
    optimizer = ds.optimizers.Momentum(0.05, momentum=0.9)
    step_counter = tf.Variable(0, dtype=tf.int64, trainable=False) if global_step else None

  def tower_fn(xb, yb):
    def loss():
      return tf.reduce_mean(tf.square(model(xb, training=True) - yb))
    return optimizer.minimize(loss, var_list=model.trainable_variables,
                              global_step=step_counter)

  return model, _run_steps(strategy, tower_fn, mode, (x, y), batch)


@functools.lru_cache(maxsize=None)
def _ds_one_device_weights(batch):
  """One device's weights after `_ds_custom_loop`: every strategy's and mode's reference."""
  model, _ = _ds_custom_loop(ds.DefaultStrategy(), "eager", batch=batch)
  return frozen(model.get_weights())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored4", "ps4"])
def test_ds_optimizer_on_a_ragged_batch_matches_one_device(name, mode):
  # 41 examples on 4 towers: 11/10/10/10. Each tower's mean loss weighs n_i / 41.
  model, _ = _ds_custom_loop(STRATEGIES[name](), mode, batch=41)
  assert_all_close(model.get_weights(), _ds_one_device_weights(41))


@pytest.mark.parametrize("global_step", [False, True])
@pytest.mark.parametrize("name", ["default", "mirrored4", "ps4"])
def test_ds_apply_gradients_result_is_returned_by_a_tf_function(name, global_step):
  _, returned = _ds_custom_loop(STRATEGIES[name](), "function", batch=32,
                                global_step=global_step)
  if global_step:
    assert [int(np.asarray(r)) for r in returned] == list(range(1, OPT_STEPS + 1))
  else:
    assert returned == [None] * OPT_STEPS


# --- layers that already worked keep working (Conv2D, Embedding + LSTM/GRU, attention) ---


def _layer_model(kind):
  keras.utils.set_random_seed(5)
  if kind == "conv":
    layers = [keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, activation="relu"),
              keras.layers.Flatten(), keras.layers.Dense(1)]
  elif kind in ("lstm", "gru"):
    rnn = keras.layers.LSTM(5) if kind == "lstm" else keras.layers.GRU(5)
    layers = [keras.Input((7,), dtype="int32"), keras.layers.Embedding(11, 4), rnn,
              keras.layers.Dense(1)]
  else:
    inputs = keras.Input((5, 4))
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(attended))
    return keras.Model(inputs, outputs)
  return keras.Sequential(layers)


def _layer_data(kind, batch=16, steps=3):
  rng = np.random.default_rng(2)
  shape = {"conv": (6, 6, 2), "lstm": (7,), "gru": (7,), "attention": (5, 4)}[kind]
  x = rng.integers(0, 11, (steps * batch,) + shape).astype(np.int32) if kind in (
      "lstm", "gru") else rng.normal(size=(steps * batch,) + shape).astype(np.float32)
  return x, rng.normal(size=(steps * batch, 1)).astype(np.float32)


def _train_layer_model(strategy, kind):
  x, y = _layer_data(kind)
  with strategy.scope():
    model = _layer_model(kind)
    optimizer = ds.optimizers.Momentum(0.05, momentum=0.9)

  def tower_fn(xb, yb):
    return optimizer.minimize(lambda: tf.reduce_mean(tf.square(model(xb) - yb)),
                              var_list=model.trainable_variables)

  _run_steps(strategy, tower_fn, "function", (x, y), 16)
  return model.get_weights()


@pytest.mark.parametrize("kind", ["conv", "lstm", "gru", "attention"])
def test_keras_layers_with_ds_optimizers_match_one_device(kind):
  expected = _train_layer_model(ds.DefaultStrategy(), kind)
  assert_all_close(_train_layer_model(STRATEGIES["mirrored4"](), kind), expected)


# --- nested reduce, batch_reduce and gather -------------------------------------------------

Pair = collections.namedtuple("Pair", ["left", "right"])


def _tower_structure():
  i = float(ds.get_tower_context().tower_id)
  return {"a": tf.constant([i, 1.0]),
          "b": [tf.constant(i * 10.0), (tf.fill([2, 2], i), Pair(tf.constant(i), None))]}


def _leaves(structure):
  """Leaves of a structure, None dropped; wrapped values are leaves (tf.nest opens them)."""
  return ds.values._wrapped.flatten(structure)  # pylint: disable=protected-access


def _first_copy(value):
  return np.asarray(value.values[0] if isinstance(value, ds.values.DistributedValues)
                    else value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["default", "mirrored4", "ps4"])
def test_nested_reduce_batch_reduce_and_gather(name, mode):
  strategy = STRATEGIES[name]()
  towers = strategy.num_towers

  def run():
    per_tower = strategy.call_for_each_tower(_tower_structure)
    return (strategy.reduce("sum", per_tower), strategy.reduce("mean", per_tower),
            strategy.batch_reduce("sum", [(per_tower, None), (per_tower["a"], None)]),
            strategy.gather(per_tower, axis=0))

  with strategy.scope():
    total, mean, (batch_total, batch_a), gathered = _in_mode(run, mode)()
  per_tower = [_leaves({"a": np.array([i, 1.0], np.float32),
                        "b": [np.float32(i * 10), (np.full([2, 2], i, np.float32),
                                                   Pair(np.float32(i), None))]})
               for i in range(towers)]
  by_leaf = list(zip(*per_tower, strict=True))
  for result in (total, mean, batch_total, gathered):  # The same structure back.
    assert sorted(result) == ["a", "b"] and isinstance(result["b"][1][1], Pair)
    assert result["b"][1][1].right is None and isinstance(result["b"][1], tuple)
  got = lambda result: [_first_copy(leaf) for leaf in _leaves(result)]
  assert_all_close(got(total), [np.sum(xs, 0) for xs in by_leaf])
  assert_all_close(got(mean), [np.mean(xs, 0) for xs in by_leaf])
  assert_all_close(got(batch_total), got(total))
  np.testing.assert_allclose(_first_copy(batch_a), [towers * (towers - 1) / 2, towers])
  assert_all_close(got(gathered), [np.stack(xs) if xs[0].ndim == 0 else np.concatenate(xs)
                                   for xs in by_leaf])


# --- SavedModel, served in a process that never imports diststrat ---------------------------

_LOADER = r"""
import json, sys
import numpy as np
import tensorflow as tf
x = np.arange(12, dtype="float32").reshape(3, 4) / 10.0
outputs = {}
for path, kind in json.loads(sys.argv[1]):
  loaded = tf.saved_model.load(path)
  if kind == "module":
    y = loaded(x)
  elif kind == "export":
    y = loaded.serve(x)
  else:
    y = list(loaded.signatures["serving_default"](tf.constant(x)).values())[0]
  outputs[path] = np.asarray(y).tolist()
assert not [m for m in sys.modules if m.split(".")[0] == "diststrat"], "diststrat imported"
print(json.dumps(outputs))
"""


class _Affine(tf.Module):

  def __init__(self):
    super().__init__()
    self.w = tf.Variable(tf.ones([4, 2]))
    self.b = tf.Variable([0.5, -0.5])

  @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
  def __call__(self, x):
    return tf.matmul(x, self.w) + self.b


@pytest.mark.processes
def test_saved_models_serve_without_diststrat(tmp_path):
  x = np.arange(12, dtype="float32").reshape(3, 4) / 10.0
  rng = np.random.default_rng(0)
  train_x, train_y = rng.random((64, 4), np.float32), rng.random((64, 2), np.float32)
  expected, jobs = {}, []
  for name in ("mirrored4", "ps4", "default"):
    strategy = STRATEGIES[name]()
    with strategy.scope():
      module = _Affine()
      module.w.assign(tf.reshape(tf.range(8, dtype=tf.float32), [4, 2]))
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
                                keras.layers.Dense(2)])
      model.compile(optimizer="adam", loss="mse")
    model.fit(train_x, train_y, batch_size=16, epochs=1, verbose=0)
    for kind, obj, save in (
        ("module", module, lambda o, p: tf.saved_model.save(o, p)),
        ("keras", model, lambda o, p: tf.saved_model.save(o, p)),
        ("export", model, lambda o, p: o.export(p, verbose=False))):
      path = str(tmp_path / f"{name}_{kind}")
      save(obj, path)
      jobs.append((path, kind))
      expected[path] = (module(x) if kind == "module" else model(x, training=False)).numpy()
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", _LOADER, json.dumps(jobs)], env=env,
                        cwd=str(tmp_path), capture_output=True, text=True, timeout=240,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  served = json.loads(proc.stdout.strip().splitlines()[-1])
  for path, value in expected.items():
    np.testing.assert_allclose(served[path], value, rtol=1e-6, atol=1e-6, err_msg=path)


# --- the bridge: what tf.distribute reports, its errors ------------------------------------


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("towers,axis", [(2, 0), (4, 0), (4, 1), (4, -1)])
def test_replica_context_all_gather_and_its_gradient_match_one_device(towers, axis, traced):
  """Contrastive losses gather every replica's embeddings: `all_gather` was missing
  (AttributeError). 5 rows (or columns) over the towers: unequal parts. An integer
  value gathered alongside keeps the float one's gradient."""
  x = np.arange(15, dtype=np.float32).reshape(5, 3) / 10
  w0 = np.array([1.0, -2.0, 0.5], np.float32)
  rows = axis == 0
  w = tf.Variable(w0)
  with tf.GradientTape() as tape:
    e = x * w if rows else tf.transpose(x * w)
    loss = tf.reduce_sum(tf.matmul(e, e, transpose_a=not rows, transpose_b=rows))
  expected = tape.gradient(loss, w).numpy()

  s = ds.MirroredStrategy(["/cpu:%d" % i for i in range(towers)])
  with s.scope():
    v = tf.Variable(w0)
  parts = ds.values.PerDevice({d: tf.constant(p) for d, p in zip(
      s.worker_devices, np.array_split(x, towers), strict=True)})

  def tower(x):
    with tf.GradientTape() as tape:
      e = x * v if rows else tf.transpose(x * v)
      ids = tf.ones(tf.shape(e), tf.int32)
      gathered = tf.distribute.get_replica_context().all_gather(
          {"e": e, "ids": ids}, axis=axis)
      loss = tf.reduce_sum(tf.matmul(e, gathered["e"], transpose_a=not rows,
                                     transpose_b=rows))
    return tape.gradient(loss, v), gathered

  with s.scope():
    step = lambda: s.call_for_each_tower(tower, parts)  # noqa: E731
    grads, gathered = tf.function(step)() if traced else step()
    total = s.reduce("sum", grads).primary.numpy()
  np.testing.assert_allclose(total, expected, rtol=1e-5)
  for component in gathered["e"].values:
    np.testing.assert_allclose(component.numpy(), x * w0 if rows else (x * w0).T, rtol=1e-6)
  for component in gathered["ids"].values:
    assert component.numpy().sum() == 15


def _replica_reductions():
  """What tf.distribute code reduces in a replica function: numbers, integers, means."""
  ctx = tf.distribute.get_replica_context()
  rid = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
  ints = tf.constant([1, 2], tf.int32) + rid
  return {
      "towers": ctx.all_reduce(tf.distribute.ReduceOp.SUM, 1.0),  # Counting the towers.
      "int_sum": ctx.all_reduce("sum", 2),
      "int_mean": ctx.all_reduce(tf.distribute.ReduceOp.MEAN, ints),
      "float_mean": ctx.all_reduce("mean", {"f": tf.cast(ints, tf.float32)}),
      "ints": ints,
  }


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("towers", [1, 2])
def test_replica_context_all_reduce_and_reduce_match_tf_distribute(towers, traced):
  """`all_reduce("sum", 1.0)` gave 1.0 on every tower count (the towers' equal Python
  numbers were taken as one value); a mean of integers floored where tf.distribute
  divides (`all_reduce` over several towers, and `reduce` with an `axis` on one)."""
  devices = ["/cpu:%d" % i for i in range(towers)]

  def results(strategy, traced):
    with strategy.scope():
      adapter = tf.distribute.get_strategy()

      def step():
        per_tower = adapter.run(_replica_reductions)
        local = {key: adapter.experimental_local_results(per_tower[key]) for key in per_tower}
        return local, adapter.reduce("mean", per_tower["ints"], axis=0)

      local, mean = tf.function(step)() if traced else step()
    return tf.nest.map_structure(lambda t: (t.dtype.name, t.numpy().tolist()), (local, mean))

  # tf.distribute's own eager run refuses Python numbers: its traced results are the
  # reference.
  expected = results(tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice()), traced=True)
  assert results(ds.MirroredStrategy(devices), traced) == expected


@pytest.mark.parametrize("towers", [1, 2])
def test_reduce_of_a_value_every_tower_returned_matches_tf_distribute(towers):
  """A sum of what every tower returned as one object (a Python number, a tensor made
  outside the function) was that value, as if there were one tower: with an axis it
  counts once per tower, without one it is refused, as tf.distribute does."""
  devices = ["/cpu:%d" % i for i in range(towers)]

  def results(strategy):
    outer = tf.constant([1.0, 2.0])
    out = []
    with strategy.scope():
      adapter = tf.distribute.get_strategy()
      for fn, axes in ((lambda: outer, (None, 0)), (lambda: 3.0, (None,))):
        for op in ("SUM", "MEAN"):
          for axis in axes:
            try:
              out.append(float(tf.reduce_sum(adapter.reduce(op, adapter.run(fn), axis=axis))))
            except ValueError:
              out.append("ValueError")
    return out

  expected = results(tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice()))
  assert results(ds.MirroredStrategy(devices)) == expected
  if towers > 1:
    s = ds.MirroredStrategy(devices)
    with s.scope(), pytest.raises(ValueError, match=r"reduce\('sum', value, axis=None\) takes "
                                  r"what run\(\) returned.*multiply the value by "
                                  r"num_replicas_in_sync"):
      tf.distribute.get_strategy().reduce("SUM", 3.0, axis=None)


@pytest.mark.parametrize("towers", [1, 2, 4])
def test_experimental_distribute_values_from_function_gives_each_tower_its_value(towers):
  """It was missing (AttributeError)."""
  s = ds.MirroredStrategy(["/cpu:%d" % i for i in range(towers)])
  with s.scope():
    adapter = tf.distribute.get_strategy()
    values = adapter.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([2], float(ctx.replica_id_in_sync_group * 10
                                       + ctx.num_replicas_in_sync)))
    results = adapter.experimental_local_results(adapter.run(lambda v: v + 1.0,
                                                             args=(values,)))
  assert [r.numpy().tolist() for r in results] == [[10.0 * i + towers + 1.0] * 2
                                                   for i in range(towers)]
  # One object for every tower stays each tower's whole value (it was taken as a global
  # batch and split across the towers).
  shared = tf.range(8.0)
  with s.scope():
    same = adapter.experimental_distribute_values_from_function(lambda ctx: shared)
    sizes = adapter.experimental_local_results(adapter.run(tf.size, args=(same,)))
  assert [int(n) for n in sizes] == [8] * towers
  if towers > 1:
    assert [c.device for c in values.values] == list(s.worker_devices)
    with s.scope():
      v = tf.Variable(1.0)
    # A distributed variable's local results are its copies, as tf.distribute's (it gave
    # the variable itself).
    assert adapter.experimental_local_results(v) == tuple(v.values)


_V1_OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.01),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.01, 0.9),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("name", sorted(_V1_OPTIMIZERS))
def test_tf_compat_v1_optimizers_in_towers_train_like_one_device(name, traced):
  """They reach the bridge for the loss reduction (AttributeError
  '_scale_loss_for_estimator'), `update(..., group=False)` (iterated: None was not
  iterable), `update_non_slot` and `group` (Adam's beta powers): all raised."""
  x = np.array([[1.0, 3.0], [2.0, 1.0], [0.5, 4.0], [3.0, 3.0]], np.float32)

  def train(s, batch):
    with s.scope():
      w = tf.Variable([1.0, 2.0])
      opt = _V1_OPTIMIZERS[name]()

    def tower(x):
      opt.minimize(lambda: tf.reduce_sum(tf.square(tf.linalg.matvec(x, w) - 1.0)),
                   var_list=[w])

    step = lambda: s.call_for_each_tower(tower, batch)  # noqa: E731
    step = tf.function(step) if traced else step
    for _ in range(3):
      step()
    return w

  expected = train(ds.get_distribution_strategy(), tf.constant(x)).numpy()
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  w = train(s, ds.values.PerDevice({s.worker_devices[0]: tf.constant(x[:2]),
                                    s.worker_devices[1]: tf.constant(x[2:])}))
  for component in w.values:
    np.testing.assert_allclose(component.numpy(), expected, rtol=1e-5)


def test_a_strategy_whose_scope_was_entered_is_freed():
  """The adapters' map held each adapter, which holds its strategy: a strategy whose
  scope was entered once was never freed. A Keras model keeps its strategy alive."""
  import gc  # pylint: disable=g-import-not-at-top
  import weakref  # pylint: disable=g-import-not-at-top
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    first = tf.distribute.get_strategy()
    assert tf.distribute.get_strategy() is first  # One adapter while it is held.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  ref = weakref.ref(s)
  del s, first
  gc.collect()
  assert ref() is not None  # The model's strategy.
  np.testing.assert_allclose(model.predict(np.ones((4, 2), np.float32), verbose=0).shape,
                             (4, 1))
  del model
  gc.collect()
  assert ref() is None


def _copies_of(variables):
  """Every per-device copy of `variables` (Keras variables or diststrat ones)."""
  found = []
  for v in variables:
    v = getattr(v, "value", v)
    found += list(getattr(v, "values", None) or [v])
  return found


class _GraphRecorder(keras.layers.Layer):
  """Passes its input through; records weakly the graphs its call is traced in."""

  def __init__(self, graphs):
    super().__init__()
    self.record = graphs.append  # Not the list: Keras would track a copy of it.

  def call(self, x):
    import weakref  # pylint: disable=g-import-not-at-top
    if not tf.executing_eagerly():
      self.record(weakref.ref(tf.compat.v1.get_default_graph()))
    return x


def _fit_and_drop(run_eagerly=False, synchronized=False, graphs=None):
  """Weak references to a strategy, a Keras model it fit, and every copy of the model's
  variables, once nothing else holds them; `graphs` (a list) gets weak references to the
  graphs the model's steps were traced in."""
  import weakref  # pylint: disable=g-import-not-at-top
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    model = keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4),
        _GraphRecorder([] if graphs is None else graphs),
        keras.layers.BatchNormalization(synchronized=synchronized), keras.layers.Dense(1)])
    model.compile("adam", "mse", run_eagerly=run_eagerly)
    model.fit(np.ones((16, 3), np.float32), np.ones((16, 1), np.float32), batch_size=8,
              verbose=0)
  variables = _copies_of(model.variables)
  assert len(variables) > len(model.variables)  # Per-device copies.
  return weakref.ref(s), weakref.ref(model), [weakref.ref(v) for v in variables]


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["traced", "eager"])
def test_a_strategy_that_fit_a_model_is_freed_with_it(run_eagerly):
  """One garbage collection freed the model but not its strategy: the strategy and its
  reductions formed reference cycles (the measured reduction's budget was a method of
  the strategy; each reduction's launcher held a method of the reduction), and the
  strategy was still held, when the collection looked, by the adapters that diststrat
  keeps for the model and its optimizer until they are collected. The strategy waited
  for the next collection."""
  import gc  # pylint: disable=g-import-not-at-top
  strategy, model, variables = _fit_and_drop(run_eagerly)
  gc.collect()
  assert model() is None
  assert strategy() is None
  assert [v for v in variables if v() is not None] == []


def test_a_strategy_that_fit_a_synchronized_batch_normalization_is_freed():
  """A synchronized BatchNormalization all-reduces its moments with a differentiable
  reduction, whose gradient was a `tf.custom_gradient`: TensorFlow keeps those for ever
  once a tf.function traced them, and this one held its replica context, and through it
  the strategy, the tower, the train step, the model and every copy of its variables.
  Even without the context, it held the traced graph, which holds the buffers of the
  variables it captured. The graph is freed with the model now, as without the
  synchronized layer."""
  import gc  # pylint: disable=g-import-not-at-top
  graphs = []
  strategy, model, variables = _fit_and_drop(synchronized=True, graphs=graphs)
  assert graphs  # The train step's.
  gc.collect()
  assert model() is None
  assert strategy() is None
  assert [v for v in variables if v() is not None] == []
  assert [g for g in graphs if g() is not None] == []


def test_a_strategy_whose_towers_differentiated_all_gather_in_a_tf_function_is_freed():
  """As all_reduce's, all_gather's traced custom gradient held its replica context, and
  through it the strategy and its variables, for ever."""
  import gc  # pylint: disable=g-import-not-at-top
  import weakref  # pylint: disable=g-import-not-at-top

  def run():
    s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
      v = tf.Variable([1.0, 2.0])

    def tower():
      with tf.GradientTape() as tape:
        gathered = tf.distribute.get_replica_context().all_gather(v * 2.0, axis=0)
        loss = tf.reduce_sum(gathered * gathered)
      return tape.gradient(loss, v)

    with s.scope():
      traced = tf.function(lambda: s.call_for_each_tower(tower))()
      eager = s.call_for_each_tower(tower)  # Eagerly nothing is kept: the reference.
    for t, e in zip(traced.values, eager.values, strict=True):
      np.testing.assert_allclose(t.numpy(), e.numpy())
    return weakref.ref(s), weakref.ref(v)

  strategy, variable = run()
  gc.collect()
  assert strategy() is None
  assert variable() is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["all_reduce", "all_gather"])
def test_a_gradient_of_the_gradient_of_a_replica_context_reduction_matches_tf_distribute(
    method, mode):
  """A gradient penalty differentiates a tower's gradient, which went through all_reduce
  (a synchronized BatchNormalization's) or all_gather: the reduction's gradient ran in
  merge_call, in another thread, so the outer tape saw none of it and the second-order
  gradient was None, where tf.distribute's gradient is itself differentiable."""
  devices = ["/cpu:0", "/cpu:1"]

  def tower_fn(v):
    def fn():
      ctx = tf.distribute.get_replica_context()
      with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
          x = v * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
          out = ctx.all_reduce("sum", x) if method == "all_reduce" else ctx.all_gather(
              x, axis=0)
          loss = tf.reduce_sum(out * out * out)
        grad = inner.gradient(loss, v)
        penalty = tf.reduce_sum(grad * grad)
      return grad, outer.gradient(penalty, v)
    return fn

  reference = tf.distribute.MirroredStrategy(
      devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
  with reference.scope():
    w = tf.Variable([1.0, 2.0])
  expected = tf.function(lambda: reference.run(tower_fn(w)))()
  s = ds.MirroredStrategy(devices)
  with s.scope():
    v = tf.Variable([1.0, 2.0])
    got = _in_mode(lambda: s.call_for_each_tower(tower_fn(v)), mode)()
  for g, e in zip(got, expected, strict=True):
    assert g is not None  # The second-order gradient was None.
    for tower_got, tower_expected in zip(g.values, e.values, strict=True):
      np.testing.assert_allclose(tower_got.numpy(), tower_expected.numpy(), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["all_reduce", "all_gather"])
def test_forward_mode_through_a_replica_context_reduction_raises(method, mode):
  """A tf.autodiff.ForwardAccumulator watching what a tower reduces gave the reduction's
  result no tangent: jvp() None eagerly, zeros in a tf.function, where the default
  strategy gives the tangent. The reduction runs in merge_call, in another thread,
  which the tower's accumulators do not see: it raises NotImplementedError naming
  tf.GradientTape instead. Reverse mode (the reference) gives the derivative."""
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    v = tf.Variable([1.0, 2.0])

  def reduce(ctx, x):
    return ctx.all_reduce("sum", x) if method == "all_reduce" else ctx.all_gather(x, axis=0)

  def forward():
    ctx = tf.distribute.get_replica_context()
    with tf.autodiff.ForwardAccumulator(v, tf.constant([1.0, 0.0])) as acc:
      out = reduce(ctx, v * 2.0)
    return acc.jvp(out)

  def reverse():
    ctx = tf.distribute.get_replica_context()
    with tf.GradientTape() as tape:
      out = reduce(ctx, v * 2.0)
    return tape.gradient(out, v)

  def unwatched():  # An accumulator watching something else: the reduction runs.
    ctx = tf.distribute.get_replica_context()
    with tf.autodiff.ForwardAccumulator(tf.constant(1.0), tf.constant(1.0)):
      return reduce(ctx, v * 2.0)

  with s.scope():
    assert _in_mode(lambda: s.call_for_each_tower(reverse), mode)() is not None
    assert _in_mode(lambda: s.call_for_each_tower(unwatched), mode)() is not None
    with pytest.raises(NotImplementedError, match="tf.GradientTape"):
      _in_mode(lambda: s.call_for_each_tower(forward), mode)()


@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_of_floats_with_integers_keeps_the_floats_gradient(mode):
  """all_reduce of a structure mixing float and integer tensors (a loss and an example
  count) was not differentiable at all: tape.gradient through its float part was None,
  where tf.distribute's (and all_gather's) gradient covers the float leaves. Reference:
  the float reduced alone."""
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    v = tf.Variable([1.0, 2.0])

  def tower(with_count):
    ctx = tf.distribute.get_replica_context()
    with tf.GradientTape() as tape:
      x = v * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
      if with_count:
        reduced, count = ctx.all_reduce("sum", (x, tf.size(x)))
      else:
        reduced, count = ctx.all_reduce("sum", x), None
      loss = tf.reduce_sum(reduced * reduced)
    return tape.gradient(loss, v), count

  with s.scope():
    expected, _ = _in_mode(lambda: s.call_for_each_tower(tower, False), mode)()
    got, count = _in_mode(lambda: s.call_for_each_tower(tower, True), mode)()
  assert [int(c) for c in count.values] == [4, 4]
  assert got is not None  # The towers' gradients were None.
  for g, e in zip(got.values, expected.values, strict=True):
    np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6)


@pytest.mark.parametrize("method", ["all_reduce", "all_gather"])
def test_tf_gradients_of_a_replica_context_reduction_in_a_tower_match_a_tape(method):
  """tf.gradients inside a traced tower goes through the reductions' gradient as a tape
  does (the gradient registered once, looked up per graph)."""
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    v = tf.Variable([1.0, 2.0])

  def reduced():
    ctx = tf.distribute.get_replica_context()
    x = v * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
    out = ctx.all_reduce("sum", x) if method == "all_reduce" else ctx.all_gather(x, axis=0)
    return tf.reduce_sum(out * out)

  def with_tape():
    with tf.GradientTape() as tape:
      loss = reduced()
    return tape.gradient(loss, v)

  def with_tf_gradients():
    return tf.gradients(reduced(), v)[0]

  with s.scope():
    expected = tf.function(lambda: s.call_for_each_tower(with_tape))()
    got = tf.function(lambda: s.call_for_each_tower(with_tf_gradients))()
  for g, e in zip(got.values, expected.values, strict=True):
    np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6)


def test_a_reduction_differentiated_after_its_tower_ended_raises_context_error():
  """The gradient of a tower's all_reduce, asked for by tf.gradients after the towers
  returned, cannot merge with them: ContextError, as before its replica context was
  held weakly."""
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    v = tf.Variable(1.0)

  @tf.function
  def gradient_outside_the_tower():
    out = s.call_for_each_tower(
        lambda: tf.distribute.get_replica_context().all_reduce("sum", v * 2.0))
    return tf.gradients(out.values[0], v)

  with s.scope(), pytest.raises(ds.errors.ContextError, match="tower"):
    gradient_outside_the_tower()


@pytest.mark.parametrize("name", ["mirrored2", "ps2"])
def test_tf_distribute_reports_the_diststrat_context(name):
  strategy = STRATEGIES[name]()
  assert not tf.distribute.has_strategy()
  with strategy.scope():
    adapter = tf.distribute.get_strategy()
    assert adapter.diststrat_strategy is strategy
    assert tf.distribute.in_cross_replica_context()

    def tower_fn():
      context = tf.distribute.get_replica_context()
      return (context.replica_id_in_sync_group, context.num_replicas_in_sync,
              tf.distribute.get_strategy() is adapter)

    seen = strategy.call_for_each_tower(tower_fn)
  assert [v for v in seen[0].values] == [0, 1] and seen[1:] == (2, True)
  assert not tf.distribute.has_strategy()
  with ds.DefaultStrategy().scope():
    assert not tf.distribute.has_strategy()  # TensorFlow's own default stands for ours.


def test_distribute_datasets_from_function_says_what_to_do():
  with STRATEGIES["mirrored2"]().scope():
    with pytest.raises(NotImplementedError, match=r"does not implement "
                       r"distribute_datasets_from_function.*Pass a tf.data.Dataset of global "
                       r"batches .* to model.fit"):
      tf.distribute.get_strategy().distribute_datasets_from_function(lambda ctx: None)


@pytest.mark.parametrize("given", ["array", "function"])
def test_experimental_distribute_dataset_of_something_else_says_what_to_pass(given):
  """The bridge's experimental_distribute_dataset given a numpy array or a function (as
  diststrat's own distribute_dataset takes) raised AttributeError ("'function' object has
  no attribute 'prefetch'")."""
  value = np.zeros((4, 2)) if given == "array" else (lambda: tf.data.Dataset.range(4))
  with STRATEGIES["mirrored2"]().scope():
    adapter = tf.distribute.get_strategy()
    with pytest.raises(TypeError, match=r"experimental_distribute_dataset\(\) takes a "
                       r"tf.data.Dataset of global batches .*Received: (ndarray|function)\. "
                       r".*MirroredStrategy.distribute_dataset\(\)"):
      adapter.experimental_distribute_dataset(value)
    data = adapter.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))
    assert [b.numpy().tolist() for b in data] == [[0, 1], [2, 3]]


def test_keras_merge_fns_are_compared_by_the_function_they_wrap():
  strategy = STRATEGIES["mirrored2"]()

  def tower_fn():
    branch = (lambda s: 1) if ds.get_tower_context().tower_id == 0 else (lambda s: 2)
    return tf.distribute.get_replica_context().merge_call(branch)

  with strategy.scope():
    assert strategy.call_for_each_tower(
        lambda: tf.distribute.get_replica_context().merge_call(lambda s: 3)) == 3
    with pytest.raises(ds.errors.MergeCallMismatchError, match=r"different merge_fns"):
      strategy.call_for_each_tower(tower_fn)


# --- the bridge in a custom loop written for tf.distribute ---------------------------------


def _tutorial_loop(strategy, mode, step_is_function=False):
  """TensorFlow's custom training loop tutorial, as written for tf.distribute: run the
  step with `strategy.run`, sum the per-replica losses with `strategy.reduce`.
  `step_is_function`: the replica function is a `tf.function` itself."""
  global_batch = 12
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(36, 3)).astype("float32"), rng.normal(size=(36, 1)).astype("float32")
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
  with strategy.scope():
    adapter = tf.distribute.get_strategy()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    loss_object = keras.losses.MeanSquaredError(reduction="none")

    def train_step(inputs):
      features, labels = inputs
      with tf.GradientTape() as tape:
        per_example = tf.reshape(loss_object(labels, model(features, training=True)), [-1])
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
      return loss

    if step_is_function:
      train_step = tf.function(train_step)

    def distributed_step(inputs):
      per_replica_losses = adapter.run(train_step, args=(inputs,))
      return adapter.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    step = _in_mode(distributed_step, mode)
    losses = [float(step(batch)) for batch in adapter.experimental_distribute_dataset(data)]
  return losses, [np.asarray(w) for w in model.get_weights()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_strategy_reduce_of_run_results_sums_the_towers_losses(name, mode):
  # strategy.run returned the towers' losses concatenated (a vector of N values), so the
  # tutorial's `strategy.reduce(SUM, ..., axis=None)` gave that vector, not the loss.
  losses, weights = _tutorial_loop(STRATEGIES[name](), mode)
  expected_losses, expected_weights = _tutorial_loop(STRATEGIES["default"](), mode)
  np.testing.assert_allclose(losses, expected_losses, **TOL)
  assert_all_close(weights, expected_weights)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_run_of_a_tf_function_merges_across_towers_as_tf_distribute_does(name, mode):
  # `strategy.run(train_step)` with a `tf.function` train_step (TensorFlow's run accepts
  # one) ran the function in each tower, which traced it on its own: the Keras
  # optimizer's merge_call inside raised ContextError ("while the tower was tracing a
  # tf.function of its own"). tf.distribute runs the towers inside the function's trace.
  losses, weights = _tutorial_loop(STRATEGIES[name](), mode, step_is_function=True)
  expected_losses, expected_weights = _tutorial_loop(STRATEGIES["default"](), mode)
  np.testing.assert_allclose(losses, expected_losses, **TOL)
  assert_all_close(weights, expected_weights)


@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_run_converts_the_replica_function_with_autograph_as_tf_distribute_does(name):
  # In a tf.function, `strategy.run(step)` ran `step` without AutoGraph: a Python `if`
  # on a tensor raised OperatorNotAllowedInGraphError, and a `for` over `tf.range` ran
  # in Python. tf.distribute converts it, as diststrat's call_for_each_tower does.
  strategy = STRATEGIES[name]()
  batch = tf.range(8, dtype=tf.float32)

  def step(part):
    total = tf.reduce_sum(part)
    if total > 10.0:
      total = total * 10.0
    for i in tf.range(3):
      total += tf.cast(i, tf.float32)
    return total

  @tf.function
  def run():
    adapter = tf.distribute.get_strategy()
    return adapter.experimental_local_results(adapter.run(step, args=(batch,)))

  with strategy.scope():
    got = [float(t) for t in run()]
  expected = []
  for part in np.array_split(np.arange(8, dtype=np.float32), strategy.num_towers):
    total = part.sum()
    expected.append((total * 10.0 if total > 10.0 else total) + 3.0)
  np.testing.assert_allclose(got, expected)


class _ThresholdStep:
  """A callable object as a replica function: its `__call__` branches on a tensor."""

  def __init__(self, model):
    self.model = model

  def __call__(self, part):
    total = tf.reduce_sum(self.model(part))
    if total > 10.0:
      total = total * 10.0
    return total


@pytest.mark.parametrize("name", ["default", "mirrored2", "mirrored4"])
def test_run_converts_a_callable_object_and_runs_a_keras_model_as_a_tf_function_does(name):
  """`run(obj)` with a callable object, in a tf.function, ran its `__call__` without
  AutoGraph (a Python `if` on a tensor raised OperatorNotAllowedInGraphError), while a
  tf.function calling the object converts it. A Keras model given to `run` itself still
  runs as Keras runs it (Keras's own call, not converted by diststrat)."""
  strategy = STRATEGIES[name]()
  batch = tf.reshape(tf.range(8, dtype=tf.float32), [8, 1])

  def make_model():
    return keras.Sequential([keras.Input((1,)), keras.layers.Dense(2, kernel_initializer="ones")])

  def towers_results(fn):
    @tf.function
    def run():
      adapter = tf.distribute.get_strategy()
      return adapter.experimental_local_results(adapter.run(fn, args=(batch,)))
    return [t.numpy().tolist() for t in run()]

  with strategy.scope():
    model = make_model()
    got_object = towers_results(_ThresholdStep(model))
    got_model = towers_results(model)
  parts = np.array_split(np.arange(8), strategy.num_towers)
  step = _ThresholdStep(model)
  expected_object = [float(tf.function(step)(batch[p[0]:p[-1] + 1])) for p in parts]
  expected_model = [tf.function(model)(batch[p[0]:p[-1] + 1]).numpy().tolist() for p in parts]
  np.testing.assert_allclose(got_object, expected_object)
  assert got_model == expected_model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored1", "mirrored2", "mirrored4"])
def test_run_returns_per_replica_values_as_tf_distribute_does(name, mode):
  strategy = STRATEGIES[name]()
  towers = strategy.num_towers
  x = tf.reshape(tf.range(10, dtype=tf.float32), [10, 1])  # Parts of 5 or 3, 3, 2, 2.

  def tower_fn(batch):
    replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
    return {"sum": tf.reduce_sum(batch), "id": tf.cast(replica_id, tf.float32),
            "rows": batch[:, 0]}

  def run():
    adapter = tf.distribute.get_strategy()
    out = adapter.run(tower_fn, args=(x,))
    local = adapter.experimental_local_results(out)
    scalars = {k: out[k] for k in ("sum", "id")}
    return (local, adapter.reduce("sum", scalars, axis=None),
            adapter.reduce("mean", out["id"], axis=None),
            adapter.reduce("sum", out["rows"], axis=0), adapter.reduce("mean", out["rows"], axis=0))

  with strategy.scope():
    local, total, mean_id, rows_sum, rows_mean = _in_mode(run, mode)()
  parts = np.array_split(np.arange(10, dtype=np.float32), towers)
  assert len(local) == towers
  for i, (got, part) in enumerate(zip(local, parts, strict=True)):
    np.testing.assert_allclose(got["sum"], part.sum())
    np.testing.assert_allclose(got["id"], i)
    np.testing.assert_allclose(got["rows"], part)
  np.testing.assert_allclose(total["sum"], 45.0)
  np.testing.assert_allclose(total["id"], towers * (towers - 1) / 2)
  np.testing.assert_allclose(mean_id, (towers - 1) / 2)
  np.testing.assert_allclose(rows_sum, 45.0)
  np.testing.assert_allclose(rows_mean, 4.5)  # Over every example, not a mean of means.


@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_strategy_reduce_mean_along_an_axis_weighs_every_example(name):
  # With towers of unequal sizes (or an empty one) the mean was the mean of the towers'
  # means (nan for an empty tower), where tf.distribute averages over every example.
  strategy = STRATEGIES[name]()
  towers = strategy.num_towers

  def tower_fn():
    i = ds.get_tower_context().tower_id
    return tf.range(i, dtype=tf.float32)  # Tower 0 has no example.

  with strategy.scope():
    adapter = tf.distribute.get_strategy()
    per_tower = strategy.call_for_each_tower(tower_fn)
    mean = adapter.reduce(tf.distribute.ReduceOp.MEAN, per_tower, axis=0)
    total = adapter.reduce(tf.distribute.ReduceOp.SUM, per_tower, axis=0)
  values = np.concatenate([np.arange(i, dtype=np.float32) for i in range(towers)])
  np.testing.assert_allclose(mean, values.mean(), rtol=1e-6)
  np.testing.assert_allclose(total, values.sum())


@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_strategy_reduce_mean_of_integers_divides_as_tf_distribute_does(name):
  """It floored in the integers' dtype (diststrat's own reduce does): tf.distribute gives
  the true mean (float64 for int32), e.g. of per-replica example counts."""
  strategy = STRATEGIES[name]()
  with strategy.scope():
    adapter = tf.distribute.get_strategy()
    per_tower = strategy.call_for_each_tower(
        lambda: tf.constant(ds.get_tower_context().tower_id % 2))  # 0, 1, 0, 1, ...
    mean = adapter.reduce(tf.distribute.ReduceOp.MEAN, per_tower, axis=None)
  assert mean.dtype == tf.float64 and float(mean) == 0.5


@pytest.mark.parametrize("mode", MODES)
def test_num_replicas_in_sync_is_the_tower_count_for_code_other_than_keras_losses(mode):
  # In a tower given part of a batch (any `run` with a batch), num_replicas_in_sync was
  # a TowerShare for every caller: tf.constant and tf.fill of it raised ValueError,
  # tf.range gave floats, and an integer product (tf.nn.compute_average_loss without a
  # global batch size) truncated B / n_i: 4.67 on a batch of 10 over 4 towers, which is
  # neither tf.distribute's 5.0 nor one device's 4.5.
  strategy = STRATEGIES["mirrored4"]()
  batch = tf.range(10, dtype=tf.float32)  # Parts of 3, 3, 2, 2.

  def tower_fn(part):
    n = tf.distribute.get_strategy().num_replicas_in_sync
    context_n = tf.distribute.get_replica_context().num_replicas_in_sync
    return {"constant": tf.constant(n), "range": tf.range(n), "fill": tf.fill([n], 1),
            "cast": tf.cast(n, tf.int32), "context": tf.constant(context_n),
            "average": tf.nn.compute_average_loss(part),
            "regularization": tf.nn.scale_regularization_loss(tf.constant(4.0))}

  def run():
    adapter = tf.distribute.get_strategy()
    out = adapter.run(tower_fn, args=(batch,))
    return (adapter.experimental_local_results(out),
            adapter.reduce("sum", {k: out[k] for k in ("average", "regularization")},
                           axis=None))

  with strategy.scope():
    local, total = _in_mode(run, mode)()
  for tower in local:
    for key in ("constant", "cast", "context"):
      assert tower[key].dtype == tf.int32 and int(tower[key]) == 4, (key, tower[key])
    assert tower["range"].dtype == tf.int32 and list(np.asarray(tower["range"])) == [0, 1, 2, 3]
    assert list(np.asarray(tower["fill"])) == [1, 1, 1, 1]
  parts = np.array_split(np.arange(10, dtype=np.float32), 4)
  # As tf.distribute: each tower's mean over its part, divided by the number of towers.
  np.testing.assert_allclose(total["average"], sum(p.mean() / 4 for p in parts), rtol=1e-6)
  np.testing.assert_allclose(total["regularization"], 4.0, rtol=1e-6)


def _apply_in_merge_call(strategy, mode, grads_of):
  """Two steps of a Keras SGD applied in `merge_call`, tf.distribute's way: each tower
  computes its gradients, `grads_of(tower_grads)` gives what it passes to merge_call,
  and merge_fn calls `apply_gradients` with them. Returns the variable's copies."""
  x = tf.constant(np.arange(16, dtype=np.float32).reshape(8, 2) / 8.0)
  with strategy.scope():
    adapter = tf.distribute.get_strategy()
    w = tf.Variable([[1.0], [-1.0]])
    optimizer = keras.optimizers.SGD(0.1)

    def tower(part):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(part @ w)) / 8.0
      grads = grads_of([tape.gradient(loss, w)])
      tf.distribute.get_replica_context().merge_call(
          lambda _, g: optimizer.apply_gradients(zip(g, [w], strict=True)), args=(grads,))

    step = _in_mode(lambda: adapter.run(tower, args=(x,)), mode)
    step()
    step()
    return copies(w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_apply_gradients_in_merge_call_takes_all_reduced_copies_and_refuses_per_tower_ones(
    name, mode):
  """A Keras optimizer's apply_gradients in merge_fn given each tower's own gradients
  (not all-reduced) updated each copy of the variable with its own tower's gradient:
  the copies parted, silently. update() refuses per-tower values (docs/concepts.md);
  all-reduced gradients, also scaled in each tower after the all_reduce, still apply."""

  def all_reduced(grads):
    return tf.distribute.get_replica_context().all_reduce("sum", grads)

  def all_reduced_then_scaled(grads):
    return [g * 1.0 for g in all_reduced(grads)]

  expected = _apply_in_merge_call(STRATEGIES["default"](), mode, lambda g: g)[0]
  for grads_of in (all_reduced, all_reduced_then_scaled):
    got = _apply_in_merge_call(STRATEGIES[name](), mode, grads_of)
    for copy in got:
      np.testing.assert_allclose(copy, expected, **TOL)
  error = ValueError if mode == "eager" else tf.errors.InvalidArgumentError
  with pytest.raises(error, match="takes values mirrored over the devices it updates"):
    _apply_in_merge_call(STRATEGIES[name](), mode, lambda g: g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_apply_gradients_in_merge_call_applies_all_reduced_non_finite_gradients(mode, bad):
  """All-reduced gradients scaled in each tower are compared before update() takes them
  as copies; a NaN or inf one (a diverging loss) compared unequal to itself and update()
  refused it as values that differ (eager ValueError, traced InvalidArgumentError), where
  the default strategy applies it."""

  def non_finite(grads):
    reduced = tf.distribute.get_replica_context().all_reduce("sum", grads)
    return [g * bad for g in reduced]

  expected = _apply_in_merge_call(STRATEGIES["default"](), mode, lambda g: [x * bad for x in g])
  got = _apply_in_merge_call(STRATEGIES["mirrored2"](), mode, non_finite)
  for copy in got:
    np.testing.assert_array_equal(np.isnan(copy), np.isnan(expected[0]))
    np.testing.assert_array_equal(copy[~np.isnan(copy)], expected[0][~np.isnan(expected[0])])


def test_the_tf_distribute_bridges_errors_keep_their_message_in_a_tf_function():
  """A custom train_step or loop calling the bridge (`tf.distribute.get_strategy()` in a
  diststrat scope) got its errors rewritten by AutoGraph inside a tf.function ("in user
  code:", files and lines, then the message), and AutoGraph converted the bridge's own
  code."""
  s = ds.MirroredStrategy(CPUS[:2])

  def reduce_of_a_value_every_tower_returned():
    return tf.distribute.get_strategy().reduce("SUM", 3.0, axis=None)

  def a_dataset_that_is_no_dataset():
    return tf.distribute.get_strategy().experimental_distribute_dataset([1, 2])

  def datasets_from_a_function():
    return tf.distribute.get_strategy().distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(4))

  def update_of_what_is_no_variable():
    return tf.distribute.get_strategy().extended.update(3.0, lambda v: v)

  for fn in (reduce_of_a_value_every_tower_returned, a_dataset_that_is_no_dataset,
             datasets_from_a_function, update_of_what_is_no_variable):
    with s.scope():
      with pytest.raises(Exception) as eager:
        fn()
      with pytest.raises(Exception) as traced:
        tf.function(fn)()
    assert isinstance(eager.value, (ValueError, TypeError, NotImplementedError))
    assert (type(traced.value), str(traced.value)) == (type(eager.value), str(eager.value)), (
        fn.__name__)


def test_the_bridges_reduce_refuses_an_op_that_is_not_sum_or_mean():
  """`reduce("max", ...)` returned the value unchanged on one tower, or, with an axis,
  its mean; on two towers with an axis it raised IndexError. tf.distribute refuses it
  (ValueError), as the bridge now does, naming what to pass."""
  message = (r"reduce\(\) takes reduce_op tf.distribute.ReduceOp.SUM or MEAN.*"
             r"Received: reduce_op='max'")
  for devices in (CPUS[:1], CPUS[:2]):
    reference = tf.distribute.MirroredStrategy(devices)
    with reference.scope(), pytest.raises(ValueError):
      reference.reduce("max", reference.run(lambda: tf.constant([1.0, 5.0])), axis=0)
    with ds.MirroredStrategy(devices).scope():
      adapter = tf.distribute.get_strategy()
      per_tower = adapter.run(lambda: tf.constant([1.0, 5.0]))
      for axis in (None, 0):
        with pytest.raises(ValueError, match=message):
          adapter.reduce("max", per_tower, axis=axis)
      with pytest.raises(ValueError, match=r"all_reduce\(\) takes reduce_op .*reduce_op=3"):
        adapter.run(lambda: tf.distribute.get_replica_context().all_reduce(3, 1.0))
      total = adapter.reduce(tf.distribute.ReduceOp.SUM, per_tower, axis=0)
      assert float(total) == 6.0 * len(devices)
