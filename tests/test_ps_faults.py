"""Faults of a PS task on the paths a user takes outside `run_step` (docs/parameter_server.md).

Real processes on loopback, as in tests/test_cluster.py: a `LocalCluster` PS task is
frozen (SIGSTOP), killed or restarted by this process while a worker process runs one of
the functions below. The worker asks for each fault through files (`Control`), so that
it knows exactly when it happened. Every call a worker makes on a faulty PS runs in a
thread it waits for with a bound (`bounded`): a call that blocks is reported as
"blocked" instead of hanging the test. These helpers are tests/fault_control.py's, which
benchmarks/ps_faults.py shares.

- A frozen PS: eager reads (`numpy()`, `read_value()`, `np.asarray`), `read_var` and
  checkpoint saves raise `ClusterError` naming the task within `step_timeout`.
- A killed or frozen PS: writes (`update`, `assign*`, `scatter_*`) are acknowledged:
  they raise `ClusterError` from the call itself (a frozen PS's within `step_timeout`),
  never return as if done and fail at a later read.
- A PS killed during checkpoint saves, at seeded random moments: every save that fails
  raises `ClusterError` naming the task, and is never registered as the latest
  checkpoint.
"""

import dataclasses
import os
import random
import time

import numpy as np
import pytest
import tensorflow as tf

from diststrat.cluster import LocalCluster
from fault_control import Control, bounded, describe, reconnect, serve_faults

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("no_child_left")]  # (conftest.py)
PS0 = "/job:ps/replica:0/task:0"
STEP_TIMEOUT = 1.5  # Small: every frozen-PS check waits for it once.
MARGIN = 10.0  # Seconds a bounded call may take beyond its bound on a loaded machine.


def _cluster():
  return LocalCluster(1, 1, strategy_kwargs={"step_timeout": STEP_TIMEOUT},
                      start_timeout=60, result_timeout=250)


# --- a frozen PS: reads and saves are bounded (item 2) ---------------------------------


def _frozen_reads_fn(strategy, sync_dir, ckpt_dir):
  control = Control(sync_dir)
  with strategy.scope():
    v = tf.Variable([1.0, 2.0], name="v")
  checkpoint = tf.train.Checkpoint(v=v)
  manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=20)

  def taped_read_in_a_tower():  # The tape made the read wait holding the GIL: a hang.
    with tf.GradientTape() as tape:
      y = tf.reduce_sum(v * 2.0)
    return tape.gradient(y, v)

  def eagerly_in_a_tower(fn, cache_reads):
    strategy.cache_reads = cache_reads
    try:
      with strategy.scope():
        return strategy.call_for_each_tower(fn)
    finally:
      strategy.cache_reads = True

  def taped_gather_in_a_tower():  # An embedding lookup: a sparse read, the same hang.
    with tf.GradientTape() as tape:
      y = tf.reduce_sum(tf.gather(v, [1, 1]) * 3.0)
    return tf.convert_to_tensor(tape.gradient(y, v))

  paths = {
      "a taped read in a tower": lambda: eagerly_in_a_tower(taped_read_in_a_tower, True),
      "a taped gather in a tower": lambda: eagerly_in_a_tower(taped_gather_in_a_tower, True),
      "a taped read in a tower, no cache": lambda: eagerly_in_a_tower(
          taped_read_in_a_tower, False),
      "numpy": v.numpy,
      "read_value": lambda: v.read_value().numpy(),
      "np.asarray": lambda: np.asarray(v),
      "read_var": lambda: strategy.read_var(v).numpy(),
      "CheckpointManager.save": manager.save,
      "Checkpoint.write": lambda: checkpoint.write(os.path.join(ckpt_dir, "written")),
  }
  # The gather's gradient, recorded by diststrat for the function call that reads.
  gradient = eagerly_in_a_tower(taped_gather_in_a_tower, True)
  assert gradient.numpy().tolist() == [0.0, 6.0], gradient
  outcomes = {}
  for name, path in paths.items():
    path()  # Works, and everything it uses is traced, before the freeze.
    latest = manager.latest_checkpoint
    control("freeze")
    outcome = describe(*bounded(path, STEP_TIMEOUT + MARGIN))
    outcome["latest_unchanged"] = (manager.latest_checkpoint == latest and
                                   tf.train.latest_checkpoint(ckpt_dir) == latest)
    outcomes[name] = outcome
    control("thaw")
    reconnect(strategy)
    outcomes[name]["after_thaw"] = v.numpy().tolist()
  return outcomes


