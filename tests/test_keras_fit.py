"""Keras `model.fit`, `evaluate` and `predict` under diststrat (docs/keras.md).

A model built and compiled in a strategy's scope trains on every tower: a layer records,
at run time, which tower ran it on how many examples. Weights, history (with validation
data), callbacks, `evaluate` numbers and `predict` outputs are compared with the same
model trained on one device with no strategy.
"""

import functools
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from conftest import CPUS
from keras_cases import STRATEGIES, assert_all_close, assert_copies_equal, frozen, frozen_history


FEATURES = 6
SEEN = []  # (tower id, examples) per call of TowerRecorder, at run time.


@keras.saving.register_keras_serializable(package="diststrat_tests")
class TowerRecorder(keras.layers.Layer):
  """Passes its input through; records (tower id, batch rows) each time it runs."""

  def call(self, x):
    context = ds.get_tower_context()
    tower_id = context.tower_id if context is not None else -1

    def record(rows):
      SEEN.append((tower_id, int(rows)))
      return np.float32(0.0)

    zero = tf.py_function(record, [tf.shape(x)[0]], tf.float32)
    zero.set_shape([])
    return x + zero


def _data(n=96, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, FEATURES)).astype(np.float32)
  y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
  return x, y


def _make(optimizer="adam", weights=None, **compile_kwargs):
  keras.utils.set_random_seed(1)
  model = keras.Sequential([
      keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), TowerRecorder(),
      keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(1)])
  if weights is not None:
    model.set_weights(weights)
  optimizer = {"adam": lambda: keras.optimizers.Adam(0.01),
               "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
               "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
               "rmsprop": lambda: keras.optimizers.RMSprop(0.01)}[optimizer]()
  model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], **compile_kwargs)
  return model


@functools.lru_cache(maxsize=None)
def _initial_weights():
  return frozen(_make().get_weights())


def _build(strategy, optimizer="adam", **compile_kwargs):
  with strategy.scope():
    return _make(optimizer, list(_initial_weights()), **compile_kwargs)


def _callbacks(path):
  # EarlyStopping with an unreachable min_delta stops after `patience` + 1 epochs.
  return [keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True),
          keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)]


def _fit_evaluate_predict(model, data, path, batch=24, in_scope=None):
  x, y = _data()
  validation = (x[:32], y[:32])
  fit_kwargs = dict(epochs=4, validation_data=validation, callbacks=_callbacks(path),
                    verbose=0)
  if data == "numpy":
    fit = lambda: model.fit(x, y, batch_size=batch, shuffle=False, **fit_kwargs)
  else:
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    fit = lambda: model.fit(dataset, shuffle=False, **fit_kwargs)
  with in_scope.scope() if in_scope is not None else _nothing():
    history = fit().history
  return (history, model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True),
          model.predict(x, batch_size=batch, verbose=0))


class _nothing:  # pylint: disable=invalid-name
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


@functools.lru_cache(maxsize=None)
def _one_device(tmp_dir):
  model = _make(weights=list(_initial_weights()))
  path = os.path.join(tmp_dir, "one_device.keras")
  history, evaluated, predicted = _fit_evaluate_predict(model, "numpy", path)
  # The weights in ModelCheckpoint's file (the best epoch's, not the last), loaded once.
  checkpoint_weights = frozen(keras.models.load_model(path).get_weights())
  return (frozen(model.get_weights()), frozen_history(history), types.MappingProxyType(evaluated),
          frozen([predicted])[0], checkpoint_weights)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  return _one_device(str(tmp_path_factory.mktemp("one_device")))


def _assert_history_equal(got, expected):
  assert sorted(got) == sorted(expected) and "val_loss" in got
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)


# No "default" case: under the default strategy the bridge stands aside, so it would
# compare plain Keras with plain Keras.
FIT_CASES = [("mirrored1", "numpy"), ("mirrored2", "numpy"),
             ("mirrored4", "numpy"), ("ps4", "numpy"), ("mirrored4", "tf.data"),
             ("ps2", "tf.data")]


