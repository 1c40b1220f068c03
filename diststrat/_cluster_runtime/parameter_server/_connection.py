"""Cluster mode of `ParameterServerStrategy`: this worker's link to the PS tasks.

`ClusterConnection` connects this process to the cluster with
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

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _devices
from diststrat import _tf_internal
from diststrat import errors
from diststrat._cluster_runtime import _cluster_spec
from diststrat._cluster_runtime import _exposure
from diststrat._cluster_runtime import _watchdog
from diststrat._cluster_runtime.parameter_server import _shared_variables

_CONNECT_PROBE_TIMEOUT = 60.0  # Seconds a PS task has to answer when step_timeout is None.


class ClusterConnection:
  """This process's link to a parameter-server cluster; see the module docstring.

  Args:
    cluster_spec: {"ps": [...], "worker": [...]} (already checked).
    task_type, task_id: this process's task.
    step_timeout: seconds a guarded call may take (None: no limit).
    name: the owner's description, for messages.
  """

  def __init__(self, cluster_spec, task_type, task_id, step_timeout, name, wait_for_ps=False,
               wait_timeout=None):
    self.spec = cluster_spec
    self.task_type = task_type
    self.task_id = task_id
    self.local_task = f"/job:{task_type}/replica:0/task:{task_id}"
    self.ps_tasks = tuple(f"/job:{_cluster_spec.PS_JOB}/replica:0/task:{i}"
                          for i in range(len(cluster_spec[_cluster_spec.PS_JOB])))
    self.ps_devices = tuple(f"{task}/device:CPU:0" for task in self.ps_tasks)
    self.guard = _watchdog.StepGuard(self.ps_tasks, _watchdog.probe_with_an_op,
                                     step_timeout, name)
    self.names = _shared_variables.SharedNames()
    # From now on, a task's death raised by any op of this process names the task, and
    # TensorFlow's waits for pending eager work (checkpoint saves) are bounded too.
    _tf_internal.install_error_translator(_watchdog.translate_error)
    _tf_internal.install_sync_hook(self.guard.wait_for)
    # A SavedModel saved here must load where these tasks do not exist.
    _tf_internal.install_saved_model_device_rule()
    self._connect(wait_for_ps, wait_timeout)

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
    self._connect(wait_for_ps=False)

  def _connect(self, wait_for_ps, wait_timeout=None):
    """`connect()`; with `wait_for_ps`, PS tasks that are not listening yet (started
    with this process) are asked again until they answer, all within `wait_timeout`
    (the step timeout, or the default one when it is None)."""
    self.guard.clear_failure()
    timeout = self.guard.timeout or _CONNECT_PROBE_TIMEOUT
    if wait_for_ps:
      self._check_ps_tasks_answer(wait_timeout or timeout, wait=True)
    else:
      self._check_ps_tasks_answer(timeout)
    view = tf.train.ClusterSpec({
        _cluster_spec.PS_JOB: self.spec[_cluster_spec.PS_JOB],
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
      # "/cpu:0" now names this task's device, in TensorFlow's placement and in diststrat's.
      _devices.set_process_task(self.local_task)
    except errors.ClusterError as e:
      self._check_ps_tasks_answer(timeout)  # Names a task that died or froze meanwhile.
      raise errors.ClusterError(
          f"{e} This process's TensorFlow stays blocked until the connection completes "
          "or fails; if it does not, restart the process.", task=e.task) from e

  def _check_ps_tasks_answer(self, timeout, wait=False):
    addresses = self.spec[_cluster_spec.PS_JOB]
    if wait:
      outcomes = _wait_for_answers(addresses, timeout)
    else:
      outcomes = _tf_internal.probe_tf_server(addresses, timeout)
    failed = [(task, address, why) for task, address, why
              in zip(self.ps_tasks, addresses, outcomes, strict=True) if why]
    if failed:
      text = "; ".join(f"parameter server task {t} at {a} {w}" for t, a, w in failed)
      hint = ""
      if all(_exposure.is_loopback_address(a) for _, a, _ in failed) and not (
          _exposure.in_private_network()):
        hint = (" If the task runs in another process's isolated LocalCluster or "
                "diststrat-run job (a private network namespace), only that job's processes "
                "reach it: run this code in the job (LocalCluster.run_on_workers), or start "
                "the job with isolate=False (diststrat-run --no-isolate).")
      raise errors.ClusterError(
          f"Cannot connect {self.local_task} to the cluster: {text}. Start the task(s) "
          "(or fix cluster_spec), then create the strategy (or call reconnect()) again."
          f"{hint}", task=failed[0][0])

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

  def create_variable(self, device, kwargs, shared_name=None):
    """A `SharedVariable` on the PS device `device`, made from tf.Variable's `kwargs`.

    `shared_name`: the name `names.unique` gave it already (for the placement policy),
    else one is given here.
    """
    if shared_name is None:
      shared_name = self.names.unique(_arguments.variable_name(kwargs))
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


def _wait_for_answers(addresses, timeout, poll=0.5):
  """`probe_tf_server(addresses, ...)` outcomes, waiting within `timeout` s in all.

  A task that refuses the connection is not listening yet (it was started with this
  process): it is asked again every `poll` s. Once none refuses, the tasks that listen
  but did not answer yet get the rest of the time in one last probe (a frozen task is
  reported at `timeout`, an overloaded one that answers in time is waited for).
  """
  deadline = time.monotonic() + timeout
  while True:
    remaining = deadline - time.monotonic()
    outcomes = _tf_internal.probe_tf_server(addresses, max(min(poll * 4, remaining), 0.01))
    if not any(outcomes):
      return outcomes
    silent = all(why is None or why.startswith("did not answer") for why in outcomes)
    remaining = deadline - time.monotonic()
    if silent:
      return _tf_internal.probe_tf_server(addresses, remaining) if remaining > 0 else outcomes
    if remaining < poll:
      return outcomes
    time.sleep(poll)
