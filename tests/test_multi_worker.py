"""MultiWorkerMirroredStrategy on real processes (docs/multi_worker.md).

Worker functions run in LocalCluster worker processes (module-level: they are pickled);
the reference computations run in this process on one device, with no strategy. This
module does not import conftest's helpers: a worker process unpickling these functions
imports this module, and must keep its own device set-up (LocalCluster's
cpus_per_worker).
"""

import json
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.cluster import LocalCluster
from diststrat.errors import ClusterError

TIMEOUT = 150
COLLECTIVE_TIMEOUT = 3.0  # The fault tests' bound (small: each waits for it once).
pytestmark = pytest.mark.usefixtures("no_child_left")  # (conftest.py)
STEPS = 4
GLOBAL_BATCH = 8
VOCAB, DIM = 12, 3


def _data(steps=STEPS, batch=GLOBAL_BATCH, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, VOCAB, size=(steps, batch)).astype(np.int32)
  ys = rng.normal(size=(steps, batch, 1)).astype(np.float32)
  emb0 = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
  w0 = (rng.normal(size=(DIM, 1)) * 0.5).astype(np.float32)
  return ids, ys, emb0, w0


OPTIMIZERS = {
    "sgd": lambda: ds.optimizers.GradientDescent(0.1),
    "momentum": lambda: ds.optimizers.Momentum(0.05, 0.9),
    "adam": lambda: ds.optimizers.Adam(0.02),
}


def _loss(emb, w, ids, y, sparse):
  h = tf.gather(emb, ids) if sparse else tf.one_hot(ids, VOCAB) @ emb
  return tf.reduce_mean(tf.square(h @ w - y))


def _train(strategy, name, sparse, mode, steps=STEPS):
  """Trains (emb, w) on the global batches; returns the final values."""
  ids, ys, emb0, w0 = _data(steps)
  with strategy.scope(), tf.name_scope(f"{name}_{sparse}_{mode}"):
    emb, w, opt = tf.Variable(emb0, name="emb"), tf.Variable(w0, name="w"), OPTIMIZERS[name]()
    data = iter(strategy.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices((ids, ys))))

  def step(batch_ids, batch_y):
    def tower(i, y):
      opt.minimize(lambda: _loss(emb, w, i, y, sparse), var_list=[emb, w])
    strategy.call_for_each_tower(tower, batch_ids, batch_y)

  if mode == "function":
    step = tf.function(step)
  for _ in range(steps):
    step(*next(data))
  return emb.numpy(), w.numpy()


def _reference(name, sparse, steps=STEPS):
  ids, ys, emb0, w0 = _data(steps)
  emb, w, opt = tf.Variable(emb0), tf.Variable(w0), OPTIMIZERS[name]()
  for i in range(steps):
    opt.minimize(lambda i=i: _loss(emb, w, ids[i], ys[i], sparse), var_list=[emb, w])
  return emb.numpy(), w.numpy()


# --- worker functions ----------------------------------------------------------------


def _equivalence_fn(strategy):
  results = {"towers": strategy.num_towers, "task": (strategy.task_type, strategy.task_id),
             "is_chief": strategy.is_chief, "devices": list(strategy.worker_devices),
             "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
             "cores": len(os.sched_getaffinity(0)), "machine_cores": os.cpu_count()}
  with strategy.scope():
    random = tf.Variable(tf.random.normal([4, 3]))  # Unseeded: differs per process alone.
  results["random"] = random.numpy().tolist()
  results["ids"] = [int(t) for t in strategy.unwrap(strategy.call_for_each_tower(
      lambda: ds.get_tower_context().tower_id))]
  for name in OPTIMIZERS:
    for sparse in (False, True):
      for mode in ("eager", "function"):
        emb, w = _train(strategy, name, sparse, mode)
        results[f"{name}_{sparse}_{mode}"] = (emb.tolist(), w.tolist())
  return results


def _ragged_fn(strategy):
  """10 examples over 3 towers (4, 3, 3): towers' summed losses over the global batch."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(2, 10, 4)).astype(np.float32)
  y = rng.normal(size=(2, 10, 1)).astype(np.float32)
  with strategy.scope():
    w = tf.Variable(np.ones([4, 1], np.float32), name="w")
    opt = ds.optimizers.GradientDescent(0.1, loss_reduction="sum")
    data = iter(strategy.distribute_dataset(lambda: tf.data.Dataset.from_tensor_slices((x, y))))
  sizes = []

  @tf.function
  def step(bx, by):
    def tower(xi, yi):
      opt.minimize(lambda: tf.reduce_sum(tf.square(xi @ w - yi)) / 10.0, var_list=[w])
      return tf.shape(xi)[0]
    return strategy.call_for_each_tower(tower, bx, by)

  for _ in range(2):
    sizes.append([int(s) for s in strategy.unwrap(step(*next(data)))])
  return {"w": w.numpy().tolist(), "sizes": sizes}


def _many_shapes_fn(strategy):
  """Creates variables of 8 shapes (each initial value broadcast from the chief) and
  counts TensorFlow's retracing warnings meanwhile."""
  import logging  # pylint: disable=import-outside-toplevel
  warnings = []

  class Catch(logging.Handler):
    def emit(self, record):
      if "retracing" in record.getMessage():
        warnings.append(record.getMessage())

  handler = Catch()
  logging.getLogger("tensorflow").addHandler(handler)
  try:
    with strategy.scope():
      made = [tf.Variable(tf.random.uniform([k + 1, 2 * k + 1], seed=k)) for k in range(8)]
      # Unseeded: each process alone draws other flags.
      flags = tf.Variable(tf.random.uniform([64]) > 0.5)
  finally:
    logging.getLogger("tensorflow").removeHandler(handler)
  return {"warnings": warnings, "values": [v.numpy().tolist() for v in made],
          "flags": (flags.dtype.name, flags.numpy().tolist())}


