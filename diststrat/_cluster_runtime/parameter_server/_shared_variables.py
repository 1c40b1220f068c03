"""Variables that live on a parameter-server task under a shared name (docs/parameter_server.md).

An eager `tf.Variable` is an anonymous resource: only the process that made it can find
it. A `SharedVariable` is a resource variable on a parameter-server (PS) task registered
under a *shared name*, so every worker process that asks that task for the name gets the
same variable, and the variable outlives the worker that created it.

How one is made (`create_shared_variable`):

1. `VarHandleOp(shared_name=...)` runs on the PS device and returns the resource's
   handle. Its local copy, made once, is what the Python variable keeps: it holds only
   the resource's address (task, container, name), so it stays valid when the PS task
   restarts or the worker reconnects, and `tf.function` traces that captured it keep
   working.
2. One small `tf.function` on the PS creates the variable if it is missing, atomically
   across processes: under a PS-wide mutex (`MutexV2` with a shared name) it assigns the
   initial value only if `VarIsInitializedOp` says the variable is not there yet, and
   returns the shape the variable has. A worker that finds the variable already there
   binds to it and keeps its current value.
3. Every operation on the variable runs on its PS device (an explicit device scope around
   reads, assigns and scatters: `_tf_internal.RESOURCE_METHODS`), where TensorFlow
   enqueues eager remote ops asynchronously instead of wrapping each in a synchronous
   function call. The exceptions: a dense read in a tower of a `call_for_each_tower`
   that caches reads is served by that call's `ReadCache` (_cluster_runtime/parameter_server/_read_cache.py),
   and every write drops the variable from the open caches; and, eagerly outside the
   strategy's guarded calls, reads and writes are acknowledged and bounded (below).

Eagerly, outside a guarded call (`run_step`, `update`, ...), an operation on the variable
returns only once its PS task did it, and never waits longer than `step_timeout`:

- a write (`assign*`, `scatter_*`) is one small `tf.function` whose output, on this
  worker, depends on the write; the call returns (or raises `ClusterError` naming the
  task) when the PS task has done the write;
- a dense read (`value()`, `read_value()`, `numpy()`, conversions, a checkpoint save) is
  one small `tf.function` that reads on the PS task and returns the value on this
  worker, ready: using it cannot block on the PS any more. Tapes see it as a read of
  the variable.

Both run in the watchdog's helper thread (`StepGuard.run`), which the caller waits for
at most `step_timeout`: TensorFlow cannot cancel an eager call blocked on a frozen task,
so the helper thread is abandoned then, blocked until the task resumes or dies; the
guard then makes every later eager method raise `ClusterError` at once (until
`reconnect()`), so one freeze leaves one thread behind, not one per call.

Shared names must be the same in every worker process and unique: `SharedNames` gives
the n-th variable that asks for the name `x` the name `x`, `x_1`, ... in creation
order, like TensorFlow 1 graphs did, so two `tf.Variable()` calls that are both named
"Variable" get two variables.
"""

import functools
import itertools
import time

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat._cluster_runtime import _faults
from diststrat._cluster_runtime.parameter_server import _read_cache

INIT_LOCK_NAME = "diststrat/init_lock"
"""Shared name of the mutex on each PS task that makes create-if-missing atomic."""

_VARIABLE_VALUE = "VARIABLE_VALUE"  # The checkpoint key of a plain tf.Variable's value.
_RETRY_SECONDS = 2.0
_RETRY_PAUSE = 0.25

_unique_ids = itertools.count()

def _in_real_tower():
  tower = _context.get_tower_context()
  return tower is not None and tower is not _context.default_tower_context()


class SharedNames:
  """Deterministic unique names: the n-th request for `base` gets `base`, `base_1`, ...

  A name already handed out (also one a user chose, such as "w_1") is never given
  again, so names depend only on the order of the requests.
  """

  def __init__(self):
    self._used = set()
    self._next_suffix = {}

  def unique(self, base):
    if base not in self._used:
      self._used.add(base)
      return base
    suffix = self._next_suffix.get(base, 1)
    while f"{base}_{suffix}" in self._used:
      suffix += 1
    self._next_suffix[base] = suffix + 1
    name = f"{base}_{suffix}"
    self._used.add(name)
    return name


