"""MirroredStrategy's default reduction, chosen by measurement (cross_tower_ops/_measured.py
and _choose.py; docs/cross_tower_ops.md, "The default: measured")."""

import logging
import time

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.cross_tower_ops import (AllReduceCrossTowerOps, MeasuredCrossTowerOps,
                                       ReductionToOneDevice)
from diststrat.cross_tower_ops import _choose
from diststrat.cross_tower_ops import _measured
from diststrat.values import PerDevice
from conftest import CPUS

ENV = "DISTSTRAT_CROSS_TOWER_OPS"
CANDIDATES = _measured.candidates_for


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
  """Every test starts with no choice made and no pin in the environment."""
  monkeypatch.delenv(ENV, raising=False)
  _measured.clear_choices()
  yield
  _measured.clear_choices()


@pytest.fixture
def timed(monkeypatch):
  """Records each measurement: the candidates it timed and whether it ran eagerly."""
  calls = []
  original = _measured._time_candidates

  def spy(candidates, aggregation, zeros, started, budget):
    eager = []
    wrapped = [_Recording(c, eager) for c in candidates]
    timings, skipped = original(wrapped, aggregation, zeros, started, budget)
    calls.append({"timings": timings, "skipped": skipped, "eager": eager,
                  "budget": budget})
    return timings, skipped

  monkeypatch.setattr(_measured, "_time_candidates", spy)
  return calls


class _Recording:
  """A candidate that notes, at each call, whether it runs eagerly."""

  def __init__(self, ops, eager):
    self._ops, self._eager = ops, eager

  def batch_reduce(self, aggregation, pairs):
    self._eager.append(tf.executing_eagerly())
    return self._ops.batch_reduce(aggregation, pairs)


def _tower_values(strategy, shape=(3, 5), seed=0):
  rng = np.random.default_rng(seed)
  arrays = [rng.normal(size=shape).astype(np.float32) for _ in strategy.worker_devices]
  index = {}
  for device, array in zip(strategy.worker_devices, arrays, strict=True):
    with tf.device(device):
      index[device] = tf.constant(array)
  return PerDevice(index), arrays


