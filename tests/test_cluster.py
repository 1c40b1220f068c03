"""Cluster mode of ParameterServerStrategy and LocalCluster (docs/parameter_server.md).

Real processes on loopback: PS tasks are `tf.distribute.Server` child processes, and the
worker functions below run in worker processes (they must be module-level: they are
pickled). This pytest process never connects to a cluster itself, so the in-process
tests keep their local devices. Every test is bounded, and `_no_child_left` checks
after each one that no child process is left.
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat._cluster_runtime.parameter_server import _shared_variables
from diststrat.cluster import LocalCluster
from diststrat.errors import ClusterError
import read_cache_cases as cases
import sync_files

TIMEOUT = 120  # Seconds, per cluster test.

pytestmark = pytest.mark.usefixtures("no_child_left")  # (conftest.py)
PS0, PS1 = "/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"
WORKER0 = "/job:worker/replica:0/task:0"


def _cluster(num_ps=1, num_workers=1, **strategy_kwargs):
  return LocalCluster(num_ps, num_workers, strategy_kwargs=strategy_kwargs,
                      start_timeout=60, result_timeout=100)




def _progress_files(directory, task):
  return [name for name in os.listdir(directory)
          if name.startswith(f"progress_{task}_") and not name.endswith(".tmp")]


def _in_background(fn):
  """Runs fn in a thread; returns a join() that re-raises what fn raised."""
  outcome = {}

  def target():
    try:
      fn()
    except BaseException as e:  # pylint: disable=broad-except
      outcome["error"] = e

  thread = threading.Thread(target=target, daemon=True)
  thread.start()

  def join():
    thread.join(TIMEOUT)
    if "error" in outcome:
      raise outcome["error"]

  return join


# --- worker functions (run in the worker processes) -----------------------------------


def _variables_fn(strategy, ckpt_dir):
  """Variables on the PS tasks behave as tf.Variables; a plain tf.Variable is the oracle."""
  with strategy.scope():
    a = tf.Variable(tf.zeros([3]), name="a")
    b = tf.Variable(1.0)
    c = tf.Variable(2.0)                    # also "Variable": must not collide with b
    emb = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2), name="emb")
    step = tf.Variable(0, dtype=tf.int64, name="step", trainable=False)
  @tf.function
  def make_from_traced_value():
    with strategy.scope():
      tf.Variable(tf.ones([2]) * 2.0, name="traced")

  try:
    make_from_traced_value()
    traced_error = None
  except ValueError as e:
    traced_error = str(e)
  plain = {"a": tf.Variable(tf.zeros([3])),
           "emb": tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))}
  results = {
      "devices": [v.device for v in (a, b, c, emb, step)],
      "names": [v.name for v in (a, b, c, emb, step)],
      "types": sorted({type(v).__name__ for v in (a, b, c, emb, step)}),
      "is_tf_variable": all(isinstance(v, tf.Variable) for v in (a, b, c, emb, step)),
      "worker_devices": list(strategy.worker_devices),
      "parameter_devices": list(strategy.parameter_devices),
      "b_c": [float(b.numpy()), float(c.numpy())],
      "trainable": [v.trainable for v in (a, step)],
      "traced_error": traced_error,
  }

  def exercise(a, emb):
    out = []
    a.assign([1.0, 2.0, 3.0])
    a.assign_add([1.0, 1.0, 1.0])
    a.assign_sub([0.5, 0.5, 0.5])
    out.append(a.numpy())
    emb.scatter_add(tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 4])))
    emb.scatter_update(tf.IndexedSlices(tf.fill([1, 2], -1.0), tf.constant([0])))
    emb.scatter_sub(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([5])))
    out.append(emb.sparse_read([0, 1, 4]).numpy())
    out.append(tf.gather(emb, [5, 4]).numpy())
    out.append(tf.gather_nd(emb, [[1, 1]]).numpy())
    out.append(emb.gather_nd([[2, 0]]).numpy())
    emb.scatter_nd_add([[3, 1]], [10.0])
    emb.scatter_nd_update([[3, 0]], [-10.0])
    emb.batch_scatter_update(tf.IndexedSlices(tf.fill([1, 2], 0.5), tf.constant([2])))
    emb[4:6].assign(tf.fill([2, 2], 7.0))
    out.append(emb.numpy())
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(a * a) + tf.reduce_sum(tf.gather(emb, [1, 1, 3]))
    grad_a, grad_emb = tape.gradient(loss, [a, emb])
    out += [grad_a.numpy(), type(grad_emb).__name__, grad_emb.indices.numpy()]

    @tf.function
    def fn_step(x):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * x) + tf.reduce_sum(emb.sparse_read([2]))
      ga, ge = tape.gradient(loss, [a, emb])
      a.assign_sub(0.1 * ga)
      emb.scatter_sub(tf.IndexedSlices(0.1 * ge.values, ge.indices))
      return loss

    out.append(fn_step(tf.constant([1.0, 2.0, 3.0])).numpy())
    out.append(fn_step(tf.constant([1.0, 2.0, 3.0])).numpy())
    out += [a.numpy(), emb.numpy()]
    return out

  shared_out, plain_out = exercise(a, emb), exercise(plain["a"], plain["emb"])
  results["matches_plain"] = [
      (x == y) if isinstance(x, str) else bool(np.allclose(x, y))
      for x, y in zip(shared_out, plain_out, strict=True)]

  checkpoint = tf.train.Checkpoint(a=a, emb=emb, step=step)
  step.assign_add(7)
  path = checkpoint.save(os.path.join(ckpt_dir, "ckpt"))
  saved_a = a.numpy()
  a.assign([9.0, 9.0, 9.0])
  step.assign(100)
  checkpoint.restore(path).assert_consumed()
  results["restored"] = [bool(np.allclose(a.numpy(), saved_a)), int(step.numpy())]
  # The same checkpoint restores into plain variables, with no strategy.
  plain_a, plain_step = tf.Variable(tf.zeros([3])), tf.Variable(0, dtype=tf.int64)
  tf.train.Checkpoint(a=plain_a, step=plain_step).restore(path).expect_partial()
  results["portable"] = [bool(np.allclose(plain_a.numpy(), saved_a)), int(plain_step.numpy())]
  # And the reverse: a checkpoint of plain variables restores into shared ones.
  plain_a.assign([4.0, 5.0, 6.0])
  plain_path = tf.train.Checkpoint(a=plain_a).save(os.path.join(ckpt_dir, "plain"))
  tf.train.Checkpoint(a=a).restore(plain_path).assert_consumed()
  results["from_plain"] = a.numpy().tolist()
  # An assign of another shape is refused, as for a plain variable (the raw op would give
  # the variable on its PS task the new shape), also in run_step.
  results["wrong_shape"] = []
  for assign in (lambda: a.assign(tf.ones([5])),
                 lambda: strategy.run_step(lambda: a.assign(tf.ones([2, 3])))):
    try:
      assign()
      results["wrong_shape"].append("no error")
    except ValueError as e:
      results["wrong_shape"].append(str(e))
  results["wrong_shape"].append(a.numpy().tolist())
  import keras  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    layer = keras.layers.Dense(4)
    layer.build((None, 3))
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer(tf.ones([2, 3])))
  grads = tape.gradient(loss, layer.trainable_variables)
  results["keras"] = ([v.value.device for v in layer.weights],
                      [g is not None for g in grads])
  return results


def _bind_fn(strategy, add, shape):
  """Creates "w" (from [1, 2, 3]) and "w" again; adds `add` to the first."""
  with strategy.scope():
    w = tf.Variable(tf.constant([1.0, 2.0, 3.0])[:shape], name="w")
    w_again = tf.Variable(tf.zeros([2]), name="w")  # Same requested name: "w_1".
  w.assign_add(tf.fill([shape], add))
  return w.numpy().tolist(), w_again.shared_name, w.shared_name


OPTIMIZERS = {
    "sgd": lambda: ds.optimizers.GradientDescent(0.1),
    "momentum": lambda: ds.optimizers.Momentum(0.05, 0.9),
    "nesterov": lambda: ds.optimizers.Momentum(0.05, 0.9, use_nesterov=True),
    "adam": lambda: ds.optimizers.Adam(0.01),
}


def _optimizers_fn(strategy, steps):
  """Each shipped optimizer, dense and sparse, eager and tf.function, on shared variables
  against the same optimizer on plain variables in this process (the oracle)."""
  rng = np.random.default_rng(7)
  ids = tf.constant(rng.integers(0, 12, size=(steps, 16)).astype(np.int32))
  ys = tf.constant(rng.normal(size=(steps, 16, 2)).astype(np.float32))
  emb0 = rng.normal(size=(12, 4)).astype(np.float32)
  w0 = (rng.normal(size=(4, 2)) * 0.5).astype(np.float32)

  def loss_fn(emb, w, ids_i, y_i, sparse):
    def loss():
      h = tf.gather(emb, ids_i) if sparse else tf.one_hot(ids_i, 12) @ emb
      return tf.reduce_mean(tf.square(h @ w - y_i))
    return loss

  errors = {}
  for name, make in OPTIMIZERS.items():
    for sparse in (False, True):
      for mode in ("eager", "function"):
        key = f"{name}_{'sparse' if sparse else 'dense'}_{mode}"
        ref_emb, ref_w, ref_opt = tf.Variable(emb0), tf.Variable(w0), make()
        for i in range(steps):
          ref_opt.minimize(loss_fn(ref_emb, ref_w, ids[i], ys[i], sparse),
                           var_list=[ref_emb, ref_w])
        with strategy.scope(), tf.name_scope(key):
          emb, w, opt = tf.Variable(emb0, name="emb"), tf.Variable(w0, name="w"), make()
          global_step = tf.Variable(0, dtype=tf.int64, name="global_step")

        def step(ids_i, y_i, emb=emb, w=w, opt=opt, global_step=global_step, sparse=sparse):
          strategy.call_for_each_tower(
              lambda: opt.minimize(loss_fn(emb, w, ids_i, y_i, sparse), var_list=[emb, w],
                                   global_step=global_step))

        if mode == "function":
          step = tf.function(step)
        for i in range(steps):
          strategy.run_step(step, ids[i], ys[i])
        slots_on_ps = all(v.device.startswith("/job:ps/") for v in opt.variables())
        errors[key] = (float(np.abs(emb.numpy() - ref_emb.numpy()).max()),
                       float(np.abs(w.numpy() - ref_w.numpy()).max()),
                       int(global_step.numpy()), slots_on_ps)
  return errors


def _count_fn(strategy, n):
  """Adds 1 to a shared counter n times: half eagerly, half in a tf.function."""
  with strategy.scope():
    counter = tf.Variable(0, dtype=tf.int64, name="counter")

  @tf.function
  def add():
    counter.assign_add(1, read_value=False)

  for i in range(n):
    if i % 2:
      counter.assign_add(1, read_value=False)
    else:
      strategy.run_step(add)
  return int(counter.numpy())


def _read_counter_fn(strategy):
  with strategy.scope():
    counter = tf.Variable(0, dtype=tf.int64, name="counter")
  return int(counter.numpy())


def _is_chief_fn(strategy):
  return strategy.is_chief


def _threads_fn(strategy):
  del strategy  # What the strategy's creation left in this process.
  return (tf.config.threading.get_intra_op_parallelism_threads(),
          len(os.sched_getaffinity(0)), os.cpu_count())


def _regression_data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  y = x @ rng.normal(size=(8, 1)).astype(np.float32)
  w1 = (rng.normal(size=(8, 8)) * 0.3).astype(np.float32)
  w2 = (rng.normal(size=(8, 1)) * 0.3).astype(np.float32)
  return x, y, w1, w2


def _initial_regression_loss():
  x, y, w1, w2 = _regression_data()
  return float(np.mean(np.square(x @ w1 @ w2 - y)))


def _regression(strategy):
  """A linear regression with a hidden layer, and its SGD step (one tf.function)."""
  x, y, w1_0, w2_0 = _regression_data()
  with strategy.scope():
    w1 = tf.Variable(w1_0, name="w1")
    w2 = tf.Variable(w2_0, name="w2")
    opt = ds.optimizers.GradientDescent(0.002)  # Slow: still learning after 200 steps.
    global_step = tf.Variable(0, dtype=tf.int64, name="global_step", trainable=False)

  def loss():
    return tf.reduce_mean(tf.square(x @ w1 @ w2 - y))

  @tf.function
  def step():
    strategy.call_for_each_tower(lambda: opt.minimize(loss, var_list=[w1, w2],
                                                      global_step=global_step))
    return loss(), global_step.read_value()

  variables = {"w1": w1, "w2": w2, "global_step": global_step, "opt": opt}
  return variables, step, loss


def _restartable_fn(strategy, steps, sync_dir):
  """Trains `steps` steps, writing its progress; returns where it started and ended."""
  _, step, loss = _regression(strategy)
  task = strategy.task_id
  first_loss, first_step = None, None
  for i in range(steps):
    value, global_step = strategy.run_step(step)
    if first_loss is None:
      first_loss, first_step = float(value), int(global_step)
    sync_files.write(os.path.join(sync_dir, f"progress_{task}_{os.getpid()}"), str(i + 1))
    time.sleep(0.01)
  return {"pid": os.getpid(), "first_loss": first_loss, "first_global_step": first_step,
          "last_loss": float(loss()), "last_global_step": int(global_step)}


def _through_ps_failure_fn(strategy, ckpt_dir, sync_dir, steps_before, steps_after,
                           wait_for_fault):
  """Trains, checkpoints, survives a PS fault (kill or freeze) and resumes from the
  last checkpoint after the PS restarts."""
  records = []
  handler = logging.Handler()
  handler.emit = lambda record: records.append(record.getMessage())
  logging.getLogger("diststrat").addHandler(handler)
  variables, step, loss = _regression(strategy)
  checkpoint = tf.train.Checkpoint(**variables)
  manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=2)
  before = []
  for i in range(steps_before):
    before.append(float(strategy.run_step(step)[0]))
    if (i + 1) % 10 == 0:
      manager.save()
  checkpoint_loss = None
  sync_files.write(os.path.join(sync_dir, "ready"))
  sync_files.wait_for_file(os.path.join(sync_dir, "fault"), timeout=wait_for_fault)
  fault_time = time.time()
  error = None
  while time.time() - fault_time < 90:
    try:
      strategy.run_step(step)
    except ClusterError as e:
      error = e
      break
  detected = time.time() - fault_time
  sync_files.write(os.path.join(sync_dir, "need_restart"))
  sync_files.wait_for_file(os.path.join(sync_dir, "restarted"), timeout=90)
  # Before reconnecting, the restarted task does not know this worker. (gRPC may first
  # refuse a few times while its channel backs off from the failed connects.)
  not_reconnected, start = None, time.time()
  while time.time() - start < 30:
    try:
      strategy.run_step(step)
    except ClusterError as e:
      not_reconnected = (str(e), e.task, time.time() - start)
      if "restarted since" in str(e):
        break
    time.sleep(0.2)
  strategy.reconnect()
  manager.restore_or_initialize()
  checkpoint_loss = float(loss())
  after = [float(strategy.run_step(step)[0]) for _ in range(steps_after)]
  return {"error": str(error), "error_type": type(error).__name__,
          "task": getattr(error, "task", None), "detected": detected,
          "before": before, "checkpoint_loss": checkpoint_loss, "after": after,
          "global_step": int(variables["global_step"].numpy()), "logs": records,
          "not_reconnected": not_reconnected}


def _every_path_fn(strategy, sync_dir, ckpt_dir):
  """After PS task 1 is killed: every way a user touches its variable raises ClusterError
  naming it; after its restart, before reconnect(), the error says to reconnect."""
  with strategy.scope():
    w = tf.Variable([1.0, 2.0], name="w")  # On PS task 0 (least loaded: both empty).
    v = tf.Variable([3.0, 4.0], name="v")  # On PS task 1.
    opt = ds.optimizers.GradientDescent(0.1)
    with strategy.colocate_vars_with(v):  # A variable with an aggregation: wrapped.
      count = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
  checkpoint = tf.train.Checkpoint(w=w, v=v)
  v.assign([5.0, 6.0])
  count.assign(3.0)
  restart_checkpoint = tf.train.Checkpoint(v=v, count=count)
  saved = restart_checkpoint.save(os.path.join(ckpt_dir, "before"))
  v.assign([3.0, 4.0])
  count.assign(0.0)

  @tf.function
  def direct_step():
    return tf.reduce_sum(v * w)

  def optimizer_step():
    strategy.call_for_each_tower(lambda: opt.minimize(lambda: tf.reduce_sum(v * v),
                                                      var_list=[v]))

  paths = {
      "assign_add": lambda: v.assign_add([1.0, 1.0]),
      "numpy": v.numpy,
      "update": lambda: strategy.update(v, lambda c: c.assign_sub([1.0, 1.0])),
      "reduce": lambda: strategy.reduce(
          "sum", strategy.call_for_each_tower(lambda: tf.ones([2])), destinations=v),
      "read_var": lambda: strategy.read_var(v),
      "tf.function step": direct_step,
      "optimizer step": optimizer_step,
      "checkpoint save": lambda: checkpoint.save(os.path.join(ckpt_dir, "ckpt")),
  }
  assert float(direct_step()) == 11.0  # Works before the fault.
  sync_files.write(os.path.join(sync_dir, "ready"))
  sync_files.wait_for_file(os.path.join(sync_dir, "fault"), timeout=60)
  outcomes = {}
  with strategy.scope():
    for name, path in paths.items():
      start = time.monotonic()
      try:
        path()
        outcomes[name] = ("no error", None, "", 0.0)
      except Exception as e:  # pylint: disable=broad-except
        outcomes[name] = (type(e).__name__, getattr(e, "task", None), str(e),
                          time.monotonic() - start)
  sync_files.write(os.path.join(sync_dir, "need_restart"))
  sync_files.wait_for_file(os.path.join(sync_dir, "restarted"), timeout=60)
  before_reconnect, start = None, time.time()
  while time.time() - start < 30:  # gRPC may refuse a few times while it reconnects.
    try:
      v.assign_add([1.0, 1.0])
    except ClusterError as e:
      before_reconnect = (str(e), e.task)
      if "restarted since" in str(e):
        break
    time.sleep(0.2)
  strategy.reconnect()
  # The restarted task lost v and count: restoring them must not read them first.
  restart_checkpoint.restore(saved).assert_consumed()
  return {"outcomes": outcomes, "before_reconnect": before_reconnect,
          "after_reconnect": float(direct_step()), "count": float(count.numpy())}


def _device_strings_fn(strategy):
  """Device strings without a job ("/cpu:0") name this worker's devices, as TensorFlow
  places them: as destinations and in `canonicalize_device`."""
  with strategy.scope():
    per_tower = strategy.call_for_each_tower(
        lambda: tf.fill([2], float(ds.get_tower_context().tower_id)))
    total = strategy.reduce("sum", per_tower, destinations="/cpu:0")
    own = per_tower.get("/cpu:1").numpy().tolist()
    copies = strategy.broadcast(tf.constant([5.0]), destinations=["/cpu:0"])
    with tf.device("/cpu:0"):
      placed = tf.identity(tf.constant(1.0)).device
    return {"canonical": ds.canonicalize_device("/cpu:0"), "placed": placed,
            "total": list(total.devices), "copies": list(copies.devices),
            "workers": list(strategy.worker_devices), "own": own,
            "sum": strategy.unwrap(total)[0].numpy().tolist()}


def _slice_assign_then_read_fn(strategy):
  """Slice assignments bypass the variable's acknowledged writes; a read must see them."""
  with strategy.scope():
    emb = tf.Variable(tf.zeros([6, 2]), name="emb")
  stale = 0
  for i in range(200):
    emb[4:6].assign(tf.fill([2, 2], float(i)))
    stale += int(emb.numpy()[5, 0] != float(i))
  return stale