class SharedVariable(_tf_internal.ResourceVariableFromHandle):
  """A `tf.Variable` whose resource lives on a parameter-server task under a shared name.

  Made by `ParameterServerStrategy` in cluster mode; use it as any `tf.Variable`.
  `device` is its PS device; `shared_name` the name every worker process finds it by.
  Every method that touches the resource runs with the PS device as its device scope.
  """

  def __init__(self, *, handle, device, shared_name, shape, dtype, trainable=None,
               synchronization=None, aggregation=None, constraint=None, guard=None,
               local_device=None):
    self._ps_device = device
    self._local_device = local_device
    self._guard = guard
    self._diststrat_shared_name = shared_name
    super().__init__(
        handle=handle, shape=shape, dtype=dtype, name=shared_name, trainable=trainable,
        synchronization=synchronization, aggregation=aggregation, constraint=constraint,
        unique_id=f"{shared_name}_{next(_unique_ids)}")

  @property
  def device(self):
    """The PS device the variable lives on (its handle object is a local copy)."""
    return self._ps_device

  @property
  def shared_name(self):
    """The name by which every worker process finds this variable on its PS task."""
    return self._diststrat_shared_name

  def _check_healthy(self, method):
    """Eagerly, raises `ClusterError` once the connection has seen a task fail."""
    if self._guard is not None and tf.executing_eagerly():
      self._guard.check_healthy(f"{method.lstrip('_')}() of variable {self.shared_name!r}")

  def _uncached_read(self):
    """The variable's value, read on its PS device (never from a read cache)."""
    if self._read_in_a_guarded_tower():
      return _function_read(self)
    return _run_on_ps(self, "_read_variable_op", _READ_ON_DEVICE, (), {})

  def _read_in_a_guarded_tower(self):
    """Whether a read is an eager one in a tower of a guarded call (an eager
    `call_for_each_tower` or `run_step`), which the call's watchdog bounds: it must wait
    for the PS without holding the GIL, else the watchdog cannot run."""
    return (self._guard is not None and self._local_device is not None
            and tf.executing_eagerly() and _in_real_tower())

  def _acknowledged(self):
    """Whether this call's eager operations must be acknowledged and bounded here.

    Eagerly, with a guard, outside a guarded call (that call bounds its operations) and
    outside a tower (its `call_for_each_tower` is guarded).
    """
    return (self._guard is not None and self._local_device is not None
            and tf.executing_eagerly() and not self._guard.inside()
            and not _in_real_tower())

  def _serialize_to_tensors(self):
    # A save reads the value when it writes the checkpoint (a restore, which builds
    # the same saver, does not read it): eagerly, bounded by step_timeout and onto this
    # worker, so that writing the checkpoint waits on no PS task (and this worker
    # writes its files).
    if self._acknowledged():
      return {_VARIABLE_VALUE: _tf_internal.deferred_checkpoint_value(
          self._read_for_checkpoint, self.dtype, self._local_device)}
    return super()._serialize_to_tensors()

  def _read_for_checkpoint(self):
    if self._acknowledged():
      return self.read_value()
    with tf.device(self.device):  # Called in a graph: TensorFlow's own read.
      return tf.identity(self.read_value())

  def _restore_from_tensors(self, restored_tensors):
    # Eagerly, a restore is an acknowledged write like assign(), bounded likewise.
    value = restored_tensors[_VARIABLE_VALUE]
    if not self._acknowledged():
      return super()._restore_from_tensors(restored_tensors)
    if not self.shape.is_compatible_with(value.shape):
      raise ValueError(f"Cannot restore variable {self.shared_name!r} of shape "
                       f"{self.shape} from a checkpoint value of shape {value.shape}.")
    self.assign(tf.cast(value, self.dtype), read_value=False)
    return None

  def batch_scatter_update(self, sparse_delta, use_locking=False, name=None):
    # TensorFlow writes the handle directly (no wrapped method), so drop cached reads.
    try:
      return super().batch_scatter_update(sparse_delta, use_locking=use_locking, name=name)
    finally:
      _read_cache.invalidate(self)


