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
