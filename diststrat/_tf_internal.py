"""Every place where diststrat reaches past the public API of TensorFlow or Keras.

Nothing else in diststrat imports `tensorflow.python`, touches a private attribute of a
TensorFlow or Keras object, or parses TensorFlow's error text. Each reach is one named
function or class below, with the reason no public API does the job, and
tests/test_tf_internal.py has one test per name: after a TensorFlow or Keras upgrade,
the test named after the wrapper that broke fails, instead of a user's training step.

Reaches, by what needs them:

- Tower threads start from the calling thread's state, which has no public reader or
  setter: the device scope (`current_device`), the variable creator stack
  (`variable_creator_stack`, `set_variable_creator_stack`) and the control dependencies
  (`current_control_dependencies`).
- Collective ops have no public API outside `tf.distribute`, which diststrat does not
  build on (`collective_all_reduce`, `collective_all_gather`, and `in_while_loop`, which
  picks the op version); nor has setting up
  collectives across processes on the gRPC runtime, checking a peer's health, or
  aborting collectives that wait for a dead peer (`enable_cross_process_collectives`,
  `check_peer_health`, `abort_collectives`).
- Calling a traced function with a flat list of tensors (`call_flat`): the public call
  binds every argument in Python, ~7 us per tensor; a `batch_reduce` of 50 tensors on 4
  devices passes 200.
- Variables shared across processes by name (cluster mode): no public class wraps an
  existing resource handle as a `tf.Variable` (`ResourceVariableFromHandle`,
  `RESOURCE_METHODS`, `wrap_resource_methods`), and no public op brings a remote
  resource handle to this process (`copy_to_device`).
- Connecting to a cluster blocks, with no timeout, while a task is down or frozen
  (TensorFlow's remote device discovery waits for the task): a task is asked first
  whether it answers, with the same RPC and a deadline (`probe_tf_server`).
- Cluster faults are told apart only by the text of TensorFlow's errors
  (`error_summary`, `tasks_named_in_error`, `error_means_task_restarted`,
  `error_means_connection_lost`), and reach the
  user from inside TensorFlow's own calls (an op, a `tf.function` step), where only a
  hook in TensorFlow's error path can give them diststrat's type
  (`install_error_translator`).
- Keras 3 variables hold their TensorFlow variable in `_value`
  (`keras_backing_variable`), and a Keras optimizer keeps the tf.distribute strategy it
  was created under in `_distribution_strategy` (`keras_optimizer_strategy`).
- Keras 3 and TensorFlow learn about a distribution strategy only from TensorFlow's
  per-thread distribution-mode stack, which has no public setter: diststrat puts an entry
  there while one of its contexts is current (`tf_distribution_mode`), so
  `tf.distribute.get_strategy()` answers for diststrat (see diststrat/_tf_distribute_bridge.py).
- Which Keras code is creating a variable (layer state, a random seed's state) is told by
  no argument of the variable creator; the creating frames say it
  (`keras_variable_origin`).
- The pipeline (diststrat/pipeline) runs its own backward schedule: it records one tape
  entry whose inputs it chooses (`record_backward`, `should_record`) and pauses every
  tape of the thread while re-materialized stages run (`stop_recording`).
  `tf.custom_gradient` would route every variable it reads through one op on the
  caller's device, copying each stage's weights there every step.
- Inside `tf.function`, AutoGraph rebuilds errors raised in converted code from their
  message, as another type (`StagingError`) and without their notes, unless they are
  marked to pass through (`pass_through_autograph`, `pass_through_autograph_class`).
- Read caching (cluster/_read_cache.py) hands a tower a value read earlier instead of
  reading the variable again, and must make tapes treat it as a read of the variable:
  watch the variable as a read would (`variable_accessed`) and record the value as a
  function of the variable's handle (`record_variable_read`). `tf.custom_gradient`
  around the handle still needs the first, and fails for forward accumulators in a
  graph ("dtype resource is not compatible").

Protocols: methods TensorFlow calls on diststrat's objects by private names. They are
defined where the objects are; their names are listed here and tested:

- `_should_act_as_resource_variable`, `_dense_var_to_tensor`, `_shared_name`,
  `_unique_id`, `_in_graph_mode`: a distributed variable is used as a resource variable
  by tapes, ops and `tf.Module` (values/_variables.py).
- `_serialize_to_tensors`, `_restore_from_tensors`, `_copy_trackable_to_cpu`: how
  `tf.train.Checkpoint` saves a trackable (values/_variables.py).
- `_create_or_restore_slot_variable`: how `tf.train.Checkpoint` hands an optimizer the
  saved value of a slot that does not exist yet (optimizers/_optimizer.py).
- `_export_to_saved_model_graph`, `_write_object_proto`: how `tf.saved_model.save` (and
  Keras's `model.export`) writes a variable into a SavedModel (values/_variables.py).
- `_distributed_container`: how a Keras optimizer finds the variable that owns the copy
  it updates, to find that variable's slots (values/_variables.py).
- `_use_merge_call`, `_retrace_functions_for_each_device`: what TensorFlow asks
  `tf.distribute.get_strategy().extended` besides its public methods
  (diststrat/_tf_distribute_bridge.py).
"""

