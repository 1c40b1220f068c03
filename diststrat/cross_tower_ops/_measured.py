"""`MeasuredCrossTowerOps`: the reduction chosen by timing the shipped ones, once.

`MirroredStrategy()` given no `cross_tower_ops` reduces through one of these. The first
time it is asked to reduce a batch of a new kind (the key: the devices, the dtypes, the
total size and the number of tensors, each size rounded up to a power of two), it times
the shipped algorithms that fit the devices, with and without packing, on zeros of the
batch's shapes and dtypes, keeps the fastest, and reduces every later batch of that kind
with it. The choice is process-wide: another strategy on the same devices reuses it.

The measurement runs eagerly: a first reduction inside a `tf.function` being traced steps
out of the trace (`tf.init_scope`), times the candidates, and then adds the chosen one's
ops to the trace. It is bounded (`measurement_budget`): at most `MAX_SECONDS`, and inside
a step (`call_for_each_tower`) at most `FRACTION` of the time the step has taken so far,
a lower bound of the first call's time. The candidates are timed in order of preference
(the instant heuristic's pick first); those that do not fit the budget are not timed, so
a tight budget leaves the heuristic's pick. A budget below `MIN_SECONDS` times nothing:
the heuristic's pick reduces that batch, and the choice is left open for a later first
call with a larger budget (a short first step inside `tf.function` is traced once, so
for small models the heuristic's pick is what runs). The choice and the timings are logged once at
INFO on the "diststrat" logger.

Results do not depend on the choice beyond rounding: every candidate adds the same values,
but in its own order, so float sums can differ in their last bits between two processes
that chose differently. Pin the algorithm (argument or `DISTSTRAT_CROSS_TOWER_OPS`) where
runs must be bitwise reproducible.
"""

import logging
import math
import threading
import time
from typing import Any, Callable, Optional, Sequence

from diststrat._tf import tf
from diststrat import _devices
from diststrat.cross_tower_ops import _base
from diststrat.cross_tower_ops._all_reduce import AllReduceCrossTowerOps
from diststrat.cross_tower_ops._one_device import ReductionToOneDevice
from diststrat.values import _wrapped

logger = logging.getLogger("diststrat")

MAX_SECONDS = 1.0  # The measurement never takes longer than this (per kind of batch).
FRACTION = 0.1  # Inside a step: at most this fraction of the step's time so far.
MIN_SECONDS = 0.05  # Below this budget nothing is timed: one candidate's trace and runs
# could overrun it, so the heuristic's pick reduces, and the next first call of that
# kind with a larger budget measures.
TIMED_ROUNDS = 3  # Timed calls per candidate, interleaved, after one untimed warm-up.

# key -> (chosen ops, {repr of candidate: best seconds}); process-wide, guarded by _lock.
_choices: dict[Any, tuple[Any, dict[str, float]]] = {}
_lock = threading.RLock()


def candidates_for(devices: Sequence[str]) -> list[_base.CrossTowerOps]:
  """The shipped reductions that fit `devices`, in order of preference.

  Several GPUs: NCCL first; anything else: `"naive"` first (the heuristic's pick), then
  the other all-reduce algorithms and `ReductionToOneDevice`, each all-reduce also with
  packing (one chunk per device). `"collective"` comes last on CPUs: measured the slowest
  there, and the most expensive to set up.
  """
  devices = _devices.canonicalize_all(devices)
  packs = max(2, len(devices))
  gpus = len(devices) > 1 and all(_devices.device_type(d) == "GPU" for d in devices)
  if gpus:
    algorithms = ["nccl", "hierarchical_copy", "naive"]
  else:
    algorithms = ["naive", "hierarchical_copy", "collective"]
  found: list[_base.CrossTowerOps] = [AllReduceCrossTowerOps(algorithms[0])]
  found += [ReductionToOneDevice()]
  found += [AllReduceCrossTowerOps(a) for a in algorithms[1:]]
  found += [AllReduceCrossTowerOps(a, num_packs=packs) for a in algorithms]
  if not gpus:  # The collective last: slowest on CPUs, and costly to start.
    found.sort(key=lambda ops: getattr(ops, "algorithm", "") == "collective")
  return found


