"""Cluster mode of `ParameterServerStrategy`: this worker's link to the PS tasks.

`ClusterConnection` checks the cluster spec, connects this process to the cluster with
TensorFlow's gRPC runtime, names the devices (variables on
`/job:ps/replica:0/task:i/device:CPU:0`, towers on this task's GPUs, else its CPU), makes
variables as `SharedVariable`s (shared by name across worker processes) and bounds every
cluster-touching call with a `StepGuard`.

This worker connects with a view of the cluster that holds the PS tasks and itself only:
workers never talk to each other, and TensorFlow would otherwise open a context on every
other worker, which fails while one is down or restarting. Its own address comes from
the spec (a fixed port): reconnecting after a PS restart needs it to be the same.
"""

import time
from typing import Optional

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _devices
from diststrat import _tf_internal
from diststrat import errors
from diststrat._cluster_runtime import _exposure
from diststrat._cluster_runtime import _shared_variables
from diststrat._cluster_runtime import _watchdog

PS_JOB = "ps"
_CONNECT_PROBE_TIMEOUT = 60.0  # Seconds a PS task has to answer when step_timeout is None.


def _check_addresses(job, addresses):
  if isinstance(addresses, dict):
    items = sorted(addresses.items())
    if [i for i, _ in items] != list(range(len(items))):
      raise ValueError(f"cluster_spec[{job!r}] as a dict must map task ids 0..n-1 to "
                       f"addresses. Received: {addresses!r}")
    addresses = [a for _, a in items]
  if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
    raise ValueError(f"cluster_spec[{job!r}] must be a list of 'host:port' addresses. "
                     f"Received: {addresses!r}")
  for address in addresses:
    _check_address(job, address)
  return list(addresses)


def _check_address(job, address):
  """Raises ValueError unless `address` is 'host:port' with a port from 1 to 65535."""
  if isinstance(address, str) and "://" in address:
    raise ValueError(
        f"cluster_spec[{job!r}] must hold plain 'host:port' addresses: TensorFlow's gRPC "
        f"runtime adds the scheme itself. Received: {address!r}. Write "
        f"{address.split('://', 1)[1]!r}.")
  host, port = "", ""
  if isinstance(address, str):
    host, _, port = address.rpartition(":")
  if host.startswith("[") and host.endswith("]"):  # An IPv6 address: "[::1]:2222".
    host = host[1:-1]
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
        f"cluster_spec[{job!r}] must hold 'host:port' addresses with a port from 1 to "
        f"65535, such as '127.0.0.1:2222' or '[::1]:2222'. Received: {address!r}"
        f"{'' if isinstance(address, str) else f' ({type(address).__name__})'}")


def _check_unique_addresses(spec):
  """Raises ValueError if two tasks of `spec` share an address (they would share a port)."""
  seen = {}
  for job, addresses in spec.items():
    for i, address in enumerate(addresses):
      task = f"/job:{job}/replica:0/task:{i}"
      if address in seen:
        raise ValueError(
            f"Each task of cluster_spec needs its own address: two tasks cannot listen on "
            f"one port. Received: {address!r} for both {seen[address]} and {task}. Give "
            "each task its own port.")
      seen[address] = task