import contextlib
import functools
import inspect
import re
import sys
import threading

import grpc  # TensorFlow's own dependency: its gRPC runtime.

from tensorflow.python.eager import context as _eager_context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import core as _eager_core  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import execute as _execute  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record as _record  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import ops as _ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.core.protobuf import tensorflow_server_pb2 as _server_pb2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import collective_ops as _collective_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_func_graphs  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf

PROTOCOLS = {
    "distributed variables": ("_should_act_as_resource_variable", "_dense_var_to_tensor",
                              "_shared_name", "_unique_id", "_in_graph_mode"),
    "checkpoints": ("_serialize_to_tensors", "_restore_from_tensors",
                    "_copy_trackable_to_cpu"),
    "optimizer slots": ("_create_or_restore_slot_variable",),
    "SavedModel": ("_export_to_saved_model_graph", "_write_object_proto"),
    "Keras optimizer slots": ("_distributed_container",),
    "tf.distribute bridge": ("_use_merge_call", "_retrace_functions_for_each_device"),
}
"""The private method names TensorFlow calls on diststrat's objects, by purpose."""


class TensorFlowInternalsError(ImportError):
  """A private TensorFlow or Keras API that diststrat relies on is missing or changed."""


def _missing(what, detail):
  return TensorFlowInternalsError(
      f"diststrat relies on {what}, which this TensorFlow ({tf.__version__}) does not "
      f"provide as expected: {detail}. diststrat is tested with TensorFlow 2.16 to 2.21; "
      "install one of those, or report this with the version you use.")


# --- state a tower thread inherits from the calling thread -----------------------------


class _DeviceProbe:
  """Stands in for an Operation so the graph's device functions can name its device."""

  def __init__(self):
    self.device = ""
    self.type = ""
    self.name = ""
    self.node_def = None

  def _set_device(self, device):  # Called by TensorFlow's device functions.
    self.device = device if isinstance(device, str) else device.to_string()

  def _set_device_from_string(self, device_str):
    self.device = device_str


def current_device():
  """The device of the innermost `tf.device` scope ('' when none), eager or in a graph."""
  if tf.executing_eagerly():
    return _eager_context.context().device_name or ""
  probe = _DeviceProbe()
  _ops.get_default_graph()._apply_device_functions(probe)  # pylint: disable=protected-access
  return probe.device or ""


def variable_creator_stack():
  """The current thread's variable creator stack of the default graph (an opaque copy).

  Give it back to `set_variable_creator_stack`; `variable_creators` lists its functions.
  """
  return list(_ops.get_default_graph()._variable_creator_stack)  # pylint: disable=protected-access