def measurement_budget(step_started: Optional[float]) -> float:
  """Seconds the measurement may take: `MAX_SECONDS`, and inside a step (which started at
  `step_started`, a `time.perf_counter()` value) `FRACTION` of the step's time so far."""
  if step_started is None:
    return MAX_SECONDS
  return min(MAX_SECONDS, FRACTION * max(0.0, time.perf_counter() - step_started))


def clear_choices() -> None:
  """Forgets every choice made in this process (tests; a changed machine)."""
  with _lock:
    _choices.clear()


class MeasuredCrossTowerOps(_base.CrossTowerOps):
  """Reduces with the shipped algorithm that measured fastest for the devices and sizes.

  `MirroredStrategy()` uses one when given no `cross_tower_ops` (and
  `DISTSTRAT_CROSS_TOWER_OPS` is unset or `auto`). Each kind of batch (devices, dtypes,
  total bytes and tensor count, rounded up to powers of two) is measured once per
  process, then reduced with its choice: see the module docstring and
  docs/cross_tower_ops.md ("The default: measured").

  Args:
    devices: the devices whose reductions this chooses for (the candidates fit them).
    candidates: the `CrossTowerOps` to choose from, in order of preference. Default:
      `candidates_for(devices)`.
    budget: a callable returning the seconds the measurement may take, asked when it
      starts. Default: `measurement_budget(None)` (`MAX_SECONDS`).

  Example:
    >>> import tensorflow as tf
    >>> from diststrat.cross_tower_ops._measured import MeasuredCrossTowerOps
    >>> from diststrat.values import PerDevice
    >>> ops = MeasuredCrossTowerOps(["/cpu:0", "/cpu:1"])
    >>> x = PerDevice({"/cpu:0": tf.constant(1.0), "/cpu:1": tf.constant(3.0)})
    >>> [float(v) for v in ops.reduce("sum", x).values]
    [4.0, 4.0]
    >>> ops.chosen is not None
    True
  """

  def __init__(self, devices: Sequence[str],
               candidates: Optional[Sequence[_base.CrossTowerOps]] = None,
               budget: Optional[Callable[[], float]] = None) -> None:
    super().__init__()
    self._devices = _devices.canonicalize_all(devices)
    self._candidates = list(candidates) if candidates is not None else None
    self._budget = budget or (lambda: measurement_budget(None))
    self._chosen: Optional[_base.CrossTowerOps] = None
    self._heuristic: Optional[_base.CrossTowerOps] = None

  @property
  def chosen(self) -> Optional[_base.CrossTowerOps]:
    """The `CrossTowerOps` that did the last reduction (None before the first)."""
    return self._chosen

  @property
  def candidates(self) -> list[_base.CrossTowerOps]:
    if self._candidates is None:
      self._candidates = candidates_for(self._devices)
    return self._candidates

  def __repr__(self):
    if len(self._devices) == 1:
      return "MeasuredCrossTowerOps(one device: nothing to reduce)"
    return f"MeasuredCrossTowerOps(chosen={self._chosen!r})"

  def _run(self, kind, aggregation, items):
    return self._ops_for(kind, aggregation, items)._run(kind, aggregation, items)

  def _reduce(self, aggregation, per_device_value, destinations):  # Unused: _run delegates.
    return self._ops_for("reduce", aggregation, [(per_device_value, destinations)])._reduce(
        aggregation, per_device_value, destinations)

  def _first_candidate(self):
    if self._heuristic is None:
      self._heuristic = self.candidates[0]
    return self._heuristic

  def _ops_for(self, kind, aggregation, items):
    """The ops to reduce `items` with: the cached choice for their kind, else measured."""
    if kind == "broadcast":
      return self._chosen or self._first_candidate()
    dense = [(v, d) for v, d in items
             if len(v) > 1 and not any(isinstance(c, tf.IndexedSlices) for c in v.values)]
    if not dense:  # Nothing an algorithm reduces: any does.
      return self._chosen or self._first_candidate()
    key = _key(dense, self.candidates)
    with _lock:
      entry = _choices.get(key)
      if entry is None:
        budget = self._budget()
        if budget < MIN_SECONDS:  # Too little time to time anything: not chosen yet.
          self._chosen = self._first_candidate()
          return self._chosen
        entry = self._measure(aggregation, dense, budget)
        _choices[key] = entry
    self._chosen = entry[0]
    return entry[0]

  def _measure(self, aggregation, dense, budget):
    """Times the candidates on zeros shaped like `dense`, eagerly, within `budget`
    seconds; (fastest, timings)."""
    started = time.perf_counter()
    with tf.init_scope():  # Eagerly, also when called while a tf.function is traced.
      zeros = [(_zeros_like(value), destinations) for value, destinations in dense]
      timings, skipped = _time_candidates(self.candidates, aggregation, zeros, started,
                                          budget)
    if timings:
      best = min(timings, key=lambda i: timings[i])
      chosen = self.candidates[best]
    else:
      chosen = self.candidates[0]
    spent = time.perf_counter() - started
    shown = {repr(self.candidates[i]): round(seconds, 6) for i, seconds in timings.items()}
    logger.info(
        "diststrat chose %r to reduce %d tensor(s) (%s, %d bytes per device) on %s, in "
        "%.3f s of a %.3f s budget. Best seconds per batch: %s.%s Pin it with "
        "MirroredStrategy(cross_tower_ops=...) or DISTSTRAT_CROSS_TOWER_OPS.",
        chosen, len(dense), ", ".join(sorted({v.primary.dtype.name for v, _ in dense})),
        _bytes(dense), list(dense[0][0].devices), spent, budget, shown,
        f" Not timed (budget): {[repr(self.candidates[i]) for i in skipped]}."
        if skipped else "")
    return chosen, shown