@pytest.mark.parametrize("name,data", FIT_CASES)
def test_fit_evaluate_predict_match_one_device(name, data, one_device, tmp_path):
  weights, history, evaluated, predicted, checkpoint_weights = one_device
  strategy = STRATEGIES[name]()
  model = _build(strategy)
  assert model.distribute_strategy is not None
  SEEN.clear()
  path = str(tmp_path / "checkpoint.keras")
  # fit inside the scope for mirrored2, outside it (the model keeps its strategy) otherwise.
  got = _fit_evaluate_predict(model, data, path,
                              in_scope=strategy if name == "mirrored2" else None)
  towers = strategy.num_towers
  # Every tower ran every step: fit, evaluate and predict.
  assert sorted({t for t, _ in SEEN}) == list(range(towers))
  # Batches of 24 (96 examples, 32 validation: 24 + 8) or, validating a tf.data fit,
  # Keras's default 32; each split evenly.
  assert {rows for _, rows in SEEN} <= {24 // towers, 8 // towers, 32 // towers}
  _assert_history_equal(got[0], history)
  assert len(got[0]["loss"]) == len(history["loss"]) == 2  # EarlyStopping stopped both.
  assert_all_close(model.get_weights(), weights)  # Moving statistics included.
  assert got[1] == pytest.approx(evaluated, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(got[2], predicted, rtol=1e-5, atol=1e-5)  # In input order.
  assert_copies_equal(model.weights + model.optimizer.variables)
  # ModelCheckpoint's file, written under the strategy, loads with none.
  loaded = keras.models.load_model(path)
  assert_all_close(loaded.get_weights(), checkpoint_weights)


def test_weight_files_move_between_strategies(tmp_path):
  x, y = _data()
  trained = _build(STRATEGIES["mirrored4"]())
  trained.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
  trained.save_weights(str(tmp_path / "four.weights.h5"))
  trained.save(str(tmp_path / "four.keras"))
  for name in ("default", "mirrored2", "ps4"):  # 4 towers -> none, 2 towers, PS.
    model = _build(STRATEGIES[name]())
    model.load_weights(str(tmp_path / "four.weights.h5"))
    assert_all_close(model.get_weights(), trained.get_weights())
    assert_copies_equal(model.weights)
    if name == "default":  # And back: one device -> 4 towers, every copy written.
      model.save_weights(str(tmp_path / "one.weights.h5"))
      again = _build(STRATEGIES["mirrored4"]())
      again.load_weights(str(tmp_path / "one.weights.h5"))
      assert_all_close(again.get_weights(), trained.get_weights())
      assert_copies_equal(again.weights)
  with STRATEGIES["mirrored2"]().scope():
    loaded = keras.models.load_model(str(tmp_path / "four.keras"))
  assert_all_close(loaded.get_weights(), trained.get_weights())
  assert_copies_equal(loaded.weights)


def _ragged_fit_evaluate_predict(model):
  # 123 examples in batches of 41, split 11/10/10/10: towers weigh by their examples.
  x, y = _data(123, seed=2)
  history = model.fit(x, y, batch_size=41, epochs=2, shuffle=False, verbose=0).history
  return (history, model.evaluate(x, y, batch_size=41, verbose=0, return_dict=True),
          model.predict(x, batch_size=41, verbose=0))


@functools.lru_cache(maxsize=None)
def _ragged_one_device():
  """One device's history, evaluation, prediction and weights: both strategies' reference."""
  reference = _make("sgd_momentum", list(_initial_weights()))
  history, evaluated, predicted = _ragged_fit_evaluate_predict(reference)
  return (frozen_history(history), types.MappingProxyType(evaluated), frozen([predicted])[0],
          frozen(reference.get_weights()))


@pytest.mark.parametrize("name", ["mirrored4", "ps4"])
def test_ragged_last_batch_matches_one_device(name):
  expected_history, expected_eval, expected_pred, expected_weights = _ragged_one_device()
  model = _build(STRATEGIES[name](), "sgd_momentum")
  history, evaluated, predicted = _ragged_fit_evaluate_predict(model)
  assert sorted(history) == sorted(expected_history)
  for key in expected_history:
    np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-5, atol=1e-6)
  assert_all_close(model.get_weights(), expected_weights)
  assert evaluated == pytest.approx(expected_eval, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(predicted, expected_pred, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw", "rmsprop"])
def test_fit_with_other_keras_optimizers_matches_one_device(optimizer):
  x, y = _data()
  reference = _make(optimizer, list(_initial_weights()))
  reference.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
  model = _build(STRATEGIES["mirrored4"](), optimizer)
  model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
  assert_all_close(model.get_weights(), reference.get_weights())
  assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize("compile_kwargs", [{"steps_per_execution": 2}, {"run_eagerly": True}],
                         ids=["steps_per_execution", "run_eagerly"])
def test_fit_execution_options_match_one_device(compile_kwargs):
  x, y = _data()
  reference = _make(weights=list(_initial_weights()), **compile_kwargs)
  reference.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
  model = _build(STRATEGIES["mirrored2"](), **compile_kwargs)
  SEEN.clear()
  model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
  assert sorted({t for t, _ in SEEN}) == [0, 1]
  assert_all_close(model.get_weights(), reference.get_weights())


def test_batch_entry_points_and_short_predict_batches():
  x, y = _data()
  reference = _make(weights=list(_initial_weights()))
  model = _build(STRATEGIES["mirrored4"]())
  got = model.train_on_batch(x[:20], y[:20], return_dict=True)
  expected = reference.train_on_batch(x[:20], y[:20], return_dict=True)
  assert {k: float(v) for k, v in got.items()} == pytest.approx(
      {k: float(v) for k, v in expected.items()}, rel=1e-5)
  np.testing.assert_allclose(model.test_on_batch(x[:8], y[:8]),
                             reference.test_on_batch(x[:8], y[:8]), rtol=1e-5)
  np.testing.assert_allclose(model.predict_on_batch(x[:5]), reference.predict_on_batch(x[:5]),
                             rtol=1e-5, atol=1e-6)
  SEEN.clear()
  short = model.predict(x[:3], verbose=0)  # 3 examples, 4 towers: one gets none.
  assert sorted(rows for _, rows in SEEN) == [0, 1, 1, 1]
  np.testing.assert_allclose(short, reference.predict(x[:3], verbose=0), rtol=1e-5, atol=1e-6)



def test_eager_batch_entry_points_split_their_numpy_batches():
  """With `run_eagerly=True`, Keras hands `train_on_batch`, `test_on_batch` and
  `predict_on_batch`'s numpy arrays to the strategy as they are: every tower got the whole
  batch, and `predict_on_batch` returned 4 x 6 rows."""
  x, y = _data()
  reference = _make(weights=list(_initial_weights()), run_eagerly=True)
  model = _build(STRATEGIES["mirrored4"](), run_eagerly=True)
  SEEN.clear()
  got = model.train_on_batch(x[:10], y[:10], return_dict=True)
  assert sorted(SEEN) == [(0, 3), (1, 3), (2, 2), (3, 2)]
  expected = reference.train_on_batch(x[:10], y[:10], return_dict=True)
  assert {k: float(v) for k, v in got.items()} == pytest.approx(
      {k: float(v) for k, v in expected.items()}, rel=1e-5)
  assert_all_close(model.get_weights(), reference.get_weights())
  np.testing.assert_allclose(model.test_on_batch(x[:8], y[:8]),
                             reference.test_on_batch(x[:8], y[:8]), rtol=1e-5)
  SEEN.clear()
  predicted = model.predict_on_batch(x[:6])
  assert sorted(SEEN) == [(0, 2), (1, 2), (2, 1), (3, 1)]
  np.testing.assert_allclose(predicted, reference.predict_on_batch(x[:6]), rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("name", ["mirrored4", "ps4"])
def test_model_built_outside_the_scope_is_refused(name):
  x, y = _data()
  strategy = STRATEGIES[name]()
  model = _make(weights=list(_initial_weights()))  # No strategy: plain variables.
  with strategy.scope():
    with pytest.raises(ds.errors.ContextError,
                       match=r"The Keras model '.*' runs under .*Strategy.*, so its "
                             r"variables must be that strategy's. Received: 8 variables "
                             r"created outside its scope, such as \[.*\]. Build and compile "
                             r"the model inside `with strategy.scope\(\):`"):
      model.fit(x, y, batch_size=24, epochs=1, verbose=0)


@pytest.mark.parametrize("optimizer, name", [("sgd", "SGD"), ("adam", "Adam")])
def test_optimizer_created_outside_the_scope_is_refused(optimizer, name):
  # With "adam" this was TensorFlow's "Mixing different tf.distribute.Strategy objects"
  # (Keras builds Adam's slots before the first step), naming no model and no fix.
  x, y = _data()
  with STRATEGIES["mirrored2"]().scope():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)],
                             name="built_inside")
  model.compile(optimizer=optimizer, loss="mse")  # Outside: it misses the strategy.
  with pytest.raises(ds.errors.ContextError,
                     match=r"The Keras model 'built_inside' runs under MirroredStrategy.*, "
                           r"so its optimizer must be created in that strategy's scope. "
                           rf"Received: an optimizer created outside it \({name}\). Create "
                           r"the optimizer and compile the model inside `with "
                           r"strategy.scope\(\):`."):
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)