# Eager writes run as these ops, called in a small tf.function (see _on_variable_device).
_ASSIGN_OPS = {"assign": "AssignVariableOp", "assign_add": "AssignAddVariableOp",
               "assign_sub": "AssignSubVariableOp"}
_SCATTER_OPS = {f"scatter_{kind}": f"ResourceScatter{kind.capitalize()}"
                for kind in ("sub", "add", "max", "min", "mul", "div", "update")}
_SCATTER_ND_OPS = {f"scatter_nd_{kind}": f"ResourceScatterNd{kind.capitalize()}"
                   for kind in ("sub", "add", "update", "max", "min")}


_WRITE_METHODS = frozenset(
    [*_ASSIGN_OPS, *_SCATTER_OPS, *_SCATTER_ND_OPS, "_strided_slice_assign"])
"""The methods of `_tf_internal.RESOURCE_METHODS` that write the variable."""


def _on_variable_device(name, method):
  """`method` with the variable's read cache in front and its PS device around it.

  A read in a tower of a `call_for_each_tower` that caches reads is served by that
  call's `ReadCache` (_cluster_runtime/parameter_server/_read_cache.py), before any PS device scope, so that the
  use is made on the tower's device; a write drops the variable from every open cache.
  Everything else runs under the PS device (`_run_on_ps`).
  """
  if name in _tf_internal.READ_METHODS:
    def wrapper(self, *args, **kwargs):
      cache = _read_cache.active_cache()
      if cache is not None and cache.applies_to(self):
        self._check_healthy(name)
        return cache.read(self, self._uncached_read)
      if self._acknowledged():
        self._check_healthy(name)
        return _bounded_read(self, name)
      if self._read_in_a_guarded_tower():
        self._check_healthy(name)
        return _function_read(self)
      return _run_on_ps(self, name, method, args, kwargs)
  elif name in _WRITE_METHODS:
    def wrapper(self, *args, **kwargs):
      try:
        return _run_on_ps(self, name, method, args, kwargs)
      finally:
        _read_cache.invalidate(self)
        if tf.executing_eagerly() and name not in _ACKNOWLEDGED_WRITES:
          # Sent as an eager op, not waited for: the next read must not overtake it.
          self._unacknowledged_write = True
  elif name == "sparse_read":
    def wrapper(self, *args, **kwargs):
      if (self._read_in_a_guarded_tower() and self.shape.is_fully_defined()
          and not getattr(self, "_unacknowledged_write", False)):
        self._check_healthy(name)
        return _function_sparse_read(self, *args, **kwargs)
      return _run_on_ps(self, name, method, args, kwargs)
  else:
    def wrapper(self, *args, **kwargs):
      return _run_on_ps(self, name, method, args, kwargs)
  return wrapper


def _run_on_ps(variable, name, method, args, kwargs):
  """`method(variable, ...)` run under the variable's PS device; reads get its shape.

  The local copy of a remote handle carries no shape, so inside a graph a read would
  have unknown rank (Keras layers then fail); the variable knows its shape.

  Eagerly, two TensorFlow 2.21 behaviours of remote ops are worked around. An eager
  write is asynchronous and, after a task failed, can lose its error: writes run as a
  small `tf.function` instead, acknowledged by an output on this worker, which fails
  with the task's error (`_eager_write`). An eager read issued from another thread
  than the one that saw a task fail can block forever, holding the GIL: once the
  connection has seen a failure, every eager method raises `ClusterError` at once,
  until `reconnect()`.
  """
  variable._check_healthy(name)
  if variable._guard is not None and tf.executing_eagerly():
    if name in _ASSIGN_OPS or name in _SCATTER_OPS or name in _SCATTER_ND_OPS:
      return _eager_write(variable, name, *args, **kwargs)
  with tf.device(variable.device):
    result = method(variable, *args, **kwargs)
  if (name in _tf_internal.READ_METHODS and isinstance(result, tf.Tensor)
      and not tf.executing_eagerly()):
    result.set_shape(variable.shape)
  return result


_READ_ON_DEVICE = _tf_internal.base_resource_method("_read_variable_op")  # Unwrapped.
_tf_internal.wrap_resource_methods(SharedVariable, _on_variable_device)


