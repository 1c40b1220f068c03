"""What the current thread is building: device scope, variable creators, control inputs.

A tower thread starts from the calling thread's TensorFlow state, which has no public
reader or setter. Collectives also need to know whether they are being built in a
`tf.while_loop` body, which only the graph's class says. And TensorFlow keeps some
Python objects of every thread's eager state after the thread ends, which only its
per-thread record can let go of.
"""

from tensorflow.python.eager import context as _eager_context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import ops as _ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_func_graphs  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf


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


def op_callbacks():
  """The calling thread's op callbacks (`tf.debugging.enable_check_numerics()` adds one).

  The list itself, to share with another thread through `set_op_callbacks`: TensorFlow
  keeps them per thread and has no public reader.
  """
  return _eager_context.context()._thread_local_data.op_callbacks  # pylint: disable=protected-access


def set_op_callbacks(callbacks):
  """Makes `callbacks` (from `op_callbacks`) the calling thread's op callbacks."""
  _eager_context.context()._thread_local_data.op_callbacks = callbacks  # pylint: disable=protected-access


def release_thread_state():
  """Lets go of the Python objects TensorFlow keeps for the calling thread; call it last.

  TensorFlow's record of a thread's eager state (its op callbacks list, its function
  call options, its executor) outlives the thread and keeps those objects forever, so a
  program that starts a thread per step grows without bound. Pointing them at shared
  or empty values frees them. The thread must run no TensorFlow code afterwards.
  """
  data = _eager_context.context()._thread_local_data  # pylint: disable=protected-access
  data.op_callbacks = _NO_CALLBACKS
  data.function_call_options = None
  data.executor = None


_NO_CALLBACKS = ()  # Immutable: a thread that breaks the rule above fails, not the others.