@pytest.mark.parametrize("optimizer, name", [("sgd", "SGD"), ("adam", "Adam")])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_model_built_outside_compiled_inside_fit_outside_is_refused(optimizer, name,
                                                                    run_eagerly):
  # Once: with "sgd", fit trained silently on one device; with "adam", the error named
  # colocate_vars_with() and no model.
  x, y = _data()
  strategy = STRATEGIES["mirrored2"]()
  model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)],
                           name="built_outside")
  before = [w.copy() for w in model.get_weights()]
  with strategy.scope():
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
  with pytest.raises(ds.errors.ContextError,
                     match=r"The Keras model 'built_outside' was built outside the scope of "
                           rf"MirroredStrategy.*, but its optimizer \({name}\) was created in "
                           r"it \(compile\(\) ran inside `with strategy.scope\(\):`\), and it "
                           r"runs in the default tower context \(no strategy entered\): the "
                           r"model would train on one device while its optimizer belongs to "
                           r"the strategy. Build the model inside `with strategy.scope\(\):` "
                           r"too"):
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)
  for got, expected in zip(model.get_weights(), before, strict=True):
    np.testing.assert_array_equal(got, expected)  # Nothing was trained.


def test_sparse_inputs_say_what_to_do():
  with STRATEGIES["mirrored2"]().scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  sparse = tf.sparse.from_dense(tf.eye(4))
  with pytest.raises(TypeError, match=r"which it does for dense tensors only. Received: a "
                                      r"SparseTensor. Convert it to a dense tensor"):
    model.predict(tf.data.Dataset.from_tensors(sparse), verbose=0)


