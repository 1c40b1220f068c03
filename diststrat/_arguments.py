"""Arguments every layer of diststrat takes, checked and normalized in one place.

Strategies, reductions, optimizers and the cluster code all accept aggregations, Keras
variables where TensorFlow variables are meant, timeouts and variable initial values;
each is read here, with one error message per mistake.
"""

import numbers

from diststrat._tf import tf
from diststrat import _tf_internal

_AGGREGATIONS = {
    "sum": tf.VariableAggregation.SUM,
    "mean": tf.VariableAggregation.MEAN,
}


def canonical_aggregation(aggregation):
  """Returns `tf.VariableAggregation.SUM` or `.MEAN` for `aggregation`, else raises.

  Accepts `tf.VariableAggregation.SUM`, `tf.VariableAggregation.MEAN`, "sum" and "mean".

  Example:
    >>> canonical_aggregation("mean") == tf.VariableAggregation.MEAN
    True
  """
  if isinstance(aggregation, str) and aggregation.lower() in _AGGREGATIONS:
    return _AGGREGATIONS[aggregation.lower()]
  if aggregation in (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN):
    return aggregation
  raise ValueError(
      "aggregation must be one of tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN, "
      f"'sum' or 'mean'. Received: aggregation={aggregation!r}")


def as_tf_variable(value):
  """A Keras 3 variable stands for the TensorFlow variable it holds; others pass through."""
  inner = _tf_internal.keras_backing_variable(value)
  return value if inner is None else inner


def seconds(name, value, allow_none=True):
  """`value` as a positive float number of seconds (or None when allowed), else raises.

  Example:
    >>> seconds("step_timeout", 3)
    3.0
  """
  if value is None and allow_none:
    return None
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not value > 0 or value != value):
    none = ", or None for no limit" if allow_none else ""
    raise ValueError(f"{name} must be a positive number of seconds{none}. Received: "
                     f"{name}={value!r}")
  return float(value)


def initial_value_tensor(kwargs):
  """The initial value of a `tf.Variable(**kwargs)` call, as a tensor.

  Calls it if it is a callable (so a random initializer runs once), then converts it to
  the requested `dtype`, in the current device scope.
  """
  value = kwargs.get("initial_value")
  if callable(value):
    value = value()
  if isinstance(value, tf.Tensor) and kwargs.get("dtype") is None:
    return value
  return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))


def check_callable(method, name, value):
  """Returns `value` if it is callable, else raises `TypeError` naming the argument.

  Example:
    >>> check_callable("update", "fn", 3)
    Traceback (most recent call last):
    ...
    TypeError: update() takes a callable as fn, such as a function or a lambda. Received: fn=3 (int)
  """
  if not callable(value):
    raise TypeError(f"{method}() takes a callable as {name}, such as a function or a "
                    f"lambda. Received: {name}={value!r} ({type(value).__name__})")
  return value


def _is_numeric(dtype):
  dtype = tf.as_dtype(dtype).base_dtype
  return dtype.is_floating or dtype.is_integer or dtype.is_complex or dtype.is_bool


def check_reducible(method, value, wrapped_type):
  """Raises `TypeError` unless `value` is a value `method` can combine across towers.

  Accepted: a wrapped value (`wrapped_type`: per-tower values, a mirrored value or
  variable), a numeric tensor or variable, `tf.IndexedSlices`, a Python or numpy number
  or numeric array. Strings and other objects are refused at the call.
  """
  if isinstance(value, (wrapped_type, tf.IndexedSlices)):
    return value
  if isinstance(value, (tf.Tensor, tf.Variable)):
    dtype = value.dtype
  elif isinstance(value, (bool, numbers.Number)):
    return value
  else:
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
      dtype = None
  try:
    numeric = dtype is not None and _is_numeric(dtype)
  except TypeError:
    numeric = False
  if not numeric:
    received = repr(value)
    received = received if len(received) <= 80 else received[:77] + "..."
    raise TypeError(
        f"{method}() combines numbers across towers: it takes per-tower values (what "
        "call_for_each_tower returns), a numeric tensor or variable, or a structure of "
        f"them. Received: {received} ({type(value).__name__}"
        f"{', dtype ' + tf.as_dtype(dtype).name if dtype is not None else ''}). Reduce "
        "the tensors your towers compute, such as losses or gradients.")
  return value


def check_variable(method, value):
  """Returns `value` as a TensorFlow variable (a Keras variable's own), else raises."""
  variable = as_tf_variable(value)
  if not isinstance(variable, tf.Variable):
    raise TypeError(
        f"{method}() takes a variable (tf.Variable, a Keras variable, or one created in "
        f"the strategy's scope). Received: {value!r} ({type(value).__name__}). To compute "
        "with a value, do it in the towers or in cross-tower code directly; update() is "
        "for writing a variable on each device that holds it.")
  return variable


def check_int(name, value, minimum=None):
  """Returns `value` if it is an int (not a bool) >= `minimum`, else raises `ValueError`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
      minimum is not None and value < minimum):
    at_least = "" if minimum is None else f" >= {minimum}"
    raise ValueError(f"{name} must be an integer{at_least}. Received: {name}={value!r}")
  return int(value)