def _autograph_files_fn(strategy):
  del strategy

  @tf.function
  def converted(x):
    if x > 0:  # AutoGraph writes this function to a file in the temporary directory.
      x += 1
    return x

  converted(tf.constant(1))
  return sorted(m.__file__ for n, m in sys.modules.items()
                if n.startswith("__autograph_generated_file"))


def _boom_fn(strategy):
  if strategy.task_id == 1:
    raise KeyError("no such key in task 1")
  return "ok"


def _fail_later_in_task_0_fn(strategy):
  if strategy.task_id == 0:
    time.sleep(1.0)  # Task 1 fails first; task 0 (listed first) fails after it,
    raise AssertionError  # with no message (an IndexError replaced the error then).
  raise RuntimeError("task 1 failed first")


def _unpicklable_result_fn(strategy):
  return lambda: strategy


def _sleep_fn(strategy, seconds, sync_dir=None):
  if strategy.task_id == 1:
    if sync_dir:
      sync_files.write(os.path.join(sync_dir, "sleeping"))
    time.sleep(seconds)
  return "slept"


def _slow_step_fn(strategy):
  strategy.step_timeout = 1.0
  start = time.monotonic()
  try:
    strategy.run_step(time.sleep, 2.5)
  except ClusterError as e:
    return str(e), e.task, time.monotonic() - start
  return None


