"""Where a `ParameterServerStrategy` keeps its variables: in this process, or on PS tasks.

The strategy's policy (placement, towers, reductions onto a variable's device, updates
where the variable lives) is the same in both modes; what differs is behind one of two
backends, chosen once, when the strategy is created:

- `LocalBackend`: one process. Parameter devices are local devices, variables are plain
  `tf.Variable`s on them, and calls run as they are.
- `ClusterBackend`: one worker task of a cluster (`_cluster_runtime/parameter_server/`).
  Parameter devices are the PS tasks' CPUs, variables are `SharedVariable`s shared by
  name with the other workers, each eager cross-tower call runs under the watchdog
  (bounded by `step_timeout`, faults as `ClusterError`), `run_step` returns once its
  remote writes are done, reads may be cached per step, and tower-local (ON_READ)
  variables stay in this worker.
"""

import contextlib
from typing import Any, Callable, Optional

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _context
from diststrat import _devices
from diststrat import _tf_internal
from diststrat._cluster_runtime import _host_threads
from diststrat._cluster_runtime.parameter_server import _connection
from diststrat._cluster_runtime.parameter_server import _read_cache
from diststrat._cluster_runtime.parameter_server import _shared_variables


# The kwargs key under which `ClusterBackend.reserve_name` hands the name to `make_variable`.
_RESERVED_NAME = "diststrat_reserved_shared_name"