def normalize_cluster_spec(cluster_spec, task_type, task_id, with_ps=True):
  """Returns `cluster_spec` as {job: [address, ...]} after checking it and the task.

  Args:
    cluster_spec: a dict {job: [address, ...]} or a `tf.train.ClusterSpec`.
    task_type, task_id: this process's task; it must be in the spec.
    with_ps: a parameter-server cluster (it needs a "ps" job) or, if False, a cluster of
      workers only (for `MultiWorkerMirroredStrategy`; no "ps" job).

  Raises:
    ValueError: the spec is not a dict of address lists, has no PS task (or has one when
      `with_ps` is False), or does not hold the task (`task_type`, `task_id`).
  """
  if isinstance(cluster_spec, tf.train.ClusterSpec):
    cluster_spec = cluster_spec.as_dict()
  if not isinstance(cluster_spec, dict):
    raise ValueError("cluster_spec must be a dict such as {'ps': ['host:port', ...], "
                     "'worker': ['host:port', ...]}. Received: "
                     f"cluster_spec={cluster_spec!r}")
  spec = {job: _check_addresses(job, addresses) for job, addresses in cluster_spec.items()}
  _check_unique_addresses(spec)
  if not with_ps:
    if spec.get(PS_JOB):
      raise ValueError("MultiWorkerMirroredStrategy runs on worker tasks only, but "
                       f"cluster_spec has a 'ps' job. Received: cluster_spec={cluster_spec!r}."
                       " Use ParameterServerStrategy for a cluster with parameter servers.")
    spec.pop(PS_JOB, None)
    if not any(spec.values()):
      raise ValueError("cluster_spec needs at least one worker task, such as {'worker': "
                       f"['host:port', ...]}}. Received: cluster_spec={cluster_spec!r}")
  elif not spec.get(PS_JOB):
    raise ValueError("cluster_spec needs at least one parameter server: a 'ps' job with "
                     f"one address or more. Received: cluster_spec={cluster_spec!r}")
  if task_type == PS_JOB or task_type not in spec:
    raise ValueError(
        f"task_type must name the job of this worker process, one of "
        f"{sorted(j for j in spec if j != PS_JOB)} (parameter servers run no model code). "
        f"Received: task_type={task_type!r}")
  if (isinstance(task_id, bool) or not isinstance(task_id, int)
      or not 0 <= task_id < len(spec[task_type])):
    raise ValueError(f"task_id must be an index into cluster_spec[{task_type!r}], from 0 "
                     f"to {len(spec[task_type]) - 1}. Received: task_id={task_id!r}")
  return spec


def wait_for_servers(addresses, timeout, poll=0.5):
  """Waits until the TensorFlow server at each of `addresses` answers, at most `timeout` s.

  For tasks started independently (`diststrat-run`, Slurm, Kubernetes, several
  machines), where this process may come up before the others: a server that refuses
  connections is asked again. Returns when all answer or the time is up (then the
  first use of the cluster names the task that does not).
  """
  addresses = list(addresses)
  deadline = time.monotonic() + timeout
  while addresses:
    outcomes = _tf_internal.probe_tf_server(addresses, min(poll * 4, timeout))
    addresses = [a for a, why in zip(addresses, outcomes, strict=True) if why]
    if not addresses or time.monotonic() + poll > deadline:
      return
    time.sleep(poll)


class ClusterTaskMixin:
  """The cluster properties of a strategy that runs as one task of a cluster.

  The strategy sets `_cluster_spec` (the normalized spec, or None outside a cluster),
  `_task_type` and `_task_id`.
  """

  _cluster_spec: Optional[dict[str, list[str]]] = None
  _task_type: Optional[str] = None
  _task_id: Optional[int] = None

  @property
  def cluster_spec(self) -> Optional[dict[str, list[str]]]:
    """The cluster spec as {job: [address, ...]}, or None outside a cluster."""
    if self._cluster_spec is None:
      return None
    return {job: list(addresses) for job, addresses in self._cluster_spec.items()}

  @property
  def task_type(self) -> Optional[str]:
    """This process's job in the cluster ("worker", ...)."""
    return self._task_type

  @property
  def task_id(self) -> Optional[int]:
    """This process's index in its job."""
    return self._task_id


