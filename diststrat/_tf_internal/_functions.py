"""Calling a traced function with a flat list of tensors, fast; copying a `tf.function`'s
options to another function; whether the function being traced is compiled with XLA.

The public call binds every argument in Python, a cost per tensor that a `batch_reduce`
pays many times (50 tensors on 4 devices are 200 arguments); the concrete function's
flat call takes the list as it is.
"""

import functools
import inspect
from typing import Any, Callable

from tensorflow.python.ops import control_flow_util as _control_flow_util  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf

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


def tf_function_jit_compile(function: Any) -> bool:
  """Whether the `tf.function` `function` was made with `jit_compile=True`.

  No public attribute says it; a function whose flag cannot be read counts as not
  compiled.
  """
  return getattr(function, "_jit_compile", None) is True


def building_xla_function() -> bool:
  """Whether the graph being built (or one it is nested in) is a `tf.function` compiled
  with XLA (`jit_compile=True`, Keras's `compile(jit_compile=True)`), which XLA compiles
  for one device. False in eager mode.

  TensorFlow marks such a trace with an XLA control-flow context; no public API tells.
  """
  if tf.executing_eagerly():
    return False
  return bool(_control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def clone_tf_function(function: Any, python_function: Callable[..., Any]) -> Any:
  """A `tf.function` of `python_function` made with the options of `function` (its
  input signature, AutoGraph, XLA and retracing settings), as TensorFlow's own
  strategies make one around a `tf.function` given to `run`.

  Uses the function's private `_clone`, the one way to copy every option; without it, a
  plain `tf.function` with the input signature.
  """
  clone = getattr(function, "_clone", None)
  if clone is not None:
    try:
      return clone(python_function=python_function)  # pylint: disable=protected-access
    except TypeError:  # pragma: no cover - depends on the TensorFlow version
      pass
  return tf.function(python_function,  # pragma: no cover - depends on the TensorFlow version
                     input_signature=getattr(function, "input_signature", None))
