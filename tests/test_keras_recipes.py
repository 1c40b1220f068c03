"""Keras training recipes under diststrat equal one device (docs/keras.md).

Each recipe trains the same model from the same weights on the same global batches with
no strategy (the reference) and in a strategy's scope, with compiled `fit`, and compares
the weights (and the optimizer's state) afterwards. The batches of 10 examples split
3/3/2/2 over four towers, so every step is also a ragged one.
"""

import contextlib
import functools
import os
import time
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from conftest import CPUS
from diststrat.cluster import LocalCluster
from keras_cases import STRATEGIES, assert_all_close, assert_copies_equal, frozen, frozen_history

FEATURES = 5
BATCH = 10


def _data(n=60, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, FEATURES)).astype(np.float32)
  y = (x @ rng.normal(size=(FEATURES, 2)) + 0.1 * rng.normal(size=(n, 2))).astype(np.float32)
  return x, y


@contextlib.contextmanager
def _policy(name):
  if name is None:
    yield
    return
  keras.mixed_precision.set_global_policy(name)
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _model(optimizer, weights=None, policy=None, **compile_kwargs):
  keras.utils.set_random_seed(3)
  with _policy(policy):
    model = keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(2, dtype="float32")])
    if weights is not None:
      model.set_weights(weights)
    model.compile(optimizer=optimizer(), loss="mse", **compile_kwargs)
  return model


@functools.lru_cache(maxsize=None)
def _initial_weights():
  """The weights every `_fit` starts from: `_model`'s, whatever the optimizer (built once)."""
  return frozen(_model(lambda: keras.optimizers.SGD(0.1)).get_weights())


def _fit(strategy, optimizer, policy=None, epochs=2, data=None, **compile_kwargs):
  """Weights after `fit` (and the model), from the same initial weights."""
  x, y = data if data is not None else _data()
  weights = list(_initial_weights())
  scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
  with scope:
    model = _model(optimizer, weights, policy, **compile_kwargs)
  history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
  return model, history.history


RECIPES = {
    "clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.01),
    "accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=3),
    "ema": lambda: keras.optimizers.SGD(0.1, momentum=0.5, use_ema=True,
                                        ema_momentum=0.9, ema_overwrite_frequency=4),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


@functools.lru_cache(maxsize=None)
def _one_device(recipe):
  """One device's weights, optimizer variables and history after `fit` with `recipe`: the
  reference of every strategy, computed once."""
  reference, ref_history = _fit(None, RECIPES[recipe])
  return (frozen(reference.get_weights()),
          frozen(v.numpy() for v in reference.optimizer.variables), frozen_history(ref_history))


def _compare(model, history, reference):
  weights, optimizer_variables, ref_history = reference
  assert_all_close(model.get_weights(), weights)
  assert_all_close([v.numpy() for v in model.optimizer.variables], optimizer_variables)
  assert_copies_equal(model.weights + list(model.optimizer.variables))
  np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)