@pytest.mark.timeout(300)
def test_frozen_ps_makes_eager_reads_and_saves_raise_within_step_timeout(tmp_path):
  sync_dir, ckpt_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  with _cluster() as cluster:
    join = serve_faults(cluster, str(sync_dir))
    try:
      [outcomes] = cluster.run_on_workers(_frozen_reads_fn, sync_dir=str(sync_dir),
                                          ckpt_dir=str(ckpt_dir))
    finally:
      join()
  assert len(outcomes) == 9
  for path, outcome in outcomes.items():
    assert (outcome["kind"], outcome["type"], outcome["task"]) == (
        "raised", "ClusterError", PS0), (path, outcome)
    assert f"waiting on {PS0}, which does not answer (frozen, or cut off)" in (
        outcome["message"]), (path, outcome)
    assert outcome["elapsed"] < STEP_TIMEOUT + MARGIN, (path, outcome)
    assert outcome["latest_unchanged"], (path, outcome)
    assert outcome["after_thaw"] == [1.0, 2.0], (path, outcome)


def _frozen_keras_fn(strategy, sync_dir):
  import keras  # pylint: disable=import-outside-toplevel
  control = Control(sync_dir)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    predicts_only = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  x, y = np.ones((16, 4), np.float32), np.ones((16, 1), np.float32)
  paths = {
      "fit": lambda: model.fit(x, y, batch_size=8, epochs=2, verbose=0),
      "evaluate": lambda: model.evaluate(x, y, batch_size=8, verbose=0),
      "predict": lambda: model.predict(x, batch_size=8, verbose=0),
      # No fit or evaluate first: diststrat meets the model when predict asks for data.
      "predict only": lambda: predicts_only.predict(x, batch_size=8, verbose=0),
  }
  # A method of any other object run through tf.distribute's API is run as it is (a
  # dataclass instance, unhashable, made a TypeError when diststrat looked it up).
  @dataclasses.dataclass
  class Holder:
    value: float

    def double(self):
      return tf.constant([self.value * 2.0])

  with strategy.scope():
    doubled = tf.distribute.get_strategy().run(Holder(1.5).double)
  assert np.asarray(doubled).ravel().tolist() == [3.0], doubled
  outcomes = {}
  for name, path in paths.items():
    # Traced, and the step functions bounded, before the freeze. Keras's first call
    # traces and compiles its step inside the bound: on a loaded machine that took longer
    # than STEP_TIMEOUT, and the step raised with every PS answering.
    strategy.step_timeout = STEP_TIMEOUT + MARGIN
    path()
    strategy.step_timeout = STEP_TIMEOUT
    control("freeze")
    outcomes[name] = describe(*bounded(path, STEP_TIMEOUT + MARGIN))
    control("thaw")
    reconnect(strategy)
  return outcomes


@pytest.mark.timeout(300)
def test_keras_fit_evaluate_predict_on_a_frozen_ps_raise_within_step_timeout(tmp_path):
  """Keras calls its compiled steps directly, which blocked forever on a frozen PS: they
  run through `run_step` now."""
  sync_dir = tmp_path / "sync"
  sync_dir.mkdir()
  with _cluster() as cluster:
    join = serve_faults(cluster, str(sync_dir))
    try:
      [outcomes] = cluster.run_on_workers(_frozen_keras_fn, sync_dir=str(sync_dir))
    finally:
      join()
  assert sorted(outcomes) == ["evaluate", "fit", "predict", "predict only"]
  for path, outcome in outcomes.items():
    assert (outcome["kind"], outcome["type"], outcome["task"]) == (
        "raised", "ClusterError", PS0), (path, outcome)
    assert "did not finish within step_timeout" in outcome["message"], (path, outcome)
    assert outcome["elapsed"] < STEP_TIMEOUT + MARGIN, (path, outcome)


# --- a killed PS: writes are acknowledged (item 3) -------------------------------------


def _writes(strategy, v):
  ones = tf.ones([3])
  return {
      "update(assign_add)": lambda: strategy.update(v, lambda c: c.assign_add(ones)),
      "assign_add": lambda: v.assign_add(ones),
      "assign_sub": lambda: v.assign_sub(ones),
      "assign": lambda: v.assign(ones),
      "scatter_add": lambda: v.scatter_add(tf.IndexedSlices(tf.constant([1.0]),
                                                            tf.constant([0]))),
      "scatter_nd_update": lambda: v.scatter_nd_update([[1]], [5.0]),
  }


