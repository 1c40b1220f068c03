"""Read caching of parameter-server variables (diststrat/_cluster_runtime/parameter_server/_read_cache.py), in one
process.

A cluster worker's caching is reproduced here without a cluster: `_CachingStrategy` makes
`SharedVariable`s on a local "PS" device (CPU:3) and gives each `call_for_each_tower` a
`ReadCache` on CPU:0, the way a cluster worker does with its PS tasks and its own CPU.
Each test compares the cached run against the same strategy without a cache and against
plain `ParameterServerStrategy` variables (the oracle). tests/test_cluster.py checks the
same in a real cluster.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _arguments
from diststrat._cluster_runtime.parameter_server import _read_cache
from diststrat._cluster_runtime.parameter_server import _shared_variables
from diststrat.errors import ClusterError
from diststrat.strategies import _tower_threads
from conftest import CPUS
import read_cache_cases as cases

PS, WORKERS, CACHE_DEVICE = CPUS[3], CPUS[:2], CPUS[0]
MODES = ["eager", "function"]
_prefixes = itertools.count()


class _CachingStrategy(ds.ParameterServerStrategy):
  """`ParameterServerStrategy` with a cluster worker's variables and read cache, locally.

  Variables are `SharedVariable`s on PS (shared names unique to this instance); `destroy()`
  deletes their resources, which would otherwise stay in the device's resource manager.
  """

  def __init__(self, cached=True, max_bytes=_read_cache.DEFAULT_MAX_BYTES, guard=None):
    super().__init__(worker_devices=WORKERS, ps_devices=[PS])
    self._cached, self._max_bytes, self._guard = cached, max_bytes, guard
    self._prefix = f"test_read_cache_{next(_prefixes)}"
    self.made = []

  def _make_variable(self, device, next_creator, kwargs):
    name = (kwargs.get("name") or "Variable").split(":")[0]
    with tf.init_scope():
      variable = _shared_variables.create_shared_variable(
          device=device, local_device=CACHE_DEVICE,
          shared_name=f"{self._prefix}/{len(self.made)}_{name}",
          initial_value=_arguments.initial_value_tensor(kwargs), shape=kwargs.get("shape"),
          trainable=kwargs.get("trainable"), guard=self._guard)
    self.made.append(variable)
    return variable

  def _new_read_cache(self):
    return _read_cache.ReadCache(CACHE_DEVICE, self._max_bytes) if self._cached else None

  def destroy(self):
    for variable in self.made:
      tf.raw_ops.DestroyResourceOp(resource=variable.handle, ignore_lookup_error=True)


KINDS = ("plain", "uncached", "cached")


@pytest.fixture
def make_strategy():
  """make_strategy(kind, **kwargs): a plain, uncached or cached strategy, cleaned up."""
  made = []

  def make(kind, **kwargs):
    if kind == "plain":
      return ds.ParameterServerStrategy(worker_devices=WORKERS, ps_devices=[PS])
    made.append(_CachingStrategy(cached=kind == "cached", **kwargs))
    return made[-1]

  yield make
  for strategy in made:
    strategy.destroy()


# --- training: reads per step, and weights against the uncached run and the oracle ------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer", sorted(cases.OPTIMIZERS))
@pytest.mark.parametrize("model_class", [cases.MLP, cases.KerasDense],
                         ids=["mlp", "keras_dense"])
def test_training_reads_each_variable_once_per_step_with_the_same_weights(
    make_strategy, model_class, optimizer, mode):
  runs = {kind: (make_strategy(kind),) for kind in KINDS}
  runs = {kind: (s, *cases.train(s, model_class, optimizer, mode)) for kind, (s,) in runs.items()}
  plain, uncached, cached = (runs[k][1] for k in KINDS)
  initial = [v.numpy() for v in model_class().weights]
  # Training moved them.
  assert any(not np.allclose(a, b) for a, b in zip(plain, initial, strict=True))
  for a, b, c in zip(plain, uncached, cached, strict=True):
    np.testing.assert_allclose(c, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-7)
  strategy = runs["cached"][0]
  stats = strategy.last_read_cache_stats
  # Each variable is filled once per step: at its first use, before the optimizer's
  # merge_call, which then drops every value.
  assert stats["fills"] == len(cached) and stats["invalidations"] == len(cached), stats
  assert stats["hits"] > 0
  if mode == "function":
    [uncached_reads, cached_reads] = [cases.ps_reads(runs[k][2], runs[k][3], PS)
                                      for k in ("uncached", "cached")]
    # MLP: 4 variables, w2 used twice, 2 towers: 10 reads; Keras: 4 variables x 2 towers.
    assert uncached_reads == (10 if model_class is cases.MLP else 8)
    assert cached_reads == len(cached)


# --- gradients: every way a tape or a graph sees a read --------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.__name__[len("case_"):])
def test_gradients_and_values_match_uncached_reads(make_strategy, case, mode):
  results = {kind: cases.run_case(make_strategy(kind), case, mode) for kind in KINDS}
  for kind in ("uncached", "cached"):
    assert len(results[kind]) == len(results["plain"])
    for got, expected in zip(results[kind], results["plain"], strict=True):
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=kind)


def test_what_each_case_reads_from_the_cache(make_strategy):
  """The cases above do go through the cache where they should, and only there."""
  def stats(case, mode):
    strategy = make_strategy("cached")
    cases.run_case(strategy, case, mode)
    return strategy.last_read_cache_stats

  # w and b: one fill each, then only hits (4 uses each per tower, 2 towers).
  assert stats(cases.case_auto_watch, "function") == {
      "fills": 2, "hits": 6, "invalidations": 0, "too_large": 0, "other_graph": 0}
  # Each write drops its variable (b, w, emb), so the read after it fills again.
  write = stats(cases.case_write_then_read, "eager")
  assert write["invalidations"] >= 3 and write["fills"] >= 5, write
  # The merge_call drops w and b; the reads after it fill again.
  merge = stats(cases.case_read_after_merge_call, "eager")
  assert merge["invalidations"] == 2 and merge["fills"] == 4, merge
  # Reads inside tf.cond's branches (nested graphs) are left alone.
  assert stats(cases.case_cond, "function")["other_graph"] > 0
  assert stats(cases.case_cond, "eager")["other_graph"] == 0
  # The inner tf.function reads w and b itself (its trace is shared, so when it traces
  # is not counted here); the two outer uses of w per tower are cached.
  inner = stats(cases.case_inner_function, "function")
  assert inner["fills"] == 1 and inner["hits"] == 3, inner


# --- what is not cached ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_variables_over_the_size_limit_are_read_where_used(make_strategy, mode):
  strategy = make_strategy("cached", max_bytes=40)  # w: 48 bytes, b: 12 bytes.
  with strategy.scope():
    w = tf.Variable(tf.ones([4, 3]), name="w")
    b = tf.Variable(tf.ones([3]), name="b")

  def tower():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((tf.ones([2, 4]) @ w + b) * b) + tf.reduce_sum(w)
    return tape.gradient(loss, [w, b])

  step = lambda: strategy.call_for_each_tower(tower)
  with strategy.scope():
    grads = (tf.function(step) if mode == "function" else step)()
  assert strategy.last_read_cache_stats == {
      "fills": 1, "hits": 3, "invalidations": 0, "too_large": 4, "other_graph": 0}
  for grad_w in strategy.unwrap(grads[0]):
    np.testing.assert_allclose(grad_w, np.full([4, 3], 3.0))  # x^T b + 1


@pytest.mark.parametrize("max_bytes, stats", [
    (2**20, {"fills": 1, "hits": 3, "invalidations": 0, "too_large": 0, "other_graph": 0}),
    (100, {"fills": 0, "hits": 0, "invalidations": 0, "too_large": 4, "other_graph": 0}),
])
def test_keras_embedding_reads_its_table_densely(make_strategy, max_bytes, stats):
  """Keras 3's Embedding reads its whole table densely, twice per tower (the reason the
  size limit is high: over it, those reads go to the PS; docs/parameter_server.md)."""
  strategy = make_strategy("cached", max_bytes=max_bytes)  # The table: 160 bytes.
  with strategy.scope():
    embedding = keras.layers.Embedding(10, 4)
    embedding.build((None,))

  def tower():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(embedding(tf.constant([1, 2, 2])))
    return tape.gradient(loss, embedding.trainable_variables)[0]

  with strategy.scope():
    grads = strategy.call_for_each_tower(tower)
  assert strategy.last_read_cache_stats == stats
  for grad in strategy.unwrap(grads):
    dense = tf.convert_to_tensor(grad).numpy()
    np.testing.assert_allclose(dense.sum(axis=1), [0, 4, 8, 0, 0, 0, 0, 0, 0, 0])


def test_reads_outside_towers_are_not_cached(make_strategy):
  strategy = make_strategy("cached")
  with strategy.scope():
    w = tf.Variable([1.0, 2.0], name="w")
    assert float(tf.reduce_sum(w * 2.0)) == 6.0 and float(strategy.read_var(w)[1]) == 2.0
    assert strategy.last_read_cache_stats is None  # No call_for_each_tower yet.

    def merge_fn(s):
      return s.read_var(w) + w  # Cross-tower reads: not through the tower's cache.

    def tower():
      return ds.get_tower_context().merge_call(merge_fn)

    result = strategy.call_for_each_tower(tower)
  assert float(strategy.unwrap(result)[0][1]) == 4.0
  assert strategy.last_read_cache_stats["fills"] == 0


def test_cached_reads_raise_cluster_error_once_the_connection_saw_a_fault(make_strategy):
  class Guard:
    """Stands in for the connection's StepGuard."""
    failed = False

    def run(self, fn, what):
      del what
      return fn()

    def check_healthy(self, what):
      if self.failed:
        raise ClusterError(f"{what}: the PS task failed", task="/job:ps/replica:0/task:0")

  guard = Guard()
  strategy = make_strategy("cached", guard=guard)
  with strategy.scope():
    w = tf.Variable([1.0, 2.0], name="w")

  def tower():
    first = w + 0.0  # Fills the cache.
    guard.failed = ds.get_tower_context().tower_id == 1
    return first + w  # Tower 1: a cache hit, still refused.

  with strategy.scope(), pytest.raises(ClusterError, match=r"read_variable_op\(\) of "
                                                          r"variable '.*w': the PS task"):
    strategy.call_for_each_tower(tower)