class ClusterConnection:
  """This process's link to a parameter-server cluster; see the module docstring.

  Args:
    cluster_spec: {"ps": [...], "worker": [...]} (already checked).
    task_type, task_id: this process's task.
    step_timeout: seconds a guarded call may take (None: no limit).
    name: the owner's description, for messages.
  """

  def __init__(self, cluster_spec, task_type, task_id, step_timeout, name):
    self.spec = cluster_spec
    self.task_type = task_type
    self.task_id = task_id
    self.local_task = f"/job:{task_type}/replica:0/task:{task_id}"
    self.ps_tasks = tuple(f"/job:{PS_JOB}/replica:0/task:{i}"
                          for i in range(len(cluster_spec[PS_JOB])))
    self.ps_devices = tuple(f"{task}/device:CPU:0" for task in self.ps_tasks)
    self.guard = _watchdog.StepGuard(self.ps_tasks, _watchdog.probe_with_an_op,
                                     step_timeout, name)
    self.names = _shared_variables.SharedNames()
    # From now on, a task's death raised by any op of this process names the task, and
    # TensorFlow's waits for pending eager work (checkpoint saves) are bounded too.
    _tf_internal.install_error_translator(_watchdog.translate_error)
    _tf_internal.install_sync_hook(self.guard.wait_for)
    self.connect()

  def connect(self):
    """Connects (again) to every PS task, within the step timeout, or raises.

    Every PS task is asked first whether it answers (an RPC with a deadline): TensorFlow's
    own connection waits for a task that is down or frozen with no limit, and while it
    waits no TensorFlow call of this process can run. Then the connection, and the
    context initialization that makes it, run bounded by the step timeout.

    Raises:
      ClusterError: a PS task cannot be reached or does not answer, naming it and its
        address.
    """
    self.guard.clear_failure()
    timeout = self.guard.timeout or _CONNECT_PROBE_TIMEOUT
    self._check_ps_tasks_answer(timeout)
    view = tf.train.ClusterSpec({
        PS_JOB: self.spec[PS_JOB],
        self.task_type: {self.task_id: self.spec[self.task_type][self.task_id]},
    })

    def connect():
      with _watchdog.raw_errors():  # Asking the tasks would wait for this connection too.
        tf.config.experimental_connect_to_cluster(
            view, job_name=self.task_type, task_index=self.task_id, protocol="grpc")
        tf.config.list_logical_devices()  # The real connection: remote device discovery.
        # Work sent before a reconnect (to a task that died or froze since) can fail
        # after it, asynchronously (a function registration, say): such an error
        # belongs to the old connection, not to the next op on this one.
        tf.experimental.async_clear_error()

    try:
      self.guard.run(connect, f"connecting {self.local_task} to the cluster", probe=False)
      _exposure.server_started(self.local_task, self.spec[self.task_type][self.task_id])
    except errors.ClusterError as e:
      self._check_ps_tasks_answer(timeout)  # Names a task that died or froze meanwhile.
      raise errors.ClusterError(
          f"{e} This process's TensorFlow stays blocked until the connection completes "
          "or fails; if it does not, restart the process.", task=e.task) from e

  def _check_ps_tasks_answer(self, timeout):
    addresses = self.spec[PS_JOB]
    outcomes = _tf_internal.probe_tf_server(addresses, timeout)
    failed = [(task, address, why) for task, address, why
              in zip(self.ps_tasks, addresses, outcomes, strict=True) if why]
    if failed:
      text = "; ".join(f"parameter server task {t} at {a} {w}" for t, a, w in failed)
      raise errors.ClusterError(
          f"Cannot connect {self.local_task} to the cluster: {text}. Start the task(s) "
          "(or fix cluster_spec), then create the strategy (or call reconnect()) again.",
          task=failed[0][0])

  def local_devices(self):
    """This task's GPUs, else its first CPU (canonical names)."""
    prefix = self.local_task + "/"
    gpus = [d.name for d in tf.config.list_logical_devices("GPU") if d.name.startswith(prefix)]
    if gpus:
      return _devices.canonicalize_all(gpus)
    return (f"{self.local_task}/device:CPU:0",)

  def canonicalize(self, devices):
    """Canonical names of `devices`; parts left out default to this task."""
    return _devices.canonicalize_all(devices, default=self.local_task)

  def create_variable(self, device, kwargs):
    """A `SharedVariable` on the PS device `device`, made from tf.Variable's `kwargs`."""
    name = (kwargs.get("name") or "Variable").split(":")[0].strip("/") or "Variable"
    scope = tf.get_current_name_scope()
    shared_name = self.names.unique(f"{scope.rstrip('/')}/{name}" if scope else name)
    with tf.init_scope():
      if tf.is_symbolic_tensor(kwargs.get("initial_value")):
        raise ValueError(
            f"Variable {shared_name!r} is created inside a tf.function from a value "
            "computed in it. In cluster mode, create variables outside tf.function, or "
            "pass initial_value as a callable or a constant.")
      initial_value = _arguments.initial_value_tensor(kwargs)
      return _shared_variables.create_shared_variable(
          device=device, local_device=f"{self.local_task}/device:CPU:0",
          shared_name=shared_name, initial_value=initial_value, shape=kwargs.get("shape"),
          trainable=kwargs.get("trainable"), synchronization=kwargs.get("synchronization"),
          aggregation=kwargs.get("aggregation"), constraint=kwargs.get("constraint"),
          guard=self.guard)