def _shape_mismatch_fn(strategy):
  with strategy.scope():
    tf.Variable(tf.zeros([4]), name="w")


def _saved_training_step_fn(strategy, path):
  """Saves a training step of 2 towers (shared variables, a SUM variable, a metric, a
  Momentum optimizer), then runs it; returns what it computed."""
  with strategy.scope():
    m = tf.Module()
    m.w = tf.Variable([[1.0], [2.0]], name="w")
    m.count = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM, name="count")
    m.seen = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM, name="seen")
    m.opt = ds.optimizers.Momentum(0.1, 0.9)

  @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None, 1])])
  def train(x, y):
    def tower(x, y):
      m.opt.minimize(lambda: tf.reduce_sum(tf.square(x @ m.w - y)), var_list=[m.w])
      m.count.assign_add(1.0)
      m.seen.assign_add(tf.reduce_sum(y))
    strategy.call_for_each_tower(tower, x, y)
    return tf.identity(m.w), tf.identity(m.count), tf.identity(m.seen)

  m.train = train
  tf.saved_model.save(m, path)
  x, y = _saved_step_data()
  return [[t.numpy().tolist() for t in train(x, y)] for _ in range(2)]


def _saved_step_data():
  return (np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
          np.array([[1.0], [2.0]], np.float32))