@pytest.mark.parametrize("strategy_name", ["mirrored4", "ps4"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_optimizer_recipe_equals_one_device(recipe, strategy_name):
  """Clipping, gradient accumulation and EMA act on the gradient summed over the towers.

  On main: clipping is applied per tower (weights 1e-2 off), accumulation and EMA fail
  with ContextError (a merge_call inside a tf.cond branch / update() in a tower).
  """
  model, history = _fit(STRATEGIES[strategy_name](), RECIPES[recipe])
  _compare(model, history, _one_device(recipe))


def _mixed_float16_adam():
  return keras.optimizers.Adam(0.01)


@functools.lru_cache(maxsize=None)
def _mixed_float16_one_device():
  """The one-device reference of every strategy below, computed once."""
  reference, ref_history = _fit(None, _mixed_float16_adam, policy="mixed_float16")
  return (type(reference.optimizer), frozen(reference.get_weights()),
          float(reference.optimizer.dynamic_scale.numpy()),
          int(reference.optimizer.iterations.numpy()), frozen_history(ref_history))


@pytest.mark.parametrize("strategy_name", ["mirrored1", "mirrored4", "ps4"])
def test_mixed_float16_equals_one_device(strategy_name):
  """`mixed_float16` (Keras wraps the optimizer in a LossScaleOptimizer) in compiled fit.

  On main: ContextError, LossScaleOptimizer's tf.cond calls merge_call in a tower.
  """
  ref_optimizer_class, ref_weights, ref_scale, ref_iterations, ref_history = (
      _mixed_float16_one_device())
  assert issubclass(ref_optimizer_class, keras.optimizers.LossScaleOptimizer)
  model, history = _fit(STRATEGIES[strategy_name](), _mixed_float16_adam,
                        policy="mixed_float16")
  assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
  # float16 activations: the towers' partial sums round differently from one device's
  # (measured: 2.8e-5 at most after 12 steps).
  assert_all_close(model.get_weights(), ref_weights, rtol=1e-3, atol=2e-4)
  assert float(model.optimizer.dynamic_scale.numpy()) == ref_scale
  assert int(model.optimizer.iterations.numpy()) == ref_iterations
  assert_copies_equal(model.weights + list(model.optimizer.variables))
  np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=2e-3)


def _custom_loop_with_loss_scaling(strategy, policy, data, epochs=2):
  """A custom training loop (tower function, tf.function step) with Keras's
  LossScaleOptimizer: each tower scales its part of the mean loss, takes the gradient of
  the scaled loss, and calls apply_gradients. The model and optimizer are made in the
  scope (the default strategy's for the reference)."""
  return _custom_loop(
      strategy, lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
      policy, data, epochs)


def _custom_loop(strategy, make_optimizer, policy, data, epochs=2):
  """A custom training loop (tower function, tf.function step): each tower takes the
  gradient of its part of the mean loss (scaled, for a `LossScaleOptimizer`) and calls
  apply_gradients. The model and optimizer are made in the scope (the default
  strategy's for the reference)."""
  x, y = data
  weights = _model(lambda: keras.optimizers.SGD(0.1)).get_weights()
  with strategy.scope(), _policy(policy):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(2, dtype="float32")])
    model.set_weights(weights)
    optimizer = make_optimizer()
    batches = strategy.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))

  def tower_step(xb, yb):
    with tf.GradientTape() as tape:
      errors = tf.square(tf.cast(model(xb, training=True), tf.float32) - yb)
      loss = tf.reduce_sum(errors) / (BATCH * 2)  # This tower's part of the batch mean.
      scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss

  @tf.function
  def step(xb, yb):
    return strategy.reduce("sum", strategy.call_for_each_tower(tower_step, xb, yb))

  losses = []
  with strategy.scope():
    for _ in range(epochs):
      for xb, yb in batches:
        losses.append(float(_first(step(xb, yb))))
  return model, optimizer, losses


def _first(value):
  return value.values[0] if isinstance(value, ds.values.DistributedValues) else value


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("strategy_name", ["mirrored4", "ps4"])
def test_loss_scale_optimizer_in_a_custom_loop_equals_one_device(strategy_name, policy):
  """Keras's LossScaleOptimizer in a custom loop's towers (tf.function steps), as
  tf.distribute runs it: equal to the default strategy with the same optimizer.

  Once: ContextError (its tf.cond called merge_call in a tower tracing the step); only
  fit's optimizer was routed to one apply on the summed gradients.
  """
  data = _data(40)
  reference, ref_optimizer, ref_losses = _custom_loop_with_loss_scaling(
      ds.get_distribution_strategy(), policy, data)
  model, optimizer, losses = _custom_loop_with_loss_scaling(
      STRATEGIES[strategy_name](), policy, data)
  initial = _model(lambda: keras.optimizers.SGD(0.1)).get_weights()
  assert not np.allclose(reference.get_weights()[0], initial[0])  # It trained.
  tolerance = dict(rtol=1e-3, atol=2e-4) if policy == "mixed_float16" else {}
  assert_all_close(model.get_weights(), reference.get_weights(), **tolerance)
  assert float(optimizer.dynamic_scale.numpy()) == float(ref_optimizer.dynamic_scale.numpy())
  assert int(optimizer.iterations.numpy()) == int(ref_optimizer.iterations.numpy()) == 8
  assert_copies_equal(model.weights + list(optimizer.variables))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-3 if tolerance else 1e-5)


