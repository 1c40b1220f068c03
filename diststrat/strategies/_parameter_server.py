"""`ParameterServerStrategy`: variables live once, on parameter devices; towers on workers."""

from typing import Any, Callable, Optional, Sequence, Union

import itertools
import numbers

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _context
from diststrat import _devices
from diststrat import cross_tower_ops
from diststrat import errors
from diststrat._strategy import DistributionStrategy
from diststrat._cluster_runtime import _cluster_spec
from diststrat._cluster_runtime.parameter_server import _read_cache
from diststrat.strategies import _ps_backends
from diststrat.strategies import _tower_threads
from diststrat.values import _variables
from diststrat.values import _wrapped

_POLICIES = ("least_loaded", "round_robin")

DEFAULT_STEP_TIMEOUT = 300.0
"""Seconds a cluster step (`run_step`, connecting, creating a variable) may take."""


def _check_cache_reads(value, in_cluster):
  if not isinstance(value, bool):
    raise ValueError(f"cache_reads must be True, False or None (the default: True in "
                     f"cluster mode). Received: cache_reads={value!r}")
  if value and not in_cluster:
    raise ValueError(
        "cache_reads=True applies to cluster mode only: in one process the variables "
        "are plain tf.Variables on local devices, read where they are used. "
        "Received: cache_reads=True without cluster_spec. Pass cluster_spec to run as "
        "a worker of a cluster, or leave cache_reads unset.")


def _check_max_bytes(value):
  if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                            or value <= 0):
    raise ValueError("cache_reads_max_bytes must be a positive number of bytes, or None "
                     f"for no limit. Received: cache_reads_max_bytes={value!r}")
  return None if value is None else int(value)


def _check_placement(policy):
  if not callable(policy) and not isinstance(policy, str):
    raise TypeError("variable_placement must be 'least_loaded', 'round_robin' or a "
                    "callable (name, shape, dtype) -> device. Received: "
                    f"variable_placement={policy!r} of type {type(policy).__name__}")
  if not callable(policy) and policy not in _POLICIES:
    raise ValueError("variable_placement must be 'least_loaded', 'round_robin' or a "
                     "callable (name, shape, dtype) -> device. Received: "
                     f"variable_placement={policy!r}")


class VariablePlacer:
  """Chooses the parameter device of each new variable; deterministic by creation order.

  Args:
    devices: the parameter devices (canonical names).
    policy: "least_loaded" (the device holding the fewest elements so far; ties go to
      the first), "round_robin" (each device in turn), or a callable
      `(name, shape, dtype) -> device` returning one of `devices`; `name` is the name
      the variable gets (with its name scope, without ":0").
  """

  def __init__(self, devices, policy):
    _check_placement(policy)
    self._devices = tuple(devices)
    self._policy = policy
    self._elements = {d: 0 for d in self._devices}
    self._count = 0

  @property
  def loads(self) -> dict[str, int]:
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