# --- the pieces --------------------------------------------------------------------------


def test_read_cache_bookkeeping(make_strategy):
  strategy = make_strategy("uncached")
  with strategy.scope():
    w = tf.Variable([1.0, 2.0], name="w")
    names = tf.Variable(["a", "b"], name="names")
  cache = _read_cache.ReadCache(CACHE_DEVICE, max_bytes=8)
  assert cache.applies_to(w) and not cache.applies_to(names)  # Not numeric.
  reads = []
  uncached = lambda: reads.append(1) or w.read_value()
  first, second = cache.read(w, uncached), cache.read(w, uncached)
  assert len(reads) == 1 and first is not second
  assert first.device == second.device == CACHE_DEVICE  # Eagerly: the current device.
  cache.invalidate(w)
  np.testing.assert_allclose(cache.read(w, uncached), [1.0, 2.0])
  cache.invalidate_all()
  _read_cache.invalidate(w)  # Open caches only: nothing left to drop.
  assert cache.stats == {"fills": 2, "hits": 1, "invalidations": 2, "too_large": 1,
                         "other_graph": 0}

  @tf.function
  def in_a_graph():
    return tf.constant(cache.applies_to(w))

  assert not bool(in_a_graph()) and cache.stats["other_graph"] == 1  # Made eagerly.
  cache.close()
  assert not cache.applies_to(w)


