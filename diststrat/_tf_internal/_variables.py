"""Variables: wrapping an existing resource handle, and the protocols TensorFlow calls.

- Variables shared across processes by name (cluster mode): no public class wraps an
  existing resource handle as a `tf.Variable` (`ResourceVariableFromHandle`,
  `RESOURCE_METHODS`, `wrap_resource_methods`, `base_resource_method`).
- A distributed variable stands for one of its components in TensorFlow's private
  protocols (`_shared_name`, `_unique_id`, checkpoints, SavedModel export): it answers
  with the component's answer, which these functions fetch (`shared_name`, `unique_id`,
  `in_graph_mode`, `dense_var_to_tensor`, `copy_trackable_to_cpu`,
  `export_to_saved_model_graph`, `write_object_proto`).
- A variable's checkpoint value can be read only when a save writes it, not when a
  restore builds its saver (a restarted PS task has no value to read):
  `deferred_checkpoint_value`.
- A Keras optimizer finds the variable that owns the copy it updates, to find that
  variable's slots, through the copy's `_distributed_container`
  (`set_distributed_container`, `distributed_container`).
- A sliced assignment (`v[1:3].assign(x)`) calls the variable's `_strided_slice_assign`;
  a distributed variable does it on its components (`strided_slice_assign`).
- A `tf.train.Checkpoint` creates its `save_counter` when it first saves, which under
  `MultiWorkerMirroredStrategy` may happen in the chief alone; nothing it passes says
  so (`creating_checkpoint_save_counter`).
- `tf.saved_model.save` traces the functions it saves again, in its save context (the
  function cache keys on it); a distributed variable is saved as one variable, so what
  such a trace reads and writes is its primary copy (`in_saved_model_trace`); tower
  threads enter the save context of the thread that started them
  (`saved_model_trace_options`, `saved_model_trace`).
"""

import functools
import sys

from tensorflow.python.checkpoint import checkpoint as _checkpoint  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.checkpoint import tensor_callable as _tensor_callable  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import ops as _ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.saved_model import nested_structure_coder as _structure_coder  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.saved_model import save_context as _save_context  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf
from diststrat._tf_internal import _base

# pylint: disable=protected-access


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


def base_resource_method(name):
  """TensorFlow's own method `name` of `RESOURCE_METHODS`, as a function of the variable."""
  return getattr(_resource_variable_ops.BaseResourceVariable, name)


def wrap_resource_methods(cls, wrap):
  """Replaces each method of `RESOURCE_METHODS` on `cls` by `wrap(name, method)`.

  Raises:
    TensorFlowInternalsError: `BaseResourceVariable` lacks one of them (a method left
      unwrapped would silently run in the wrong place).
  """
  base = _resource_variable_ops.BaseResourceVariable
  missing = [name for name in RESOURCE_METHODS if not callable(getattr(base, name, None))]
  if missing:
    raise _base.missing("BaseResourceVariable's methods " + ", ".join(RESOURCE_METHODS),
                        f"missing {', '.join(missing)}")
  for name in RESOURCE_METHODS:
    setattr(cls, name, functools.wraps(getattr(base, name))(wrap(name, getattr(base, name))))


# --- a component's answers to TensorFlow's protocols ----------------------------------


def shared_name(variable):
  """The name of `variable`'s resource (`_shared_name`)."""
  return variable._shared_name


def unique_id(variable):
  """The id TensorFlow keys `variable` by in tapes and functions (`_unique_id`)."""
  return variable._unique_id


def in_graph_mode(variable):
  """Whether `variable` was made in a TF1 graph (`_in_graph_mode`)."""
  return variable._in_graph_mode


def dense_var_to_tensor(variable, dtype=None, name=None, as_ref=False):
  """`variable` converted to a tensor as `tf.convert_to_tensor` does it."""
  return variable._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)


def copy_trackable_to_cpu(variable, object_map):
  """Asynchronous checkpoints: `variable`'s copy on the host, recorded in `object_map`."""
  variable._copy_trackable_to_cpu(object_map)


def serialize_to_tensors(variable):
  """What a checkpoint save writes of `variable`: its `_serialize_to_tensors()` (for a
  resource variable, a value the save reads only when it writes)."""
  return variable._serialize_to_tensors()


def export_to_saved_model_graph(variable, object_map, tensor_map, options, **kwargs):
  """Writes `variable` into the SavedModel graph being built; returns its resources."""
  return variable._export_to_saved_model_graph(
      object_map=object_map, tensor_map=tensor_map, options=options, **kwargs)


def deferred_checkpoint_value(read, dtype, device):
  """A value for `_serialize_to_tensors` that a save computes with `read()` when it
  writes the checkpoint (a restore never calls it).

  `device` is where `read()` puts the value: a save groups its values by task, and the
  files of each task's values are written by that task.
  """
  return _tensor_callable.Callable(read, dtype=dtype, device=device)


_SAVE_COUNTER_FRAMES_SEARCHED = 30


