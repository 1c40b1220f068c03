"""`MultiWorkerMirroredStrategy`: synchronous data parallelism across worker processes."""

from typing import Any, Optional, Sequence

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _devices
from diststrat import _tf_internal
from diststrat._cluster_runtime import _cluster_spec
from diststrat._cluster_runtime.multi_worker import _worker_group
from diststrat.cross_tower_ops import _cross_worker
from diststrat.strategies import _mirrored
from diststrat.strategies import _tower_threads
from diststrat.values import _wrapped

DEFAULT_COLLECTIVE_TIMEOUT = 60.0
"""Seconds a collective across workers waits for the other workers before it fails."""


class MultiWorkerMirroredStrategy(_cluster_spec.ClusterTaskMixin, _mirrored.MirroredStrategy):
  """Synchronous training across worker processes, variables mirrored on every tower.

  The same program runs in every worker process. Each process runs towers on its own
  devices (threads, as in `MirroredStrategy`); tower ids count every tower of every
  worker, worker-major. Variables are mirrored on every tower of every worker, and start
  from worker 0's initial value (broadcast), so random initializers agree. Reductions
  all-reduce over all towers of all workers with TensorFlow's collective ops over its
  gRPC runtime (`diststrat.cross_tower_ops.CrossWorkerAllReduce`). `distribute_dataset`
  gives each worker its share of every global batch.

  A worker that dies, freezes or stops calling the collectives makes every other
  worker's step raise `diststrat.errors.ClusterError` naming it within
  `collective_timeout`; the worker processes must then be restarted (TensorFlow aborts
  every later collective of a process once one failed), and training resumes from the
  last checkpoint. See docs/multi_worker.md.

  Create the strategy at the start of the program, before TensorFlow runs any op: it
  makes this process a task of the cluster, which TensorFlow allows only at start-up.

  Args:
    cluster_spec: {"worker": ["host:port", ...]} (a "chief" job, if present, counts as
      the first worker), or a `tf.train.ClusterSpec`. None: the cluster of the
      `TF_CONFIG` environment variable if set (`diststrat-run` sets it), else the
      cluster of a Slurm step (`diststrat.cluster.cluster_from_slurm`), else this
      process alone.
    task_type, task_id: this process's task (from the environment when the cluster is).
    devices: this process's tower devices. Default: its GPUs, else its CPU devices.
      Every worker must have the same number.
    cross_worker_ops: a `diststrat.cross_tower_ops.CrossWorkerAllReduce` (scheme,
      packing, timeout). Default: `CrossWorkerAllReduce("hierarchical",
      timeout=collective_timeout)`.
    collective_timeout: seconds a call that runs collectives (a step) may wait for the
      other workers; a watchdog thread enforces it (docs/multi_worker.md, "Faults").
    tower_timeout: as for `MirroredStrategy`.

  Example (in each worker process, e.g. run by `LocalCluster.run_on_workers`)::

      strategy = diststrat.MultiWorkerMirroredStrategy(
          cluster_spec={"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
          task_type="worker", task_id=int(sys.argv[1]))
      with strategy.scope():
        model = ...
  """

  def __init__(self, cluster_spec: Optional[Any] = None, task_type: str = "worker",
               task_id: int = 0, devices: Optional[Sequence[str]] = None,
               cross_worker_ops: Optional[Any] = None,
               collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
               tower_timeout: float = _tower_threads.DEFAULT_TOWER_TIMEOUT) -> None:
    collective_timeout = _arguments.seconds("collective_timeout", collective_timeout,
                                            allow_none=False)
    _arguments.seconds("tower_timeout", tower_timeout, allow_none=False)  # Before starting.
    config = _cluster_spec.resolve_cluster(cluster_spec, task_type, task_id,
                                           role="multi_worker")
    if cross_worker_ops is None:
      cross_worker_ops = _cross_worker.CrossWorkerAllReduce(timeout=collective_timeout)
    elif not isinstance(cross_worker_ops, _cross_worker.CrossWorkerAllReduce):
      raise TypeError("cross_worker_ops must be a diststrat.cross_tower_ops."
                      "CrossWorkerAllReduce, such as CrossWorkerAllReduce('flat'). "
                      f"Received: {cross_worker_ops!r}")
    if config is None:
      self._task_type, self._task_id = task_type, task_id
      self._cluster_spec = None
      self._group = None
      local = _devices.canonicalize_all(devices) if devices else _devices.local_devices()
      every = local
      index, num_workers = 0, 1
    else:
      spec, task_type, task_id = config.cluster_spec, config.task_type, config.task_id
      self._task_type, self._task_id = task_type, task_id
      self._cluster_spec = spec
      name = f"MultiWorkerMirroredStrategy of /job:{task_type}/replica:0/task:{task_id}"
      self._group = _worker_group.WorkerGroup(spec, task_type, task_id, name,
                                              collective_timeout=cross_worker_ops.timeout)
      # The workers start independently (diststrat-run, Slurm, several machines): wait,
      # at most the collective timeout, until every other worker's server is up, so
      # that the first collective does not take a peer still starting for a dead one.
      _cluster_spec.wait_for_servers(
          [address for job, addresses in spec.items() for i, address in enumerate(addresses)
           if (job, i) != (task_type, task_id)], cross_worker_ops.timeout)
      local = (_devices.canonicalize_all(devices, default=self._group.local_task)
               if devices else self._group.local_devices())
      every = self._group.devices_of_every_worker(local)
      index, num_workers = self._group.index, self._group.num_workers
    self._worker_index, self._num_workers = index, num_workers
    self._all_devices = every
    cross_worker_ops.bind(local, every, index, num_workers)
    super().__init__(devices=local, cross_tower_ops=cross_worker_ops,
                     tower_timeout=tower_timeout)

  def __repr__(self):
    if self._group is None:
      return f"MultiWorkerMirroredStrategy(devices={list(self._devices)})"
    return (f"MultiWorkerMirroredStrategy(task={self._group.local_task!r}, "
            f"workers={self._num_workers}, towers={len(self._all_devices)})")

  # --- the cluster ---

  @property
  def is_chief(self) -> bool:
    """True in worker 0: the process that should write checkpoints and summaries."""
    return self._worker_index == 0

  @property
  def num_workers(self) -> int:
    return self._num_workers

  # --- variables: mirrored on this worker's towers, initial values from the chief ---

  def _create_distributed_variable(self, next_creator, kwargs, colocate_with):
    kwargs = dict(kwargs)
    with tf.init_scope():  # A collective: made once, eagerly, even inside a tf.function.
      if tf.is_symbolic_tensor(kwargs.get("initial_value")):
        raise ValueError(
            f"Variable {kwargs.get('name')!r} is created inside a tf.function from a value "
            "computed in it. Under MultiWorkerMirroredStrategy, create variables outside "
            "tf.function, or pass initial_value as a callable or a constant.")
      with tf.device(self._devices[0]):
        value = _arguments.initial_value_tensor(kwargs)
      if _tf_internal.creating_checkpoint_save_counter():
        # 0 in every worker, and made where the chief alone may be saving (the chief
        # writes checkpoints): no collective, or it would meet the others' next one.
        kwargs["initial_value"] = value
        kwargs.pop("dtype", None)
        return super()._create_distributed_variable(next_creator, kwargs, colocate_with)
      try:
        kwargs["initial_value"] = self._cross_tower_ops.broadcast_from_chief(value)
      except (tf.errors.InvalidArgumentError, tf.errors.InternalError) as e:
        # TensorFlow's words for it: "expected shape [4] but another member in the group
        # expected shape [3]", "expected type 0 and data_type 1 but got ... data_type 2".
        # TensorFlow's own error, not the message the worker group gives a collective's
        # shape mismatch (about reductions).
        cause = e.__cause__ if isinstance(e.__cause__, tf.errors.OpError) else e
        said = next((line.strip() for line in cause.message.splitlines() if "expected" in line),
                    cause.message.strip().splitlines()[0] if cause.message.strip() else "")
        raise ValueError(
            f"Variable {kwargs.get('name')!r} (shape {value.shape}, dtype "
            f"{value.dtype.name}) could not take the chief's initial value: the collective "
            "that sends it failed, as it does when the workers create variables of "
            "different shapes or dtypes, or in a different order. Every worker must create "
            "the same variables, with the same shapes and dtypes, in the same order (a "
            "shape read from each worker's own data differs). Then restart every worker "
            f"process. TensorFlow said: {said}") from e
      kwargs.pop("dtype", None)
      return super()._create_distributed_variable(next_creator, kwargs, colocate_with)

  # --- towers: numbered across all workers ---

  def _call_for_each_tower(self, fn, args, kwargs):
    runner = _tower_threads.TowerRunner(
        self, self._devices, self._tower_timeout,
        first_tower_id=self._worker_index * len(self._devices),
        num_towers=len(self._all_devices))
    return _wrapped.regroup(runner.run(fn, args, kwargs), self._devices)

  def _num_towers(self):
    return len(self._all_devices)

  def _worker_device_index(self):
    return _wrapped.PerDevice({d: i for i, d in enumerate(self._devices)})

  # --- input, gathering, reads across workers ---

  def _batch_split(self):
    return self._worker_index * len(self._devices), len(self._all_devices)

  def _gather(self, value, axis, destinations):
    if self._num_workers == 1:
      return super()._gather(value, axis, destinations)
    # Python numbers and numpy values too. A plain value has one component, this
    # worker's value, on the first device: the workers' values are concatenated.
    with tf.device(self._devices[0]):
      components = [c if isinstance(c, (tf.Tensor, tf.Variable)) else tf.convert_to_tensor(c)
                    for c in self._unwrap(value)]
    if all(c.shape.rank == 0 for c in components):
      components, axis = [tf.reshape(c, [1]) for c in components], 0  # Stacked, as locally.
    gathered = self._cross_tower_ops.gather(_wrapped.PerDevice(
        dict(zip(self._devices, components, strict=False))), axis)
    if destinations is None:
      return gathered
    return self._broadcast(gathered, destinations)

  # --- tower-local variables (metrics): every copy of every worker ---

  def _num_processes(self):
    return self._num_workers

  def _first_tower_value(self, value):
    # This worker's first tower is tower 0 in the chief only: the chief's goes to all.
    first = tf.convert_to_tensor(self._unwrap(value)[0])
    if self._num_workers == 1:
      return first
    with tf.device(self._devices[0]):
      return self._cross_tower_ops.broadcast_from_chief(first)

  def _sum_across_processes(self, tensor):
    if self._num_workers == 1:
      return tensor
    mine = _wrapped.PerDevice({self._devices[0]: tensor})
    return self._cross_tower_ops.reduce("sum", mine, self._devices[:1]).primary

