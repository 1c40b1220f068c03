"""The two places where cross-tower ops reach past TensorFlow's public API.

- Collective ops: TensorFlow has no public API for them outside `tf.distribute`, and
  diststrat builds on primitives, not on `tf.distribute` (SPEC, preamble).
- Calling a traced function with a flat list of tensors: the public call binds every
  argument to the function's signature in Python, which costs ~7 us per tensor; a
  `batch_reduce` of 50 tensors on 4 devices passes 200. `call_flat` skips the binding,
  and falls back to the public call if TensorFlow renames what it uses.

Nothing else in `diststrat.cross_tower_ops` imports `tensorflow.python`.
"""

import inspect

from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import,unused-import

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
