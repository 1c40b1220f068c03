"""The few places where diststrat reaches past TensorFlow's public API.

Nothing else in diststrat imports `tensorflow.python`. What is here, and why:

- Per-thread state that a library running model code in its own threads must carry over
  from the calling thread: the current graph's device stack, its variable creator
  stack and control dependencies. There is no public API to read or re-install these.
- Collective ops: TensorFlow has no public API for them outside `tf.distribute`, and
  diststrat builds on primitives, not on `tf.distribute` (SPEC, preamble).
- Calling a traced function with a flat list of tensors: the public call binds every
  argument to the function's signature in Python, which costs ~7 us per tensor; a
  `batch_reduce` of 50 tensors on 4 devices passes 200. `call_flat` skips the binding,
  and falls back to the public call if TensorFlow renames what it uses.
"""

import inspect

from tensorflow.python.eager import context as _context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import ops as _ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import,unused-import

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
    return _context.context().device_name or ""
  probe = _DeviceProbe()
  _ops.get_default_graph()._apply_device_functions(probe)  # pylint: disable=protected-access
  return probe.device or ""


def variable_creator_stack():
  """The current thread's variable creator stack of the default graph (a copy)."""
  return list(_ops.get_default_graph()._variable_creator_stack)  # pylint: disable=protected-access


def set_variable_creator_stack(stack):
  """Installs `stack` as this thread's variable creator stack of the default graph."""
  _ops.get_default_graph()._variable_creator_stack = list(stack)  # pylint: disable=protected-access


def current_control_dependencies():
  """The control inputs in force in the current graph (empty in eager mode)."""
  if tf.executing_eagerly():
    return []
  return list(_ops.get_default_graph()._current_control_dependencies())  # pylint: disable=protected-access


def executing_eagerly_outside_functions():
  return _ops.executing_eagerly_outside_functions()


_FAST_CALL_PARAMETERS = ["self", "tensor_inputs", "captured_inputs"]
_fast_call_ok = {}  # ConcreteFunction class -> whether its _call_flat is the one we know


def _has_fast_call(cls):
  if cls not in _fast_call_ok:
    method = getattr(cls, "_call_flat", None)
    try:
      _fast_call_ok[cls] = method is not None and list(
          inspect.signature(method).parameters) == _FAST_CALL_PARAMETERS
    except (TypeError, ValueError):  # pragma: no cover - depends on the TensorFlow version
      _fast_call_ok[cls] = False
  return _fast_call_ok[cls]


def call_flat(concrete_function, tensors):
  """Calls `concrete_function` (traced with `*tensors`) on `tensors`; returns its outputs."""
  if _has_fast_call(type(concrete_function)):
    return concrete_function._call_flat(list(tensors), concrete_function.captured_inputs)  # pylint: disable=protected-access
  return concrete_function(*tensors)


# --- Variables shared across processes (cluster mode, diststrat/_shared_variables.py) ---
#
# Why: a variable that several worker processes share lives on a parameter-server task
# under a shared name. The public `tf.Variable` always makes an anonymous resource in
# eager mode (no process but its maker can find it), and there is no public class that
# wraps an existing resource handle as a variable. `BaseResourceVariable` is that class:
# subclassing it gives every `tf.Variable` behaviour (tapes, assign*, scatter_*,
# checkpoints, tf.function captures) around a handle diststrat makes itself.

import re  # pylint: disable=g-import-not-at-top,wrong-import-order,wrong-import-position

from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top,wrong-import-position


def copy_to_device(tensor, device):
  """Copies an eager tensor to `device`, whatever its dtype (resource handles included).

  Why: `tf.identity` of a resource handle runs where the resource lives, so it cannot
  bring a parameter server's handle to the worker; the eager tensor's own copy can.
  The copy of a handle holds only the resource's address (task, container, shared
  name), so it stays valid when the task restarts or the worker reconnects.
  """
  try:
    return tensor._copy_to_device(device)  # pylint: disable=protected-access
  except RuntimeError as e:
    # A failed remote copy raises a bare RuntimeError; give it the type an op's
    # failure would have, so that callers see a lost connection as one.
    if _CONNECTION_LOST.search(str(e)):
      raise tf.errors.UnavailableError(None, None, str(e)) from e
    raise


_CONNECTION_LOST = re.compile(
    r"failed to connect|Connection refused|Connection reset|Socket closed|UNAVAILABLE")