def variable_creators():
  """The creator functions in effect in this thread, innermost last."""
  # TensorFlow 2.21 keeps (priority, function) pairs; some versions keep the functions.
  return [entry[1] if isinstance(entry, tuple) else entry for entry in variable_creator_stack()]


def set_variable_creator_stack(stack):
  """Installs `stack` (from `variable_creator_stack`) on this thread's default graph."""
  _ops.get_default_graph()._variable_creator_stack = list(stack)  # pylint: disable=protected-access


def current_control_dependencies():
  """The control inputs in force in the current graph (empty in eager mode)."""
  if tf.executing_eagerly():
    return []
  return list(_ops.get_default_graph()._current_control_dependencies())  # pylint: disable=protected-access


# --- collectives and fast calls ----------------------------------------------------------


_ORDERING_TOKENS = {}  # device -> a resource variable on it (see `_ordering_token`)
_ORDERING_TOKENS_LOCK = threading.Lock()


def in_while_loop():
  """Whether ops built now run in the body (or condition) of a `tf.while_loop`.

  True also inside a `tf.function` traced from such a body (Keras's steps, with
  `steps_per_execution` > 1, are traced from the body of its loop).
  """
  graph = _ops.get_default_graph()
  while graph is not None:
    if isinstance(graph, (_cf_func_graphs.WhileBodyFuncGraph,
                          _cf_func_graphs.WhileCondFuncGraph)):
      return True
    graph = getattr(graph, "outer_graph", None)
  return False


def _ordering_token():
  """The ordering token of the current device scope: a resource that orders collectives.

  The V2 collective ops take it as an input, so TensorFlow's automatic control
  dependencies chain the collectives of one device one after another (as every member
  of every process builds them in the same order) and leave the members on other
  devices of the same function free: chained together they would wait for each other.
  One resource per device, made once, outside any function.
  """
  device = current_device()
  with _ORDERING_TOKENS_LOCK:
    token = _ORDERING_TOKENS.get(device)
    if token is None:
      with _ops.init_scope(), tf.device(device):
        # The class itself, not tf.Variable: no strategy's variable creator sees it.
        token = _resource_variable_ops.ResourceVariable(
            0.0, trainable=False, name="diststrat_collective_ordering_token")
      _ORDERING_TOKENS[device] = token
  return [token.handle]


# Which op: the V1 collective ops keep the parameters they resolved inside the kernel,
# and run again in a `tf.while_loop` body before an earlier run finished everywhere (Keras
# with `steps_per_execution` > 1) they fail intermittently across processes with
# "CollectiveRegistry::Lookup did not find collective implementation". The V2 ops resolve
# them per run and are safe there, but with a timeout each run holds two threads (one
# V1) until the timeout expires, finished or not: outside loops, the V1 op halves that.


def collective_all_reduce(value, group_size, group_key, instance_key, mean, timeout,
                          communication_hint="auto"):
  """One member of a collective sum: every member gets the total.

  Build it under `tf.device` of the member's device. `CollectiveReduceV2` with an
  ordering token per device (`_ordering_token`) inside a `tf.while_loop`, else the V1
  `CollectiveReduce` (see the note above).

  Args:
    value: this member's tensor.
    group_size, group_key, instance_key: the collective's group and instance.
    mean: divide the total by `group_size` (the op's division truncates integers).
    timeout: seconds to wait for the other members; 0 waits forever.
    communication_hint: "auto" (a ring on CPUs) or "nccl".
  """
  final_op = "Div" if mean else "Id"
  if in_while_loop():
    return _collective_ops.all_reduce_v2(
        value, group_size, group_key, instance_key, merge_op="Add", final_op=final_op,
        communication_hint=communication_hint, timeout=timeout,
        ordering_token=_ordering_token())
  return _collective_ops.all_reduce(
      value, group_size, group_key, instance_key, merge_op="Add", final_op=final_op,
      communication_hint=communication_hint, timeout=timeout)


