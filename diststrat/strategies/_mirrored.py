"""`MirroredStrategy`: data parallelism over the devices of one machine."""

import threading
import time
from typing import Any, Optional, Sequence

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _devices
from diststrat.errors import keeps_errors_in_tf_function
from diststrat import cross_tower_ops
from diststrat.cross_tower_ops import _choose
from diststrat.cross_tower_ops import _measured
from diststrat._strategy import DistributionStrategy
from diststrat.strategies import _tower_threads
from diststrat.values import _variables
from diststrat.values import _wrapped


def create_copies(next_creator, kwargs, devices):
  """Creates one variable per device from one initial value, computed once.

  Random initializers therefore give every copy the same value. Copies after the first
  are named `<name>/tower_<i>`.
  """
  kwargs = dict(kwargs)
  with tf.device(devices[0]):
    initial_value = _arguments.initial_value_tensor(kwargs)
  copies = {}
  for i, device in enumerate(devices):
    with tf.device(device):
      if i == 0:
        kwargs["initial_value"] = initial_value
      else:
        kwargs["initial_value"] = tf.identity(initial_value)
        kwargs["name"] = f"{copies[devices[0]].name.split(':')[0]}/tower_{i}/"
      copies[device] = next_creator(**kwargs)
  return copies


def make_distributed_variable(copies, kwargs, strategy):
  """Wraps per-device copies as a MirroredVariable, or a TowerLocalVariable for ON_READ."""
  synchronization = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
  aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
  if aggregation is None:
    aggregation = tf.VariableAggregation.NONE
  if synchronization == tf.VariableSynchronization.ON_READ:
    return _variables.TowerLocalVariable(copies, aggregation, strategy)
  return _variables.MirroredVariable(copies, aggregation, strategy)


def check_variable_kwargs(kwargs):
  synchronization = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
  aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
  if synchronization == tf.VariableSynchronization.ON_READ and aggregation not in (
      tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN):
    raise ValueError(
        "A tower-local variable (synchronization=ON_READ) needs aggregation SUM or MEAN, "
        f"to know how to combine the towers' copies on read. Received: "
        f"aggregation={aggregation!r}, name={kwargs.get('name')!r}")


def _check_cross_tower_ops(value):
  """`value` if it is None or a `CrossTowerOps`, else raises `TypeError` naming the fix."""
  if value is None or isinstance(value, cross_tower_ops.CrossTowerOps):
    return value
  hint = ""
  if isinstance(value, str):
    hint = f" For an all-reduce algorithm by name, pass AllReduceCrossTowerOps({value!r})."
  raise TypeError(
      "cross_tower_ops must be a diststrat.cross_tower_ops.CrossTowerOps (such as "
      "AllReduceCrossTowerOps(\"naive\") or ReductionToOneDevice()), or None to choose "
      f"one by measurement. Received: cross_tower_ops={value!r} ({type(value).__name__})."
      f"{hint}")


def _step_budget(step):
  """The budget of the default reduction's measurement, for a strategy whose `step` (a
  `threading.local`) holds when its outermost call started: at most 1 s, and inside a
  step 10% of the step's time so far (`_measured.measurement_budget`).

  It holds the strategy's `step`, not the strategy: the strategy holds its reduction,
  which holds this, and a cycle through them would free a dropped strategy only at a
  later garbage collection than its model.
  """
  return lambda: _measured.measurement_budget(getattr(step, "started", None))