# --- tests -----------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_variables_live_on_ps_tasks_and_behave_as_tf_variables(tmp_path):
  with _cluster(num_ps=2, variable_placement="round_robin") as cluster:
    [r] = cluster.run_on_workers(_variables_fn, ckpt_dir=str(tmp_path))
  ps0, ps1 = f"{PS0}/device:CPU:0", f"{PS1}/device:CPU:0"
  assert r["devices"] == [ps0, ps1, ps0, ps1, ps0]
  assert r["names"] == ["a:0", "Variable:0", "Variable_1:0", "emb:0", "step:0"]
  assert r["types"] == ["SharedVariable"] and r["is_tf_variable"]
  assert r["worker_devices"] == [f"{WORKER0}/device:CPU:0"]
  assert r["parameter_devices"] == [ps0, ps1]
  assert r["b_c"] == [1.0, 2.0] and r["trainable"] == [True, False]
  assert all(r["matches_plain"]), r["matches_plain"]
  assert r["restored"] == [True, 7] and r["portable"] == [True, 7]
  assert "Variable 'traced' is created inside a tf.function from a value computed in " \
         "it. In cluster mode, create variables outside tf.function" in r["traced_error"]
  assert r["from_plain"] == [4.0, 5.0, 6.0]
  for message, shape in zip(r["wrong_shape"][:2], ["(5,)", "(2, 3)"], strict=True):
    assert message.startswith(f"Cannot assign a value of shape {shape} to variable 'a' "
                              "of shape (3,)"), r["wrong_shape"]
  assert r["wrong_shape"][2] == [4.0, 5.0, 6.0]
  assert r["keras"] == ([ps0, ps1], [True, True])  # Keras 3 layers make shared variables too.


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_device_strings_without_a_job_name_the_workers_devices():
  """"/cpu:0" in a worker was read as /job:localhost/...: destinations raised ValueError
  ("which TensorFlow does not have") and canonicalize_device named no device of the task."""
  with LocalCluster(1, 1, cpus_per_worker=2, start_timeout=60, result_timeout=100,
                    strategy_kwargs={"worker_devices": ["/cpu:0", "/cpu:1"]}) as cluster:
    [r] = cluster.run_on_workers(_device_strings_fn)
  assert ds.canonicalize_device(r["placed"]) == r["canonical"] == r["workers"][0]
  assert r["total"] == r["copies"] == r["workers"][:1]
  assert r["own"] == [1.0, 1.0] and r["sum"] == [1.0, 1.0]  # Towers 0 and 1.