def collective_all_gather(value, group_size, group_key, instance_key, timeout):
  """One member of a collective gather: every member gets all values, concatenated along
  the first axis in group-rank order. Every member's value has the same shape. V2 in a
  `tf.while_loop`, else V1, as `collective_all_reduce`."""
  if in_while_loop():
    return _collective_ops.all_gather_v2(value, group_size, group_key, instance_key,
                                         timeout=timeout, ordering_token=_ordering_token())
  return _collective_ops.all_gather(value, group_size, group_key, instance_key,
                                    timeout=timeout)


def collective_all_reduce_max(value, group_size, group_key, instance_key, timeout):
  """One member of a collective maximum (merge_op "Max"); V2 or V1 as above."""
  if in_while_loop():
    return _collective_ops.all_reduce_v2(value, group_size, group_key, instance_key,
                                         merge_op="Max", final_op="Id", timeout=timeout,
                                         ordering_token=_ordering_token())
  return _collective_ops.all_reduce(value, group_size, group_key, instance_key,
                                    merge_op="Max", final_op="Id", timeout=timeout)


def enable_cross_process_collectives(cluster_spec, task_type, task_id, leader):
  """Makes this process a task of `cluster_spec` that runs collectives with the others.

  Starts this task's gRPC server on its address in the spec. Must run before this
  process's TensorFlow context is initialized (before any op).

  Args:
    cluster_spec: a `tf.train.ClusterSpec`.
    task_type, task_id: this process's task.
    leader: the task that leads collective groups, such as "/job:worker/replica:0/task:0".

  Raises:
    RuntimeError: TensorFlow was initialized already (an op ran, devices were listed).
  """
  context = _eager_context.context()
  context.configure_collective_ops(collective_leader=leader,
                                   scoped_allocator_enabled_ops=("CollectiveReduce",))
  address = cluster_spec.task_address(task_type, task_id)
  server_def = _server_pb2.ServerDef(
      cluster=cluster_spec.as_cluster_def(), job_name=task_type, task_index=task_id,
      protocol="grpc", port=int(address.rsplit(":", 1)[1]),
      # Without this, every collective across processes times out (TF_NOTES).
      default_session_config=context.config)
  context.enable_collective_ops(server_def)
  context.ensure_initialized()


def check_peer_health(task, timeout):
  """Returns if `task` (a collective peer) is alive within `timeout` seconds, else raises.

  Raises:
    tf.errors.UnavailableError: the task is down; FailedPreconditionError: it
      restarted; DeadlineExceededError: it did not answer in time.
  """
  _eager_context.context().check_collective_ops_peer_health(
      task, timeout_in_ms=max(1, int(timeout * 1000)))


def abort_collectives(message):
  """Aborts every collective of this process; later ones fail at once (sticky)."""
  _eager_context.context().abort_collective_ops(14, message)  # 14: UNAVAILABLE.


_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def probe_tf_server(addresses, timeout):
  """Asks each TensorFlow server at `addresses` for its devices, all at once.

  The RPC TensorFlow's remote device discovery sends, with a deadline: a server that is
  down refuses at once, a frozen one does not answer in time (its kernel still accepts
  TCP connections, so only an RPC tells). Touches no TensorFlow state.

  Args:
    addresses: "host:port" strings.
    timeout: seconds the servers have to answer.

  Returns:
    One entry per address: None if it answered, else a short description of the failure
    ("cannot be reached (UNAVAILABLE: ...)" or "did not answer within N s").
  """
  channels, calls = [], []
  try:
    for address in addresses:
      channel = grpc.insecure_channel(address)
      channels.append(channel)
      stub = channel.unary_unary(_GET_STATUS, request_serializer=lambda _: b"",
                                 response_deserializer=lambda raw: raw)
      calls.append(stub.future(None, timeout=timeout))
    outcomes = []
    for call in calls:
      try:
        call.result()
        outcomes.append(None)
      except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
          outcomes.append(f"did not answer within {timeout:g} s (frozen, overloaded or cut "
                          "off)")
        else:
          outcomes.append(f"cannot be reached ({e.code().name}: {e.details()})")
    return outcomes
  finally:
    for channel in channels:
      channel.close()