@pytest.mark.parametrize("recipe", ["accumulation", "ema", "global_clipnorm"])
@pytest.mark.parametrize("strategy_name", ["mirrored4", "ps4"])
def test_optimizer_recipe_in_a_custom_loop_equals_one_device(strategy_name, recipe):
  """Gradient accumulation, EMA and clipping in a custom loop's towers (tf.function
  steps): the optimizer created in the scope applies once per step on the summed
  gradients, so weights and optimizer variables (accumulators, EMA copies) equal the
  default strategy's."""
  data = _data(40)
  reference, ref_optimizer, ref_losses = _custom_loop(
      ds.get_distribution_strategy(), RECIPES[recipe], "float32", data)
  model, optimizer, losses = _custom_loop(
      STRATEGIES[strategy_name](), RECIPES[recipe], "float32", data)
  initial = _model(lambda: keras.optimizers.SGD(0.1)).get_weights()
  assert not np.allclose(reference.get_weights()[0], initial[0])  # It trained.
  assert_all_close(model.get_weights(), reference.get_weights())
  assert_all_close([v.numpy() for v in optimizer.variables],
                   [v.numpy() for v in ref_optimizer.variables])
  # 8 steps; with accumulation over 3, Keras counts the 2 steps that updated.
  steps = 8 // 3 if recipe == "accumulation" else 8
  assert int(optimizer.iterations.numpy()) == int(ref_optimizer.iterations.numpy()) == steps
  assert_copies_equal(model.weights + list(optimizer.variables))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_mixed_float16_skips_a_step_with_non_finite_gradients_in_one_tower():
  """A gradient that overflows in one tower makes the summed one non-finite: the step is
  skipped and the loss scale halves on every copy, as on one device."""
  x, y = _data(20)
  y[7] = 1e4  # In tower 2 (rows 6-7 of the first batch): its float16 gradients overflow.
  optimizer = lambda: keras.optimizers.SGD(0.01)
  reference, _ = _fit(None, optimizer, policy="mixed_float16", epochs=1, data=(x, y))
  model, _ = _fit(STRATEGIES["mirrored4"](), optimizer, policy="mixed_float16", epochs=1,
                  data=(x, y))
  scale = float(model.optimizer.dynamic_scale.numpy())
  assert scale == float(reference.optimizer.dynamic_scale.numpy())
  assert scale < 32768.0  # The initial scale: at least one step was skipped.
  assert_copies_equal(model.weights + list(model.optimizer.variables))
  assert_all_close(model.get_weights(), reference.get_weights(), rtol=2e-3, atol=2e-3)


# --- metrics stay per worker process in a parameter-server cluster --------------------


def _wait_for(path, timeout=90.0):
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"{path} did not appear within {timeout} s")
    time.sleep(0.02)


def _worker_data(task_id):
  return _data(30, seed=10 + task_id)


class _PauseAfterFirstBatch(keras.callbacks.Callback):
  """Worker 0's evaluate: after its first batch, lets worker 1 run a whole evaluate."""

  def __init__(self, sync_dir):
    super().__init__()
    self._first = os.path.join(sync_dir, "w0_first_batch")
    self._done = os.path.join(sync_dir, "w1_done")

  def on_test_batch_end(self, batch, logs=None):
    if batch == 0:
      open(self._first, "w").close()
      _wait_for(self._done)


def _evaluate_per_worker_fn(strategy, weights, sync_dir):
  """Each worker evaluates its own data with the same (shared) weights.

  Worker 1 runs its whole evaluate (which resets the metrics, then updates them) between
  worker 0's first and second batches: if the metric variables were shared on the PS,
  worker 0's logs would include worker 1's reset and data.
  """
  x, y = _worker_data(strategy.task_id)
  with strategy.scope():
    model = _model(lambda: keras.optimizers.SGD(0.1), weights, metrics=["mae"])
  if strategy.task_id == 0:
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True,
                          callbacks=[_PauseAfterFirstBatch(sync_dir)])
  else:
    _wait_for(os.path.join(sync_dir, "w0_first_batch"))
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    open(os.path.join(sync_dir, "w1_done"), "w").close()
  metric_devices = sorted({v.value.device for m in model.metrics for v in m.variables})
  return {k: float(v) for k, v in logs.items()}, metric_devices