_MAIN_SCRIPT = """
import tensorflow as tf
from diststrat.cluster import LocalCluster

seen = []

def place(name, shape, dtype):
  seen.append(name)
  return "/job:ps/task:1" if name == "b" else "/job:ps/task:0"

def devices(strategy):
  with strategy.scope():
    return [tf.Variable(0.0, name=name).device for name in ("a", "b")]

def names(strategy):
  with strategy.scope():
    made = [tf.Variable(0.0, name="b") for _ in range(2)] + [tf.Variable(0.0)]
  return seen, [v.name[:-2] for v in made], [v.device[-19:] for v in made]

if __name__ == "__main__":
  with LocalCluster(2, 1, strategy_kwargs={"variable_placement": place},
                    start_timeout=60, result_timeout=100) as cluster:
    print("devices", cluster.run_on_workers(devices))
    print("names", cluster.run_on_workers(names))
    try:
      LocalCluster(1, 1, strategy_kwargs={"variable_placement": lambda *a: "x"}).run_on_workers(
          devices)
    except TypeError as e:
      print("lambda", "module-level" in str(e))
"""


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_scripts_functions_in_strategy_kwargs_reach_the_workers(tmp_path):
  """A variable_placement defined in a script run as `python script.py` could not be
  unpickled in the workers (AttributeError), which died with a ClusterError.

  It gets the name each variable gets: a second `b` was placed as "b" (on PS task 1),
  although the variable is `b_1`."""
  script = tmp_path / "train.py"
  script.write_text(textwrap.dedent(_MAIN_SCRIPT))
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=TIMEOUT - 10, env=dict(os.environ, PYTHONPATH=repo))
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert f"devices {[[PS0 + '/device:CPU:0', PS1 + '/device:CPU:0']]}" in proc.stdout
  names, on = ["b", "b_1", "Variable"], ["task:1/device:CPU:0"] + ["task:0/device:CPU:0"] * 2
  assert f"names {[(names, names, on)]}" in proc.stdout, proc.stdout
  assert "lambda True" in proc.stdout


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_an_eager_read_sees_the_slice_assignment_before_it():
  # The read runs in the watchdog's helper thread: without waiting for this process's
  # pending remote ops first, 65 of 200 reads returned the old value.
  with _cluster(num_ps=1) as cluster:
    assert cluster.run_on_workers(_slice_assign_then_read_fn) == [0]


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_worker_processes_leave_no_autograph_files():
  """A worker ends with os._exit, which skips TensorFlow's exit hook that removes the
  files AutoGraph generated: the worker removes its own first."""
  with _cluster(num_ps=1) as cluster:
    [files] = cluster.run_on_workers(_autograph_files_fn)
  assert files, "the worker's function was not converted by AutoGraph"
  assert [f for f in files if os.path.exists(f)] == []


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_optimizers_on_shared_variables_match_plain_variables():
  with _cluster(num_ps=2) as cluster:
    [errors] = cluster.run_on_workers(_optimizers_fn, steps=6)
  assert len(errors) == 16
  for key, (emb_error, w_error, global_step, slots_on_ps) in errors.items():
    assert emb_error < 1e-5 and w_error < 1e-5, key
    assert global_step == 6 and slots_on_ps, key


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_existing_variables_keep_their_values_names_are_unique_slow_steps_time_out():
  with _cluster() as cluster:
    [first] = cluster.run_on_workers(_bind_fn, add=10.0, shape=3)
    [second] = cluster.run_on_workers(_bind_fn, add=100.0, shape=3)
    with pytest.raises(ValueError, match=r"Variable 'w' already exists on "
                       rf"{PS0}/device:CPU:0 with shape \(3,\), but this program creates "
                       r"it with shape \(4,\)") as info:
      cluster.run_on_workers(_shape_mismatch_fn)
    [(slow, task, elapsed)] = cluster.run_on_workers(_slow_step_fn)
  assert first == ([11.0, 12.0, 13.0], "w_1", "w")
  assert second == ([111.0, 112.0, 113.0], "w_1", "w")  # Bound to w: not initialized again.
  assert any(f"raised in worker task {WORKER0}" in note for note in info.value.__notes__)
  # A step slower than step_timeout while every PS task answers: ClusterError, no task.
  assert "did not finish within step_timeout=1 s, although every parameter server task " \
         "answers" in slow and "raise step_timeout" in slow
  assert task is None and 1.0 <= elapsed < 2.5


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_two_workers_lose_no_update():
  with _cluster(num_workers=2) as cluster:
    finals = cluster.run_on_workers(_count_fn, n=500)
    assert cluster.run_on_workers(_read_counter_fn) == [1000, 1000]
    # docs/launch.md: a custom loop's chief (worker 0) writes the checkpoints.
    assert cluster.run_on_workers(_is_chief_fn) == [True, False]
    # Three tasks on this machine: each worker takes a third of the cores for its
    # intra-op threads, at least 1 (0: TensorFlow's default, when that would be all,
    # or when the process is pinned to some cores or the environment chose a count).
    [(threads, cores, machine), second] = cluster.run_on_workers(_threads_fn)
    share = max(1, cores // 3)
    chosen = cores < machine or os.environ.get("TF_NUM_INTRAOP_THREADS")
    assert threads == second[0] == (0 if chosen or share >= cores else share), (
        threads, cores, machine)
  assert all(500 <= f <= 1000 for f in finals), finals


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_restarted_worker_continues_from_current_values(tmp_path):
  with _cluster(num_workers=2) as cluster:
    def restart_worker_0_mid_training():
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline:
        done = [0]
        for name in _progress_files(tmp_path, task=0):
          try:
            with open(os.path.join(tmp_path, name)) as f:
              done.append(int(f.read() or 0))
          except (OSError, ValueError):
            pass
        if max(done) >= 40:
          cluster.restart("worker", 0)
          return
        time.sleep(0.02)
      raise TimeoutError("worker 0 made no progress")

    join = _in_background(restart_worker_0_mid_training)
    results = cluster.run_on_workers(_restartable_fn, steps=150, sync_dir=str(tmp_path))
    join()
  pids_of_worker_0 = {name.split("_")[2] for name in _progress_files(tmp_path, task=0)}
  assert len(pids_of_worker_0) == 2  # The first process, then the restarted one.
  restarted, other = results
  assert str(restarted["pid"]) in pids_of_worker_0
  # The restarted worker found the variables trained by both workers, not fresh ones.
  assert restarted["first_global_step"] > 40
  assert restarted["first_loss"] < 0.8 * _initial_regression_loss()
  assert restarted["last_loss"] < restarted["first_loss"]
  assert max(restarted["last_global_step"], other["last_global_step"]) >= 150 + 40


def _fault_and_restart(cluster, sync_dir, task_type, task_id, sig):
  def run():
    sync_files.wait_for_file(os.path.join(sync_dir, "ready"), timeout=90)
    cluster.kill(task_type, task_id, sig)
    sync_files.write(os.path.join(sync_dir, "fault"), json.dumps(time.time()))
    sync_files.wait_for_file(os.path.join(sync_dir, "need_restart"), timeout=90)
    cluster.restart(task_type, task_id)
    sync_files.write(os.path.join(sync_dir, "restarted"))
  return _in_background(run)


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_killed_ps_raises_cluster_error_then_restart_and_restore_resume(tmp_path):
  sync_dir, ckpt_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  with _cluster(num_ps=2) as cluster:
    join = _fault_and_restart(cluster, str(sync_dir), "ps", 1, signal.SIGKILL)
    [r] = cluster.run_on_workers(_through_ps_failure_fn, ckpt_dir=str(ckpt_dir),
                                 sync_dir=str(sync_dir), steps_before=30, steps_after=30,
                                 wait_for_fault=60)
    join()
  assert r["error_type"] == "ClusterError" and r["task"] == PS1
  assert f"Parameter server task {PS1} cannot be reached" in r["error"]
  assert "call strategy.reconnect(), then restore the last checkpoint" in r["error"]
  assert r["detected"] < 60
  message, task, _ = r["not_reconnected"]
  assert task == PS1 and f"Parameter server task {PS1} restarted since " in message
  assert "Call strategy.reconnect(), then restore the last checkpoint" in message
  before, after = r["before"], r["after"]
  assert before[-1] < before[0]
  # Restored to step 30's checkpoint: the loss goes on from there and keeps falling.
  assert r["checkpoint_loss"] == pytest.approx(before[-1], rel=0.2)
  assert after[-1] < after[0] < before[0]
  assert r["global_step"] == 60


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_every_path_to_a_killed_ps_raises_cluster_error_naming_it(tmp_path):
  sync_dir, ckpt_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  with _cluster(num_ps=2, step_timeout=5.0) as cluster:
    join = _fault_and_restart(cluster, str(sync_dir), "ps", 1, signal.SIGKILL)
    [r] = cluster.run_on_workers(_every_path_fn, sync_dir=str(sync_dir),
                                 ckpt_dir=str(ckpt_dir))
    join()
  assert len(r["outcomes"]) == 8
  for path, (error_type, task, message, elapsed) in r["outcomes"].items():
    assert (error_type, task) == ("ClusterError", PS1), (path, error_type, message)
    # Either the failed op ("cannot be reached: it died") or, for an op TensorFlow never
    # fails, the watchdog at step_timeout ("waiting on ..., which cannot be reached").
    assert re.search(rf"{PS1}( cannot be reached: it died|, which cannot be reached)",
                     message), (path, message)
    assert elapsed < 5.0 + 3.0, (path, elapsed)
  message, task = r["before_reconnect"]
  assert task == PS1 and f"Parameter server task {PS1} restarted since" in message
  assert "Call strategy.reconnect()" in message and "died" not in message
  assert r["after_reconnect"] == pytest.approx(1.0 * 5.0 + 2.0 * 6.0)
  assert r["count"] == 3.0


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_frozen_ps_is_reported_by_the_watchdog(tmp_path):
  sync_dir, ckpt_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  with _cluster(step_timeout=3.0) as cluster:
    join = _fault_and_restart(cluster, str(sync_dir), "ps", 0, signal.SIGSTOP)
    [r] = cluster.run_on_workers(_through_ps_failure_fn, ckpt_dir=str(ckpt_dir),
                                 sync_dir=str(sync_dir), steps_before=20, steps_after=20,
                                 wait_for_fault=60)
    join()
  assert r["error_type"] == "ClusterError" and r["task"] == PS0
  assert "did not finish within step_timeout=3 s, waiting on " in r["error"]
  assert f"{PS0}, which does not answer (frozen, or cut off)" in r["error"]
  assert 3.0 <= r["detected"] < 8.0
  [log] = [m for m in r["logs"] if "diststrat watchdog" in m]
  assert "has been stuck for" in log and f"waiting on {PS0}" in log
  # After the restart: reconnect, restore, and training goes on from the checkpoint.
  assert r["checkpoint_loss"] == pytest.approx(r["before"][-1], rel=0.2)
  assert r["after"][-1] < r["after"][0] < r["before"][0]


def _nothing_fn(strategy):
  return repr(strategy)


def _touch_variable_fn(strategy, sync_dir):
  with strategy.scope():
    v = tf.Variable(0.0)
  sync_files.write(os.path.join(sync_dir, "ready"))
  for _ in range(600):
    v.assign_add(1.0)
    time.sleep(0.05)


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_connecting_to_a_dead_or_frozen_ps_fails_within_step_timeout():
  with _cluster(step_timeout=3.0) as cluster:
    address = cluster.cluster_spec["ps"][0]
    cluster.kill("ps", 0, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ClusterError, match=rf"parameter server task {PS0} at {address} did "
                       r"not answer within 3 s \(frozen, overloaded or cut off\)") as frozen:
      cluster.run_on_workers(_nothing_fn)
    frozen_time = time.monotonic() - start
    cluster.kill("ps", 0)  # Now nothing listens on its port.
    with pytest.raises(ClusterError, match=rf"parameter server task {PS0} at {address} "
                       r"cannot be reached \(UNAVAILABLE") as dead:
      cluster.run_on_workers(_nothing_fn)
  assert frozen.value.task == dead.value.task == PS0
  # The worker process's start (TensorFlow import) plus the 3 s bound.
  assert frozen_time < 60


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_crashed_ps_is_reported_with_its_signal(tmp_path):
  with _cluster(step_timeout=5.0) as cluster:
    def crash_ps():
      sync_files.wait_for_file(os.path.join(tmp_path, "ready"))
      cluster.kill("ps", 0, signal.SIGSEGV)
    join = _in_background(crash_ps)
    with pytest.raises(ClusterError) as info:
      cluster.run_on_workers(_touch_variable_fn, sync_dir=str(tmp_path))
    join()
    assert cluster.exit_status("ps", 0) == -11
  notes = "".join(info.value.__notes__)
  assert f"(parameter server task {PS0} was killed by signal SIGSEGV (exit status -11)" in notes
  assert info.value.task == PS0


@pytest.mark.parametrize("kwargs, message", [
    ({"start_timeout": "soon"}, r"start_timeout must be a positive number of seconds. "
                                r"Received: start_timeout='soon'"),
    ({"start_timeout": -1}, r"start_timeout must be a positive number of seconds. Received: "
                            r"start_timeout=-1$"),
    ({"start_timeout": float("nan")}, r"Received: start_timeout=nan$"),
    ({"result_timeout": 0}, r"result_timeout must be a positive number of seconds. Received: "
                            r"result_timeout=0$"),
    ({"strategy_kwargs": "x"}, r"strategy_kwargs must be a dict of keyword arguments for each "
                               r"worker's strategy, such as \{'step_timeout': 10\}, or None. "
                               r"Received: strategy_kwargs='x' \(str\)."),
    ({"strategy_kwargs": {1: 2}}, r"Received: strategy_kwargs=\{1: 2\} \(dict\)."),
    ({"strategy_kwargs": {"task_id": 1}}, r"strategy_kwargs cannot set task_id: LocalCluster "
                                          r"gives each worker's strategy the cluster's spec and "
                                          r"the worker's own task. .*Leave them out."),
    ({"cpus_per_worker": 0}, r"cpus_per_worker must be a positive integer \(the logical CPU "
                             r"devices, so towers, of each worker process\), or None for "
                             r"TensorFlow's default of one. Received: cpus_per_worker=0"),
    ({"cpus_per_worker": 1.5}, r"Received: cpus_per_worker=1.5"),
])
def test_local_cluster_refuses_bad_arguments_before_starting_anything(kwargs, message):
  # Once: float('soon') and dict('x') raised ValueErrors that named no argument;
  # start_timeout=-1 or nan started the cluster and blamed the PS for not starting in
  # time; cpus_per_worker=0 ran with one CPU. Unmarked: starting a process fails this
  # test (conftest.py), and no cluster is left running.
  from diststrat.cluster import _local_cluster  # pylint: disable=import-outside-toplevel
  running = set(_local_cluster._running_clusters)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=message):
    with LocalCluster(num_ps=1, num_workers=1, **kwargs):
      pass
  assert set(_local_cluster._running_clusters) == running  # pylint: disable=protected-access