_FAST_CALL_PARAMETERS = ["self", "tensor_inputs", "captured_inputs"]


@functools.lru_cache(maxsize=None)
def _has_fast_call(cls):
  method = getattr(cls, "_call_flat", None)
  try:
    return method is not None and list(
        inspect.signature(method).parameters) == _FAST_CALL_PARAMETERS
  except (TypeError, ValueError):  # pragma: no cover - depends on the TensorFlow version
    return False


def call_flat(concrete_function, tensors):
  """Calls `concrete_function` (traced with `*tensors`) on `tensors`; returns its outputs.

  Uses the concrete function's private flat call when it has the signature we know, and
  the public call (slower, same result) otherwise.
  """
  if _has_fast_call(type(concrete_function)):
    return concrete_function._call_flat(list(tensors), concrete_function.captured_inputs)  # pylint: disable=protected-access
  return concrete_function(*tensors)


# --- variables around a resource handle (cluster mode) -----------------------------------


class ResourceVariableFromHandle(_resource_variable_ops.BaseResourceVariable):
  """A `tf.Variable` around a resource handle that already exists.

  `BaseResourceVariable` gives every `tf.Variable` behaviour (tapes, assign*, scatter_*,
  checkpoints, `tf.function` captures); its constructor takes the handle through private
  arguments.
  """

  def __init__(self, *, handle, shape, dtype, name, trainable=None, synchronization=None,
               aggregation=None, constraint=None, unique_id):
    super().__init__(
        trainable=trainable, shape=shape, dtype=dtype, handle=handle,
        constraint=constraint, synchronization=synchronization, aggregation=aggregation,
        name=name, unique_id=unique_id, handle_name=name, in_graph_mode=False)


RESOURCE_METHODS = (
    "_read_variable_op", "read_value", "read_value_no_copy", "sparse_read",
    "is_initialized", "assign", "assign_add", "assign_sub", "scatter_sub", "scatter_add",
    "scatter_max", "scatter_min", "scatter_mul", "scatter_div", "scatter_update",
    "scatter_nd_sub", "scatter_nd_add", "scatter_nd_update", "scatter_nd_max",
    "scatter_nd_min", "_strided_slice_assign",
)
"""The methods of a resource variable that run an op on its resource.

Not `gather_nd` and `batch_scatter_update`: run eagerly on a remote device, their shape
functions do not see the variable's shape and fail (plain remote tf.Variables fail the
same way in TF 2.21); TensorFlow places them by the resource when left alone.
"""

READ_METHODS = ("_read_variable_op", "read_value", "read_value_no_copy")
"""The methods of `RESOURCE_METHODS` that return the variable's value."""


def wrap_resource_methods(cls, wrap):
  """Replaces each method of `RESOURCE_METHODS` on `cls` by `wrap(name, method)`.

  Raises:
    TensorFlowInternalsError: `BaseResourceVariable` lacks one of them (a method left
      unwrapped would silently run in the wrong place).
  """
  base = _resource_variable_ops.BaseResourceVariable
  missing = [name for name in RESOURCE_METHODS if not callable(getattr(base, name, None))]
  if missing:
    raise _missing("BaseResourceVariable's methods " + ", ".join(RESOURCE_METHODS),
                   f"missing {', '.join(missing)}")
  for name in RESOURCE_METHODS:
    setattr(cls, name, functools.wraps(getattr(base, name))(wrap(name, getattr(base, name))))


_CONNECTION_LOST = re.compile(
    r"failed to connect|Connection refused|Connection reset|Socket closed|UNAVAILABLE|"
    r"grpc_status:14", re.IGNORECASE)


def copy_to_device(tensor, device):
  """Copies an eager tensor to `device`, whatever its dtype (resource handles included).

  `tf.identity` of a resource handle runs where the resource lives, so it cannot bring a
  parameter server's handle to the worker; the eager tensor's own copy can. A failed
  remote copy raises a bare RuntimeError; it is raised as `UnavailableError` when its
  text says the connection was lost, the type an op's failure would have.
  """
  try:
    return tensor._copy_to_device(device)  # pylint: disable=protected-access
  except RuntimeError as e:
    if _CONNECTION_LOST.search(str(e)):
      raise tf.errors.UnavailableError(None, None, str(e)) from e
    raise


