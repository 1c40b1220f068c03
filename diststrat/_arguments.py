"""Arguments every layer of diststrat takes, checked and normalized in one place.

Strategies, reductions, optimizers and the cluster code all accept aggregations,
variables that stand for a TensorFlow variable, timeouts and variable initial values;
each is read here, with one error message per mistake. A public method normalizes its
arguments once, on entry; the hooks it calls receive only the normalized forms
(`Aggregation`, canonical device tuples, `tf.Variable`s).

This module knows no library above TensorFlow: what a variable of another library
stands for is registered with `register_variable_unwrapper` (the Keras support
registers Keras 3's variables).
"""

import enum
import functools
import inspect
import numbers
import typing
from typing import Any, Callable

from diststrat._tf import tf
from diststrat import _integrations


class Aggregation(enum.Enum):
  """How values are combined across towers: the one form hooks receive.

  The public methods take "sum", "mean", `tf.VariableAggregation.SUM` or `.MEAN` (see
  `canonical_aggregation`) and hand their hooks a member of this enum. A member is
  equal to the `tf.VariableAggregation` member of the same name when it is on the left
  of `==` (`aggregation == tf.VariableAggregation.MEAN`), and hashes as it, so hooks
  written against `tf.VariableAggregation` keep working; its `name` is "SUM" or
  "MEAN".

  Example:
    >>> Aggregation.MEAN == tf.VariableAggregation.MEAN, Aggregation.MEAN.name
    (True, 'MEAN')
  """

  SUM = 1  # The values of tf.VariableAggregation.SUM and .MEAN.
  MEAN = 2

  def __eq__(self, other):
    if isinstance(other, Aggregation):
      return self is other
    if isinstance(other, tf.VariableAggregation):
      return self.name == other.name
    return NotImplemented

  def __hash__(self):
    return hash(self.value)


_AGGREGATIONS = {
    "sum": Aggregation.SUM,
    "mean": Aggregation.MEAN,
}


def canonical_aggregation(aggregation):
  """Returns `Aggregation.SUM` or `.MEAN` for `aggregation`, else raises `ValueError`.

  Accepts `tf.VariableAggregation.SUM`, `tf.VariableAggregation.MEAN`, "sum" and "mean"
  (any case), and an `Aggregation` (as it is).

  Example:
    >>> canonical_aggregation("mean") is Aggregation.MEAN
    True
    >>> canonical_aggregation(tf.VariableAggregation.SUM) is Aggregation.SUM
    True
  """
  if isinstance(aggregation, Aggregation):
    return aggregation
  if isinstance(aggregation, str) and aggregation.lower() in _AGGREGATIONS:
    return _AGGREGATIONS[aggregation.lower()]
  if aggregation in (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN):
    return Aggregation[aggregation.name]  # Also tf.compat.v1.VariableAggregation's.
  raise ValueError(
      "aggregation must be one of tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN, "
      f"'sum' or 'mean'. Received: aggregation={aggregation!r}")


# Functions `fn(value)` that return the `tf.Variable` `value` stands for, or None.
_variable_unwrappers: list[Callable[[Any], Any]] = []


def register_variable_unwrapper(fn):
  """Registers `fn(value) -> tf.Variable | None`: the TensorFlow variable `value` holds.

  `as_tf_variable` asks each registered function in turn; the first that returns a
  variable wins. A library whose variables hold a `tf.Variable` (Keras 3) registers one,
  so that every public method takes its variables where a `tf.Variable` is meant.
  Registering a function twice registers it once.
  """
  if fn not in _variable_unwrappers:
    _variable_unwrappers.append(fn)


def as_tf_variable(value):
  """The `tf.Variable` `value` stands for (see `register_variable_unwrapper`), else `value`.

  Example:
    >>> v = tf.Variable(1.0)
    >>> as_tf_variable(v) is v, as_tf_variable(3)
    (True, 3)
  """
  _integrations.install_pending()  # They register the unwrappers.
  for unwrap in _variable_unwrappers:
    inner = unwrap(value)
    if inner is not None:
      return inner
  return value


MAX_SECONDS = 1e9
"""The longest timeout taken (about 31 years): Python's waits refuse much longer ones
(`threading.TIMEOUT_MAX`, about 292 years on Linux), with an `OverflowError`."""