@pytest.mark.processes
def test_keras_metrics_stay_per_worker_in_a_ps_cluster(tmp_path):
  """On main: the metric variables are shared on the PS, worker 1's reset and batches land
  in worker 0's logs."""
  weights = _model(lambda: keras.optimizers.SGD(0.1)).get_weights()
  with LocalCluster(num_ps=1, num_workers=2, start_timeout=60, result_timeout=150) as cluster:
    results = cluster.run_on_workers(_evaluate_per_worker_fn, weights=weights,
                                     sync_dir=str(tmp_path))
  reference = _model(lambda: keras.optimizers.SGD(0.1), weights, metrics=["mae"])
  for task_id, (logs, devices) in enumerate(results):
    x, y = _worker_data(task_id)
    expected = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    for key in ("loss", "mae"):
      np.testing.assert_allclose(logs[key], expected[key], rtol=1e-5, err_msg=key)
    assert devices and all(f"/job:worker/replica:0/task:{task_id}/" in d for d in devices), \
        devices


STEPS_EACH = 150


def _count_steps_fn(strategy, sync_dir):
  """Trains STEPS_EACH Keras SGD steps, started with the other worker (both at once)."""
  with strategy.scope():
    w = tf.Variable(tf.zeros([3]), name="w")
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build([w])

  @tf.function
  def step():
    strategy.call_for_each_tower(lambda: optimizer.apply_gradients([(tf.ones([3]), w)]))

  strategy.run_step(step)  # Traced before the other worker starts counting.
  open(os.path.join(sync_dir, f"ready_{strategy.task_id}"), "w").close()
  _wait_for(os.path.join(sync_dir, f"ready_{1 - strategy.task_id}"))
  for _ in range(STEPS_EACH - 1):
    strategy.run_step(step)
  open(os.path.join(sync_dir, f"done_{strategy.task_id}"), "w").close()
  _wait_for(os.path.join(sync_dir, f"done_{1 - strategy.task_id}"))
  returned = optimizer.iterations.assign_add(0)  # The new value, as Keras's returns.
  assert int(tf.convert_to_tensor(returned)) == int(optimizer.iterations.numpy())
  return int(optimizer.iterations.numpy()), w.numpy().tolist()


@pytest.mark.processes
def test_keras_iterations_count_every_workers_steps_in_a_ps_cluster(tmp_path):
  """Keras increments `iterations` as a read and a write: two workers stepping at once
  lost increments; the weights' updates never."""
  with LocalCluster(num_ps=1, num_workers=2, start_timeout=60, result_timeout=150) as cluster:
    results = cluster.run_on_workers(_count_steps_fn, sync_dir=str(tmp_path))
  for iterations, weights in results:
    assert iterations == 2 * STEPS_EACH
    assert weights == [-0.5 * 2 * STEPS_EACH] * 3


class _RaiseAfterFirstBatch(keras.callbacks.Callback):
  def on_train_batch_end(self, batch, logs=None):
    raise RuntimeError("stop in worker 1")


def _fit_raising_in_worker_1_fn(strategy, checkpoint):
  x, y = _worker_data(strategy.task_id)
  with strategy.scope():
    model = _model(lambda: keras.optimizers.SGD(0.1))
  callbacks = [keras.callbacks.ModelCheckpoint(checkpoint)]
  if strategy.task_id == 1:
    callbacks.append(_RaiseAfterFirstBatch())
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
  return "done"


@pytest.mark.processes
def test_a_failed_fit_leaves_no_scratch_directory(tmp_path, monkeypatch):
  """Worker 1's ModelCheckpoint writes to a scratch directory, which `fit` removes when
  it ends; when it raised, the directory was left (the task ends with os._exit)."""
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setenv("TMPDIR", str(scratch))  # The cluster's processes inherit it.
  with LocalCluster(num_ps=1, num_workers=2, start_timeout=60, result_timeout=150) as cluster:
    with pytest.raises(RuntimeError, match="stop in worker 1"):
      cluster.run_on_workers(_fit_raising_in_worker_1_fn,
                             checkpoint=str(tmp_path / "model.keras"))
  assert not [p.name for p in scratch.iterdir() if p.name.startswith("diststrat_worker")]


# --- smaller recipes -----------------------------------------------------------------