class LocalBackend:
  """Variables on this process's devices (see the module docstring)."""

  in_cluster = False

  def __init__(self, worker_devices, ps_devices):
    if worker_devices is None:
      worker_devices = _devices.local_devices()
    if ps_devices is None:
      ps_devices = (_devices.canonicalize(tf.config.list_logical_devices("CPU")[0].name),)
    self.worker_devices = _devices.check_exist(_devices.canonicalize_all(worker_devices),
                                               "worker_devices")
    self.ps_devices = _devices.check_exist(_devices.canonicalize_all(ps_devices),
                                           "ps_devices")

  def describe(self) -> str:
    return f"worker_devices={list(self.worker_devices)}, ps_devices={list(self.ps_devices)}"

  def guarded(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    del what
    return fn(*args, **kwargs)

  def step(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return self.guarded(what, fn, *args, **kwargs)

  def creation_scope(self):
    return contextlib.nullcontext()

  def reserve_name(self, kwargs) -> str:
    """The name a new variable made from tf.Variable's `kwargs` gets (without ":0")."""
    return _arguments.variable_name(kwargs)

  def make_variable(self, device, next_creator, kwargs):
    with tf.device(device):
      if isinstance(kwargs.get("initial_value"), tf.Tensor):
        kwargs["initial_value"] = tf.identity(kwargs["initial_value"])
      return next_creator(**kwargs)

  def keeps_tower_local_variables(self) -> bool:
    """Whether ON_READ variables stay in this worker process (not on a parameter device)."""
    return False

  def new_read_cache(self, max_bytes):
    del max_bytes
    return None

  def read_var(self, v):
    return tf.identity(v)

  def wrote_eagerly(self, variable) -> None:
    """`update()` ran ops on `variable`'s handle eagerly: in-process, they are done."""
    del variable

  def step_timeout(self) -> Optional[float]:
    return None

  def set_step_timeout(self, strategy, seconds):
    del seconds
    raise ValueError(f"step_timeout applies to cluster mode only (this {strategy!r} runs "
                     "in one process).")

  def reconnect(self, strategy) -> None:
    raise ValueError(f"reconnect() applies to cluster mode only; {strategy!r} runs in one "
                     "process.")


class ClusterBackend:
  """Variables on the PS tasks of a cluster (see the module docstring).

  Args:
    config: the checked cluster and this worker's task (`resolve_cluster`).
    worker_devices: this task's tower devices; default its GPUs, else its CPU.
    step_timeout: seconds a guarded call may take (None: no limit).
    wait_for_ps: wait (up to the step timeout) for the PS tasks to start first: they
      were started with this process (by Slurm, Kubernetes, the launcher).
  """

  in_cluster = True

  def __init__(self, config, worker_devices, step_timeout, wait_for_ps, default_timeout):
    spec = config.cluster_spec
    name = f"ParameterServerStrategy of /job:{config.task_type}/replica:0/task:{config.task_id}"
    # Before the connection initializes TensorFlow: its thread pools are made then.
    self.intra_op_threads = _host_threads.share_cores(spec, name)
    # wait_for_ps: PS tasks not listening yet are waited for, within step_timeout in all.
    self.connection = _connection.ClusterConnection(
        spec, config.task_type, config.task_id, step_timeout, name=name,
        wait_for_ps=wait_for_ps, wait_timeout=step_timeout or default_timeout)
    self.ps_devices = self.connection.ps_devices
    if worker_devices is None:
      worker_devices = self.connection.local_devices()
    self.worker_devices = _devices.check_exist(self.connection.canonicalize(worker_devices),
                                               "worker_devices")

  def describe(self) -> str:
    return f"task={self.connection.local_task!r}, ps_tasks={list(self.connection.ps_tasks)}"

  def guarded(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, eagerly bounded by `step_timeout`.

    It runs in the watchdog's helper thread, in this thread's context (see
    `_context.ThreadState`); a cluster fault raises `ClusterError` naming the task.
    Inside a `tf.function` trace, or inside a guarded call, it runs directly.
    """
    guard = self.connection.guard
    if guard.inside() or not tf.executing_eagerly():
      return fn(*args, **kwargs)
    state = _context.ThreadState()

    def call():
      with state.enter():
        return fn(*args, **kwargs)

    return guard.run(call, what)

  def step(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A whole step: guarded, and returning once its writes reached the PS tasks."""

    def acknowledged_step(*args, **kwargs):
      result = fn(*args, **kwargs)
      if tf.executing_eagerly():
        # A tf.function's remote writes may still be on their way to the PS tasks when
        # it returns: the step returns once they are done (or raises their error).
        _tf_internal.wait_for_pending_ops()
      return result

    return self.guarded(what, acknowledged_step, *args, **kwargs)

  def creation_scope(self):
    # A variable is made once, eagerly, even when first used in a tf.function: it lives
    # on a PS task beyond any one trace.
    return tf.init_scope()

  def reserve_name(self, kwargs) -> str:
    """The shared name a new variable made from tf.Variable's `kwargs` gets (unique:
    `w`, `w_1`, ...), given now so that the placement policy sees it; `make_variable`
    then uses it."""
    name = self.connection.names.unique(_arguments.variable_name(kwargs))
    kwargs[_RESERVED_NAME] = name
    return name

  def make_variable(self, device, next_creator, kwargs):
    del next_creator
    return self.connection.create_variable(device, kwargs,
                                           shared_name=kwargs.pop(_RESERVED_NAME, None))

  def keeps_tower_local_variables(self) -> bool:
    return True

  def new_read_cache(self, max_bytes):
    return _read_cache.ReadCache(f"{self.connection.local_task}/device:CPU:0", max_bytes)

  def wrote_eagerly(self, variable) -> None:
    """`update()` ran ops on `variable`'s handle eagerly (an optimizer's fused update):
    TensorFlow sent them to the PS task without waiting, so the next read of it in a
    tower must not overtake them (a read by function call can, under load)."""
    _shared_variables.note_unacknowledged_write(variable)

  def read_var(self, v):
    if tf.executing_eagerly() and not self.connection.guard.inside():
      # Each eager read of a PS variable is bounded by step_timeout and returns its
      # value on this worker (_cluster_runtime/parameter_server/_shared_variables.py):
      # ready, so using it cannot block on a PS task.
      return tf.identity(v)
    return self.guarded(f"read_var() of {v.name}", tf.identity, v)

  def step_timeout(self) -> Optional[float]:
    return self.connection.guard.timeout

  def set_step_timeout(self, strategy, seconds):
    del strategy
    self.connection.guard.timeout = seconds  # Checked by the guard.

  def reconnect(self, strategy) -> None:
    del strategy
    self.connection.connect()