def test_tower_runner_step_cache_hook():
  class Recorder:
    invalidations = 0

    def invalidate_all(self):
      self.invalidations += 1

  recorder = Recorder()
  strategy = ds.ParameterServerStrategy(worker_devices=WORKERS, ps_devices=[PS])
  seen = []

  def tower():
    seen.append(ds.get_tower_context().step_cache)
    for _ in range(3):
      ds.get_tower_context().merge_call(lambda s: None)

  runner = _tower_threads.TowerRunner(strategy, WORKERS, step_cache=recorder)
  with strategy.scope():
    runner.run(tower, (), {})
  assert seen == [recorder, recorder] and recorder.invalidations == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"cache_reads": "yes"}, r"cache_reads must be True, False or None \(the default: True "
                             r"in cluster mode\). Received: cache_reads='yes'"),
    ({"cache_reads": True}, r"cache_reads=True applies to cluster mode only: in one process "
                            r"the variables are plain tf.Variables.*Received: cache_reads="
                            r"True without cluster_spec. Pass cluster_spec"),
    ({"cache_reads_max_bytes": 0}, r"cache_reads_max_bytes must be a positive number of "
                                   r"bytes, or None for no limit. Received: "
                                   r"cache_reads_max_bytes=0"),
    ({"cache_reads_max_bytes": True}, "Received: cache_reads_max_bytes=True"),
    ({"cache_reads_max_bytes": 1.5}, "Received: cache_reads_max_bytes=1.5"),
])
def test_cache_arguments_are_checked(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ds.ParameterServerStrategy(worker_devices=WORKERS, ps_devices=[PS], **kwargs)


def test_cache_reads_defaults_off_in_one_process():
  s = ds.ParameterServerStrategy(worker_devices=WORKERS, ps_devices=[PS],
                                 cache_reads_max_bytes=None)
  assert s.cache_reads is False and s.last_read_cache_stats is None
  s.cache_reads = None  # The default for this mode.
  assert s.cache_reads is False
  with pytest.raises(ValueError, match="cache_reads=True applies to cluster mode only"):
    s.cache_reads = True