def _two_output_model(weights=None):
  keras.utils.set_random_seed(5)
  inputs = keras.Input((FEATURES,))
  hidden = keras.layers.Dense(6, activation="tanh")(inputs)
  model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(hidden),
                               "b": keras.layers.Dense(2, name="b")(hidden)})
  if weights is not None:
    model.set_weights(weights)
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss={"a": "mse", "b": "mae"},
                loss_weights={"a": 1.0, "b": 0.5})
  return model


def _two_output_data():
  x, _ = _data(26)
  rng = np.random.default_rng(4)
  y = {"a": rng.normal(size=(26, 1)).astype(np.float32),
       "b": rng.normal(size=(26, 2)).astype(np.float32)}
  return x, y


@functools.lru_cache(maxsize=None)
def _two_output_initial_weights():
  return frozen(_two_output_model().get_weights())


@functools.lru_cache(maxsize=None)
def _two_output_one_device(batch_size):
  """One device's history, evaluation and weights: every strategy's reference, made once."""
  x, y = _two_output_data()
  reference = _two_output_model(list(_two_output_initial_weights()))
  ref_history = reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
                              verbose=0).history
  ref_eval = reference.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
  return (frozen_history(ref_history), types.MappingProxyType(ref_eval),
          frozen(reference.get_weights()))


@pytest.mark.parametrize("strategy_name", ["mirrored4", "ps4"])
@pytest.mark.parametrize("batch_size", [10, 3])
def test_per_output_losses_on_ragged_batches_equal_one_device(strategy_name, batch_size):
  """Batches of 10 split 3/3/2/2 (the last, 6, splits 2/2/1/1); batches of 3 leave a tower
  without an example on every step: nothing is nan, every number is one device's.

  On main: the per-output losses ("a_loss", "b_loss") weigh each tower as a whole batch
  (Keras passes the static batch size, unknown in a traced step), 2.6e-3 off.
  """
  x, y = _two_output_data()
  ref_history, ref_eval, ref_weights = _two_output_one_device(batch_size)
  with STRATEGIES[strategy_name]().scope():
    model = _two_output_model(list(_two_output_initial_weights()))
  history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
  evaluated = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
  assert sorted(history) == sorted(ref_history) and "a_loss" in history
  for key in ref_history:
    assert np.all(np.isfinite(history[key])), (key, history[key])
    np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
  for key in ref_eval:
    np.testing.assert_allclose(evaluated[key], ref_eval[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
  assert_all_close(model.get_weights(), ref_weights)


def _generator_numbers(strategy):
  """Numbers drawn in cross-tower context from a generator made in the scope."""
  scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
  with scope:
    generator = tf.random.Generator.from_seed(7)
    eager = generator.normal([3])
    traced = tf.function(lambda: generator.uniform([2]))()
    skipped = generator.skip(5)
  return generator, [eager.numpy(), traced.numpy(), np.asarray(skipped)]


@pytest.mark.parametrize("strategy_name", ["mirrored4", "ps4"])
def test_random_generator_created_in_the_scope(strategy_name):
  """On main: TypeError: 'NoneType' object is not subscriptable (the adapter's
  update(..., group=True) returned no value)."""
  strategy = STRATEGIES[strategy_name]()
  _, expected = _generator_numbers(None)
  generator, got = _generator_numbers(strategy)
  assert_all_close(got, expected)
  with strategy.scope():
    per_tower = strategy.call_for_each_tower(lambda: generator.normal([2]))
  draws = [np.asarray(v) for v in strategy.unwrap(per_tower)]
  assert all(np.all(np.isfinite(d)) for d in draws)
  assert not np.array_equal(draws[0], draws[1])  # One stream per tower.
  assert_copies_equal([generator.state])


def _small_model():
  model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
  return model


def test_jit_compile_raises_naming_the_fix_on_several_devices_and_trains_on_one():
  """On main: an XLA InvalidArgumentError about a resource on another device."""
  x, y = _data(20)
  with STRATEGIES["mirrored4"]().scope():
    model = _small_model()
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
  with pytest.raises(ValueError, match=r"compiled with jit_compile=True, but under "
                     r"MirroredStrategy.* its step runs on 4 devices.*Compile it with "
                     r"jit_compile=False under this strategy"):
    model.fit(x, y, batch_size=BATCH, verbose=0)
  # The default ('auto') is False under a strategy: it trains.
  with STRATEGIES["mirrored4"]().scope():
    model = _small_model()
    model.compile(optimizer="sgd", loss="mse")
  assert model.jit_compile is False
  model.fit(x, y, batch_size=BATCH, verbose=0)
  # One device: XLA compiles the step, equal to one device without a strategy.
  weights = _small_model().get_weights()
  reference = _small_model()
  reference.set_weights(weights)
  reference.compile(optimizer="sgd", loss="mse", jit_compile=True)
  reference.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
  with STRATEGIES["mirrored1"]().scope():
    model = _small_model()
    model.set_weights(weights)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
  model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
  assert_all_close(model.get_weights(), reference.get_weights())


def test_jit_compile_on_one_device_other_than_the_first_equals_one_device():
  """XLA compiles Keras's step for the device its call is placed on: the strategy's one
  device (here CPU:2, as MirroredStrategy(["/gpu:1"])), not the first one.

  Before: fit raised InvalidArgumentError "Trying to access resource .../kernel/0 located
  in device CPU:2 from device CPU:0".
  """
  x, y = _data(20)
  weights = _small_model().get_weights()
  reference = _small_model()
  reference.set_weights(weights)
  reference.compile(optimizer="sgd", loss="mse", jit_compile=False)
  ref_loss = reference.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False).history["loss"]
  with ds.MirroredStrategy(CPUS[2:3]).scope():
    model = _small_model()
    model.set_weights(weights)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
  loss = model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False).history["loss"]
  assert_all_close(model.get_weights(), reference.get_weights())
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                             rtol=1e-5, atol=1e-6)