class _MeanSquareLoss(keras.layers.Layer):
  """Adds 0.1 times the mean square of its input to the model's losses."""

  def call(self, x):
    self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
    return x


@pytest.mark.parametrize("run_eagerly,more_losses", [(False, False), (True, False), (True, True)],
                         ids=["compiled", "eager", "eager, regularizers and add_loss"])
def test_a_batch_smaller_than_the_tower_count_trains_like_one_device(run_eagerly, more_losses):
  """Batches of 2 (fit), 3 (evaluate) and 1 (predict) over 4 towers: the empty towers
  add nothing to the loss (their loss is an empty tensor; Keras's Mean would add nan).
  With a kernel and an activity regularizer and an `add_loss`, an empty eager tower's
  compiled loss (an empty vector) is added to those losses: it raised
  InvalidArgumentError "Shapes of all inputs must match"."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  y = rng.normal(size=(6, 1)).astype(np.float32)
  extra = ({"kernel_regularizer": keras.regularizers.L2(0.1), "activity_regularizer": "l2"}
           if more_losses else {})

  def run(strategy):
    with strategy.scope():
      keras.utils.set_random_seed(1)
      model = keras.Sequential(
          [keras.Input((5,)), keras.layers.Dense(4, activation="relu", **extra)]
          + ([_MeanSquareLoss()] if more_losses else []) + [keras.layers.Dense(1)])
      model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"],
                    run_eagerly=run_eagerly)
    history = model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0).history
    evaluated = model.evaluate(x, y, batch_size=3, verbose=0)
    predicted = model.predict(x, batch_size=1, verbose=0)
    return history, evaluated, [w.numpy() for w in model.weights], predicted

  reference = run(ds.DefaultStrategy())
  towers = run(ds.MirroredStrategy(CPUS))
  for key in ("loss", "mae"):
    np.testing.assert_allclose(towers[0][key], reference[0][key], rtol=1e-5)
  np.testing.assert_allclose(towers[1], reference[1], rtol=1e-5)
  for got, want in zip(towers[2], reference[2], strict=True):
    np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(towers[3], reference[3], atol=1e-6)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_an_empty_tower_adds_no_nan_through_batch_normalization(run_eagerly):
  """Batches of 1 over 4 towers: tower 0 gets the example, towers 1-3 none. Their
  BatchNormalization's batch mean is 0 / 0, and gamma's gradient got nan from it, which
  the sum spread to every copy. Tower 0 normalizes over the same one example as one
  device, so the weights must be one device's."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(3, 5)).astype(np.float32)
  y = rng.normal(size=(3, 2)).astype(np.float32)

  def run(strategy):
    with strategy.scope():
      keras.utils.set_random_seed(1)
      model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                                keras.layers.BatchNormalization(), keras.layers.Dense(2)])
      model.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=run_eagerly)
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
    return [(w.path.split("/")[-1], w.numpy()) for w in model.weights]

  reference = run(ds.DefaultStrategy())
  towers = run(ds.MirroredStrategy(CPUS))
  for (name, got), (_, want) in zip(towers, reference, strict=True):
    assert np.isfinite(got).all(), name
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)