def seconds(name, value, allow_none=True):
  """`value` as a positive float number of seconds, at most `MAX_SECONDS` (or None when
  allowed), else raises `ValueError`.

  Example:
    >>> seconds("step_timeout", 3)
    3.0
    >>> seconds("tower_timeout", float("inf"), allow_none=False)
    Traceback (most recent call last):
    ...
    ValueError: tower_timeout must be a positive number of seconds, at most 1e+09 (about 31 years). Received: tower_timeout=inf. Every wait is bounded: for a practically unlimited one, pass a large number such as 86400 (a day).
  """
  if value is None and allow_none:
    return None
  none = ", or None for no limit" if allow_none else ""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not value > 0 or value != value):
    raise ValueError(f"{name} must be a positive number of seconds{none}. Received: "
                     f"{name}={value!r}")
  if value > MAX_SECONDS:
    fix = ("Pass None for no limit." if allow_none else
           "Every wait is bounded: for a practically unlimited one, pass a large number "
           "such as 86400 (a day).")
    raise ValueError(f"{name} must be a positive number of seconds, at most "
                     f"{MAX_SECONDS:g} (about 31 years){none}. Received: {name}={value!r}. "
                     f"{fix}")
  return float(value)


def variable_name(kwargs):
  """The name (without ":0") that a `tf.Variable(**kwargs)` call gives its variable.

  TensorFlow's: the `name` argument, "Variable" when there is none, inside the current
  name scope (Keras layers make their variables in theirs, so a kernel is
  "sequential/dense/kernel").
  """
  name = (kwargs.get("name") or "Variable").split(":")[0].strip("/") or "Variable"
  scope = tf.get_current_name_scope()
  return f"{scope.rstrip('/')}/{name}" if scope else name


def initial_value_tensor(kwargs):
  """The initial value of a `tf.Variable(**kwargs)` call, as a tensor.

  Calls it if it is a callable (so a random initializer runs once), then converts it to
  the requested `dtype`, in the current device scope.
  """
  value = kwargs.get("initial_value")
  if value is None:
    # TensorFlow's SavedModel loader makes its variables so (it restores them after),
    # and so does a variable made with only a shape and a dtype.
    raise ValueError(
        f"Variable {kwargs.get('name')!r} is created without an initial value (as "
        "tf.saved_model.load does) inside a diststrat strategy's scope, which makes "
        "every variable from its initial value. Call tf.saved_model.load outside the "
        "scope (its functions can then run in call_for_each_tower), or give the "
        "variable an initial_value.")
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


def _deferred_kind(fn):
  """(what `fn` is, what calling it makes instead of running its body), or None."""
  if not (inspect.isroutine(fn) or isinstance(fn, functools.partial)):
    fn = inspect.getattr_static(type(fn), "__call__", fn)  # A callable object's method.
  if inspect.isasyncgenfunction(fn):
    return "an asynchronous generator function (async def with yield)", "async generator"
  if inspect.iscoroutinefunction(fn):
    return "a coroutine function (async def)", "coroutine"
  if inspect.isgeneratorfunction(fn):
    return "a generator function (it yields)", "generator"
  return None


def check_runs_when_called(method, name, value, where):
  """Returns `value` unless it is a generator or coroutine function, else raises
  `TypeError`: calling one runs none of its body, which would run later, `where` it is
  not meant to (outside the towers).

  Example:
    >>> def fn():
    ...   yield 1
    >>> check_runs_when_called("call_for_each_tower", "fn", fn, "outside the towers")
    Traceback (most recent call last):
    ...
    TypeError: call_for_each_tower() runs fn and uses what it returns, but fn=fn is a generator function (it yields): calling it runs none of its body and returns a generator, whose body would run later, when consumed, outside the towers. Make fn a plain function that returns its values (a list or a tuple instead of yields; asyncio.run(...) inside it for async code).
  """
  kind = _deferred_kind(value)
  if kind is None:
    return value
  described, made = kind
  if isinstance(value, functools.partial):
    label = f"partial({getattr(value.func, '__name__', type(value.func).__name__)})"
  else:
    label = getattr(value, "__name__", None) or f"a {type(value).__name__} object, whose __call__"
  raise TypeError(
      f"{method}() runs {name} and uses what it returns, but {name}={label} is "
      f"{described}: calling it runs none of its body and returns "
      f"{'an' if made[0] == 'a' else 'a'} {made}, whose body would run later, when consumed, {where}. Make {name} a plain "
      "function that returns its values (a list or a tuple instead of yields; "
      "asyncio.run(...) inside it for async code).")