def test_strategy_kwargs_the_workers_strategy_does_not_take_are_refused_when_given():
  """Each worker's strategy would refuse the keyword (a TypeError from every worker
  process, once started); the cluster refuses it itself. Unmarked: starting a process
  fails this test (conftest.py)."""
  with pytest.raises(TypeError, match=r"strategy_kwargs has colective_timeout, which "
                                      r"MultiWorkerMirroredStrategy does not take \(the "
                                      r"strategy of a cluster without PS tasks\)\. It takes "
                                      r"devices, cross_worker_ops, collective_timeout, "):
    LocalCluster(num_ps=0, num_workers=2, strategy_kwargs={"colective_timeout": 5})
  with pytest.raises(TypeError, match=r"strategy_kwargs has collective_timeout, which "
                                      r"ParameterServerStrategy does not take"):
    LocalCluster(num_ps=1, strategy_kwargs={"collective_timeout": 5, "step_timeout": 5})
  # What each strategy takes passes.
  LocalCluster(num_ps=0, strategy_kwargs={"collective_timeout": 5, "devices": None})
  LocalCluster(num_ps=1, strategy_kwargs={"step_timeout": 5, "cache_reads": True})


@pytest.mark.processes
@pytest.mark.timeout(2 * TIMEOUT)
def test_local_cluster_errors_and_cleanup(tmp_path):
  with pytest.raises(ValueError, match="num_ps must be a non-negative integer. Received: "
                                       "num_ps=-1"):
    LocalCluster(num_ps=-1)
  with pytest.raises(ValueError, match="num_workers must be a positive integer. Received: "
                                       "num_workers=0"):
    LocalCluster(num_workers=0)
  # result_timeout counts from the workers' start (a fork: no TensorFlow import), so a
  # small one leaves room for the quick calls below and fires soon on the slow one.
  cluster = LocalCluster(num_workers=2, result_timeout=10)
  with pytest.raises(RuntimeError, match="is not running: use it as `with LocalCluster"):
    _ = cluster.cluster_spec
  with pytest.raises(ZeroDivisionError):
    with cluster:
      ps_pid = cluster.pid("ps", 0)
      spec = cluster.cluster_spec
      assert [a.split(":")[0] for a in spec["ps"] + spec["worker"]] == ["127.0.0.1"] * 3
      assert len({a for a in spec["ps"] + spec["worker"]}) == 3
      with pytest.raises(ValueError, match="task_type must be 'ps' or 'worker'"):
        cluster.kill("chief", 0)
      with pytest.raises(ValueError, match="task_id must be from 0 to 0 for the 'ps' job"):
        cluster.kill("ps", 1)
      with pytest.raises(ValueError, match="worker processes exist only while "
                                           "run_on_workers"):
        cluster.restart("worker", 0)
      with pytest.raises(TypeError, match="fn must be a module-level function"):
        cluster.run_on_workers(lambda strategy: 1)
      with pytest.raises(TypeError, match="sends its keyword arguments to the worker "
                                          "processes by pickling them; these cannot be"):
        cluster.run_on_workers(_boom_fn, callback=lambda: 1)
      with pytest.raises(TypeError, match="the result of '_unpicklable_result_fn' cannot be "
                                          "pickled to send it back"):
        cluster.run_on_workers(_unpicklable_result_fn)
      with pytest.raises(KeyError, match="no such key in task 1") as info:
        cluster.run_on_workers(_boom_fn)
      assert any("raised in worker task /job:worker/replica:0/task:1" in note
                 for note in info.value.__notes__)
      # The worker that failed first is the one raised (task 0's error, first in task
      # order, was raised before), and the later failure is named with its message.
      with pytest.raises(RuntimeError, match="task 1 failed first") as info:
        cluster.run_on_workers(_fail_later_in_task_0_fn)
      assert ("(raised first, in /job:worker/replica:0/task:1; later failures: "
              "/job:worker/replica:0/task:0: AssertionError: )"
              in info.value.__notes__)

      def kill_worker_1():
        sync_files.wait_for_file(str(tmp_path / "sleeping"))
        with pytest.raises(RuntimeError, match="run_on_workers\\(\\) is already running"):
          cluster.run_on_workers(_boom_fn)
        cluster.kill("worker", 1)

      join = _in_background(kill_worker_1)
      with pytest.raises(ClusterError, match="Worker task /job:worker/replica:0/task:1 was "
                                             r"killed by signal SIGKILL \(exit status -9\) before "
                                             "returning") as info:
        cluster.run_on_workers(_sleep_fn, seconds=30, sync_dir=str(tmp_path))
      join()
      assert info.value.task == "/job:worker/replica:0/task:1"
      with pytest.raises(ClusterError, match=r"Worker task\(s\) /job:worker/replica:0/task:1 "
                                             r"returned no result within result_timeout=10 s"):
        cluster.run_on_workers(_sleep_fn, seconds=120)
      _ = 1 / 0
  assert not os.path.exists(f"/proc/{ps_pid}")  # Stopped although the body raised.
  with pytest.raises(RuntimeError, match="was started already"):
    cluster.start()


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_bad_signal_is_refused_and_a_dead_fork_server_hides_no_error_of_the_body():
  """`kill(..., sig=-9)` killed the cluster's fork server (its os.kill raised), and a
  cluster whose fork server had died raised `BrokenPipeError` on leaving its `with`
  block, in place of the body's exception (and left the rest of `stop()` undone)."""
  from diststrat.cluster import _local_cluster  # pylint: disable=g-import-not-at-top
  with pytest.raises(KeyError, match="the body's error"):
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
      for sig in (-9, 0, 12345, "SIGKILL", True, 9.0):
        with pytest.raises(ValueError, match=r"sig must be a signal of this system, such "
                                             r"as signal.SIGKILL \(the default\) or "
                                             rf"signal.SIGSTOP. Received: sig={sig!r}"):
          cluster.kill("ps", 0, sig)
      # The PS and its fork server live on. A numpy integer is a task id too (it was
      # refused: "task_id must be from 0 to 0 ... Received: task_id=np.int64(0)").
      assert cluster.exit_status("ps", np.int64(0)) is None
      # The fork server dies (the OOM killer, say); its children die with it.
      os.kill(_local_cluster.shared_fork_server_pid() or cluster._forkserver.pid,
              signal.SIGKILL)
      raise KeyError("the body's error")
  assert repr(cluster).endswith("stopped)")