def _time_candidates(candidates, aggregation, zeros, started, budget):
  """({candidate index: best seconds}, indices the budget left out).

  Each candidate is called once untimed (its trace and set-up) and once timed; then
  `TIMED_ROUNDS - 1` more timed rounds run, interleaved over the candidates so that drift
  hits them alike. A candidate starts only if the time it is expected to take (the last
  one's warm-up and rounds) still fits the budget; one that fails (a device it does not
  suit) is left out. The first candidate is always timed.
  """
  def elapsed():
    return time.perf_counter() - started

  timings, skipped, estimate = {}, [], 0.0
  for i, ops in enumerate(candidates):
    if timings and elapsed() + estimate > budget:
      skipped.append(i)
      continue
    t0 = time.perf_counter()
    try:
      ops.batch_reduce(aggregation, zeros)
    except (tf.errors.OpError, ValueError, TypeError, NotImplementedError) as e:
      logger.debug("diststrat: %r cannot reduce here (%s); not a candidate.", ops, e)
      continue
    warm = time.perf_counter() - t0
    t1 = time.perf_counter()
    ops.batch_reduce(aggregation, zeros)
    timings[i] = time.perf_counter() - t1
    estimate = max(estimate, warm + TIMED_ROUNDS * timings[i])
  for _ in range(TIMED_ROUNDS - 1):
    for i in list(timings):
      if elapsed() > budget:
        return timings, skipped
      t0 = time.perf_counter()
      candidates[i].batch_reduce(aggregation, zeros)
      timings[i] = min(timings[i], time.perf_counter() - t0)
  return timings, skipped


def _zeros_like(value):
  """A `PerDevice` of zeros with `value`'s shapes (unknown dimensions: 1) and dtypes."""
  index = {}
  for device, component in zip(value.devices, value.values, strict=True):
    shape = [1 if d is None else d for d in component.shape.as_list()] \
        if component.shape.rank is not None else [1]
    with tf.device(device):
      index[device] = tf.zeros(shape, component.dtype)
  return _wrapped.PerDevice(index)


def _bytes(dense):
  total = 0
  for value, _ in dense:
    component = value.primary
    elements = component.shape.num_elements() if component.shape.is_fully_defined() else 1
    total += elements * component.dtype.size
  return total


def _bucket(n):
  """`n` rounded up to a power of two (0 stays 0)."""
  return 0 if n <= 0 else 1 << math.ceil(math.log2(n))


def _key(dense, candidates):
  devices = tuple(dense[0][0].devices)
  same_places = all(tuple(v.devices) == tuple(d) for v, d in dense)
  dtypes = tuple(sorted({v.primary.dtype.name for v, _ in dense}))
  return (devices, same_places, dtypes, _bucket(_bytes(dense)), _bucket(len(dense)),
          tuple(repr(c) for c in candidates))