# --- what TensorFlow's error text says ---------------------------------------------------

_TASK_PATTERN = re.compile(r"/job:[A-Za-z0-9_]+/replica:\d+/task:\d+")
_RESTARTED_PATTERN = re.compile(
    r"context_id|Unable to find the relevant tensor|incarnation|was probably restarted")
_NOISE = ("Graph execution error", "Detected at node", "<stack traces", "root error(s)",
          "(most recent call last)", "Additional GRPC error information")


def error_summary(error, limit=200):
  """The line of a TensorFlow error's message that says what happened (at most `limit`)."""
  text = error.message if isinstance(error, tf.errors.OpError) else str(error)
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  useful = [line for line in lines if not any(noise in line for noise in _NOISE)]
  line = (useful or lines or [""])[0]
  line = re.sub(r"^\(\d+\)\s*", "", line)  # "(0) UNAVAILABLE: ..." -> "UNAVAILABLE: ..."
  return line if len(line) <= limit else line[:limit - 3] + "..."


def tasks_named_in_error(error, tasks):
  """The tasks of `tasks` (such as "/job:ps/replica:0/task:0") that `error` names."""
  named = set(_TASK_PATTERN.findall(str(error)))
  return [t for t in tasks if t in named]


def error_means_connection_lost(error):
  """Whether an error's text says a connection to a remote task failed.

  TensorFlow reports some lost connections as `InternalError` or `UnknownError` ("This
  should never happen"), with the gRPC status (14, UNAVAILABLE) only in the text.
  """
  return bool(_CONNECTION_LOST.search(str(error)))


def error_means_task_restarted(error):
  """Whether a TensorFlow error says a remote task restarted (its state is gone).

  TensorFlow raises these as `AbortedError`, `InvalidArgumentError` or `NotFoundError`,
  told apart from other errors of those types only by their text.
  """
  return isinstance(error, (tf.errors.AbortedError, tf.errors.InvalidArgumentError,
                            tf.errors.NotFoundError)) and bool(
                                _RESTARTED_PATTERN.search(str(error)))


_TRANSLATOR_MARK = "_diststrat_translator"
# Where TensorFlow 2.21 raises errors of eager ops and function calls: ops on the fast
# path build them in core._status_to_exception; the others, and every tf.function call,
# come out of execute.quick_execute (also named execute.execute, and used by
# execute_with_cancellation's callers).
_EXECUTE_NAMES = ("quick_execute", "execute", "execute_with_cancellation")


def _wrap_raising(function, translate):
  def wrapper(*args, **kwargs):
    try:
      return function(*args, **kwargs)
    except tf.errors.OpError as e:
      translated = _translate_safely(translate, e)
      if translated is e:
        raise
      raise translated from e
  setattr(wrapper, _TRANSLATOR_MARK, function)
  return wrapper


def _translate_safely(translate, error):
  try:
    return translate(error)
  except Exception:  # pylint: disable=broad-except
    return error  # A translator that fails leaves the error as TensorFlow made it.


def install_error_translator(translate):
  """Passes every error raised by an eager op or a `tf.function` call to `translate`.

  `translate(error)` returns the exception to raise: the same one, or another (raised
  from it). Installing again replaces the translator; `uninstall_error_translator`
  restores TensorFlow's own functions.

  Raises:
    TensorFlowInternalsError: TensorFlow no longer has the functions it wraps.
  """
  uninstall_error_translator()
  missing = [n for n in _EXECUTE_NAMES if not callable(getattr(_execute, n, None))]
  if not callable(getattr(_eager_core, "_status_to_exception", None)):
    missing.append("core._status_to_exception")
  if missing:
    raise _missing("TensorFlow's eager error path", f"missing {', '.join(missing)}, so "
                   "cluster faults would keep TensorFlow's error types")
  for name in _EXECUTE_NAMES:
    setattr(_execute, name, _wrap_raising(getattr(_execute, name), translate))
  original = _eager_core._status_to_exception  # pylint: disable=protected-access

  def status_to_exception(status):
    return _translate_safely(translate, original(status))

  setattr(status_to_exception, _TRANSLATOR_MARK, original)
  _eager_core._status_to_exception = status_to_exception  # pylint: disable=protected-access