def _checkpoint_fn(strategy, checkpoint_dir):
  """Trains, saves on the chief (others to scratch); returns the values saved."""
  emb, w = None, None
  ids, ys, emb0, w0 = _data()
  with strategy.scope():
    emb, w = tf.Variable(emb0, name="emb"), tf.Variable(w0, name="w")
    opt = ds.optimizers.Adam(0.02)
  for i in range(STEPS):
    local = strategy.distribute_dataset(
        lambda i=i: tf.data.Dataset.from_tensors((ids[i], ys[i])))
    batch_ids, batch_y = next(iter(local))
    strategy.call_for_each_tower(
        lambda a, b: opt.minimize(lambda: _loss(emb, w, a, b, True), var_list=[emb, w]),
        batch_ids, batch_y)
  checkpoint = tf.train.Checkpoint(emb=emb, w=w, opt=opt)
  directory = checkpoint_dir if strategy.is_chief else os.path.join(
      checkpoint_dir, f"scratch_{strategy.task_id}")
  path = checkpoint.write(os.path.join(directory, "ckpt"))
  return {"path": path, "emb": emb.numpy().tolist(), "w": w.numpy().tolist(),
          "m": opt.get_slot(w, "m").numpy().tolist()}


def _restore_fn(strategy, path):
  """Restores a checkpoint written by another number of workers."""
  ids, ys, emb0, w0 = _data()
  with strategy.scope():
    emb, w = tf.Variable(tf.zeros_like(emb0), name="emb"), tf.Variable(tf.zeros_like(w0))
    opt = ds.optimizers.Adam(0.02)
    opt.build([emb, w])
  tf.train.Checkpoint(emb=emb, w=w, opt=opt).read(path).assert_consumed()
  return {"emb": emb.numpy().tolist(), "w": w.numpy().tolist(),
          "m": opt.get_slot(w, "m").numpy().tolist()}