def _eager_write(variable, method, *args, **kwargs):
  """An eager write as one acknowledged function call on the variable's PS device.

  Takes the arguments of the `tf.Variable` method `method`: `assign*(value, use_locking,
  name, read_value)`, `scatter_*(sparse_delta, use_locking, name)`,
  `scatter_nd_*(indices, updates, name)`. Returns once the PS task did the write
  (bounded by the guard's `step_timeout` outside a guarded call), or raises.
  """
  if method in _ASSIGN_OPS:
    value = tf.convert_to_tensor(args[0] if args else kwargs["value"], dtype=variable.dtype)
    if method == "assign" and not variable.shape.is_compatible_with(value.shape):
      # TensorFlow's method checks this before its op; the raw op would silently give
      # the variable on its PS task the value's shape.
      raise ValueError(
          f"Cannot assign a value of shape {value.shape} to variable "
          f"{variable.shared_name!r} of shape {variable.shape}: the shapes are "
          f"incompatible, as for a tf.Variable. Assign a value of shape {variable.shape}.")
    read_value = args[3] if len(args) > 3 else kwargs.get("read_value", True)
    _acknowledged_write(variable, method, _ASSIGN_OPS[method], value)
    return variable if read_value else None
  if method in _SCATTER_OPS:
    delta = args[0] if args else kwargs["sparse_delta"]
    if not isinstance(delta, tf.IndexedSlices):
      raise TypeError(f"{method}() takes a tf.IndexedSlices. Received: {delta!r}")
    _acknowledged_write(variable, method, _SCATTER_OPS[method],
                        tf.convert_to_tensor(delta.indices),
                        tf.convert_to_tensor(delta.values, dtype=variable.dtype))
    return variable
  indices = args[0] if args else kwargs["indices"]
  updates = args[1] if len(args) > 1 else kwargs["updates"]
  _acknowledged_write(variable, method, _SCATTER_ND_OPS[method],
                      tf.convert_to_tensor(indices),
                      tf.convert_to_tensor(updates, dtype=variable.dtype))
  return variable


def _acknowledged_write(variable, method, op_name, *tensors):
  """Runs the write `op_name` and waits for its acknowledgement from the PS task.

  Without an output on this worker, TensorFlow runs the call as a remote op that
  returns before the PS task ran it (and a dead task's error surfaces at a later read);
  the acknowledgement is an output on this worker that depends on the write.
  """
  local_device = variable._local_device
  write = _write_function(variable.device, op_name, local_device)

  def call():
    # Called on this worker: under a PS device scope (as in update()), TensorFlow would
    # run the whole call on the PS task, its output left there.
    with tf.device(local_device):
      return write(variable.handle, *tensors).numpy()

  if not variable._acknowledged():
    call()  # In a guarded call, or a tower of one: that call bounds it.
    return
  variable._guard.run(call, f"{method}() of variable {variable.shared_name!r}")


@functools.lru_cache(maxsize=None)
def _write_function(device, op_name, local_device):
  """A tf.function: the raw op `op_name` on a variable's handle on `device`, then an
  acknowledgement (a scalar on `local_device`) that depends on it."""
  op = getattr(tf.raw_ops, op_name)

  @tf.function(autograph=False, reduce_retracing=True)
  def write(handle, *tensors):
    with tf.device(device):
      if op_name in _ASSIGN_OPS.values():
        done = op(resource=handle, value=tensors[0])
      elif op_name.startswith("ResourceScatterNd"):
        done = op(ref=handle, indices=tensors[0], updates=tensors[1])
      else:
        done = op(resource=handle, indices=tensors[0], updates=tensors[1])
      with tf.control_dependencies([done]):
        acknowledged = tf.constant(True)
    with tf.device(local_device):
      return tf.identity(acknowledged)

  return write