def test_fit_inside_another_strategys_scope_names_the_models_strategy():
  """On main: "Cannot enter the scope of Mirrored(4) inside ... Mirrored(2)", a scope the
  user never entered."""
  x, y = _data(20)
  four, two = STRATEGIES["mirrored4"](), STRATEGIES["mirrored2"]()
  with four.scope():
    model = _small_model()
    model.compile(optimizer="sgd", loss="mse")
  with two.scope():
    with pytest.raises(ds.errors.ContextError) as info:
      model.fit(x, y, batch_size=BATCH, verbose=0)
  message = str(info.value)
  assert message.startswith(f"A Keras model (or optimizer, or other tf.distribute-aware "
                            f"code) created in the scope of {four!r} was used inside the "
                            f"cross-tower context of {two!r}")
  assert "Call fit/evaluate/predict outside any strategy's scope" in message
  assert f"to train under {two!r}, build and compile the model inside that strategy's " \
         "scope" in message
  model.fit(x, y, batch_size=BATCH, verbose=0)  # Outside any scope: its own strategy.


def test_mixing_with_tf_distribute_explains_the_fix():
  """On main: TensorFlow's bare "Mixing different tf.distribute.Strategy objects" (no
  fix), and a diststrat scope inside a tf.distribute scope was entered silently."""
  strategy = STRATEGIES["mirrored2"]()
  tf_strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy") as info:
    with strategy.scope():
      with tf_strategy.scope():
        pass
  notes = " ".join(getattr(info.value, "__notes__", []))
  assert "a tf.distribute strategy was used inside the scope of diststrat's " \
         f"{strategy!r}" in notes and "Enter the tf.distribute strategy's scope outside " \
         "any diststrat scope" in notes
  with tf_strategy.scope():
    with pytest.raises(ds.errors.ContextError, match=r"Cannot enter the scope of "
                       r"diststrat's MirroredStrategy.* inside the scope of the "
                       r"tf.distribute strategy .*Leave the tf.distribute scope first"):
      with strategy.scope():
        pass
  # A model made under diststrat keeps training under it inside a tf.distribute scope.
  x, y = _data(20)
  with strategy.scope():
    model = _small_model()
    model.compile(optimizer="sgd", loss="mse")
  with tf_strategy.scope():
    model.fit(x, y, batch_size=BATCH, verbose=0)


# --- file callbacks and custom outputs across worker processes ------------------------