def _frozen_writes_fn(strategy, sync_dir):
  control = Control(sync_dir)
  with strategy.scope():
    v = tf.Variable([1.0, 2.0, 3.0], name="v")
  outcomes = {}
  for name, write in _writes(strategy, v).items():
    write()  # Traced and known to the PS task before it freezes.
    v.numpy()
    control("freeze")
    outcomes[name] = describe(*bounded(write, STEP_TIMEOUT + MARGIN))
    control("thaw")
    reconnect(strategy)
  return outcomes


@pytest.mark.timeout(300)
def test_writes_to_a_frozen_ps_raise_within_step_timeout(tmp_path):
  with _cluster() as cluster:
    join = serve_faults(cluster, str(tmp_path))
    try:
      [outcomes] = cluster.run_on_workers(_frozen_writes_fn, sync_dir=str(tmp_path))
    finally:
      join()
  assert len(outcomes) == 6
  for write, outcome in outcomes.items():
    # Not acknowledged within step_timeout: the write raises, it does not return as if
    # it had been done (nor block).
    assert (outcome["kind"], outcome["type"], outcome["task"]) == (
        "raised", "ClusterError", PS0), (write, outcome)
    assert f"waiting on {PS0}, which does not answer (frozen, or cut off)" in (
        outcome["message"]), (write, outcome)
    assert outcome["elapsed"] < STEP_TIMEOUT + MARGIN, (write, outcome)


def _killed_writes_fn(strategy, sync_dir):
  control = Control(sync_dir)
  with strategy.scope():
    v = tf.Variable([1.0, 2.0, 3.0], name="v")
  outcomes = {}
  for name, write in _writes(strategy, v).items():
    for _ in range(3):  # Traced and known to the PS task before it dies.
      write()
    v.numpy()
    control("kill")
    calls = []

    def three_writes(write=write, calls=calls):
      for _ in range(3):
        write()
        calls.append(1)

    outcomes[name] = describe(*bounded(three_writes, STEP_TIMEOUT + MARGIN))
    outcomes[name]["returned_before_raising"] = len(calls)
    control("restart")
    reconnect(strategy)
    v.assign([1.0, 2.0, 3.0])  # The restarted task lost v.
  return outcomes


@pytest.mark.timeout(300)
def test_writes_to_a_killed_ps_raise_from_the_call(tmp_path):
  with _cluster() as cluster:
    join = serve_faults(cluster, str(tmp_path))
    try:
      [outcomes] = cluster.run_on_workers(_killed_writes_fn, sync_dir=str(tmp_path))
    finally:
      join()
  assert len(outcomes) == 6
  for write, outcome in outcomes.items():
    # The first write after the kill raises: none returns as if it had been done.
    assert outcome["returned_before_raising"] == 0, (write, outcome)
    assert (outcome["kind"], outcome["type"], outcome["task"]) == (
        "raised", "ClusterError", PS0), (write, outcome)
    assert f"Parameter server task {PS0} cannot be reached" in outcome["message"], (
        write, outcome)
    assert outcome["elapsed"] < STEP_TIMEOUT + MARGIN, (write, outcome)


# --- a PS killed during saves: ClusterError, never the latest (item 4) -----------------


SAVES_KILLED = 12


def _saves_killed_fn(strategy, sync_dir, ckpt_dir, seed):
  control = Control(sync_dir)
  with strategy.scope():
    weights = {f"w{i}": tf.Variable(tf.random.stateless_normal([256, 256], seed=[i, 0]),
                                    name=f"w{i}") for i in range(16)}  # 4 MB in all
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(**weights), ckpt_dir,
                                       max_to_keep=100)
  start = time.monotonic()
  for _ in range(3):
    manager.save()
  save_seconds = (time.monotonic() - start) / 3
  rng = random.Random(seed)
  outcomes = []
  for _ in range(SAVES_KILLED):
    # The kill lands anywhere in the first two saves after the request, or between.
    delay = rng.uniform(0.0, 2.0 * save_seconds)
    control(f"kill_after {delay:.4f}")
    deadline = time.monotonic() + 30
    outcome = None
    while time.monotonic() < deadline:  # Saves until one fails.
      before = manager.latest_checkpoint
      kind, value, elapsed = bounded(manager.save, STEP_TIMEOUT + MARGIN)
      if kind == "returned":
        continue
      outcome = describe(kind, value, elapsed)
      outcome["latest_before"] = before
      outcome["latest_after"] = manager.latest_checkpoint
      outcome["latest_in_state_file"] = tf.train.latest_checkpoint(ckpt_dir)
      outcome["delay"] = delay
      break
    outcomes.append(outcome)
    control("restart")
    reconnect(strategy)
    manager.restore_or_initialize()
  return {"outcomes": outcomes, "save_seconds": save_seconds}