def _bounded_read(variable, method):
  """The variable's value on this worker, read within the guard's `step_timeout`.

  The read runs in the guard's helper thread; tapes of the calling thread see the
  value as a read of the variable.
  """
  local_device = variable._local_device
  read = _read_function(variable.device, local_device, variable.dtype)

  def call():
    # Writes this process sent without waiting (a slice assignment, ops called on the
    # handle) run first: this thread's read would otherwise race them to the PS.
    _tf_internal.wait_for_pending_ops()
    with tf.device(local_device):  # Else, under a PS device scope, the value stays there.
      return read(variable.handle)

  value = variable._guard.run(
      call, f"{method.lstrip('_')}() of variable {variable.shared_name!r}")
  _tf_internal.variable_accessed(variable)
  result = tf.identity(value)
  _tf_internal.record_variable_read(variable, result)
  return result


# The eager writes that `_run_on_ps` sends as an acknowledged function call.
_ACKNOWLEDGED_WRITES = frozenset([*_ASSIGN_OPS, *_SCATTER_OPS, *_SCATTER_ND_OPS])


def note_unacknowledged_write(variable):
  """Records that this process sent an eager write of `variable` without waiting for it
  (an op on its handle, such as an optimizer's fused update): its next read in a tower
  is then an eager op, which does not overtake the write (see `_function_read`)."""
  if isinstance(variable, SharedVariable):
    variable._unacknowledged_write = True


def _function_read(variable):
  """Eagerly, in a tower of a guarded call: the variable's value, read by a function call.

  An eager remote read op waits for a frozen PS holding the GIL, so the call's watchdog
  could never raise `ClusterError` at `step_timeout` (a tape around the read made it
  wait at once); a function call waits without it. The value comes back on this
  worker; tapes of the tower see a read of the variable. (Sparse reads: see
  `_function_sparse_read`.)

  After an eager write this process sent without waiting (a slice assignment), the
  read is an eager op, as before: a function call could overtake the write.
  """
  if getattr(variable, "_unacknowledged_write", False):
    value = _run_on_ps(variable, "_read_variable_op", _READ_ON_DEVICE, (), {})
    variable._unacknowledged_write = False  # The read ran after it.
    return value
  local_device = variable._local_device
  read = _read_function(variable.device, local_device, variable.dtype)
  # Tapes and forward accumulators see the read as recorded below, not the call (a
  # forward accumulator cannot differentiate a call whose input is a remote handle).
  with tf.device(local_device), _tf_internal.stop_recording():
    value = read(variable.handle)
  _tf_internal.variable_accessed(variable)
  result = tf.identity(value)
  _tf_internal.record_variable_read(variable, result)
  return result


def _function_sparse_read(variable, indices, name=None):
  """Eagerly, in a tower of a guarded call: `variable.sparse_read(indices)` (what
  `tf.gather` and embedding lookups call), by a function call, as `_function_read` reads
  the whole value; recorded on the tower's tapes as TensorFlow records the gather (its
  gradient: `IndexedSlices` of the variable)."""
  del name
  indices = tf.convert_to_tensor(indices)
  gather = _sparse_read_function(variable.device, variable._local_device, variable.dtype)
  with tf.device(variable._local_device), _tf_internal.stop_recording():
    value = gather(variable.handle, indices)
  _tf_internal.variable_accessed(variable)
  dense_shape = tf.constant(variable.shape.as_list(), tf.int32)

  def backward(grad):
    rows = tf.reshape(tf.size(indices), [1])
    values = tf.reshape(grad, tf.concat([rows, dense_shape[1:]], 0))
    return [tf.IndexedSlices(values, tf.reshape(indices, rows), dense_shape), None]

  _tf_internal.record_backward("ResourceGather", [value], [variable.handle, indices],
                               backward)
  return value


@functools.lru_cache(maxsize=None)
def _sparse_read_function(device, local_device, dtype):
  """A tf.function: rows of a variable gathered on `device`, returned on `local_device`."""

  @tf.function(autograph=False, reduce_retracing=True)
  def gather(handle, indices):
    with tf.device(device):
      rows = tf.raw_ops.ResourceGather(resource=handle, indices=indices, dtype=dtype)
    with tf.device(local_device):
      return tf.identity(rows)

  return gather


@functools.lru_cache(maxsize=None)
def _read_function(device, local_device, dtype):
  """A tf.function: a variable's value read on `device`, returned on `local_device`."""

  @tf.function(autograph=False, reduce_retracing=True)
  def read(handle):
    with tf.device(device):
      value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
    with tf.device(local_device):
      return tf.identity(value)

  return read