class _TowerIdModel(keras.Sequential):
  """Adds the mean tower id to its training logs (a custom step output, not a metric)."""

  def train_step(self, data):
    logs = super().train_step(data)
    logs["tower_id"] = tf.cast(ds.get_tower_context().tower_id, tf.float32)
    return logs


class _RecordPaths(keras.callbacks.Callback):
  """Records, at the end of every epoch, where the file callbacks write."""

  def __init__(self, callbacks):
    super().__init__()
    self.watched = callbacks
    self.seen = []

  def on_epoch_end(self, epoch, logs=None):
    self.seen.append(_paths(self.watched))


class _DirectoryBoard(keras.callbacks.TensorBoard):
  """A TensorBoard callback that creates its log directory and writes a file there
  instead of summaries (the tensorboard package, which writes them, is not installed
  here): what diststrat changes is the directory."""

  def on_train_begin(self, logs=None):
    os.makedirs(self.log_dir, exist_ok=True)

  def on_epoch_end(self, epoch, logs=None):
    with open(os.path.join(self.log_dir, f"epoch_{epoch}"), "w") as f:
      f.write(repr(logs))

  def on_train_end(self, logs=None):
    pass

  def on_train_batch_end(self, batch, logs=None):
    pass

  def on_test_begin(self, logs=None):
    pass

  def on_test_end(self, logs=None):
    pass


def _paths(callbacks):
  checkpoint, csv_logger, backup, board = callbacks
  return [checkpoint.filepath, csv_logger.filename, backup.backup_dir, board.log_dir]


def _file_callbacks_fn(strategy, out_dir):
  x, y = _data(40)
  with strategy.scope():
    keras.utils.set_random_seed(3)
    model = _TowerIdModel([keras.Input((FEATURES,)), keras.layers.Dense(2)], name="towers")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  callbacks = [  # The same paths in every worker.
      keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "ckpt.weights.h5"),
                                      save_weights_only=True),
      keras.callbacks.CSVLogger(os.path.join(out_dir, "log.csv")),
      keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
      _DirectoryBoard(os.path.join(out_dir, "tb"))]
  recorder = _RecordPaths(callbacks)
  history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                      callbacks=callbacks + [recorder])
  during = recorder.seen
  scratch = sorted({os.path.dirname(p) for seen in during for p in seen
                    if not p.startswith(out_dir)})
  return {"during": during, "after": _paths(callbacks), "scratch": scratch,
          "scratch_left": [s for s in scratch if os.path.exists(s)],
          "tower_id": history.history["tower_id"], "loss": history.history["loss"],
          "towers": strategy.num_towers}


@pytest.mark.processes
def test_file_callbacks_write_once_across_parameter_server_workers(tmp_path):
  """The same under ParameterServerStrategy: two workers run one program, so worker 1
  writes to scratch (it wrote the user's paths: the docs' BackupAndRestore recipe under
  `diststrat-run --ps 1 --workers 2` failed 3 runs of 5, HDF5 refusing a lock or reading
  a half-written backup)."""
  out_dir = str(tmp_path)
  with LocalCluster(num_ps=1, num_workers=2, cpus_per_worker=2, start_timeout=60,
                    result_timeout=150) as cluster:
    chief, other = cluster.run_on_workers(_file_callbacks_fn, out_dir=out_dir)
  user_paths = [os.path.join(out_dir, name) for name in
                ("ckpt.weights.h5", "log.csv", "backup", "tb")]
  assert chief["during"] == [user_paths, user_paths] and chief["scratch"] == []
  assert other["after"] == user_paths
  assert len(other["scratch"]) == 4, other["scratch"]
  for seen in other["during"]:  # The backup too, from the start (never the chief's).
    assert not any(p.startswith(out_dir) for p in seen), seen
  assert other["scratch_left"] == []
  assert sorted(os.listdir(out_dir)) == ["ckpt.weights.h5", "log.csv", "tb"]


