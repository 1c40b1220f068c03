"""A worker's place in a synchronous cluster: collectives across worker processes.

`WorkerGroup` sets up this process as one task of a cluster of worker processes that
run the same program (`MultiWorkerMirroredStrategy`). TensorFlow's gRPC runtime carries
collective ops between them: this process starts its own server on its address in the
cluster spec, and task 0 of the first job leads the collective groups.

Faults: the collectives have no timeout of their own (TensorFlow would hold a thread
per run for as long as the timeout); this process's `CollectiveWatchdog` ends a call
that waits on a failed peer: at once when a peer is dead or restarted, after the
collective timeout when a peer is frozen or alive but not joining. The error becomes
`ClusterError` naming the task at fault, from the watchdog's verdict, or else found by
asking every peer whether it is alive (`check_peer_health`, bounded): a dead peer
refuses, a frozen one does not answer in time, a restarted one is a different task.
TensorFlow aborts every later collective of a process once one failed, so the message
says to restart the worker processes and restore the last checkpoint.

A collective whose members have tensors of different shapes (a reduction of a shape
read from each worker's own data) fails in TensorFlow with `InvalidArgumentError`
"Shape mismatch in the collective instance ..."; `translate_error` gives it a message
that names both shapes and the fix, keeping its type.
"""

import re

from diststrat._tf import tf
from diststrat import _devices
from diststrat import _tf_internal
from diststrat import errors
from diststrat._cluster_runtime.multi_worker import _collective_watchdog
from diststrat._cluster_runtime import _exposure
from diststrat._cluster_runtime import _host_threads
from diststrat._cluster_runtime import _watchdog

_PROBE_TIMEOUT = 1.0
_SHAPE_MISMATCH = re.compile(
    r"Shape mismatch in the collective instance \d+\. Op at device (\S+) expected shape "
    r"(\[[^\]]*\]) but another member in the group expected shape (\[[^\]]*\])")
_ADVICE = ("TensorFlow aborts every later collective in a process once one failed: "
           "restart every worker process (with LocalCluster, call run_on_workers again), "
           "then restore the last checkpoint.")


class WorkerGroup:
  """This process's link to the other worker processes of its cluster.

  Args:
    cluster_spec: {job: [address, ...]} of worker tasks (already checked).
    task_type, task_id: this process's task.
    name: the owner's description, for messages.
    collective_timeout: seconds a call that runs collectives may wait on its peers.

  Raises:
    RuntimeError: TensorFlow was already initialized in this process.
  """

  def __init__(self, cluster_spec, task_type, task_id, name, collective_timeout=60.0):
    self.spec = cluster_spec
    self.task_type = task_type
    self.task_id = task_id
    # Worker order: job by job, in the spec's order (a "chief" job, if any, first).
    jobs = sorted(cluster_spec, key=lambda job: (job != "chief", list(cluster_spec).index(job)))
    self.tasks = tuple(f"/job:{job}/replica:0/task:{i}" for job in jobs
                       for i in range(len(cluster_spec[job])))
    self.local_task = f"/job:{task_type}/replica:0/task:{task_id}"
    self.index = self.tasks.index(self.local_task)
    self.name = name
    # Before TensorFlow initializes: its thread pools are made then.
    self.intra_op_threads = _host_threads.share_cores(cluster_spec, name)
    try:
      _tf_internal.enable_cross_process_collectives(
          tf.train.ClusterSpec(cluster_spec), task_type, task_id, leader=self.tasks[0],
          # Grappler's ScopedAllocatorOptimizer for the V1 all-reduces: faster steps, at a
          # cost to large all-reduces (docs/benchmarks.md, "The ScopedAllocatorOptimizer").
          scoped_allocator_ops=("CollectiveReduce",))
    except (RuntimeError, ValueError) as e:
      raise errors.ContextError(
          f"{name} must be created before TensorFlow initializes in this process (before "
          "any op runs or devices are listed): it makes this process a task of the "
          "cluster, which TensorFlow allows only at start-up. Create the strategy first, "
          f"at the top of the program. TensorFlow said: {e}") from e
    _exposure.server_started(self.local_task, cluster_spec[task_type][task_id])
    # "/cpu:0" now names this task's device, in TensorFlow's placement and in diststrat's.
    _devices.set_process_task(self.local_task)
    peers = [t for t in self.tasks if t != self.local_task]
    self.watchdog = _collective_watchdog.CollectiveWatchdog(
        peers, collective_timeout, _tf_internal.check_peer_health, name)
    self.guard = _watchdog.StepGuard(peers, _probe_peer, None, name, role="Worker task",
                                     advice=_ADVICE, restarted_advice=_ADVICE,
                                     blame_silent_peers=True,
                                     known_fault=self._known_fault)
    _tf_internal.install_error_translator(translate_error)
    _tf_internal.set_call_tracker(self.watchdog)
    # A SavedModel saved here must load where these tasks do not exist.
    _tf_internal.install_saved_model_device_rule()
    self.watchdog.start()

  def _known_fault(self, error):
    verdict = self.watchdog.verdict
    if verdict is None or _collective_watchdog.ABORT_MARK not in str(error):
      return None
    return verdict.task, verdict.status

  @property
  def num_workers(self):
    return len(self.tasks)

  @property
  def is_chief(self):
    return self.index == 0

  def local_devices(self):
    """This task's GPUs, else its CPU devices (canonical names), in order."""
    prefix = self.local_task + "/"
    for kind in ("GPU", "CPU"):
      names = [d.name for d in tf.config.list_logical_devices(kind)
               if d.name.startswith(prefix)]
      if names:
        return _devices.canonicalize_all(names)
    return (f"{self.local_task}/device:CPU:0",)

  def devices_of_every_worker(self, local_devices):
    """Every worker's devices, worker-major, assuming every worker has the same ones.

    The same list in every process: each worker's are this worker's with its task.
    """
    suffixes = [d[len(self.local_task):] for d in local_devices]
    return tuple(task + suffix for task in self.tasks for suffix in suffixes)


def _probe_peer(task):
  _tf_internal.check_peer_health(task, _PROBE_TIMEOUT)


def translate_error(error: BaseException) -> BaseException:
  """`error` (raised by TensorFlow in this process) with a clear message if it is a
  collective's shape mismatch (still an `InvalidArgumentError`, raised from TensorFlow's);
  else as `_watchdog.translate_error` makes it (`ClusterError` for a fault)."""
  if not isinstance(error, tf.errors.InvalidArgumentError):
    return _watchdog.translate_error(error)
  found = _SHAPE_MISMATCH.search(error.message)
  if found is None:
    return _watchdog.translate_error(error)
  device, mine, theirs = found.groups()
  said = found.group(0)
  message = (
      f"The workers reduced tensors of different shapes in one collective: this worker's "
      f"has shape {mine} (on {device}), another worker's {theirs}. Every worker must "
      "reduce tensors of the same shape, in the same order; a shape read from each "
      "worker's own data differs (such as the rows of a worker's part of a batch): reduce "
      "a value of a fixed shape (a sum over the rows), or use gather() for rows. Tensors "
      "reduced together travel concatenated, as one vector of all their elements. "
      f"{_ADVICE} TensorFlow said: {said}.")
  translated = tf.errors.InvalidArgumentError(error.node_def, error.op, message)
  translated.__cause__ = error
  return translated
