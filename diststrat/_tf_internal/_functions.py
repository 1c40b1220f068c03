"""Calling a traced function with a flat list of tensors, fast.

The public call binds every argument in Python, a cost per tensor that a `batch_reduce`
pays many times (50 tensors on 4 devices are 200 arguments); the concrete function's
flat call takes the list as it is.
"""

import functools
import inspect

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