def uninstall_error_translator():
  """Restores TensorFlow's own error path (undoes `install_error_translator`)."""
  for module, names in ((_execute, _EXECUTE_NAMES), (_eager_core, ("_status_to_exception",))):
    for name in names:
      original = getattr(getattr(module, name, None), _TRANSLATOR_MARK, None)
      if original is not None:
        setattr(module, name, original)


# --- tapes ----------------------------------------------------------------------------


def record_backward(op_name, outputs, inputs, backward):
  """Records on every active tape of this thread: `outputs` were computed from `inputs`.

  `backward(*output_gradients)` returns one gradient (or None) per input. What
  `tf.custom_gradient` is built on, without its routing through one device.
  """
  _record.record_operation_backprop_only(op_name, outputs, inputs, backward)


def stop_recording():
  """Context manager: no tape of this thread records while it is entered."""
  return _record.stop_recording()


def variable_accessed(variable):
  """Tells this thread's tapes, and the graph being built, that `variable` was read.

  What every read of a resource variable does first: tapes that watch accessed
  variables start watching it (`tape.watched_variables()` lists it), and a `FuncGraph`
  marks it as used. No public API does this without running a read op on the
  variable's own device.
  """
  _resource_variable_ops.variable_accessed(variable)


def record_variable_read(variable, value):
  """Records `value` on this thread's tapes as a read of `variable` (gradient: identity).

  The record TensorFlow makes for a read inside a graph, on the variable's handle,
  which `tape.watch(variable)` and `tape.gradient(..., variable)` look up; it replaces
  what the tapes recorded for `value` before. In a graph, forward accumulators
  (`tf.autodiff.ForwardAccumulator`) watch the graph's capture of the handle instead,
  so the read is recorded for them on the capture too.
  """
  _record.record_operation("ReadVariableOp", [value], [variable.handle],
                           backward_function=lambda grad: [grad],
                           forward_function=lambda tangent: [tangent])
  if not tf.executing_eagerly():
    captured = tf.convert_to_tensor(variable.handle)  # This graph's capture of it.
    if captured is not variable.handle:
      _record.record_operation_forwardprop_only(
          "ReadVariableOp", [value], [captured], backward_function=lambda grad: [grad],
          forwardprop_output_indices=None)


def should_record(tensors):
  """True when some active tape of this thread watches one of `tensors`."""
  return _record.should_record_backprop(tensors)


# --- Keras ---------------------------------------------------------------------------


def keras_backing_variable(value):
  """The `tf.Variable` a Keras 3 variable holds, or None if `value` is not one.

  Keras 3 keeps it in `_value`; its public `.value` reads the variable instead.
  """
  if type(value).__module__.startswith("keras") and hasattr(value, "_value"):
    inner = getattr(value, "_value")
    if isinstance(inner, tf.Variable):
      return inner
  return None


def keras_optimizer_strategy(optimizer):
  """The `tf.distribute` strategy a Keras 3 optimizer captured when created, or None.

  Keras's TensorFlow optimizer applies its updates through that strategy, and has no
  public accessor for it.
  """
  return getattr(optimizer, "_distribution_strategy", None)


# Where Keras 3 (TensorFlow backend) makes the tf.Variable behind a `keras.Variable`, and
# where a SeedGenerator makes its state: the modules are looked up among those already
# imported (a Keras variable being created means Keras is loaded), never imported here.
_KERAS_VARIABLE_MODULE = "keras.src.backend.tensorflow.core"
_KERAS_SEED_MODULE = "keras.src.random.seed_generator"
_KERAS_FRAMES_SEARCHED = 60