# --- in this process: argument checks and the building blocks ----------------------------


def test_local_cluster_takes_numpy_integers():
  """`LocalCluster(num_workers=np.int64(2))` was refused: "num_workers must be a positive
  integer. Received: num_workers=np.int64(2)"."""
  cluster = LocalCluster(num_ps=np.int64(0), num_workers=np.int64(2),
                         cpus_per_worker=np.int32(2))
  assert (cluster.num_ps, cluster.num_workers) == (0, 2)
  assert type(cluster.num_workers) is int  # pylint: disable=unidiomatic-typecheck
  assert repr(cluster) == "LocalCluster(num_ps=0, num_workers=2, new)"
  with pytest.raises(ValueError, match="num_workers must be a positive integer. Received: "
                                       "num_workers=np.float64"):
    LocalCluster(num_workers=np.float64(2))
  # A numpy signal number is a signal (it was refused: "sig must be a signal of this
  # system ... Received: sig=np.int64(9)"); the cluster is not running.
  with pytest.raises(ClusterError, match="is not running"):
    cluster.kill("worker", np.int64(1), np.int64(signal.SIGKILL))


@pytest.mark.parametrize("spec, kwargs, message", [
    (["127.0.0.1:1"], {}, "cluster_spec must be a dict such as"),
    ({"worker": ["127.0.0.1:1"]}, {}, "needs at least one parameter server: a 'ps' job"),
    ({"ps": "127.0.0.1:1", "worker": ["127.0.0.1:2"]}, {},
     r"cluster_spec\['ps'\] must be a list of 'host:port' addresses"),
    ({"ps": ["127.0.0.1"], "worker": ["127.0.0.1:2"]}, {},
     r"cluster_spec\['ps'\] must hold 'host:port' addresses with a port from 1 to 65535.*"
     r"Received: '127.0.0.1'"),
    ({"ps": ["127.0.0.1:abc"], "worker": ["127.0.0.1:2"]}, {},
     r"cluster_spec\['ps'\] must hold 'host:port' addresses .*Received: '127.0.0.1:abc'"),
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:70000"]}, {},
     r"cluster_spec\['worker'\] must hold 'host:port' addresses .*Received: '127.0.0.1:70000'"),
    ({"ps": [":2222"], "worker": ["127.0.0.1:2"]}, {},
     r"must hold 'host:port' addresses .*Received: ':2222'"),
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, {"step_timeout": "3"},
     r"step_timeout must be a positive number of seconds, or None for no limit. "
     r"Received: step_timeout='3'"),
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, {"step_timeout": True},
     r"step_timeout must be a positive number of seconds"),
    ({"ps": {1: "127.0.0.1:1"}, "worker": ["127.0.0.1:2"]}, {},
     r"cluster_spec\['ps'\] as a dict must map task ids 0..n-1 to addresses"),
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, {"task_type": "ps"},
     r"task_type must name the job of this worker process, one of \['worker'\]"),
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, {"task_id": 1},
     r"task_id must be an index into cluster_spec\['worker'\], from 0 to 0"),
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, {"ps_devices": ["/cpu:0"]},
     "ps_devices cannot be given with cluster_spec"),
    # Checked after connecting: ClusterError for the PS that is not there (no process
    # listens on port 1) hid the bad argument.
    ({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, {"variable_placement": "random"},
     r"variable_placement must be 'least_loaded', 'round_robin' or a callable"),
])
def test_bad_cluster_arguments(spec, kwargs, message):
  with pytest.raises(ValueError, match=message):
    ds.ParameterServerStrategy(cluster_spec=spec, **kwargs)