@pytest.mark.timeout(600)
def test_ps_killed_during_saves_raises_cluster_error_and_the_save_is_not_the_latest(
    tmp_path):
  sync_dir, ckpt_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  with _cluster() as cluster:
    join = serve_faults(cluster, str(sync_dir))
    try:
      [result] = cluster.run_on_workers(_saves_killed_fn, sync_dir=str(sync_dir),
                                        ckpt_dir=str(ckpt_dir), seed=18)
    finally:
      join()
  outcomes = result["outcomes"]
  assert len(outcomes) == SAVES_KILLED
  for i, outcome in enumerate(outcomes):
    assert outcome is not None, (i, "no save failed within 30 s of the kill")
    assert (outcome["kind"], outcome["type"], outcome["task"]) == (
        "raised", "ClusterError", PS0), (i, outcome)
    # The save that raised is not registered: the latest is still the one before it.
    assert outcome["latest_after"] == outcome["latest_before"], (i, outcome)
    assert outcome["latest_in_state_file"] == outcome["latest_before"], (i, outcome)


def _killed_before_the_final_wait_fn(strategy, sync_dir, ckpt_dir):
  control = Control(sync_dir)
  with strategy.scope():
    v = tf.Variable([1.0, 2.0], name="v")
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), ckpt_dir, max_to_keep=5)
  first = manager.save()
  # A write callback runs after the save wrote its files and before the save's final
  # wait for pending work (and before the manager's own callback registers it): the
  # PS dies at that moment.
  options = tf.train.CheckpointOptions(experimental_write_callbacks=[
      lambda: control("kill")])
  kind, value, elapsed = bounded(lambda: manager.save(options=options),
                                  STEP_TIMEOUT + MARGIN)
  killed_save = describe(kind, value, elapsed)
  killed_save["returned"] = value if kind == "returned" else None
  killed_save["latest"] = manager.latest_checkpoint
  killed_save["latest_in_state_file"] = tf.train.latest_checkpoint(ckpt_dir)
  latest = manager.latest_checkpoint
  next_save = describe(*bounded(manager.save, STEP_TIMEOUT + MARGIN))
  next_save["latest_unchanged"] = (manager.latest_checkpoint == latest and
                                   tf.train.latest_checkpoint(ckpt_dir) == latest)
  return {"first": first, "killed_save": killed_save, "next_save": next_save}


@pytest.mark.timeout(300)
def test_ps_killed_after_a_save_wrote_its_files_never_leaves_a_raised_save_registered(
    tmp_path):
  sync_dir, ckpt_dir = tmp_path / "sync", tmp_path / "ckpt"
  sync_dir.mkdir()
  with _cluster() as cluster:
    join = serve_faults(cluster, str(sync_dir))
    try:
      [r] = cluster.run_on_workers(_killed_before_the_final_wait_fn,
                                   sync_dir=str(sync_dir), ckpt_dir=str(ckpt_dir))
    finally:
      join()
  killed = r["killed_save"]
  if killed["kind"] == "returned":
    # Its files were complete and acknowledged before the PS died: it is the latest.
    assert killed["latest"] == killed["latest_in_state_file"] == killed["returned"], r
  else:
    assert (killed["kind"], killed["type"], killed["task"]) == (
        "raised", "ClusterError", PS0), r
    assert killed["latest"] == killed["latest_in_state_file"] == r["first"], r
  # Whichever it was, the next save fails as ClusterError and is not registered.
  next_save = r["next_save"]
  assert (next_save["kind"], next_save["type"], next_save["task"]) == (
      "raised", "ClusterError", PS0), r
  assert next_save["latest_unchanged"], r
