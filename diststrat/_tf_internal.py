"""The few places where diststrat reaches past TensorFlow's public API.

TensorFlow keeps some per-thread state that a library running model code in its own
threads must carry over from the calling thread: the current graph's device stack, its
variable creator stack, name scope and control dependencies. There is no public API to
read or re-install these, so the reach lives here, in one small module, and nowhere else.
"""

from tensorflow.python.eager import context as _context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import ops as _ops  # pylint: disable=g-direct-tensorflow-import

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