class MirroredStrategy(DistributionStrategy):
  """Data parallelism on the devices of one machine, variables mirrored on each.

  `call_for_each_tower` runs the model function once per device, each tower in its own
  thread (stepped one at a time, so runs are deterministic); `merge_call` pauses the
  towers and runs a function once with all their values. Variables created in `scope()`
  are `MirroredVariable`s: one copy per device, kept equal by `update`.

  Args:
    devices: the devices to run towers on. Default: all local GPUs, else all local CPU
      devices.
    cross_tower_ops: a `diststrat.cross_tower_ops.CrossTowerOps` that does reductions,
      used as it is. Default: the one `DISTSTRAT_CROSS_TOWER_OPS` names (`naive`,
      `hierarchical_copy`, `collective`, `nccl`, optionally `:<num_packs>`, or
      `one_device`), else measured: the first reduction of each kind of batch times the
      shipped algorithms that fit the devices, with and without packing, once per
      process, and keeps the fastest (`strategy.cross_tower_ops.chosen` shows it after
      the first step). docs/cross_tower_ops.md, "The default: measured".
    tower_timeout: seconds a tower may run between two pauses (merge_call or return)
      before the call fails with an error naming the tower; a guard against hangs.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.MirroredStrategy(["/cpu:0"])
    >>> with s.scope():
    ...   v = tf.Variable(2.0)
    ...   out = s.call_for_each_tower(lambda: v * 3.0)
    ...   float(s.reduce("sum", out).primary)
    6.0
  """

  @keeps_errors_in_tf_function
  def __init__(self, devices: Optional[Sequence[str]] = None,
               cross_tower_ops: Optional[Any] = None,
               tower_timeout: float = _tower_threads.DEFAULT_TOWER_TIMEOUT) -> None:
    super().__init__()
    tower_timeout = _arguments.seconds("tower_timeout", tower_timeout, allow_none=False)
    if devices is None:
      devices = _devices.local_devices()
    devices = _devices.canonicalize_all(devices)
    if not devices:
      raise ValueError("MirroredStrategy needs at least one device. Received: devices=[]")
    self._devices = self._check_devices(devices)
    self._step = threading.local()  # started: perf_counter() at the outermost call's start
    if cross_tower_ops is None:  # A bad DISTSTRAT_CROSS_TOWER_OPS is refused here.
      cross_tower_ops = _choose.default_cross_tower_ops(self._devices,
                                                        _step_budget(self._step))
    self._cross_tower_ops = _check_cross_tower_ops(cross_tower_ops)
    self._tower_timeout = tower_timeout

  def _check_devices(self, devices):
    """`devices` if they all exist here (a subclass may check them later), else raises."""
    return _devices.check_exist(devices, "devices")

  def __repr__(self):
    return f"MirroredStrategy(devices={list(self._devices)})"

  @property
  def cross_tower_ops(self) -> "cross_tower_ops.CrossTowerOps":
    """The `CrossTowerOps` that does this strategy's reductions: the one given, or by
    default a `MeasuredCrossTowerOps` whose `.chosen` (and repr) shows the algorithm it
    measured fastest, after the first reduction."""
    return self._get_cross_tower_ops()

  def _get_cross_tower_ops(self):
    return self._cross_tower_ops

  # --- variables ---

  def _create_variable(self, next_creator, kwargs, colocate_with):
    check_variable_kwargs(kwargs)
    tower = _tower_threads.current_tower(self)
    if tower is not None:
      return tower.shared_variable(kwargs, lambda: self._create_distributed_variable(
          next_creator, kwargs, colocate_with))
    return self._create_distributed_variable(next_creator, kwargs, colocate_with)

  def _create_distributed_variable(self, next_creator, kwargs, colocate_with):
    if colocate_with is None:
      devices = self._devices
    else:
      devices = _wrapped.devices_of(colocate_with)
    return make_distributed_variable(create_copies(next_creator, kwargs, devices), kwargs,
                                     self)

  # --- towers ---

  def _call_for_each_tower(self, fn, args, kwargs):
    outermost = getattr(self._step, "started", None) is None
    if outermost:
      self._step.started = time.perf_counter()
    try:
      runner = _tower_threads.TowerRunner(self, self._devices, self._tower_timeout)
      return _wrapped.regroup(runner.run(fn, args, kwargs), self._devices)
    finally:
      if outermost:
        self._step.started = None

  # --- reductions and updates: the base class's, through _get_cross_tower_ops ---

  def _non_slot_devices(self, var_list):
    return self._devices

  def _read_var(self, v):
    return tf.identity(v.read_value())

  # --- devices ---

  def _num_towers(self):
    return len(self._devices)

  def _worker_devices(self):
    return self._devices

  def _parameter_devices(self):
    return self._devices