def check_called_without_arguments(method, name, value, hint=""):
  """Returns `value` if it can be called with no arguments, else raises `TypeError`
  naming the argument, what it needs and `hint`. A callable whose signature Python cannot
  read is returned as it is.

  Example:
    >>> check_called_without_arguments("distribute_dataset", "dataset_fn", lambda ctx: ctx)
    Traceback (most recent call last):
    ...
    TypeError: distribute_dataset() calls dataset_fn with no arguments, but it needs some: missing a required argument: 'ctx'.
  """
  try:
    signature = inspect.signature(value)
  except (TypeError, ValueError):
    return value
  try:
    signature.bind()
  except TypeError as e:
    raise TypeError(f"{method}() calls {name} with no arguments, but it needs some: "
                    f"{e}.{hint}") from None
  return value


def _is_numeric(dtype):
  dtype = tf.as_dtype(dtype).base_dtype
  return dtype.is_floating or dtype.is_integer or dtype.is_complex


def _dtype_of(value):
  """The dtype of a tensor, variable or array; "python" for a Python number; else None."""
  if isinstance(value, (tf.Tensor, tf.Variable)):
    return value.dtype
  if isinstance(value, (bool, numbers.Number)):
    return tf.bool if isinstance(value, bool) else "python"
  dtype = getattr(value, "dtype", None)
  if dtype is None or not hasattr(value, "shape"):
    return None
  return dtype


def check_reducible(method, value, wrapped_type):
  """Raises `TypeError` unless `value` is a value `method` can combine across towers.

  Accepted: a wrapped value (`wrapped_type`: per-tower values, a mirrored value or
  variable) whose components are numeric, a numeric (float, integer or complex) tensor
  or variable, `tf.IndexedSlices`, a Python or numpy number or numeric array. Strings,
  booleans and other objects are refused at the call, in every strategy (the default
  strategy, which returns the value unchanged, too).
  """
  if isinstance(value, tf.IndexedSlices):
    return value
  if isinstance(value, wrapped_type):
    for component in value.values:
      if _dtype_of(component) is not None:
        _check_numeric(method, value, component)
    return value
  _check_numeric(method, value, value)
  return value


def _check_numeric(method, value, leaf):
  dtype = _dtype_of(leaf)
  if dtype == "python":
    return
  try:
    numeric = dtype is not None and _is_numeric(dtype)
  except TypeError:
    numeric = False
  if numeric:
    return
  dtype_name = tf.as_dtype(dtype).name if dtype is not None else None
  fix = ("Reduce the tensors your towers compute, such as losses or gradients.")
  if dtype_name == "bool":
    fix = ("Booleans cannot be summed or averaged: cast them first, such as "
           "tf.cast(value, tf.int32) to count the towers where it is True, or "
           "tf.cast(value, tf.float32).")
  raise TypeError(
      f"{method}() combines numbers across towers: it takes per-tower values (what "
      "call_for_each_tower returns) of a float, integer or complex dtype, a numeric tensor "
      f"or variable, or a structure of them. Received: {short_repr(value)} "
      f"({type(value).__name__}{', dtype ' + dtype_name if dtype_name else ''}). {fix}")


def check_broadcast_leaf(leaf):
  """`leaf` if `broadcast` can copy it (what `tf.convert_to_tensor` takes: a tensor, a
  variable, a number, a string, an array), else `TypeError` naming what it takes.

  TensorFlow's own error was `ValueError` in eager mode and `TypeError` in a graph.
  """
  if leaf is None or isinstance(leaf, (tf.Tensor, tf.Variable, tf.IndexedSlices)):
    return leaf
  try:
    tf.convert_to_tensor(leaf)
  except (TypeError, ValueError) as e:
    raise TypeError(
        "broadcast() copies tensors: it takes a tensor, a variable, or a value "
        "tf.convert_to_tensor takes (a number, a string, a numpy array, a list of "
        "numbers), or a dict, list, tuple or namedtuple of them. Received: "
        f"{short_repr(leaf)} ({type(leaf).__name__}). Convert it to a tensor first.") from e
  return leaf