def _fault_fn(strategy, sync_dir, fault, checkpoint_dir):
  """Trains until the parent injects `fault` into worker 1; reports what the others saw."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  y = x @ rng.normal(size=(4, 1)).astype(np.float32)
  with strategy.scope():
    w = tf.Variable(np.zeros([4, 1], np.float32), name="w")
    step_var = tf.Variable(0, dtype=tf.int64, name="global_step")
    opt = ds.optimizers.GradientDescent(0.05)
  checkpoint = tf.train.Checkpoint(w=w, global_step=step_var)
  latest = tf.train.latest_checkpoint(checkpoint_dir)
  if latest:
    checkpoint.restore(latest).assert_consumed()
  first_loss = float(tf.reduce_mean(tf.square(x @ w - y)))

  @tf.function
  def step():
    strategy.call_for_each_tower(lambda: opt.minimize(
        lambda: tf.reduce_mean(tf.square(x @ w - y)), var_list=[w], global_step=step_var))

  task = strategy.task_id
  report = os.path.join(sync_dir, f"report_{task}.json")
  start, error = None, None
  for i in range(400 if fault else 30):
    if fault == "stop_calling" and task == 1 and i == 10:
      _touch(os.path.join(sync_dir, "fault"))
      # Alive, but calls the next collective only once the others gave up (reported).
      deadline = time.monotonic() + 60
      while not os.path.exists(os.path.join(sync_dir, "report_0.json")):
        assert time.monotonic() < deadline, "worker 0 did not report"
        time.sleep(0.05)
    if i == 10 and task == 0 and fault:
      _touch(os.path.join(sync_dir, "ready"))
    try:
      start = time.time()
      step()
    except ClusterError as e:
      error = (str(e), e.task, time.time() - start)
      break
    if i % 10 == 9 and strategy.is_chief and not fault:
      checkpoint.save(os.path.join(checkpoint_dir, "ckpt"))  # Only the chief writes.
    time.sleep(0.05 if fault else 0)
  result = {"error": error, "first_loss": first_loss,
            "last_loss": float(tf.reduce_mean(tf.square(x @ w - y))),
            "global_step": int(step_var.numpy())}
  with open(report + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(report + ".tmp", report)
  return result


KERAS_BATCH = 10  # Over 4 towers: 3, 3, 2, 2 examples; worker 0 gets 6, worker 1 gets 4.


def _keras_data():
  rng = np.random.default_rng(11)
  x = rng.normal(size=(30, 5)).astype(np.float32)
  y = (x @ rng.normal(size=(5, 2)) + 0.1 * rng.normal(size=(30, 2))).astype(np.float32)
  return x, y


def _keras_run(strategy, checkpoint_path, export_path=None):
  """model.fit (validation, ModelCheckpoint), evaluate, predict, export: a Keras MLP, Adam."""
  import keras  # pylint: disable=import-outside-toplevel
  x, y = _keras_data()
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(2)])
    rng = np.random.default_rng(12)
    model.set_weights([rng.normal(size=w.shape).astype(np.float32) * 0.5 + (w != 0)
                       for w in model.get_weights()])  # (moving variance stays positive)
    # 3 steps per execution: Keras runs them in a tf.while_loop, collectives and all.
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  steps_per_execution=3)
  history = model.fit(x, y, batch_size=KERAS_BATCH, epochs=3, shuffle=False, verbose=0,
                      validation_data=(x[:14], y[:14]),
                      callbacks=[keras.callbacks.ModelCheckpoint(checkpoint_path)])
  evaluation = model.evaluate(x, y, batch_size=KERAS_BATCH, verbose=0)
  predictions = model.predict(x, batch_size=KERAS_BATCH, verbose=0)
  if export_path:
    model.export(export_path, verbose=False)
  return {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "evaluation": [float(v) for v in evaluation],
          "predictions": np.asarray(predictions).tolist(),
          "weights": [w.tolist() for w in model.get_weights()],
          "iterations": int(model.optimizer.iterations.numpy())}


def _keras_fit_fn(strategy, checkpoint_dir):
  import keras  # pylint: disable=import-outside-toplevel
  # Callbacks run in every worker: each writes its own file, as with checkpoints.
  name = "model.keras" if strategy.is_chief else f"model_{strategy.task_id}.keras"
  export = "export" if strategy.is_chief else f"export_{strategy.task_id}"
  result = _keras_run(strategy, os.path.join(checkpoint_dir, name),
                      os.path.join(checkpoint_dir, export))
  with strategy.scope():
    dropout = keras.layers.Dropout(0.5, seed=7)
    masks = strategy.call_for_each_tower(lambda: dropout(tf.ones((1, 32)), training=True))
    result["masks"] = (strategy.gather(masks, axis=0).numpy() != 0).tolist()
    # A tower-local sum assigned in cross-tower context reads back whole: 4 copies of 2.5.
    total = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM)
    total.assign(10.0)
    result["tower_local"] = (float(total.numpy()), float(strategy.read_var(total)),
                             [float(c) for c in strategy.unwrap(total)])
    # Dtypes TensorFlow's collectives do not take travel across workers in another one.
    def odd_dtypes():
      tower = ds.get_tower_context().tower_id
      return tf.complex(1.0, float(tower)), tf.constant(tower + 1, tf.int8)
    complex_values, small_ints = strategy.call_for_each_tower(odd_dtypes)
    complex_sum = strategy.reduce("sum", complex_values).values
    int8_sum = strategy.reduce("sum", small_ints).values
    result["complex_sum"] = {complex(v.numpy()) for v in complex_sum}
    result["int8_sum"] = {(int(v.numpy()), v.dtype.name) for v in int8_sum}
    result["complex_gathered"] = [complex(v) for v in strategy.gather(complex_values).numpy()]
    halves = strategy.call_for_each_tower(
        lambda: tf.cast(ds.get_tower_context().tower_id, tf.bfloat16) / 2)
    gathered = strategy.gather(halves)  # The gather kernels take no bfloat16.
    result["bfloat16_gathered"] = (gathered.dtype.name, [float(v) for v in gathered.numpy()])
    # Tower writes: ONLY_FIRST_REPLICA takes global tower 0's (it took each worker's own
    # first tower's); a Python number counts once per tower (MEAN gave 0.5 per step).
    first = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    strategy.call_for_each_tower(lambda: first.assign(5.0 + ds.get_tower_context().tower_id))
    counters = {name: tf.Variable(0, dtype=tf.int64, aggregation=aggregation)
                for name, aggregation in (("sum", tf.VariableAggregation.SUM),
                                          ("mean", tf.VariableAggregation.MEAN))}
    for counter in counters.values():
      strategy.call_for_each_tower(lambda c=counter: c.assign_add(1))
    result["tower_writes"] = ([float(c) for c in strategy.unwrap(first)],
                              {n: [int(c) for c in strategy.unwrap(v)]
                               for n, v in counters.items()})
    # Two gathers in one tf.function, worker 1's towers with no rows (a ragged last
    # batch): the collectives of the row counts disagreed between the workers (SIGSEGV).
    def rows(x):
      tower = ds.get_tower_context().tower_id
      n = [1, 1, 0, 0][tower] + tf.cast(x, tf.int32) * 0
      return (tf.fill(tf.stack([n, 3]), float(tower)) + x,
              tf.fill(tf.stack([n, 1]), float(tower)) + x)

    @tf.function
    def two_gathers(x):
      wide, narrow = strategy.call_for_each_tower(rows, x)
      return strategy.gather(wide), strategy.gather(narrow)

    result["ragged_gathers"] = [t.numpy().tolist() for t in two_gathers(tf.constant(0.0))]
    # No tower with a row (a gather of empty values, empty sparse gradients), and rows of
    # no elements: TensorFlow's collective gather crashed the workers (SIGSEGV).
    no_rows = strategy.call_for_each_tower(lambda: tf.zeros([0, 3]))
    empty_rows = strategy.call_for_each_tower(lambda: tf.ones([2, 0]))
    no_slices = strategy.call_for_each_tower(lambda: tf.IndexedSlices(
        tf.zeros([0, 3]), tf.zeros([0], tf.int64), tf.constant([5, 3], tf.int64)))
    result["empty_gathers"] = [strategy.gather(no_rows).shape.as_list(),
                               strategy.gather(empty_rows).shape.as_list(),
                               strategy.reduce("sum", no_slices).primary.values.shape.as_list()]
    # A plain value counts as one value in each worker: MEAN gives it back.
    plain = tf.constant([1.0, 2.0])
    result["plain"] = {a: strategy.reduce(a, plain).values[0].numpy().tolist()
                       for a in ("sum", "mean")}
  # fit's default shuffle, with no random seed: each worker would draw its own order.
  x, y = _keras_data()
  with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
  try:
    model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, verbose=0)
    result["unseeded_shuffle"] = None
  except ValueError as e:
    result["unseeded_shuffle"] = str(e)
  return result


def _gather_fn(strategy):
  """gather() of a plain value (one per worker), along negative axes, of booleans, and
  of strings (refused)."""
  results = {}
  with strategy.scope():
    tower_id = lambda: ds.get_tower_context().tower_id  # noqa: E731
    mine = tf.constant([1.0, 2.0]) * (strategy.task_id + 1)
    results["plain"] = strategy.gather(mine).numpy().tolist()
    results["plain_scalar"] = strategy.gather(tf.constant(3.0)).numpy().tolist()
    # Then per-tower scalars: the eager gather of one component was reused for four.
    results["scalars"] = strategy.gather(strategy.call_for_each_tower(
        lambda: tf.cast(tower_id(), tf.float32))).numpy().tolist()
    columns = strategy.call_for_each_tower(lambda: tf.fill([2, 1], float(tower_id())))
    results["axes"] = {axis: strategy.gather(columns, axis=axis).numpy().tolist()
                       for axis in (-1, -2, 1)}
    flags = tf.function(lambda: strategy.gather(
        strategy.call_for_each_tower(lambda: tf.fill([1, 2], tower_id() % 2 == 0)), axis=-1))
    results["bools"] = flags().numpy().tolist()
    try:
      strategy.gather(strategy.call_for_each_tower(lambda: tf.fill([1], "a")))
      results["strings"] = None
    except TypeError as e:
      results["strings"] = str(e)
  return results


def _ragged_eager_data():
  rng = np.random.default_rng(8)
  ids = rng.integers(0, VOCAB, size=(22,)).astype(np.int32)  # Batches of 8, 8 and 6.
  return ids, rng.normal(size=(22, 1)).astype(np.float32)


def _ragged_eager_fn(strategy):
  """Eager steps and gathers over batches of 8, 8, 6: towers of 2, 2, 2, 2 then 2, 2, 1,
  1, so worker 0's shapes stay and worker 1's change at the last batch."""
  ids, y = _ragged_eager_data()
  with strategy.scope():
    emb = tf.Variable(np.ones((VOCAB, 1), np.float32), name="emb")
    opt = ds.optimizers.GradientDescent(0.1)
    batches = strategy.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices((ids, y)).batch(8))
  gathered = []
  for batch_ids, batch_y in batches:  # Sparse gradients, reduced eagerly.
    strategy.call_for_each_tower(lambda i, t: opt.minimize(
        lambda: tf.reduce_mean(tf.square(tf.gather(emb, i) - t)), var_list=[emb]),
        batch_ids, batch_y)
    gathered.append(strategy.gather(batch_y).numpy())
  return {"emb": emb.numpy().tolist(), "gathered": np.concatenate(gathered).tolist()}


def _device_strings_fn(strategy):
  """Device strings without a job ("/cpu:1") name this worker's devices, as TensorFlow
  places them: as destinations, in `get()` and in `canonicalize_device`."""
  with strategy.scope():
    per_tower = strategy.call_for_each_tower(
        lambda: tf.fill([2], float(ds.get_tower_context().tower_id)))
    total = strategy.reduce("sum", per_tower, destinations="/cpu:1")
    copies = strategy.broadcast(tf.constant([5.0]), destinations=["/cpu:0", "/cpu:1"])
    return {"canonical": ds.canonicalize_device("/cpu:1") == strategy.worker_devices[1],
            "total": [(d == strategy.worker_devices[1], c.numpy().tolist())
                      for d, c in zip(total.devices, strategy.unwrap(total), strict=True)],
            "copies": [c.numpy().tolist() for c in strategy.unwrap(copies)],
            "own": per_tower.get("/cpu:1").numpy().tolist()}


def _mismatched_variable_fn(strategy):
  """Worker 1 creates its variable with another shape (one read from its own data)."""
  try:
    with strategy.scope():
      tf.Variable(tf.ones([3 + strategy.task_id]), name="vocabulary_counts")
  except Exception as e:  # pylint: disable=broad-except
    return (type(e).__name__, str(e))
  return None


def _chief_saves_in_scope_fn(strategy, checkpoint_dir):
  """The chief alone saves, inside strategy.scope(): the checkpoint's save counter is
  made then, in the chief only."""
  with strategy.scope():
    w = tf.Variable([1.0, 2.0], name="w")
    checkpoint = tf.train.Checkpoint(w=w)
    totals = []
    for step in range(2):
      w.assign_add([1.0, 1.0])
      if strategy.is_chief:
        checkpoint.save(os.path.join(checkpoint_dir, "ckpt"))
      totals.append(float(strategy.reduce("mean", strategy.call_for_each_tower(
          lambda s=step: tf.constant(float(s)) + tf.cast(
              ds.get_tower_context().tower_id, tf.float32))).primary))
    w.assign([0.0, 0.0])
    checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))  # In every worker.
    return {"totals": totals, "w": w.numpy().tolist(),
            "saves": int(checkpoint.save_counter.numpy())}


def _local_collectives_fn(strategy):
  """Each worker also reduces with local MirroredStrategies: worker 0's measured default
  times every candidate, the collective all-reduce among them, worker 1's times none (its
  budget too short, as under load); then both reduce with a local collective all-reduce.
  Returns the totals, local and across workers, in turn."""
  from diststrat.cross_tower_ops import _measured  # pylint: disable=import-outside-toplevel
  _measured.MAX_SECONDS = 60.0 if strategy.is_chief else 0.0
  measured = ds.MirroredStrategy(strategy.worker_devices)
  collective = ds.MirroredStrategy(strategy.worker_devices,
                                   cross_tower_ops=ds.cross_tower_ops.AllReduceCrossTowerOps(
                                       "collective"))
  totals = []
  for s in (measured, strategy, collective, strategy):
    with s.scope():
      per_tower = s.call_for_each_tower(
          lambda: tf.cast(ds.get_tower_context().tower_id, tf.float32) + 1.0)
      totals.append(float(s.reduce("sum", per_tower).primary))
  timed = [name for _, timings in _measured._choices.values()  # pylint: disable=protected-access
           for name in timings]
  return {"totals": totals, "timed_collective": any("'collective'" in n for n in timed)}


def _touch(path):
  with open(path, "w"):
    pass


def _saved_step_fn(strategy, path, scratch):
  """Every worker runs a training step and saves it (a tower-local variable's saved value
  is its aggregate over every worker: a collective). Then the chief alone saves a step
  with no tower-local variable, and every worker traces a new reduction, which needs
  the workers' collective keys still in step."""
  with strategy.scope():
    m = tf.Module()
    m.w = tf.Variable([[1.0], [2.0]], name="w")
    m.seen = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM, name="seen")
    opt = ds.optimizers.GradientDescent(0.1, loss_reduction="sum")

  @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None, 1])])
  def train(x, y):
    def tower(x, y):
      opt.minimize(lambda: tf.reduce_sum(tf.square(x @ m.w - y)), var_list=[m.w])
      m.seen.assign_add(tf.reduce_sum(y))
    strategy.call_for_each_tower(tower, x, y)
    return tf.identity(m.w), tf.identity(m.seen)

  m.train = train
  with strategy.scope():
    adapter = tf.distribute.get_strategy()

  @tf.function(input_signature=[])
  def mean():  # An integer mean through the tf.distribute bridge: 2 in every tower.
    with strategy.scope():
      return adapter.reduce("MEAN", strategy.call_for_each_tower(lambda: tf.constant(2)),
                            axis=None)

  m.mean = mean
  x, y = _saved_step_data()
  train(x, y)
  assert float(mean()) == 2.0
  tf.saved_model.save(m, path if strategy.is_chief else scratch)
  plain = tf.Module()
  plain.w = m.w

  @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None, 1])])
  def train_w(x, y):
    strategy.call_for_each_tower(lambda x, y: opt.minimize(
        lambda: tf.reduce_sum(tf.square(x @ m.w - y)), var_list=[m.w]), x, y)
    return tf.identity(m.w)

  plain.train = train_w
  if strategy.is_chief:
    tf.saved_model.save(plain, scratch)
  total = tf.function(lambda: strategy.reduce(
      "sum", strategy.call_for_each_tower(lambda: tf.constant(1.0))).primary)()
  return float(total)


