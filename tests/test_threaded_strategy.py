"""A strategy written outside diststrat that runs its towers in threads, as
docs/write_your_own_strategy.md ("Beyond the example") says a production strategy does,
with only the documented hooks and helpers: `_capture_thread_state` gives its tower
threads the caller's graph, variable creators and diststrat context."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from sequential_strategy import SequentialStrategy
from conftest import CPUS

TIMEOUT = 60.0  # Seconds a tower waits in merge_call for the others.


class _Merger:
  """Pauses the towers of one call in merge_call; the last to arrive runs merge_fn.

  Its lock is held by the one tower that runs: the others wait for it.
  """

  def __init__(self, devices):
    self.devices = devices
    self.cond = threading.Condition(threading.RLock())
    self.waiting = {}  # tower_id -> (args, kwargs)
    self.returned = 0
    self.generation = 0
    self.result = self.error = None

  def merge(self, context, merge_fn, args, kwargs):
    with self.cond:
      generation = self.generation
      self.waiting[context.tower_id] = (args, kwargs)
      if len(self.waiting) + self.returned == len(self.devices):
        self._run(context, merge_fn)
      elif not self.cond.wait_for(lambda: self.generation != generation, TIMEOUT):
        raise TimeoutError(f"tower {context.tower_id} waited {TIMEOUT} s in merge_call")
      if self.error is not None:
        raise self.error
      return ds.values.select_device(context.device, self.result)

  def tower_returned(self):
    with self.cond:
      self.returned += 1
      if self.waiting:
        self._run(None, None)

  def _run(self, context, merge_fn):
    """Runs merge_fn once with the towers' arguments regrouped (the lock is held)."""
    self.result = self.error = None
    if self.returned:
      self.error = ds.errors.MergeCallMismatchError(
          f"towers {sorted(self.waiting)} called merge_call, the others returned")
    else:
      parts = [self.waiting[i] for i in range(len(self.devices))]
      args = ds.values.regroup([p[0] for p in parts], self.devices)
      kwargs = ds.values.regroup([p[1] for p in parts], self.devices)
      try:
        # The base version runs merge_fn in the strategy's cross-tower context.
        self.result = ds.TowerContext._merge_call(context, merge_fn, args, kwargs)
      except Exception as e:  # pylint: disable=broad-except
        self.error = e
    self.waiting = {}
    self.generation += 1
    self.cond.notify_all()


class _ThreadedTowerContext(ds.TowerContext):

  def __init__(self, merger, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._merger = merger

  def _merge_call(self, merge_fn, args, kwargs):
    return self._merger.merge(self, merge_fn, args, kwargs)


class ThreadedStrategy(SequentialStrategy):
  """SequentialStrategy's variables and reductions; each tower in a thread of its own."""

  def __init__(self, devices):
    super().__init__(devices)
    self.created = []  # The variables _create_variable made, for the tests.

  def _create_variable(self, next_creator, kwargs, colocate_with):
    variable = super()._create_variable(next_creator, kwargs, colocate_with)
    self.created.append(variable)
    return variable

  def _call_for_each_tower(self, fn, args, kwargs):
    state = self._capture_thread_state()  # The caller's graph, creators, context.
    merger = _Merger(self._devices)
    shares = ds.values.batch_shares((args, kwargs)) or {}
    results, errors = [None] * len(self._devices), []

    def tower(tower_id, device):
      context = _ThreadedTowerContext(merger, self, tower_id, len(self._devices), device,
                                      batch_share=shares.get(device))
      try:
        # One tower runs at a time (a graph is not built from several threads at once):
        # each holds the merger's lock, which waiting in merge_call releases.
        with merger.cond, state.enter(device=device, slot=tower_id), \
            self._tower_scope(context):
          results[tower_id] = fn(*ds.values.select_device(device, args),
                                 **ds.values.select_device(device, kwargs))
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
      finally:
        merger.tower_returned()

    threads = [threading.Thread(target=tower, args=(i, d))
               for i, d in enumerate(self._devices)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(TIMEOUT)
    if errors:
      raise errors[0]
    return ds.values.regroup(results, self._devices)


def _train_keras_custom_loop(strategy, use_function):
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 3)).astype(np.float32)
  y = rng.normal(size=(8, 1)).astype(np.float32)
  with strategy.scope():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.1)  # Creates its state in the first merge_call.
    data = strategy.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(4))

    def tower(x, y):
      with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
      return tf.distribute.get_replica_context().all_reduce("sum", loss)

    def step(x, y):
      return strategy.call_for_each_tower(tower, x, y)

    step = tf.function(step) if use_function else step
    for batch in data:
      step(*batch)
  return model, optimizer


@pytest.mark.parametrize("use_function", [False, True])
def test_towers_in_threads_train_a_keras_model_as_one_device(use_function):
  # Without a way to carry the caller's state, the towers' threads had no variable
  # creator (the optimizer's state, made in merge_call, bypassed _create_variable) and
  # no graph (in a tf.function, Keras's Dense.call failed with a TypeError).
  reference, _ = _train_keras_custom_loop(ds.DefaultStrategy(), use_function)
  strategy = ThreadedStrategy(CPUS[:2])
  model, optimizer = _train_keras_custom_loop(strategy, use_function)
  for got, want in zip(model.weights, reference.weights, strict=True):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
  created = {id(v) for v in strategy.created}
  assert optimizer.variables and all(id(v.value) in created for v in optimizer.variables)


def test_towers_in_threads_keep_the_callers_colocation():
  strategy = ThreadedStrategy(CPUS[:3])
  with tf.device(CPUS[0]):
    anchor = tf.Variable(1.0)
  with strategy.scope():
    with strategy.colocate_vars_with(anchor):
      made = strategy.call_for_each_tower(lambda: tf.Variable(2.0))
  assert [v.device for v in strategy.unwrap(made)] == [CPUS[0]] * 3


def test_a_tower_missing_a_merge_call_is_named():
  strategy = ThreadedStrategy(CPUS[:2])

  def fn():
    context = ds.get_tower_context()
    if context.tower_id == 0:
      context.merge_call(lambda s: None)

  with strategy.scope(), pytest.raises(ds.errors.MergeCallMismatchError,
                                       match=r"towers \[0\] called merge_call"):
    strategy.call_for_each_tower(fn)