def short_repr(value: Any, limit: int = 80) -> str:
  """`repr(value)`, cut to `limit` characters."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def check_value_destination_pairs(method, value):
  """`value` as a list of 2-item (value, destinations) pairs, else raises `ValueError`.

  `method` is the public method refusing it ("batch_reduce"). A list or tuple of pairs
  (or an iterator over them, such as a `zip`) is taken; anything else, such as the
  per-tower value itself, is refused with the fix.

  Example:
    >>> check_value_destination_pairs("batch_reduce", 3.0)
    Traceback (most recent call last):
    ...
    ValueError: batch_reduce() takes value_destination_pairs, a list of (value, destinations) pairs such as [(per_tower, None)]. Received: value_destination_pairs=3.0 (float). To reduce one value, call reduce(aggregation, value, destinations).
  """
  if isinstance(value, (list, tuple)) or (
      isinstance(value, typing.Iterator) and not isinstance(value, (str, bytes))):
    pairs = list(value)
  else:
    raise ValueError(
        f"{method}() takes value_destination_pairs, a list of (value, destinations) pairs "
        f"such as [(per_tower, None)]. Received: value_destination_pairs="
        f"{short_repr(value)} ({type(value).__name__}). To reduce one value, call "
        "reduce(aggregation, value, destinations).")
  for i, pair in enumerate(pairs):
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
      raise ValueError(
          f"{method}() takes value_destination_pairs, a list of (value, destinations) "
          f"pairs such as [(per_tower, None)]. Received: value_destination_pairs[{i}]="
          f"{short_repr(pair)} ({type(pair).__name__}). Pair each value with its "
          "destinations (None for the default).")
  return pairs


_VARIABLE_FIXES = {
    "update": ("To compute with a value, do it in the towers or in cross-tower code "
               "directly; update() is for writing a variable on each device that holds it."),
    "colocate_vars_with": ("Pass the variable whose devices the new variables should share "
                           "(or what non_slot_devices() returns)."),
    "apply_gradients": ("Create the step counter once, such as tf.Variable(0, "
                        "dtype=tf.int64), in the strategy's scope, and pass it."),
    "read_var": ("A tensor is already a value: use it directly; read_var() is for reading "
                 "a variable (a tower-local one aggregated over the towers)."),
}


def check_variable(method, value, name="var"):
  """Returns `value` as a TensorFlow variable (a Keras variable's own), else raises.

  Example:
    >>> check_variable("read_var", "x", name="v")
    Traceback (most recent call last):
    ...
    TypeError: read_var() takes a variable as v (a tf.Variable, a Keras variable, or one created in the strategy's scope). Received: v='x' (str). A tensor is already a value: use it directly; read_var() is for reading a variable (a tower-local one aggregated over the towers).
  """
  variable = as_tf_variable(value)
  if not isinstance(variable, tf.Variable):
    raise TypeError(
        f"{method}() takes a variable as {name} (a tf.Variable, a Keras variable, or one "
        f"created in the strategy's scope). Received: {name}={short_repr(value)} "
        f"({type(value).__name__}). {_VARIABLE_FIXES.get(method, '')}".rstrip())
  return variable


def check_variable_list(method, var_list, required=False):
  """`var_list` as a list of variables (None when not given and not `required`), else
  `TypeError` naming the mistake: one variable instead of a list, or an item that is not
  a variable."""
  if var_list is None and not required:
    return None
  variable = as_tf_variable(var_list)
  if isinstance(variable, tf.Variable):
    raise TypeError(
        f"{method}() takes var_list, a list of variables. Received: var_list=<variable "
        f"{variable.name.split(':')[0]!r}>, one variable, not a list. Pass [variable].")
  if isinstance(var_list, (str, bytes, tf.Tensor)) or not hasattr(var_list, "__iter__"):
    raise TypeError(
        f"{method}() takes var_list, a list of variables. Received: "
        f"var_list={short_repr(var_list)} ({type(var_list).__name__}). Pass "
        "e.g. model.trainable_variables.")
  items = list(var_list)
  for i, item in enumerate(items):
    if not isinstance(as_tf_variable(item), tf.Variable):
      raise TypeError(
          f"{method}() takes var_list, a list of variables. Received: "
          f"var_list[{i}]={short_repr(item)} ({type(item).__name__}). Pass "
          "only variables (tf.Variable, Keras variables).")
  return items


def check_int(name, value, minimum=None):
  """Returns `value` if it is an int (not a bool) >= `minimum`, else raises `ValueError`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
      minimum is not None and value < minimum):
    at_least = "" if minimum is None else f" >= {minimum}"
    raise ValueError(f"{name} must be an integer{at_least}. Received: {name}={value!r}")
  return int(value)