def _train(strategy, steps=3):
  """A linear model trained with diststrat's Momentum in a tf.function; its weights."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(8, 6)).astype(np.float32)
  y = rng.normal(size=(8, 2)).astype(np.float32)
  with strategy.scope():
    w = tf.Variable(np.ones((6, 2), np.float32))
    b = tf.Variable(np.zeros((2,), np.float32))
    opt = ds.optimizers.Momentum(0.1, 0.9)
    dataset = strategy.distribute_dataset(
        lambda: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    iterator = iter(dataset)

    def tower(features, labels):
      def loss():
        return tf.reduce_mean(tf.square(tf.matmul(features, w) + b - labels))
      return opt.minimize(loss, var_list=[w, b])

    @tf.function
    def step(batch):
      return strategy.call_for_each_tower(tower, *batch)

    for _ in range(steps):
      step(next(iterator))
  return [v.numpy() for v in (w, b)]


# --- the heuristic and the candidates ---------------------------------------------------


def test_candidates_fit_the_devices():
  names = [repr(c) for c in _measured.candidates_for(CPUS)]
  assert names[0] == "AllReduceCrossTowerOps(algorithm='naive', num_packs=1)"
  assert "ReductionToOneDevice(reduce_to_device=None)" in names
  assert "AllReduceCrossTowerOps(algorithm='naive', num_packs=4)" in names  # Packing too.
  assert not any("nccl" in n for n in names)
  assert names[-2:] == ["AllReduceCrossTowerOps(algorithm='collective', num_packs=1)",
                        "AllReduceCrossTowerOps(algorithm='collective', num_packs=4)"]
  gpus = [repr(c) for c in _measured.candidates_for(["/gpu:0", "/gpu:1"])]
  assert gpus[0] == "AllReduceCrossTowerOps(algorithm='nccl', num_packs=1)"
  assert not any("collective" in n for n in gpus)


# --- pinned ---------------------------------------------------------------------------


def test_a_pinned_algorithm_is_used_as_it_is(timed):
  ops = AllReduceCrossTowerOps("hierarchical_copy")
  s = ds.MirroredStrategy(CPUS, cross_tower_ops=ops)
  assert s.cross_tower_ops is ops
  value, arrays = _tower_values(s)
  with s.scope():
    result = s.reduce("sum", value)
  np.testing.assert_allclose(result.primary.numpy(), np.sum(arrays, axis=0), rtol=1e-6)
  assert timed == [] and not _measured._choices  # Nothing measured.


@pytest.mark.parametrize("value, expected", [
    ("naive", "AllReduceCrossTowerOps(algorithm='naive', num_packs=1)"),
    ("hierarchical_copy:2", "AllReduceCrossTowerOps(algorithm='hierarchical_copy', "
                            "num_packs=2)"),
    (" Collective ", "AllReduceCrossTowerOps(algorithm='collective', num_packs=1)"),
    ("one_device", "ReductionToOneDevice(reduce_to_device=None)"),
])
def test_the_environment_variable_pins_the_default(monkeypatch, timed, value, expected):
  monkeypatch.setenv(ENV, value)
  s = ds.MirroredStrategy(CPUS)
  assert repr(s.cross_tower_ops) == expected
  value, arrays = _tower_values(s)
  with s.scope():
    result = s.reduce("mean", value)
  np.testing.assert_allclose(result.primary.numpy(), np.mean(arrays, axis=0), rtol=1e-6)
  assert timed == []


@pytest.mark.parametrize("value", ["auto", "AUTO", ""])
def test_auto_or_empty_measures(monkeypatch, value):
  monkeypatch.setenv(ENV, value)
  assert isinstance(ds.MirroredStrategy(CPUS).cross_tower_ops, MeasuredCrossTowerOps)


@pytest.mark.parametrize("value", ["fastest", "naive:0", "naive:x", "one_device:2",
                                   "ring", "naive:"])
def test_a_bad_environment_value_is_refused(monkeypatch, value):
  monkeypatch.setenv(ENV, value)
  with pytest.raises(ValueError, match=(
      r"DISTSTRAT_CROSS_TOWER_OPS must be one of auto, one_device, naive, "
      r"hierarchical_copy, collective, nccl; .*Received: DISTSTRAT_CROSS_TOWER_OPS="
      + repr(value).replace("(", r"\(") + r"\. Unset it")):
    ds.MirroredStrategy(CPUS)


def test_nccl_from_the_environment_is_refused_on_cpus(monkeypatch):
  monkeypatch.setenv(ENV, "nccl")
  with pytest.raises(ValueError, match=r"DISTSTRAT_CROSS_TOWER_OPS=nccl runs on GPUs "
                                       r"only, but the strategy's devices are \["):
    ds.MirroredStrategy(CPUS)


def test_the_environment_does_not_override_an_argument(monkeypatch):
  monkeypatch.setenv(ENV, "collective")
  ops = ReductionToOneDevice()
  assert ds.MirroredStrategy(CPUS, cross_tower_ops=ops).cross_tower_ops is ops


# --- measured -------------------------------------------------------------------------


def test_the_choice_is_measured_once_and_reused(timed, caplog):
  s = ds.MirroredStrategy(CPUS)
  ops = s.cross_tower_ops
  assert ops.chosen is None and repr(ops) == "MeasuredCrossTowerOps(chosen=None)"
  value, arrays = _tower_values(s)
  with caplog.at_level(logging.INFO, logger="diststrat"):
    with s.scope():
      first = s.reduce("sum", value)
      second = s.batch_reduce("sum", [(value, None)])[0]
    other = ds.MirroredStrategy(CPUS)  # Another strategy on the same devices.
    with other.scope():
      other.reduce("sum", value)
  assert len(timed) == 1, timed
  assert timed[0]["timings"]  # At least one candidate was timed.
  chosen = ops.chosen
  assert chosen is other.cross_tower_ops.chosen
  assert chosen in ops.candidates
  assert repr(ops) == f"MeasuredCrossTowerOps(chosen={chosen!r})"
  for result in (first, second):
    np.testing.assert_allclose(result.primary.numpy(), np.sum(arrays, axis=0), rtol=1e-6)
  messages = [r.getMessage() for r in caplog.records if "diststrat chose" in r.getMessage()]
  assert len(messages) == 1, messages
  assert repr(chosen) in messages[0] and "Best seconds per batch" in messages[0]
  assert "DISTSTRAT_CROSS_TOWER_OPS" in messages[0]


def test_another_size_is_measured_again(timed):
  s = ds.MirroredStrategy(CPUS[:2])
  small, _ = _tower_values(s, shape=(4,))
  large, _ = _tower_values(s, shape=(256, 64))
  with s.scope():
    s.reduce("sum", small)
    s.reduce("sum", small)
    s.reduce("sum", large)
  assert len(timed) == 2


def test_a_first_call_in_a_trace_measures_eagerly(timed):
  s = ds.MirroredStrategy(CPUS)
  value, arrays = _tower_values(s)

  @tf.function
  def reduce(v):
    return s.reduce("sum", v).values

  with s.scope():
    out = reduce(value)
    again = reduce(value)
  assert len(timed) == 1
  assert timed[0]["eager"] and all(timed[0]["eager"]), timed[0]["eager"]
  for copy in list(out) + list(again):
    np.testing.assert_allclose(copy.numpy(), np.sum(arrays, axis=0), rtol=1e-6)
  # The trace holds the chosen reduction only: no zeros made for the measurement.
  graph = reduce.get_concrete_function(value).graph
  assert not any(op.type in ("Fill", "Zeros") for op in graph.get_operations())


def test_the_budget_is_a_fraction_of_the_steps_time_so_far():
  assert _measured.measurement_budget(None) == _measured.MAX_SECONDS
  budget = _measured.measurement_budget(time.perf_counter() - 0.5)
  assert _measured.FRACTION * 0.5 <= budget < _measured.FRACTION * 0.5 + 0.05
  assert _measured.measurement_budget(time.perf_counter() - 3600) == _measured.MAX_SECONDS


def test_a_step_too_short_to_pay_for_measuring_uses_the_heuristic(timed, monkeypatch):
  # A first step whose budget (a fraction of its time so far) is below MIN_SECONDS times
  # nothing: the heuristic's pick reduces, and no choice is cached.
  monkeypatch.setattr(_measured, "FRACTION", 0.0)
  s = ds.MirroredStrategy(CPUS)
  reference = _train(ds.DefaultStrategy(), steps=1)
  weights = _train(s, steps=1)
  assert timed == []
  assert s.cross_tower_ops.chosen is s.cross_tower_ops.candidates[0]
  for got, want in zip(weights, reference, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # With time to spare (the fraction's cap), the same first step measures.
  monkeypatch.setattr(_measured, "FRACTION", 1e6)
  _train(ds.MirroredStrategy(CPUS), steps=1)
  assert len(timed) == 1 and timed[0]["budget"] == _measured.MAX_SECONDS


def test_the_budget_stops_the_measurement(timed):
  ops = MeasuredCrossTowerOps(CPUS, budget=lambda: 0.0)
  value, arrays = _tower_values(ds.MirroredStrategy(CPUS))
  result = ops.reduce("sum", value)
  np.testing.assert_allclose(result.primary.numpy(), np.sum(arrays, axis=0), rtol=1e-6)
  assert timed == []  # No time: nothing timed, the heuristic's pick.
  assert ops.chosen is ops.candidates[0]
  # The smallest budget that times: the first candidate at least, maybe not all.
  ops = MeasuredCrossTowerOps(CPUS, budget=lambda: _measured.MIN_SECONDS)
  result = ops.reduce("sum", value)
  np.testing.assert_allclose(result.primary.numpy(), np.sum(arrays, axis=0), rtol=1e-6)
  assert 0 in timed[0]["timings"]
  assert sorted(list(timed[0]["timings"]) + timed[0]["skipped"]) == list(
      range(len(ops.candidates)))


def test_the_measurement_stays_within_one_second():
  ops = MeasuredCrossTowerOps(CPUS)
  value, _ = _tower_values(ds.MirroredStrategy(CPUS), shape=(64, 64))
  import time  # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  ops.reduce("sum", value)
  # The bound is checked before each candidate starts: one may overrun it by its own time.
  assert time.perf_counter() - started < 3 * _measured.MAX_SECONDS


@pytest.mark.parametrize("index", range(len(CANDIDATES(CPUS))),
                         ids=[repr(c) for c in CANDIDATES(CPUS)])
def test_training_equals_the_reference_whatever_is_chosen(monkeypatch, index):
  """The default strategy's result, whichever candidate the measurement keeps."""
  monkeypatch.setattr(_measured, "candidates_for",
                      lambda devices: [CANDIDATES(devices)[index]])
  reference = _train(ds.get_distribution_strategy())
  s = ds.MirroredStrategy(CPUS)
  got = _train(s)
  assert repr(s.cross_tower_ops.chosen) == repr(CANDIDATES(CPUS)[index])
  for a, b in zip(got, reference, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_choose_module_names_the_environment_variable():
  assert _choose.ENVIRONMENT_VARIABLE == ENV