def creating_checkpoint_save_counter():
  """Whether the variable being created now is a `tf.train.Checkpoint`'s `save_counter`
  (created, as 0, at its first `save`, `write` of a `CheckpointManager` or `restore`).

  Call it from a variable creator. TensorFlow passes nothing that says so (its name,
  "save_counter", is any variable's to take), so the calling frames are searched for
  `Checkpoint._maybe_create_save_counter`.
  """
  code = getattr(getattr(_checkpoint.Checkpoint, "_maybe_create_save_counter", None),
                 "__code__", None)
  if code is None:
    return False
  frame = sys._getframe(1)
  for _ in range(_SAVE_COUNTER_FRAMES_SEARCHED):
    if frame is None:
      return False
    if frame.f_code is code:
      return True
    frame = frame.f_back
  return False


def write_object_proto(variable, proto, options):
  """Fills `variable`'s SavedModel object proto."""
  variable._write_object_proto(proto, options)


def strided_slice_assign(variable, **kwargs):
  """`variable[...].assign(value)` as TensorFlow's slice helper calls it, with its
  begin/end/strides/masks keyword arguments."""
  return variable._strided_slice_assign(**kwargs)


def in_saved_model_trace():
  """Whether `tf.saved_model.save` is tracing the functions it saves, on this thread."""
  return _save_context.in_save_context()


def saved_model_trace_options():
  """The `tf.saved_model.SaveOptions` of the save tracing on this thread, or None."""
  return _save_context.get_save_options() if _save_context.in_save_context() else None


def saved_model_trace(options):
  """Context manager: this thread traces for a save with `options` too (a tower thread
  of a function the save traces); the save context is per thread."""
  return _save_context.save_context(options)


class _TupleOfComponents:
  """A codec of TensorFlow's SavedModel structure coder: writes an instance of `cls` as
  the tuple of its components (what tf.nest flattens it to), which the loader reads back
  with its own tuple codec. Never decodes."""

  def __init__(self, cls, components):
    self._cls = cls
    self._components = components

  def can_encode(self, pyobj):
    return isinstance(pyobj, self._cls)

  def do_encode(self, pyobj, encode_fn):
    return encode_fn(tuple(self._components(pyobj)))

  def can_decode(self, value):
    del value
    return False

  def do_decode(self, value, decode_fn):
    raise AssertionError("never decodes")  # can_decode is False.


_saved_as_tuples: set = set()


def save_as_tuple_of_components(cls, components):
  """Makes a SavedModel describe an instance of `cls` in a saved function's arguments or
  results as the tuple `components(instance)`, so that a process without diststrat loads
  the function (TensorFlow encodes only its own structures: any other raises
  `NotEncodableError` during `tf.saved_model.save`). `components` must return what
  `tf.nest` flattens an instance to, in that order. Registering a class twice is a no-op.

  Raises:
    TensorFlowInternalsError: TensorFlow's structure coder no longer takes codecs.
  """
  if cls in _saved_as_tuples:
    return
  register = getattr(_structure_coder, "register_codec", None)
  if not callable(register):
    raise _base.missing("tensorflow.python.saved_model.nested_structure_coder.register_codec",
                        "it is missing, so a function taking or returning diststrat's "
                        "wrapped values could not be saved in a SavedModel")
  register(_TupleOfComponents(cls, components))
  _saved_as_tuples.add(cls)


def install_saved_model_device_rule():
  """Makes the functions `tf.saved_model.save` traces name no task of a cluster.

  TensorFlow hard-codes an op's device in a saved function, and a loader that has no
  such job fails ("was explicitly assigned to /job:ps/replica:0/task:0/device:CPU:0 but
  available devices are [ /job:localhost/... ]"). In a cluster process every tower, PS
  variable and reduction has such a device. Once installed, an op created while this
  thread traces for a save (`in_saved_model_trace`) whose device names a job other than
  `localhost` keeps only its device type and index (`/device:CPU:0`), which a loader
  places on its own devices. Installing twice is a no-op.

  Raises:
    TensorFlowInternalsError: TensorFlow's graphs no longer apply device scopes there.
  """
  original = getattr(_ops.Graph, "_apply_device_functions", None)
  if getattr(original, "diststrat_saved_model_device_rule", False):
    return
  if not callable(original):
    raise _base.missing("tf.Graph._apply_device_functions",
                        "it is missing, so a SavedModel saved in a cluster process would "
                        "name the cluster's tasks and load nowhere else")

  @functools.wraps(original)
  def apply_device_functions(graph, op):
    original(graph, op)
    if _save_context.in_save_context() and "/job:" in op.device:
      spec = tf.DeviceSpec.from_string(op.device)
      if spec.job not in (None, "localhost"):
        op._set_device_from_string(
            spec.replace(job=None, replica=None, task=None).to_string())

  apply_device_functions.diststrat_saved_model_device_rule = True
  _ops.Graph._apply_device_functions = apply_device_functions


def set_distributed_container(component, container):
  """Makes `component` report `container()` (a weak reference) as its owner."""
  component._distributed_container = container


def distributed_container(component):
  """The object `component` reports as its owner, or None."""
  container = getattr(component, "_distributed_container", None)
  return container() if callable(container) else None