class GuideModel(keras.Model):
  """The custom `train_step` of Keras's guide "Customizing what happens in fit()": it
  returns `{m.name: m.result() for m in self.metrics}`, where the compiled metrics'
  result is itself a dict (`{"compile_metrics": {"mae": ...}}`)."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.compute_loss(y=y, y_pred=y_pred)
    gradients = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply(gradients, self.trainable_variables)
    for metric in self.metrics:
      if metric.name == "loss":
        self.update_loss_tracker(metric, loss)
      else:
        metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}

  def update_loss_tracker(self, tracker, loss):
    tracker.update_state(loss)  # As the guide does.


def _compiled_guide_model(model_class, strategy):
  """A small functional model of `model_class`, built and compiled in `strategy`'s scope."""
  with strategy.scope():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = model_class(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
  return model


@pytest.mark.parametrize("name", ["mirrored2", "mirrored4"])
def test_a_custom_train_step_returning_nested_metric_results_logs_one_devices(name):
  """The nested metric results were logged as diststrat `PerDevice` objects (one value
  per tower, not a number) in `History`; now each is the metric's global value."""
  x, y = _data(n=60)

  def run(strategy):
    model = _compiled_guide_model(GuideModel, strategy)
    history = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x[:20], y[:20])).history
    return history, model.get_weights()

  reference, reference_weights = run(ds.DefaultStrategy())
  history, weights = run(STRATEGIES[name]())
  assert sorted(history) == sorted(reference)
  for key in ("mae", "val_loss", "val_mae"):
    assert all(isinstance(v, float) for v in history[key]), (key, history[key])
    np.testing.assert_allclose(history[key], reference[key], rtol=1e-5, err_msg=key)
  assert_all_close(weights, reference_weights)