def _saved_step_data():
  return (np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
          np.array([[1.0], [2.0]], np.float32))


# --- tests -------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_two_workers_of_two_towers_train_like_one_device():
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT) as c:
    first, second = c.run_on_workers(_equivalence_fn)
  assert (first["towers"], first["task"], first["is_chief"]) == (4, ("worker", 0), True)
  assert (second["task"], second["is_chief"]) == (("worker", 1), False)
  assert first["devices"] == [f"/job:worker/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
  assert first["ids"] == [0, 1] and second["ids"] == [2, 3]
  assert first["random"] == second["random"]  # Broadcast from the chief.
  # Two tasks on this machine: each takes half the cores for its intra-op threads (0:
  # TensorFlow's default, every core, when half would be all of them, or when the
  # process is pinned to some cores or the environment chose a count).
  half = max(1, first["cores"] // 2)
  chosen = first["cores"] < first["machine_cores"] or os.environ.get("TF_NUM_INTRAOP_THREADS")
  assert first["intra_op_threads"] == second["intra_op_threads"] == (
      0 if chosen or half >= first["cores"] else half)
  for name in OPTIMIZERS:
    for sparse in (False, True):
      ref_emb, ref_w = _reference(name, sparse)
      for mode in ("eager", "function"):
        key = f"{name}_{sparse}_{mode}"
        for worker in (first, second):
          emb, w = worker[key]
          np.testing.assert_allclose(emb, ref_emb, rtol=1e-5, atol=1e-6, err_msg=key)
          np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_initial_values_from_the_chief_without_retracing_warnings():
  """Each variable's initial value is broadcast from the chief; every worker printed
  TensorFlow's retracing warning (a tf.function made per broadcast). A bool variable
  kept each worker's own initial value (random flags differed between the workers)."""
  with LocalCluster(num_ps=0, num_workers=2, result_timeout=TIMEOUT) as c:
    first, second = c.run_on_workers(_many_shapes_fn, strategy="multi_worker")
  assert first["values"] == second["values"]  # The chief's, in both.
  assert first["flags"][0] == "bool" and first["flags"] == second["flags"]
  assert first["warnings"] == second["warnings"] == []


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_checkpoints_move_between_worker_counts_mirrored_and_no_strategy(tmp_path):
  with LocalCluster(num_ps=0, num_workers=2, result_timeout=TIMEOUT) as c:
    saved, _ = c.run_on_workers(_checkpoint_fn, checkpoint_dir=str(tmp_path))
  assert saved["path"].startswith(str(tmp_path))
  with LocalCluster(num_ps=0, num_workers=3, result_timeout=TIMEOUT) as c:
    restored = c.run_on_workers(_restore_fn, path=saved["path"])
    ragged = c.run_on_workers(_ragged_fn)
  for r in restored:
    assert r == {k: saved[k] for k in ("emb", "w", "m")}
  # Into a 4-tower MirroredStrategy and into no strategy, in this process.
  strategy = ds.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")][:4])
  for scope in (strategy.scope(), ds.DefaultStrategy().scope()):
    with scope:
      emb, w = tf.Variable(tf.zeros([VOCAB, DIM])), tf.Variable(tf.zeros([DIM, 1]))
    tf.train.Checkpoint(emb=emb, w=w).read(saved["path"]).expect_partial()
    np.testing.assert_array_equal(emb.numpy(), saved["emb"])
    np.testing.assert_array_equal(w.numpy(), saved["w"])
  # Ragged: 10 examples over 3 towers, each worker its share; equal to one device.
  assert [r["sizes"] for r in ragged] == [[[4]] * 2, [[3]] * 2, [[3]] * 2]
  rng = np.random.default_rng(3)
  x = rng.normal(size=(2, 10, 4)).astype(np.float32)
  y = rng.normal(size=(2, 10, 1)).astype(np.float32)
  w = np.ones([4, 1], np.float32)
  for i in range(2):
    w = w - 0.1 * (2 * x[i].T @ (x[i] @ w - y[i]) / 10.0)
  for r in ragged:
    np.testing.assert_allclose(r["w"], w, rtol=1e-5)


def _inject(cluster, sync_dir, fault):
  def run():
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(sync_dir, "ready")):
      if time.monotonic() > deadline:
        return
      time.sleep(0.05)
    if fault == "kill":
      cluster.kill("worker", 1)
    elif fault == "freeze":
      cluster.kill("worker", 1, signal.SIGSTOP)
    _touch(os.path.join(sync_dir, "fault"))
    if fault == "freeze":  # Once the others reported it, end the frozen process.
      while not all(os.path.exists(os.path.join(sync_dir, f"report_{t}.json"))
                    for t in (0, 2)) and time.monotonic() < deadline:
        time.sleep(0.1)
      cluster.kill("worker", 1)
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread


@pytest.mark.processes
@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("fault", ["kill", "freeze", "stop_calling"])
def test_a_failed_worker_is_named_in_every_other_worker(tmp_path, fault):
  sync_dir, checkpoint_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  checkpoint_dir.mkdir()
  workers = 3 if fault != "stop_calling" else 2
  with LocalCluster(num_ps=0, num_workers=workers, result_timeout=TIMEOUT,
                    strategy_kwargs={"collective_timeout": COLLECTIVE_TIMEOUT}) as cluster:
    if fault == "stop_calling":  # No warm-up: worker 1 stops by itself.
      _touch(os.path.join(sync_dir, "ready"))
    thread = _inject(cluster, str(sync_dir), fault)
    try:
      cluster.run_on_workers(_fault_fn, sync_dir=str(sync_dir), fault=fault,
                             checkpoint_dir=str(checkpoint_dir))
      raised = None
    except Exception as e:  # pylint: disable=broad-except
      raised = e  # A killed or frozen worker's own failure.
    thread.join(10)
  survivors = [t for t in range(workers) if t != 1]
  for task in survivors:
    with open(sync_dir / f"report_{task}.json") as f:
      report = json.load(f)
    message, blamed, elapsed = report["error"]
    print(f"{fault}: worker {task} raised after {elapsed:.1f} s: {message[:120]}")
    assert blamed == "/job:worker/replica:0/task:1", (fault, message)
    assert "restart every worker process" in message, message
    assert elapsed < COLLECTIVE_TIMEOUT + 4.0, (fault, elapsed)
    if fault != "kill":  # A dead peer is found at once; a live one that does not join at
      assert elapsed >= COLLECTIVE_TIMEOUT, (fault, elapsed)  # the bound, not before.
  if fault == "kill":
    assert isinstance(raised, ClusterError) and "was killed by signal SIGKILL (exit status -9)" in str(raised)
  if fault == "freeze":
    assert isinstance(raised, ClusterError) and "was killed by signal SIGKILL (exit status -9)" in str(raised)


@pytest.mark.processes
@pytest.mark.timeout(2 * TIMEOUT)
def test_restart_and_restore_resume_training(tmp_path):
  sync_dir, checkpoint_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  checkpoint_dir.mkdir()
  with LocalCluster(num_ps=0, num_workers=2, result_timeout=TIMEOUT) as cluster:
    first = cluster.run_on_workers(_fault_fn, sync_dir=str(sync_dir), fault=None,
                                   checkpoint_dir=str(checkpoint_dir))
    # A fresh set of worker processes (as after a failure) resumes from the checkpoint.
    second = cluster.run_on_workers(_fault_fn, sync_dir=str(sync_dir), fault=None,
                                    checkpoint_dir=str(checkpoint_dir))
  assert first[0]["global_step"] == 30
  assert second[0]["global_step"] == 60  # Restored at 30, then 30 more steps.
  assert second[0]["first_loss"] == pytest.approx(first[0]["last_loss"], rel=1e-5)
  assert second[0]["last_loss"] < second[0]["first_loss"] < first[0]["first_loss"]
  assert first[0]["last_loss"] == pytest.approx(first[1]["last_loss"], rel=1e-6)


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_keras_fit_evaluate_predict_on_two_workers_of_two_towers_equal_one_device(tmp_path):
  """And fit's default shuffle with no random seed is refused: each worker shuffled the
  arrays in its own order, and the workers split different global batches (some
  examples trained on twice an epoch, others never), silently."""
  import keras  # pylint: disable=import-outside-toplevel
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT) as c:
    results = c.run_on_workers(_keras_fit_fn, checkpoint_dir=str(tmp_path))
  # The reference: this process, one device, no strategy, the same global batches.
  reference = _keras_run(ds.DefaultStrategy(), str(tmp_path / "reference.keras"))
  assert reference["iterations"] == 9  # 3 epochs of 3 batches.
  assert sorted(reference["history"]) == ["loss", "mae", "val_loss", "val_mae"]
  for result in results:
    assert result["iterations"] == reference["iterations"]
    assert sorted(result["history"]) == sorted(reference["history"])
    for key, values in reference["history"].items():
      np.testing.assert_allclose(result["history"][key], values, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(result["evaluation"], reference["evaluation"], rtol=1e-5)
    # predict returns every worker's towers' rows, in input order, in every worker.
    np.testing.assert_allclose(result["predictions"], reference["predictions"],
                               rtol=1e-5, atol=1e-6)
    # BN statistics too.
    for got, want in zip(result["weights"], reference["weights"], strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Dropout: one mask per tower of every worker, no two the same.
    assert len(result["masks"]) == 4
    assert len({tuple(m) for m in result["masks"]}) == 4, "one mask repeated"
  assert results[0]["masks"] == results[1]["masks"]  # Gathered from all towers in both.
  for result in results:
    assert result["tower_local"] == (10.0, 10.0, [2.5, 2.5])
    assert result["complex_sum"] == {4 + 6j} and result["int8_sum"] == {(10, "int8")}
    assert result["complex_gathered"] == [1 + 0j, 1 + 1j, 1 + 2j, 1 + 3j]
    assert result["bfloat16_gathered"] == ("bfloat16", [0.0, 0.5, 1.0, 1.5])
    assert result["tower_writes"] == ([5.0, 5.0], {"sum": [4, 4], "mean": [1, 1]})
    assert result["plain"] == {"sum": [2.0, 4.0], "mean": [1.0, 2.0]}
    assert result["ragged_gathers"] == [[[0.0] * 3, [1.0] * 3], [[0.0], [1.0]]]
    assert result["empty_gathers"] == [[0, 3], [8, 0], [0, 3]]
    assert "keras.utils.set_random_seed(seed)" in (result["unseeded_shuffle"] or ""), (
        result["unseeded_shuffle"])
  # The chief's ModelCheckpoint file loads with no strategy, with the trained weights.
  loaded = keras.models.load_model(str(tmp_path / "model.keras"))
  for got, want in zip(loaded.get_weights(), reference["weights"], strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The chief's SavedModel (model.export) serves the trained model.
  exported = tf.saved_model.load(str(tmp_path / "export"))  # (kept: it owns the variables)
  served = exported.serve(tf.constant(_keras_data()[0]))
  np.testing.assert_allclose(served.numpy(), reference["predictions"], rtol=1e-5, atol=1e-6)


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_gather_of_plain_values_negative_axes_and_booleans_across_workers():
  """A plain value raised (it has no component on the second device), a negative axis
  built a transpose of the wrong rank, booleans reached a kernel that takes no bool."""
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT) as c:
    results = c.run_on_workers(_gather_fn)
  # The reference: one process, 4 towers; a plain value counts once in each worker.
  s = ds.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")][:4])
  with s.scope():
    tower_id = lambda: ds.get_tower_context().tower_id  # noqa: E731
    columns = s.call_for_each_tower(lambda: tf.fill([2, 1], float(tower_id())))
    axes = {axis: s.gather(columns, axis=axis).numpy().tolist() for axis in (-1, -2, 1)}
    flags = s.gather(s.call_for_each_tower(lambda: tf.fill([1, 2], tower_id() % 2 == 0)),
                     axis=-1).numpy().tolist()
    scalars = s.gather(s.call_for_each_tower(
        lambda: tf.cast(tower_id(), tf.float32))).numpy().tolist()
  for result in results:
    assert result["plain"] == np.concatenate([[1.0, 2.0], [2.0, 4.0]]).tolist()
    assert result["plain_scalar"] == [3.0, 3.0]
    assert result["scalars"] == scalars
    assert result["axes"] == axes
    assert result["bools"] == flags
    assert "carries numbers and booleans only" in result["strings"], result["strings"]


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_eager_sparse_steps_and_gathers_over_a_ragged_last_batch():
  """Eager reductions and gathers traced for each worker's own shapes: at the last batch
  worker 1 traced anew and worker 0 reused its trace, so their collective keys parted
  and both failed at the collective timeout, blaming the other."""
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT,
                    strategy_kwargs={"collective_timeout": 10.0}) as c:
    results = c.run_on_workers(_ragged_eager_fn)
  ids, y = _ragged_eager_data()
  emb, opt = tf.Variable(np.ones((VOCAB, 1), np.float32)), ds.optimizers.GradientDescent(0.1)
  for start in range(0, 22, 8):  # The reference: one device, the same global batches.
    opt.minimize(lambda s=start: tf.reduce_mean(tf.square(
        tf.gather(emb, ids[s:s + 8]) - y[s:s + 8])), var_list=[emb])
  for result in results:
    np.testing.assert_allclose(result["emb"], emb.numpy(), rtol=1e-5, atol=1e-6)
    assert result["gathered"] == y.tolist()


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_device_strings_without_a_job_name_the_workers_devices():
  """"/cpu:1" was read as /job:localhost/...: destinations raised ValueError ("which
  TensorFlow does not have"), get() found no value."""
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT) as c:
    results = c.run_on_workers(_device_strings_fn)
  for task, result in enumerate(results):
    assert result["canonical"]
    assert result["total"] == [(True, [6.0, 6.0])]  # Towers 0 + 1 + 2 + 3.
    assert result["copies"] == [[5.0], [5.0]]
    assert result["own"] == [2.0 * task + 1] * 2  # This worker's second tower.


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_variable_of_another_shape_in_one_worker_is_named():
  """The collective that gives a variable the chief's initial value failed with
  TensorFlow's InvalidArgumentError about "collective instance 100000000"."""
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=1, result_timeout=TIMEOUT,
                    strategy_kwargs={"collective_timeout": COLLECTIVE_TIMEOUT}) as c:
    results = c.run_on_workers(_mismatched_variable_fn)
  assert all(r is not None for r in results), results  # Neither worker went on.
  named = [message for kind, message in results if kind == "ValueError"]
  assert named, results
  for message in named:
    assert "Variable 'vocabulary_counts" in message, message
    assert "with the same shapes and dtypes, in the same order" in message, message
    assert "expected shape" in message, message


