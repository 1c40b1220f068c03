"""`ParameterServerStrategy`: variables live once, on parameter devices; towers on workers."""

from diststrat._tf import tf
from diststrat import _devices
from diststrat._strategy import DistributionStrategy
from diststrat.strategies import _mirrored
from diststrat.strategies import _tower_threads
from diststrat.values import _wrapped

_POLICIES = ("least_loaded", "round_robin")


class VariablePlacer:
  """Chooses the parameter device of each new variable; deterministic by creation order.

  Args:
    devices: the parameter devices (canonical names).
    policy: "least_loaded" (the device holding the fewest elements so far; ties go to
      the first), "round_robin" (each device in turn), or a callable
      `(name, shape, dtype) -> device` returning one of `devices`.
  """

  def __init__(self, devices, policy):
    if not callable(policy) and policy not in _POLICIES:
      raise ValueError("variable_placement must be 'least_loaded', 'round_robin' or a "
                       "callable (name, shape, dtype) -> device. Received: "
                       f"variable_placement={policy!r}")
    self._devices = tuple(devices)
    self._policy = policy
    self._elements = {d: 0 for d in self._devices}
    self._count = 0

  @property
  def loads(self):
    """Elements placed so far on each device."""
    return dict(self._elements)

  def place(self, name, shape, dtype):
    """Returns the device for a new variable and records its size there."""
    if callable(self._policy):
      chosen = self._policy(name, shape, dtype)
      try:
        device = _devices.canonicalize(chosen)
      except ValueError:
        device = None
      if device not in self._elements:
        raise ValueError(
            f"variable_placement returned {chosen!r} for variable {name!r}; it must return "
            f"one of the parameter devices {list(self._devices)}.")
    elif self._policy == "round_robin":
      device = self._devices[self._count % len(self._devices)]
    else:
      device = min(self._devices, key=lambda d: self._elements[d])  # First on ties.
    self._count += 1
    size = shape.num_elements() if shape.is_fully_defined() else 1
    self._elements[device] += size
    return device


class ParameterServerStrategy(DistributionStrategy):
  """Variables on parameter devices, towers on worker devices.

  Each variable lives once, on one parameter device chosen by `variable_placement`;
  towers run on the worker devices in threads, as in `MirroredStrategy`. `reduce` onto a
  variable sums the towers' values on that variable's device, and `update` runs there,
  so an optimizer's update of a variable happens where the variable lives.

  Args:
    worker_devices: where towers run. Default: the local GPUs, else the local CPU
      devices.
    ps_devices: where variables live. Default: the first local CPU device.
    cluster_spec: reserved for cluster mode (see docs/parameter_server.md).
    task_type: this process's job in the cluster.
    task_id: this process's task index in its job.
    variable_placement: "least_loaded", "round_robin", or a callable
      `(name, shape, dtype) -> device`.
    tower_timeout: seconds a tower may run between pauses (see `MirroredStrategy`).

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.ParameterServerStrategy(worker_devices=["/cpu:0"], ps_devices=["/cpu:0"])
    >>> with s.scope():
    ...   v = tf.Variable([1.0, 2.0])
    >>> type(v).__name__, v.device.endswith("CPU:0")
    ('ResourceVariable', True)
  """

  def __init__(self, worker_devices=None, ps_devices=None, cluster_spec=None,
               task_type="worker", task_id=0, variable_placement="least_loaded",
               tower_timeout=_tower_threads.DEFAULT_TOWER_TIMEOUT):
    super().__init__()
    self._cluster_spec = cluster_spec
    self._task_type = task_type
    self._task_id = task_id
    if cluster_spec is not None:
      raise NotImplementedError("cluster mode is not available yet")
    if worker_devices is None:
      worker_devices = _mirrored.local_devices()
    if ps_devices is None:
      ps_devices = (_devices.canonicalize(tf.config.list_logical_devices("CPU")[0].name),)
    self._worker_devices_tuple = _devices.canonicalize_all(worker_devices)
    self._ps_devices = _devices.canonicalize_all(ps_devices)
    if not self._worker_devices_tuple or not self._ps_devices:
      raise ValueError("ParameterServerStrategy needs at least one worker device and one "
                       f"parameter device. Received: worker_devices={worker_devices!r}, "
                       f"ps_devices={ps_devices!r}")
    self._placer = VariablePlacer(self._ps_devices, variable_placement)
    self._tower_timeout = float(tower_timeout)
    self._reducer = None

  def __repr__(self):
    return (f"ParameterServerStrategy(worker_devices={list(self._worker_devices_tuple)}, "
            f"ps_devices={list(self._ps_devices)})")

  @property
  def placer(self):
    """The `VariablePlacer` (its `loads` shows the elements per parameter device)."""
    return self._placer

  # --- variables ---

  def _create_variable(self, next_creator, kwargs, colocate_with):
    tower = _tower_threads.current_tower(self)
    create = lambda: self._create_placed_variable(next_creator, kwargs, colocate_with)
    if tower is not None:
      return tower.shared_variable(kwargs, create)
    return create()

  def _create_placed_variable(self, next_creator, kwargs, colocate_with):
    kwargs = dict(kwargs)
    if colocate_with is not None:
      device = _wrapped.devices_of(colocate_with)[0]
    else:
      initial_value = kwargs.get("initial_value")
      if callable(initial_value):
        initial_value = initial_value()
      initial_value = tf.convert_to_tensor(initial_value, dtype=kwargs.get("dtype"))
      kwargs["initial_value"] = initial_value
      device = self._placer.place(kwargs.get("name"), initial_value.shape,
                                  initial_value.dtype)
    return self._make_variable(device, next_creator, kwargs)

  def _make_variable(self, device, next_creator, kwargs):
    """Creates the variable on `device` (in-process: a plain tf.Variable there)."""
    with tf.device(device):
      if isinstance(kwargs.get("initial_value"), tf.Tensor):
        kwargs["initial_value"] = tf.identity(kwargs["initial_value"])
      return next_creator(**kwargs)

  # --- towers ---

  def _call_for_each_tower(self, fn, args, kwargs):
    runner = _tower_threads.TowerRunner(self, self._worker_devices_tuple, self._tower_timeout)
    return _wrapped.regroup(runner.run(fn, args, kwargs), self._worker_devices_tuple)

  # --- reductions and updates: the base class's, through _get_cross_tower_ops ---

  def _get_cross_tower_ops(self):
    # Reduce on the first destination: a variable's own device when reducing onto it.
    if self._reducer is None:
      from diststrat import cross_tower_ops  # pylint: disable=g-import-not-at-top
      self._reducer = cross_tower_ops.ReductionToOneDevice()
    return self._reducer

  def _non_slot_devices(self, var_list):
    return min(var_list, key=lambda v: v.name)

  def _read_var(self, v):
    return tf.identity(v)

  # --- devices ---

  def _num_towers(self):
    return len(self._worker_devices_tuple)

  def _worker_devices(self):
    return self._worker_devices_tuple

  def _parameter_devices(self):
    return self._ps_devices