class GuideModelLoggingOneDevicesLoss(GuideModel):
  """The guide's step with the loss tracker updated as docs/keras.md says, to log one
  device's loss: `update_state(loss * n, sample_weight=1 / n)`."""

  def update_loss_tracker(self, tracker, loss):
    n = tf.distribute.get_strategy().num_replicas_in_sync
    tracker.update_state(loss * tf.cast(n, loss.dtype), sample_weight=1 / n)


def test_the_guide_step_logs_one_devices_loss_as_docs_keras_says_on_ragged_batches():
  """docs/keras.md, "What a step returns". Batches of 10 over 4 towers (parts of 3, 3,
  2, 2): `loss * n` alone logs 4.82 in the first epoch where one device logs 4.49, since
  `n` is the int N in a train_step and the tracker weighs each tower's update by its
  share (the page said `loss * n`, when `n` was a `TowerShare` there)."""
  x, y = _data(n=60)

  def run(strategy):
    model = _compiled_guide_model(GuideModelLoggingOneDevicesLoss, strategy)
    return model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history

  reference = run(ds.DefaultStrategy())
  history = run(STRATEGIES["mirrored4"]())
  np.testing.assert_allclose(history["loss"], reference["loss"], rtol=1e-5)


@pytest.mark.parametrize("kind", ["add", "lstm"])
def test_residual_and_lstm_models_on_batches_smaller_than_the_tower_count(kind):
  """Compiled steps on batches of 2 and 3 over 4 towers. The batches' size is static, and
  TensorFlow inferred the empty towers' parts as 0 rows: `keras.ops.add` (the `Add`
  layer, an LSTM cell's bias) takes a 0-size axis for a squeezable one and built a
  `BiasAdd` of two matrices, `ValueError: Shape must be rank 1 but is rank 2`."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  y = rng.normal(size=(6, 5)).astype(np.float32)

  def run(strategy):
    with strategy.scope():
      keras.utils.set_random_seed(1)
      inputs = keras.Input((5,))
      hidden = keras.layers.Dense(5)(inputs)
      if kind == "add":
        outputs = keras.layers.Add()([inputs, hidden])
      else:
        outputs = keras.layers.LSTM(5)(keras.layers.Reshape((5, 1))(hidden))
      model = keras.Model(inputs, outputs)
      model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0).history
    on_batch = model.train_on_batch(x[:3], y[:3])
    return (history["loss"], on_batch, model.predict_on_batch(x[:3]),
            model.predict(x, batch_size=5, verbose=0), model.get_weights())

  reference = run(ds.DefaultStrategy())
  towers = run(ds.MirroredStrategy(CPUS))
  for got, want in zip(towers[:4], reference[:4], strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert_all_close(towers[4], reference[4])


@pytest.mark.parametrize("data", ["shuffled tf.data", "generator", "PyDataset"])
def test_fit_reads_the_data_as_one_device_does(data):
  """Under a strategy, Keras's fit (and evaluate) took one batch from a pass of their own
  over the data before the first step, for its shapes. A dataset that reshuffles each
  pass then gave the first epoch its second order, a Python generator lost the batches
  that pass took (and the prefetch after it), a shuffled PyDataset another order. The
  model is built from the dataset's element spec instead."""
  x, y = _data()

  class Batches(keras.utils.PyDataset):
    def __len__(self):
      return 4

    def __getitem__(self, i):
      return x[24 * i:24 * (i + 1)], y[24 * i:24 * (i + 1)]

  def fit(model):
    tf.random.set_seed(0)
    keras.utils.set_random_seed(2)
    if data == "generator":
      batches = (b for _ in range(3) for b in Batches())
      model.fit(batches, steps_per_epoch=4, epochs=2, verbose=0)
    elif data == "PyDataset":
      model.fit(Batches(), epochs=2, shuffle=True, verbose=0)
    else:
      dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=1).batch(24)
      model.fit(dataset, epochs=2, verbose=0)
    return model.get_weights()

  reference = fit(_make("sgd_momentum", list(_initial_weights())))
  assert_all_close(fit(_build(STRATEGIES["mirrored2"](), "sgd_momentum")), reference)