def test_in_process_strategy_has_no_cluster_methods():
  s = ds.ParameterServerStrategy(worker_devices=["/cpu:0"], ps_devices=["/cpu:0"])
  assert s.run_step(lambda x: x + 1, 1) == 2 and s.step_timeout is None
  assert s.cluster_spec is None
  with pytest.raises(ValueError, match="reconnect\\(\\) applies to cluster mode only"):
    s.reconnect()
  with pytest.raises(ValueError, match="step_timeout applies to cluster mode only"):
    s.step_timeout = 5
  with pytest.raises(ValueError, match="step_timeout must be a positive number of seconds"):
    ds.ParameterServerStrategy(worker_devices=["/cpu:0"], step_timeout=0)
  with s.scope():
    with pytest.raises(ds.errors.ContextError, match="run_step\\(\\) .* it runs a whole step"):
      s.call_for_each_tower(lambda: s.run_step(lambda: 1))


def test_shared_names_are_unique_and_deterministic():
  def names():
    n = _shared_variables.SharedNames()
    return [n.unique(b) for b in ["Variable", "w_1", "Variable", "w", "w", "w", "a/w"]]
  assert names() == names() == ["Variable", "w_1", "Variable_1", "w", "w_2", "w_3", "a/w"]


def test_cluster_error_keeps_its_task_through_pickling():
  import pickle  # pylint: disable=g-import-not-at-top
  error = pickle.loads(pickle.dumps(ClusterError("gone", task=PS0)))
  assert (str(error), error.task) == ("gone", PS0)


def test_cluster_module_is_public():
  assert "cluster" in ds.__all__ and ds.cluster.LocalCluster is LocalCluster
  assert ds.cluster.__all__ == ["LocalCluster", "serve", "ClusterConfig",
                                "cluster_from_environment", "cluster_from_slurm"]


# --- read caching: 1 worker process with 2 towers -------------------------------------


READ_CACHE_MODELS = {"mlp": cases.MLP, "keras_dense": cases.KerasDense}
# Adam alone: its slots are PS variables too, read and written beside the weights; plain
# gradient descent adds no path of its own (tests/test_read_cache.py runs both, in one
# process, with the same checks).
READ_CACHE_OPTIMIZERS = ["adam"]
READ_CACHE_CASES = [cases.case_auto_watch, cases.case_keras_layer, cases.case_write_then_read,
                    cases.case_read_after_merge_call, cases.case_forward_accumulator]


def _read_cache_fn(strategy):
  """Trains, and runs tower functions, with 2 towers, without then with read caching.

  Each run makes its own variables on the PS (a second request for a name gets a new
  shared name).
  """
  out = {"worker_devices": list(strategy.worker_devices), "default": strategy.cache_reads,
         "weights": {}, "reads": {}, "stats": {}, "cases": {}, "case_fills": {}}
  for cached in (False, True):
    strategy.cache_reads = cached
    for model, model_class in READ_CACHE_MODELS.items():
      for optimizer in READ_CACHE_OPTIMIZERS:
        for mode in ("eager", "function"):
          key = (model, optimizer, mode, cached)
          out["weights"][key], step, args = cases.train(strategy, model_class, optimizer, mode)
          out["stats"][key] = strategy.last_read_cache_stats
          if mode == "function":
            out["reads"][key] = cases.ps_reads(step, args, f"{PS0}/device:CPU:0")
    for case in READ_CACHE_CASES:
      for mode in ("eager", "function"):
        out["cases"][(case.__name__, mode, cached)] = cases.run_case(strategy, case, mode)
        out["case_fills"][(case.__name__, mode, cached)] = (
            strategy.last_read_cache_stats or {}).get("fills", 0)
  return out


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_reads_are_cached_per_step_with_the_same_training():
  with LocalCluster(1, 1, cpus_per_worker=2, start_timeout=60, result_timeout=100,
                    strategy_kwargs={"worker_devices": ["/cpu:0", "/cpu:1"]}) as cluster:
    [r] = cluster.run_on_workers(_read_cache_fn)
  assert r["worker_devices"] == [f"{WORKER0}/device:CPU:0", f"{WORKER0}/device:CPU:1"]
  assert r["default"] is True  # cache_reads defaults to True in cluster mode.
  # The oracle: the same training and towers in this process, with plain variables.
  reference = ds.ParameterServerStrategy(worker_devices=["/cpu:0", "/cpu:1"],
                                         ps_devices=["/cpu:3"])
  for model, model_class in READ_CACHE_MODELS.items():
    for optimizer in READ_CACHE_OPTIMIZERS:
      for mode in ("eager", "function"):
        key = (model, optimizer, mode)
        expected = cases.train(reference, model_class, optimizer, mode)[0]
        uncached, cached = (r["weights"][key + (c,)] for c in (False, True))
        for a, b, c in zip(expected, uncached, cached, strict=True):
          np.testing.assert_allclose(c, b, rtol=1e-6, atol=1e-7, err_msg=str(key))
          np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6, err_msg=str(key))
        # Cached: each of the 4 variables is read from the PS once per step (then the
        # optimizer's merge_call drops the values); uncached, once per use per tower.
        stats = r["stats"][key + (True,)]
        assert stats["fills"] == 4 and stats["hits"] > 0, (key, stats)
        assert r["stats"][key + (False,)] is None
        if mode == "function":
          reads = (r["reads"][key + (False,)], r["reads"][key + (True,)])
          assert reads == ((10 if model == "mlp" else 8), 4), (key, reads)
  for case in READ_CACHE_CASES:
    for mode in ("eager", "function"):
      expected = cases.run_case(reference, case, mode)
      for cached in (False, True):
        got = r["cases"][(case.__name__, mode, cached)]
        assert (r["case_fills"][(case.__name__, mode, cached)] > 0) == cached
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
          np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                     err_msg=f"{case.__name__} {mode} cached={cached}")


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_saved_training_step_loads_and_trains_in_a_process_outside_the_cluster(tmp_path):
  """The save's trace hard-coded the cluster's devices (/job:ps, /job:worker): loading
  in another process failed with "Cannot assign a device ... /job:ps/replica:0/task:0"."""
  path = str(tmp_path / "saved")
  with LocalCluster(1, 1, cpus_per_worker=2, start_timeout=60, result_timeout=100,
                    strategy_kwargs={"worker_devices": ["/cpu:0", "/cpu:1"]}) as cluster:
    [live] = cluster.run_on_workers(_saved_training_step_fn, path=path)
  loaded = tf.saved_model.load(path)  # This process: no cluster, no strategy.
  x, y = _saved_step_data()
  got = [[t.numpy().tolist() for t in loaded.train(x, y)] for _ in range(2)]
  for a, b in zip(got, live, strict=True):
    for u, v in zip(a, b, strict=True):
      np.testing.assert_allclose(u, v, rtol=1e-6)
  assert live[1][1:] == [4.0, 12.0]  # 2 towers: count and seen added per tower.