def test_a_reduction_of_another_shape_in_one_worker_names_both_shapes():
  """A reduction whose shape differs per worker (read from each worker's data) failed
  with TensorFlow's raw InvalidArgumentError "Shape mismatch in the collective instance".
  The worker group's error translator (installed for every eager op and tf.function
  call of a worker) keeps the type and says what differs and the fix. TensorFlow's
  error, as a worker of 2 got it from `strategy.reduce("sum", tf.ones([3 + task_id]))`,
  is made here: no cluster needed."""
  from diststrat._cluster_runtime.multi_worker import _worker_group  # pylint: disable=import-outside-toplevel
  said = ("Shape mismatch in the collective instance 100000000. Op at device "
          "/job:worker/replica:0/task:1/device:CPU:0 expected shape [4,2] but another "
          "member in the group expected shape [3,2]")
  raw = tf.errors.InvalidArgumentError(None, None, f"Graph execution error:\n\n{said}. This "
                                       "is likely due to different input shapes")
  error = _worker_group.translate_error(raw)
  assert isinstance(error, tf.errors.InvalidArgumentError) and error.__cause__ is raw
  assert error.message.startswith(
      "The workers reduced tensors of different shapes in one collective: this worker's "
      "has shape [4,2] (on /job:worker/replica:0/task:1/device:CPU:0), another worker's "
      "[3,2]. Every worker must reduce tensors of the same shape, in the same order"), error
  assert f"TensorFlow said: {said}." in error.message, error
  other = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [3] vs. [4]")
  assert _worker_group.translate_error(other) is other


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_the_chief_alone_saves_a_checkpoint_inside_the_scope(tmp_path):
  """The save counter took the chief's value by a collective that only the chief made:
  it met the other worker's next reduction, and both failed (or, of one dtype and
  shape, would have mixed their values)."""
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=1, result_timeout=TIMEOUT,
                    strategy_kwargs={"collective_timeout": COLLECTIVE_TIMEOUT}) as c:
    results = c.run_on_workers(_chief_saves_in_scope_fn, checkpoint_dir=str(tmp_path))
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-2")
  for result in results:  # Towers 0 and 1 (one per worker): mean of s + 0 and s + 1.
    assert result == {"totals": [0.5, 1.5], "w": [3.0, 4.0], "saves": 2}, result


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_local_collectives_in_a_worker_leave_the_keys_across_workers_in_step():
  """A collective within one worker (a local MirroredStrategy's, timed by its measured
  default only when its budget lasts) took keys from the counters of the collectives
  across workers: the workers' next collective got other keys, and they waited for each
  other until the collective timeout (ClusterError blaming the other worker). And two
  workers' local groups got one group key, which the group leader refused ("joining a
  group that is already full")."""
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT,
                    strategy_kwargs={"collective_timeout": COLLECTIVE_TIMEOUT}) as c:
    results = c.run_on_workers(_local_collectives_fn)
  assert [r["timed_collective"] for r in results] == [True, False]
  local = float(np.sum(np.arange(2) + 1.0))  # Each worker's 2 towers.
  every = float(np.sum(np.arange(4) + 1.0))  # All 4 towers.
  for r in results:
    assert r["totals"] == [local, every, local, every], r


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_cross_worker_ops_in_strategy_kwargs_reach_the_workers():
  """CrossWorkerAllReduce could not be pickled (its lock), so LocalCluster could not
  give it to the workers' strategies. Here: the flat scheme in packs, eager steps and
  gathers over a ragged last batch."""
  ops = ds.cross_tower_ops.CrossWorkerAllReduce("flat", num_packs=2, timeout=30.0)
  assert repr(pickle.loads(pickle.dumps(ops))) == repr(ops)
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT,
                    strategy_kwargs={"cross_worker_ops": ops}) as c:
    results = c.run_on_workers(_ragged_eager_fn)
  ids, y = _ragged_eager_data()
  emb, opt = tf.Variable(np.ones((VOCAB, 1), np.float32)), ds.optimizers.GradientDescent(0.1)
  for start in range(0, 22, 8):
    opt.minimize(lambda s=start: tf.reduce_mean(tf.square(
        tf.gather(emb, ids[s:s + 8]) - y[s:s + 8])), var_list=[emb])
  for result in results:
    np.testing.assert_allclose(result["emb"], emb.numpy(), rtol=1e-5, atol=1e-6)
    assert result["gathered"] == y.tolist()