def test_stateful_recurrent_layers_on_several_towers_say_what_to_do():
  """A stateful RNN keeps one state per example of the whole batch; split across towers,
  Keras's error said the batch size was wrong (2 for 4), which no batch size fixes."""
  x = np.zeros((8, 3, 2), np.float32)
  with ds.MirroredStrategy(CPUS[:2]).scope():
    model = keras.Sequential([keras.Input((3, 2), batch_size=4),
                              keras.layers.GRU(3, stateful=True, name="gru"), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
  for run in (lambda: model.fit(x, x[:, 0, :1], batch_size=4, verbose=0),
              lambda: model.predict(x, batch_size=4, verbose=0)):
    with pytest.raises(ValueError, match=r"stateful recurrent layers \['gru'\].*2 towers"
                                         r".*stateful=False.*one device"):
      run()


class _ExampleCounter(keras.layers.Layer):
  """Counts the examples it sees in training, in a variable summed across towers."""

  def build(self, input_shape):
    self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                aggregation="sum", dtype=self.counter_dtype, name="seen")
    self.taken = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                 aggregation="sum", dtype=self.counter_dtype, name="taken")

  def call(self, x, training=None):
    if training:
      rows = tf.cast(tf.shape(x)[0], self.counter_dtype)
      self.seen.assign_add(rows)
      self.taken.assign_sub(2 * rows)
    return x


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("name", ["mirrored4", "ps4"])
def test_a_keras_assign_add_to_a_sum_variable_adds_every_towers_delta(name, dtype):
  # Keras writes assign_add(d) as assign(v + d): summed over the towers, that added N
  # copies of the old value each step (a count of the examples grew geometrically).
  x, y = _data(42)

  def counts(strategy):
    with strategy.scope():
      counter = _ExampleCounter()
      counter.counter_dtype = dtype
      model = keras.Sequential([keras.Input((FEATURES,)), counter, keras.layers.Dense(1)])
      model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)  # 6 steps an epoch, the last of 2.
    assert_copies_equal([counter.seen, counter.taken])
    return [counter.seen.numpy(), counter.taken.numpy()]

  expected = counts(ds.DefaultStrategy())
  assert expected == [84, -168]
  np.testing.assert_array_equal(counts(STRATEGIES[name]()), expected)


@pytest.mark.parametrize("kind", ["lstm_unrolled", "gru"])
def test_recurrent_layers_with_both_dropouts_draw_each_towers_own_masks(kind):
  # A recurrent cell caches its input and recurrent dropout masks on itself, and the
  # towers share the cell: a tower used another tower's masks (a shape error on this
  # ragged batch, 3 + 2) or drew again where the others did not
  # (MergeCallMismatchError, unrolled). LSTM, GRU and SimpleRNN share the cache.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, 4, 3)).astype(np.float32)
  y = rng.normal(size=(10, 1)).astype(np.float32)
  layer = {"lstm_unrolled": lambda: keras.layers.LSTM(4, dropout=0.2, recurrent_dropout=0.3,
                                                      unroll=True),
           "gru": lambda: keras.layers.GRU(4, dropout=0.2, recurrent_dropout=0.3)}[kind]

  def make():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4, 3)), layer(), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model

  with STRATEGIES["mirrored2"]().scope():
    model = make()
  history = model.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False).history
  assert np.all(np.isfinite(history["loss"]))
  assert_copies_equal(model.weights + model.optimizer.variables)
  reference = make()  # One device, with the weights trained (no dropout in inference).
  reference.set_weights(model.get_weights())
  assert model.evaluate(x, y, batch_size=5, verbose=0) == pytest.approx(
      reference.evaluate(x, y, batch_size=5, verbose=0), rel=1e-5, abs=1e-6)
