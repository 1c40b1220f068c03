"""Gradient tapes: recording an operation, pausing recording, marking a variable read,
whether a forward accumulator watches a tensor.

- The pipeline (diststrat/pipeline) runs its own backward schedule: it records one tape
  entry whose inputs it chooses (`record_backward`, `should_record`) and pauses every
  tape of the thread while re-materialized stages run (`stop_recording`).
  `tf.custom_gradient` would route every variable it reads through one op on the
  caller's device, copying each stage's weights there every step.
- Read caching (diststrat/_cluster_runtime/parameter_server/_read_cache.py) hands a tower a value read
  earlier instead of reading the variable again, and must make tapes treat it as a read
  of the variable: watch the variable as a read would (`variable_accessed`) and record
  the value as a function of the variable's handle (`record_variable_read`).
  `tf.custom_gradient` around the handle still needs the first, and fails for forward
  accumulators in a graph ("dtype resource is not compatible").
- The replica context's reductions in the tf.distribute bridge (diststrat/_keras/_facade.py)
  run in `merge_call`, in another thread, which no forward accumulator of the tower's
  thread sees: they refuse a tower value an accumulator watches
  (`forward_accumulator_watching`) instead of giving it no tangent.
"""

from tensorflow.python import pywrap_tfe as _pywrap_tfe  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record as _record  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf


def record_backward(op_name, outputs, inputs, backward):
  """Records on every active tape of this thread: `outputs` were computed from `inputs`.

  `backward(*output_gradients)` returns one gradient (or None) per input. What
  `tf.custom_gradient` is built on, without its routing through one device.
  """
  _record.record_operation_backprop_only(op_name, outputs, inputs, backward)


def stop_recording():
  """Context manager: no tape of this thread records while it is entered."""
  return _record.stop_recording()


def gradient_tape_recording():
  """True when a gradient tape (or a forward accumulator) of this thread is recording
  (entered, not paused).

  Tapes are per thread: a tower thread's ops are never recorded on a tape of the
  thread that started it. No public API tells whether any tape is active.
  """
  return _record.could_possibly_record() and not _pywrap_tfe.TFE_Py_TapeSetIsStopped()


def forward_accumulator_watching(tensors):
  """True when a forward accumulator (`tf.autodiff.ForwardAccumulator`) of this thread
  has a tangent for one of `tensors`. No public API tells it but asking for a JVP,
  which needs the accumulator object."""
  if not _record.could_possibly_record():
    return False
  return bool(_pywrap_tfe.TFE_Py_PackJVPs(list(tensors))[1])


def should_record(tensors):
  """True when some active tape of this thread watches one of `tensors`."""
  return _record.should_record_backprop(tensors)


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