def test_one_worker_multi_worker_gather_equals_mirrored():
  """Without a cluster, gather() is MirroredStrategy's: a plain value, a negative axis."""
  devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
  got = []
  for s in (ds.MultiWorkerMirroredStrategy(devices=devices), ds.MirroredStrategy(devices)):
    with s.scope():
      columns = s.call_for_each_tower(
          lambda: tf.fill([2, 1], float(ds.get_tower_context().tower_id)))
      got.append([s.gather(tf.constant([1.0, 2.0])).numpy().tolist(),
                  s.gather(tf.constant(3.0)).numpy().tolist(),
                  s.gather(columns, axis=-1).numpy().tolist()])
  assert got[0] == got[1]


def test_multi_worker_argument_errors():
  with pytest.raises(ValueError, match="MultiWorkerMirroredStrategy runs on worker tasks "
                                       "only, but cluster_spec has a 'ps' job"):
    ds.MultiWorkerMirroredStrategy(cluster_spec={"ps": ["127.0.0.1:1"],
                                                 "worker": ["127.0.0.1:2"]})
  with pytest.raises(ValueError, match=r"collective_timeout must be a positive number of "
                                       r"seconds. Received: collective_timeout=0"):
    ds.MultiWorkerMirroredStrategy(collective_timeout=0)
  with pytest.raises(TypeError, match="cross_worker_ops must be a diststrat.cross_tower_ops."
                                      "CrossWorkerAllReduce"):
    ds.MultiWorkerMirroredStrategy(cross_worker_ops=ds.cross_tower_ops.ReductionToOneDevice())
  with pytest.raises(TypeError, match=r"CrossWorkerAllReduce\('flat'\). Received: 'flat'"):
    ds.MultiWorkerMirroredStrategy(cross_worker_ops="flat")
  with pytest.raises(ValueError, match="scheme must be one of 'hierarchical', 'flat'"):
    ds.cross_tower_ops.CrossWorkerAllReduce("ring")
  with pytest.raises(ValueError, match=r"bucket_bytes must be a positive integer \(bytes per "
                                       r"collective\) or None .* Received: bucket_bytes=0"):
    ds.cross_tower_ops.CrossWorkerAllReduce(bucket_bytes=0)
  with pytest.raises(ValueError, match="strategy must be 'parameter_server' .* or "
                                       "'multi_worker'"):
    LocalCluster(num_ps=0).run_on_workers(_ragged_fn, strategy="parameter_server")
  # Refused at the call, before any worker process starts to refuse its cluster spec.
  with pytest.raises(ValueError, match=r"strategy='multi_worker' runs on a cluster without "
                                       r"parameter servers, .* has 1 PS task"):
    LocalCluster(num_ps=1).run_on_workers(_ragged_fn, strategy="multi_worker")