def _keras_code(module_name, path):
  obj = sys.modules.get(module_name)
  for name in path:
    obj = getattr(obj, name, None)
  return getattr(obj, "__code__", None)


def keras_variable_origin():
  """Who is creating the variable being created now: "seed", "keras" or None.

  "keras": a `keras.Variable` (layer weights and state, optimizer and metric variables)
  is making its TensorFlow variable; "seed": that variable is the state of a Keras
  `SeedGenerator` (Dropout and every random layer); None: anything else. Call it from a
  variable creator. Keras passes nothing that says so, so the calling frames are
  searched for `keras.Variable._initialize` and `SeedGenerator.__init__`.
  """
  variable_init = _keras_code(_KERAS_VARIABLE_MODULE, ("Variable", "_initialize"))
  if variable_init is None:
    return None
  seed_init = _keras_code(_KERAS_SEED_MODULE, ("SeedGenerator", "__init__"))
  frame = sys._getframe(1)  # pylint: disable=protected-access
  origin = None
  for _ in range(_KERAS_FRAMES_SEARCHED):
    if frame is None:
      break
    if frame.f_code is variable_init:
      origin = "keras"
    elif frame.f_code is seed_init:
      return "seed" if origin else None
    frame = frame.f_back
  return origin


# --- TensorFlow's distribution-mode stack ------------------------------------------------


class _DistributionMode:
  """An entry of TensorFlow's per-thread distribution-mode stack (three attributes)."""

  def __init__(self, strategy, cross_replica_context, replica_context):
    self.strategy = strategy
    self.cross_replica_context = cross_replica_context
    self.replica_context = replica_context


def _distribution_mode_stack():
  stack = getattr(_ops.get_default_graph(), "_distribution_strategy_stack", None)
  if not isinstance(stack, list):
    raise _missing("the per-thread distribution stack of TensorFlow's graphs "
                   "(Graph._distribution_strategy_stack)",
                   "it is gone, so Keras would train on one device under diststrat")
  return stack


@contextlib.contextmanager
def tf_distribution_mode(strategy, replica_context=None):
  """Makes `tf.distribute` report `strategy` (and `replica_context`) in this thread.

  While entered, `tf.distribute.get_strategy()` returns `strategy`, `has_strategy()` is
  True, and `get_replica_context()` returns `replica_context`; with `replica_context`
  None it is the cross-replica context of `strategy`. The entry goes on the current
  default graph's stack (a `tf.function` being traced copies the stack of the graph
  around it) and is removed from that same stack on exit.
  """
  stack = _distribution_mode_stack()
  entry = _DistributionMode(strategy, strategy if replica_context is None else None,
                            replica_context)
  stack.append(entry)
  try:
    yield
  finally:
    for i in range(len(stack) - 1, -1, -1):
      if stack[i] is entry:
        del stack[i]
        break


# --- AutoGraph ---------------------------------------------------------------------------

_AUTOGRAPH_PASS_THROUGH = "ag_pass_through"
_AUTOGRAPH_METADATA = "ag_error_metadata"


def pass_through_autograph(error):
  """Makes AutoGraph re-raise `error` itself: same type, message and notes.

  AutoGraph leaves alone an error that has `ag_pass_through`; one that already carries
  its `ag_error_metadata` (attached in converted code deeper down, such as a tower
  function) would be rebuilt at the top, so that is removed.
  """
  setattr(error, _AUTOGRAPH_PASS_THROUGH, True)
  if _AUTOGRAPH_METADATA in getattr(error, "__dict__", {}):
    delattr(error, _AUTOGRAPH_METADATA)
  return error


def pass_through_autograph_class(cls):
  """Class decorator: every error of `cls` passes through AutoGraph as itself."""
  setattr(cls, _AUTOGRAPH_PASS_THROUGH, True)
  return cls