@pytest.mark.processes
def test_file_callbacks_write_once_across_worker_processes(tmp_path):
  """The chief writes to the user's paths, worker 1 to a scratch directory that is gone
  after fit; a custom step output is averaged over every tower of every worker.

  On main: both workers write the user's paths (a race: h5py cannot lock the file), and
  each worker logs the mean tower id of its own towers.
  """
  out_dir = str(tmp_path)
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, start_timeout=60,
                    result_timeout=150) as cluster:
    chief, other = cluster.run_on_workers(_file_callbacks_fn, strategy="multi_worker",
                                          out_dir=out_dir)
  user_paths = [os.path.join(out_dir, name) for name in
                ("ckpt.weights.h5", "log.csv", "backup", "tb")]
  assert chief["during"] == [user_paths, user_paths] and chief["scratch"] == []
  assert other["after"] == user_paths  # Given back after fit.
  assert len(other["scratch"]) == 4, other["scratch"]
  for seen in other["during"]:
    assert not any(p.startswith(out_dir) for p in seen), seen
  assert other["scratch_left"] == []
  # The mean tower id over every tower of both workers (each has half of them).
  mean_id = (chief["towers"] - 1) / 2
  assert chief["towers"] >= 4 and chief["tower_id"] == other["tower_id"] == [mean_id] * 2
  np.testing.assert_allclose(chief["loss"], other["loss"], rtol=1e-6)
  # One writer: the chief's files, and nothing else, at the user's paths.
  assert sorted(os.listdir(out_dir)) == ["ckpt.weights.h5", "log.csv", "tb"]  # Backup removed.
  with open(os.path.join(out_dir, "log.csv")) as f:
    assert len(f.read().strip().splitlines()) == 3  # A header and two epochs.


def test_a_worker_beside_a_chief_job_writes_file_callbacks_to_scratch():
  """tf.distribute's TF_CONFIG layout, a "chief" job and one "worker" task: the worker
  was taken for the only worker and wrote the user's paths too, racing the chief. Every
  task but the chief writes to scratch (the strategies' `is_chief` is the reference)."""
  from diststrat._cluster_runtime import _cluster_spec  # pylint: disable=import-outside-toplevel
  from diststrat._keras import _file_callbacks  # pylint: disable=import-outside-toplevel
  specs = [{"chief": ["a:1"], "worker": ["b:1"]},
           {"chief": ["a:1"], "worker": ["b:1"], "ps": ["p:1"]},
           {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
           {"worker": ["a:1", "b:1"]}, {"worker": ["a:1"], "ps": ["p:1"]}, {"chief": ["a:1"]}]
  for spec in specs:
    for task_type in ("chief", "worker"):
      for task_id in range(len(spec.get(task_type, ()))):
        chief = _cluster_spec.is_chief_task(spec, task_type, task_id)
        strategy = types.SimpleNamespace(cluster_spec=spec, task_type=task_type,
                                         task_id=task_id, is_chief=chief)
        assert _file_callbacks._other_worker(strategy) is (not chief), (  # pylint: disable=protected-access
            spec, task_type, task_id)


class ErrorLogger(keras.Model):
  """A custom train_step that logs a metric of its own, per example and as batch means."""

  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(1, kernel_initializer="ones")
    self.per_example = keras.metrics.Mean(name="per_example")
    self.batch_means = keras.metrics.Mean(name="batch_means")

  def call(self, x):
    return self.dense(x)

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      prediction = self(x)
      loss = self.compute_loss(x, y, prediction)
    grads = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
    errors = tf.reshape(tf.abs(prediction - y), [-1])
    self.per_example.update_state(errors)
    self.batch_means.update_state(tf.reduce_mean(errors))
    return {m.name: m.result() for m in (self.per_example, self.batch_means)}


def test_a_metric_of_a_custom_train_step_given_per_example_values_equals_one_device():
  """docs/keras.md, "What a step returns": per-example values give one device's metric,
  also when a batch leaves a tower empty; the mean of a tower with no example is nan."""
  x = np.arange(10, dtype=np.float32).reshape(5, 2)
  y = np.ones((5, 1), np.float32)

  def fit(strategy):
    with strategy.scope() if strategy else contextlib.nullcontext():
      model = ErrorLogger()
      model.compile("sgd", "mse")
    history = model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0).history
    return {name: values[-1] for name, values in history.items()}

  one, towers = fit(None), fit(STRATEGIES["mirrored4"]())
  np.testing.assert_allclose(towers["per_example"], one["per_example"], rtol=1e-6)
  assert np.isnan(towers["batch_means"]) and not np.isnan(one["batch_means"])