def _proc_status(field):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def _long_run_fn(strategy, steps):
  """Trains a tiny model for `steps` steps at the defaults; native threads and memory."""
  rng = np.random.default_rng(7)
  x = rng.normal(size=(8, 4)).astype(np.float32)
  y = x @ rng.normal(size=(4, 1)).astype(np.float32)
  with strategy.scope():
    w = tf.Variable(np.zeros([4, 1], np.float32), name="w")
    opt = ds.optimizers.GradientDescent(0.01)

  @tf.function
  def step():
    strategy.call_for_each_tower(lambda: opt.minimize(
        lambda: tf.reduce_mean(tf.square(x @ w - y)), var_list=[w]))

  samples = {}
  start = time.monotonic()
  for i in range(steps):
    step()
    if i + 1 in (100, steps // 2, steps):  # After the warm-up, half-way, at the end.
      samples[i + 1] = (_proc_status("Threads"), _proc_status("VmRSS") // 1024)
  return {"samples": samples, "seconds": time.monotonic() - start,
          "w": w.numpy().tolist()}


@pytest.mark.processes
@pytest.mark.timeout(3 * TIMEOUT)
def test_a_long_run_keeps_threads_flat_at_the_defaults():
  """1,000 steps on 2 workers: TensorFlow's per-collective timeout threads would add
  about one native thread per step (docs/design/tensorflow_facts.md), some 900 from step
  100 to the end, nine times the bound below."""
  steps = 1000
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=1,
                    result_timeout=3 * TIMEOUT) as cluster:
    results = cluster.run_on_workers(_long_run_fn, strategy="multi_worker", steps=steps)
  for task, result in enumerate(results):
    samples = {int(k): v for k, v in result["samples"].items()}
    threads = [samples[k][0] for k in sorted(samples)]
    rss = [samples[k][1] for k in sorted(samples)]
    print(f"worker {task}: threads {threads}, RSS MiB {rss}, {result['seconds']:.1f} s")
    assert threads[-1] - threads[0] <= 100, (task, samples)
    assert rss[-1] - rss[0] <= 100, (task, samples)  # MiB from step 100 to the end.
  assert results[0]["w"] == results[1]["w"]


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_saved_training_step_runs_alone_as_one_workers_towers(tmp_path):
  """The save's trace kept the cross-worker collectives: loaded in one process, the step
  waited for the other worker forever; and a chief-only save took collective keys the
  other worker did not, so a reduction both traced later could not meet."""
  path = str(tmp_path / "saved")
  with LocalCluster(num_ps=0, num_workers=2, cpus_per_worker=2, result_timeout=TIMEOUT) as c:
    assert c.run_on_workers(_saved_step_fn, path=path,
                            scratch=str(tmp_path / "scratch")) == [4.0, 4.0]
  loaded = tf.saved_model.load(path)  # This process: no cluster, no strategy.
  assert float(loaded.mean()) == 2.0  # Divided by the towers summed (1.0: by all 4).
  # The reference: the same step on one worker's 2 towers, from the saved values.
  s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with s.scope():
    w = tf.Variable(loaded.w.numpy())
    seen = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)
    opt = ds.optimizers.GradientDescent(0.1, loss_reduction="sum")
  seen.assign(loaded.seen.numpy())
  x, y = _saved_step_data()

  def tower(x, y):
    opt.minimize(lambda: tf.reduce_sum(tf.square(x @ w - y)), var_list=[w])
    seen.assign_add(tf.reduce_sum(y))

  for _ in range(2):
    got = [t.numpy() for t in loaded.train(x, y)]
    s.call_for_each_tower(tower, tf.constant(x), tf.constant(y))
    np.testing.assert_allclose(got[0], w.numpy(), rtol=1e-6)
    assert float(got[1]) == float(seen.numpy())