class ParameterServerStrategy(_cluster_spec.ClusterTaskMixin, DistributionStrategy):
  """Variables on parameter devices, towers on worker devices.

  Each variable lives once, on one parameter device chosen by `variable_placement`;
  towers run on the worker devices in threads, as in `MirroredStrategy`. `reduce` onto a
  variable sums the towers' values on that variable's device, and `update` runs there,
  so an optimizer's update of a variable happens where the variable lives.

  With `cluster_spec`, this process is one worker task of a cluster whose parameter
  servers are TensorFlow gRPC servers (`tf.distribute.Server`) in their own processes:
  the strategy connects to them, variables live on `/job:ps/replica:0/task:i/device:CPU:0`
  and are shared by name with every other worker process (a variable that already
  exists keeps its value), and towers run on this task's GPUs, else its CPU. Run each
  training step with `run_step`: a dead or frozen PS task then raises `ClusterError`
  naming it within `step_timeout`. Each `call_for_each_tower` reads each PS variable over
  the network once, not once per use (`cache_reads`). See docs/parameter_server.md.

  Args:
    worker_devices: where towers run. Default: the local GPUs, else the local CPU
      devices (in cluster mode: this task's GPUs, else its CPU:0).
    ps_devices: where variables live. Default: the first local CPU device. Not allowed
      with `cluster_spec`, which names the PS tasks.
    cluster_spec: {"ps": ["host:port", ...], "worker": ["host:port", ...]} (or a
      `tf.train.ClusterSpec`) to run as one worker task of that cluster. None (and no
      `ps_devices`): the cluster of the `TF_CONFIG` environment variable if set
      (`diststrat-run` sets it), else of a Slurm step
      (`diststrat.cluster.cluster_from_slurm`), else this process alone.
    task_type: this process's job in the cluster (from the environment when the
      cluster is).
    task_id: this process's task index in its job (likewise).
    variable_placement: "least_loaded", "round_robin", or a callable
      `(name, shape, dtype) -> device`.
    tower_timeout: seconds a tower may run between pauses (see `MirroredStrategy`).
    step_timeout: cluster mode: seconds a step run by `run_step` (or connecting, or
      creating a variable) may take before it is abandoned with `ClusterError`; None
      for no limit. Settable later as `strategy.step_timeout`.
    cache_reads: cluster mode: whether a `call_for_each_tower` reads each PS variable
      once, onto this worker's CPU, and serves every use in its towers from that value
      (until a `merge_call` or a write to the variable; see docs/parameter_server.md).
      None (the default) means True in cluster mode and False in one process, where
      caching does not apply. Settable later as `strategy.cache_reads`.
    cache_reads_max_bytes: variables larger than this many bytes are not cached but
      read where they are used; None for no limit.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.ParameterServerStrategy(worker_devices=["/cpu:0"], ps_devices=["/cpu:0"])
    >>> with s.scope():
    ...   v = tf.Variable([1.0, 2.0])
    >>> type(v).__name__, v.device.endswith("CPU:0")
    ('ResourceVariable', True)

  In a worker process of a cluster (see `diststrat.cluster.LocalCluster`)::

      s = ds.ParameterServerStrategy(cluster_spec={"ps": ["127.0.0.1:2222"],
                                                   "worker": ["127.0.0.1:2223"]},
                                     task_type="worker", task_id=0, step_timeout=60)
      with s.scope():
        w = tf.Variable(tf.zeros([784, 10]))   # on /job:ps/replica:0/task:0/device:CPU:0
      loss = s.run_step(train_step, batch)     # ClusterError if a PS task dies or freezes
  """

  def __init__(self, worker_devices: Optional[Sequence[str]] = None,
               ps_devices: Optional[Sequence[str]] = None,
               cluster_spec: Optional[Any] = None, task_type: str = "worker",
               task_id: int = 0,
               variable_placement: Union[str, Callable[..., str]] = "least_loaded",
               tower_timeout: float = _tower_threads.DEFAULT_TOWER_TIMEOUT,
               step_timeout: Optional[float] = DEFAULT_STEP_TIMEOUT,
               cache_reads: Optional[bool] = None,
               cache_reads_max_bytes: Optional[int] = _read_cache.DEFAULT_MAX_BYTES) -> None:
    super().__init__()
    step_timeout = _arguments.seconds("step_timeout", step_timeout)
    tower_timeout = _arguments.seconds("tower_timeout", tower_timeout, allow_none=False)
    if cluster_spec is not None and ps_devices is not None:
      raise ValueError(
          "ps_devices cannot be given with cluster_spec: in cluster mode the parameter "
          "devices are the CPUs of the 'ps' tasks of the spec. Received: "
          f"ps_devices={ps_devices!r}")
    config = None
    if ps_devices is None:  # Else one process, whatever the environment says.
      config = _cluster_spec.resolve_cluster(cluster_spec, task_type, task_id,
                                             role="parameter_server")
    if cache_reads is None:
      cache_reads = config is not None
    _check_cache_reads(cache_reads, in_cluster=config is not None)
    self._cache_reads = cache_reads
    self._cache_reads_max_bytes = _check_max_bytes(cache_reads_max_bytes)
    _check_placement(variable_placement)  # Before connecting to a cluster.
    self._last_read_cache_stats: Optional[dict[str, int]] = None
    self._steps = itertools.count(1)
    self._backend: Union[_ps_backends.LocalBackend, _ps_backends.ClusterBackend]
    if config is None:
      self._task_type, self._task_id = task_type, task_id
      self._backend = _ps_backends.LocalBackend(worker_devices, ps_devices)
    else:
      self._cluster_spec = config.cluster_spec
      self._task_type, self._task_id = config.task_type, config.task_id
      # Started with its PS tasks (Slurm, Kubernetes, the launcher): let them start.
      self._backend = _ps_backends.ClusterBackend(
          config, worker_devices, step_timeout, wait_for_ps=config.source != "arguments",
          default_timeout=DEFAULT_STEP_TIMEOUT)
    self._worker_devices_tuple = self._backend.worker_devices
    self._ps_devices = self._backend.ps_devices
    if not self._worker_devices_tuple or not self._ps_devices:
      raise ValueError("ParameterServerStrategy needs at least one worker device and one "
                       f"parameter device. Received: worker_devices={worker_devices!r}, "
                       f"ps_devices={ps_devices!r}")
    self._placer = VariablePlacer(self._ps_devices, variable_placement)
    self._tower_timeout = tower_timeout
    # Reduces on the first destination: a variable's own device when reducing onto it.
    self._reducer = cross_tower_ops.ReductionToOneDevice()

  def __repr__(self):
    return f"ParameterServerStrategy({self._backend.describe()})"

  @property
  def is_chief(self) -> bool:
    """True in the process that should write checkpoints and summaries.

    In a cluster: worker task 0 (task 0 of a "chief" job if the spec has one), as
    `MultiWorkerMirroredStrategy.is_chief`. In one process (no cluster): True.

    Example:
      >>> import diststrat as ds
      >>> ds.ParameterServerStrategy(worker_devices=["/cpu:0"], ps_devices=["/cpu:1"]).is_chief
      True
    """
    return _cluster_spec.is_chief_task(self._cluster_spec, self._task_type, self._task_id)

  @property
  def placer(self) -> "VariablePlacer":
    """The `VariablePlacer` (its `loads` shows the elements per parameter device)."""
    return self._placer

  # --- cluster mode ---

  @property
  def cache_reads(self) -> bool:
    """Whether each `call_for_each_tower` reads each PS variable once (cluster mode).

    Settable; a `tf.function` traced before keeps the reads it traced.
    """
    return self._cache_reads

  @cache_reads.setter
  def cache_reads(self, value: Optional[bool]) -> None:
    if value is None:
      value = self._backend.in_cluster
    _check_cache_reads(value, in_cluster=self._backend.in_cluster)
    self._cache_reads = value

  @property
  def last_read_cache_stats(self) -> Optional[dict[str, int]]:
    """What the read cache of the last `call_for_each_tower` did, for debugging.

    A dict: `fills` (variables read from a PS), `hits` (uses served from a value read
    before), `invalidations` (values dropped by `merge_call`s and writes),
    `too_large` (reads of variables over `cache_reads_max_bytes`, or not numeric) and
    `other_graph` (reads in a nested graph or under `tf.init_scope`), counted while the
    towers run: per call eagerly, per trace in a `tf.function`. None when the last call
    did not cache reads.
    """
    return None if self._last_read_cache_stats is None else dict(self._last_read_cache_stats)

  @property
  def step_timeout(self) -> Optional[float]:
    """Cluster mode: seconds a `run_step` step may take before `ClusterError` (or None)."""
    return self._backend.step_timeout()

  @step_timeout.setter
  def step_timeout(self, seconds: Optional[float]) -> None:
    self._backend.set_step_timeout(self, seconds)

  def run_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs one training step, `fn(*args, **kwargs)`, and returns its result.

    In cluster mode the step runs under the watchdog: in a helper thread that the
    calling thread waits for at most `step_timeout` seconds. A PS task that died or
    restarted makes the step raise `diststrat.errors.ClusterError` naming the task
    (within a fraction of a second: the failed op, then asking each task which one failed); a PS task
    that stops answering (frozen) makes it raise `ClusterError` naming that task after
    `step_timeout`, with a warning on the "diststrat" logger, and the blocked step is
    abandoned. `fn` runs in this strategy's
    scope if the caller is in it, under the caller's device and name scope. Call it
    from the cross-tower context or outside any strategy; `fn` is typically a
    `tf.function` that calls `call_for_each_tower`.

    In cluster mode the step returns once the writes it sent to the PS tasks are done
    (a `tf.function` returns before its remote writes ran): a step that returned has
    applied its updates.

    In one process (no cluster_spec), it is `fn(*args, **kwargs)`.

    Example::

        @tf.function
        def step(x, y):
          return strategy.call_for_each_tower(tower_fn, x, y)

        for x, y in batches:
          loss = strategy.run_step(step, x, y)

    Raises:
      ClusterError: a PS task died, restarted or froze during the step.
      ContextError: called from a tower context.
    """
    mode = _context.current_mode()
    if mode.tower_context is not None and not _context.in_default_context():
      raise errors.ContextError(
          f"run_step() of {self!r} was called in {_context.describe_current_context()}; "
          "it runs a whole step, so call it from the cross-tower context or outside any "
          "strategy, and call call_for_each_tower() inside the step.")
    name = getattr(fn, "__name__", type(fn).__name__)
    return self._backend.step(f"step {next(self._steps)} ({name})", fn, *args, **kwargs)

  def _guarded(self, what, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`; in cluster mode, eagerly, bounded by `step_timeout`."""
    return self._backend.guarded(what, fn, *args, **kwargs)

  def reconnect(self) -> None:
    """Connects this worker to the cluster again, after a PS task was restarted.

    A restarted PS task starts empty, and TensorFlow refuses to talk to it over the old
    connection (steps raise `ClusterError` saying it restarted). After `reconnect()`,
    the variables this strategy made (and `tf.function`s that use them) work again, on
    the restarted task's fresh variables: restore the last `tf.train.Checkpoint` before
    training on. Variables on tasks that did not restart keep their values.

    Example::

        except diststrat.errors.ClusterError:
          cluster.restart("ps", 0)          # or your job scheduler restarts it
          strategy.reconnect()
          checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))

    Raises:
      ValueError: the strategy is not in cluster mode.
      ClusterError: a PS task still cannot be reached within `step_timeout`.
    """
    self._backend.reconnect(self)

  # --- variables ---

  def _create_variable(self, next_creator, kwargs, colocate_with):
    tower = _tower_threads.current_tower(self)
    create = lambda: self._create_placed_variable(next_creator, kwargs, colocate_with)
    if tower is not None:
      return tower.shared_variable(kwargs, create)
    return create()

  def _create_placed_variable(self, next_creator, kwargs, colocate_with):
    with self._backend.creation_scope():
      kwargs = dict(kwargs)
      if self._backend.keeps_tower_local_variables() and \
          kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
        return self._create_worker_local_variable(next_creator, kwargs)
      if colocate_with is not None:
        device = _wrapped.devices_of(colocate_with)[0]
      else:
        kwargs["initial_value"] = _arguments.initial_value_tensor(kwargs)
        # In cluster mode the name is the unique shared name (`w_1` for a second `w`).
        device = self._placer.place(self._backend.reserve_name(kwargs),
                                    kwargs["initial_value"].shape, kwargs["initial_value"].dtype)
      return self._wrap_if_written_in_towers(
          self._make_variable(device, next_creator, kwargs), device, kwargs)

  def _create_worker_local_variable(self, next_creator, kwargs):
    """A tower-local variable (ON_READ: Keras metrics) of this worker process, in cluster mode.

    Its state is this worker's, as under tf.distribute: shared on a PS task, another
    worker's resets and updates would land in this worker's metrics (docs/parameter_server.md).
    It is a plain variable on this worker's first device, written by every tower (the
    towers' values add up, as a parameter-device variable's do in one process), never
    shared with the other workers, and saved by checkpoints as this worker's value.
    """
    with tf.device(self._worker_devices_tuple[0]):
      kwargs["initial_value"] = _arguments.initial_value_tensor(kwargs)
      return _variables.mark_created_by(next_creator(**kwargs), self)

  def _wrap_if_written_in_towers(self, variable, device, kwargs):
    """`variable`, or a one-copy `MirroredVariable` of it if towers write it as one.

    Towers write a variable with an aggregation (such as a Keras optimizer's step
    counter, ONLY_FIRST_REPLICA) and Keras's non-trainable state (batch normalization's
    moving statistics, random seed states): wrapped, their tower writes are merged and
    applied once per step, as under `MirroredStrategy`, instead of once per tower. Other
    variables stay plain `tf.Variable`s on their parameter device.
    """
    aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
    on_read = kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
    merged_state = (_variables.rules_for_new_variable().merges_tower_writes
                    and kwargs.get("trainable") is False)
    if not on_read and (aggregation != tf.VariableAggregation.NONE or merged_state):
      return _variables.MirroredVariable({device: variable}, aggregation, self)
    return _variables.mark_created_by(variable, self)

  def _make_variable(self, device, next_creator, kwargs):
    """Creates the variable on `device`.

    In one process, a plain tf.Variable there; in cluster mode, a `SharedVariable` on
    that PS device, shared by name with the other workers.
    """
    return self._backend.make_variable(device, next_creator, kwargs)

  # --- towers ---

  def _call_for_each_tower(self, fn, args, kwargs):
    return self._guarded("call_for_each_tower()", self._run_towers, fn, args, kwargs)

  def _new_read_cache(self):
    """The `ReadCache` of one `call_for_each_tower` call, or None if reads are not cached."""
    if not self._cache_reads:
      return None
    return self._backend.new_read_cache(self._cache_reads_max_bytes)

  def _run_towers(self, fn, args, kwargs):
    cache = self._new_read_cache()
    runner = _tower_threads.TowerRunner(self, self._worker_devices_tuple, self._tower_timeout,
                                        step_cache=cache)
    try:
      results = runner.run(fn, args, kwargs)
    finally:
      if cache is not None:
        cache.close()
      self._last_read_cache_stats = None if cache is None else cache.stats
    return _wrapped.regroup(results, self._worker_devices_tuple)

  # In cluster mode, each cross-tower operation called eagerly is bounded by step_timeout
  # and reports a dead or frozen PS task as ClusterError (see _guarded).

  def _reduce(self, aggregation, value, destinations):
    return self._guarded("reduce()", super()._reduce, aggregation, value, destinations)

  def _batch_reduce(self, aggregation, value_destination_pairs):
    return self._guarded("batch_reduce()", super()._batch_reduce, aggregation,
                         value_destination_pairs)

  def _broadcast(self, tensor, destinations):
    return self._guarded("broadcast()", super()._broadcast, tensor, destinations)

  def _update(self, var, fn, args, kwargs):
    result = self._guarded(f"update() of {var.name}", super()._update, var, fn, args, kwargs)
    if tf.executing_eagerly():  # A one-copy MirroredVariable (an aggregation): its copy.
      copies = var.values if isinstance(var, _variables.DistributedVariable) else (var,)
      for copy in copies:
        self._backend.wrote_eagerly(copy)
    return result

  def _update_non_slot(self, colocate_with, fn, args, kwargs):
    return self._guarded("update_non_slot()", super()._update_non_slot, colocate_with, fn,
                         args, kwargs)

  # --- reductions and updates: the base class's, through _get_cross_tower_ops ---

  def _get_cross_tower_ops(self):
    return self._reducer

  def _non_slot_devices(self, var_list):
    return min(var_list, key=lambda v: v.name)

  def _read_var(self, v):
    return self._backend.read_var(v)

  # --- devices ---

  def _num_towers(self):
    return len(self._worker_devices_tuple)

  def _worker_devices(self):
    return self._worker_devices_tuple

  def _parameter_devices(self):
    return self._ps_devices