@functools.lru_cache(maxsize=None)
def _create_if_missing_fn(device, dtype):
  """A tf.function on `device`: (handle, value) -> (created, shape), under the PS mutex."""

  @tf.function(input_signature=[tf.TensorSpec([], tf.resource), tf.TensorSpec(None, dtype)],
               autograph=False)
  def create_if_missing(handle, value):
    with tf.device(device):
      lock = tf.raw_ops.MutexLock(mutex=tf.raw_ops.MutexV2(shared_name=INIT_LOCK_NAME))
      with tf.control_dependencies([lock]):
        exists = tf.raw_ops.VarIsInitializedOp(resource=handle)

      def create():
        with tf.control_dependencies(
            [tf.raw_ops.AssignVariableOp(resource=handle, value=value)]):
          return tf.constant(True)

      created = tf.cond(exists, lambda: tf.constant(False), create)
      with tf.control_dependencies([created]):
        shape = tf.raw_ops.VariableShape(input=handle, out_type=tf.int64)
      with tf.control_dependencies([shape]):
        released = tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)
      with tf.control_dependencies([released]):
        return tf.identity(created), tf.identity(shape)

  return create_if_missing


def create_shared_variable(*, device, local_device, shared_name, initial_value, shape=None,
                           trainable=None, synchronization=None, aggregation=None,
                           constraint=None, guard=None):
  """Creates (or binds to) the variable `shared_name` on the PS device `device`.

  Args:
    device: the PS device, such as "/job:ps/replica:0/task:0/device:CPU:0".
    local_device: a device of this process; the variable's handle object lives there.
    shared_name: the name every worker uses for this variable.
    initial_value: an eager tensor; assigned only if the variable does not exist yet.
    shape: the variable's shape (default: the initial value's).
    trainable, synchronization, aggregation, constraint: as for `tf.Variable`.
    guard: the connection's `StepGuard`: creating the variable runs under it, and the
      variable's eager methods raise `ClusterError` once it has seen a task fail.

  Returns:
    A `SharedVariable`.

  Raises:
    ValueError: the variable exists on its PS task with another shape. (Another dtype
      is not detected here: TensorFlow has no op that tells a variable's dtype without
      reading it, and a read in the wrong dtype of a variable once read sparsely aborts
      the PS task.)
  """
  initial_value = tf.convert_to_tensor(initial_value)
  dtype = initial_value.dtype.base_dtype
  shape = initial_value.shape if shape is None else tf.TensorShape(shape)

  def connect_once():
    with tf.device(device):
      remote = tf.raw_ops.VarHandleOp(dtype=dtype, shape=shape, shared_name=shared_name,
                                      container="")
    try:
      handle = _tf_internal.copy_to_device(remote, local_device)
    except RuntimeError as e:  # A lost connection: raised as an op's error would be.
      translated = _faults.as_op_error(e)
      if translated is e:
        raise
      raise translated from e
    _, found = _create_if_missing_fn(device, dtype)(handle, initial_value)
    return handle, tf.TensorShape(found.numpy().tolist())

  def connect():
    # Create-if-missing is idempotent: a connection that gRPC is still re-opening (just
    # after a task restarted) is retried for a moment before the error counts.
    deadline = time.monotonic() + _RETRY_SECONDS
    while True:
      try:
        return connect_once()
      except tf.errors.UnavailableError:
        if time.monotonic() > deadline:
          raise
        time.sleep(_RETRY_PAUSE)

  if guard is None:
    handle, found = connect()
  else:
    handle, found = guard.run(connect, f"creating variable {shared_name!r} on {device}")
  if not shape.is_compatible_with(found):
    raise ValueError(
        f"Variable {shared_name!r} already exists on {device} with shape {found}, but "
        f"this program creates it with shape {shape}. Workers that share a cluster must "
        "create the same variables in the same order; restart the parameter servers to "
        "start from scratch.")
  return SharedVariable(handle=handle, device=device, shared_name=shared_name, shape=shape,
                        dtype=dtype, trainable=trainable, synchronization=synchronization,
                        aggregation=aggregation, constraint=constraint, guard=guard,
                        local_device=local_device)
