"""`CrossTowerOps`: the base class of every cross-tower reduction algorithm.

The public methods (`reduce`, `batch_reduce`, `broadcast`) check and normalize their
arguments once (the aggregation to an `Aggregation`, destinations to a tuple of canonical
devices by `values._wrapped.resolve_destinations`, values to `PerDevice`s), handle what every algorithm shares (values held on one device, `IndexedSlices`),
and call an underscored hook for the rest. Hooks only build graph ops under `tf.device`:
in eager mode the base class traces them once per input signature into a `tf.function` and
runs that (`_launch.Launcher`), so one call launches the work on every device together
(collectives hang otherwise) and costs one dispatch instead of one per op. Inside a
`tf.function` the hooks add their ops to the function being traced.

A new algorithm is a subclass that implements `_reduce` (and, to do a batch together,
`_batch_reduce`); see docs/cross_tower_ops.md.
"""

from typing import Any, Sequence

from diststrat._tf import tf
from diststrat import _devices
from diststrat import _arguments
from diststrat.errors import keeps_errors_in_tf_function
from diststrat._arguments import Aggregation
from diststrat._arguments import as_tf_variable
from diststrat._arguments import canonical_aggregation
from diststrat.cross_tower_ops import _launch
from diststrat.values import _wrapped


class CrossTowerOps:
  """Reduces per-tower values across devices and broadcasts values to devices.

  Every method works in eager mode and inside `tf.function`. Results are `Mirrored` values
  with one component per destination device, placed on that device.

  Example:
    >>> import tensorflow as tf
    >>> from diststrat.cross_tower_ops import AllReduceCrossTowerOps
    >>> from diststrat.values import PerDevice
    >>> ops = AllReduceCrossTowerOps("naive")
    >>> grads = PerDevice({"/cpu:0": tf.constant(1.0), "/cpu:1": tf.constant(3.0)})
    >>> [float(v) for v in ops.reduce("mean", grads).values]
    [2.0, 2.0]
  """

  def __init__(self) -> None:
    self._launcher = _launch.Launcher(self._build)

  # Subclasses implement: `_reduce` (required); the hooks after it have defaults.

  def _reduce(self, aggregation, per_device_value, destinations):
    """Reduces one dense value held on two or more devices.

    Args:
      aggregation: `Aggregation.SUM` or `Aggregation.MEAN` (equal to
        `tf.VariableAggregation.SUM`/`MEAN`: `aggregation == tf.VariableAggregation.MEAN`
        tests for the mean).
      per_device_value: a `PerDevice` of dense tensors of one dtype, at least two.
      destinations: a tuple of canonical device strings.

    Returns:
      A `Mirrored` with the reduced value on each of `destinations`.
    """
    raise NotImplementedError(f"{type(self).__name__} must implement _reduce()")

  def _batch_reduce(self, aggregation, value_destination_pairs):
    """Reduces several dense values together; by default, `_reduce` on each pair.

    Args:
      aggregation: as in `_reduce`.
      value_destination_pairs: a list of `(per_device_value, destinations)`, each as the
        arguments of `_reduce`.

    Returns:
      A list with one `Mirrored` per pair.
    """
    return [self._reduce(aggregation, value, destinations)
            for value, destinations in value_destination_pairs]

  def _broadcast(self, tensor, destinations):
    """Copies `tensor` (dense or `IndexedSlices`) to each of `destinations` (a tuple)."""
    return mirror(tensor, destinations)

  def _reduce_indexed_slices(self, aggregation, per_device_value, destinations):
    """Reduces `IndexedSlices` by concatenating them on the first destination."""
    device = destinations[0]
    return mirror(concat_indexed_slices(aggregation, per_device_value, device),
                  destinations, source_device=device)

  def _failure_hint(self):
    """Advice added to the message of an error raised while the launched work runs."""
    return ""

  # The sum and the mean of a value held on one device are that value: true unless the
  # algorithm also reduces across values this process does not hold (other workers').
  _one_value_is_the_total = True

  # Shared behaviour:

  @keeps_errors_in_tf_function
  def reduce(self, aggregation: Any, per_device_value: Any, destinations: Any = None) -> Any:
    """Reduces the components of `per_device_value` and mirrors the result.

    Args:
      aggregation: `tf.VariableAggregation.SUM`, `tf.VariableAggregation.MEAN`, `"sum"` or
        `"mean"`. MEAN divides by the number of components (integers: floor division).
      per_device_value: a `PerDevice` (or any wrapped value) of tensors or
        `tf.IndexedSlices`, or a plain tensor (one value, on its device).
      destinations: where the result goes: None (the devices of `per_device_value`), a
        device string, a list of them, a variable or a wrapped value (their devices).

    Returns:
      A `Mirrored` with one component per destination device, placed on that device.
      `IndexedSlices` stay `IndexedSlices`: the towers' values and indices concatenated.

    Raises:
      ValueError: a bad aggregation, destinations, or components of different dtypes.

    Example:
      >>> import tensorflow as tf
      >>> from diststrat.cross_tower_ops import ReductionToOneDevice
      >>> from diststrat.values import PerDevice
      >>> x = PerDevice({"/cpu:0": tf.constant(1.0), "/cpu:1": tf.constant(3.0)})
      >>> [float(v) for v in ReductionToOneDevice().reduce("sum", x, "/cpu:1").values]
      [4.0]
    """
    aggregation = canonical_aggregation(aggregation)
    value = _reducible(_as_per_device(per_device_value, "reduce", destinations), "reduce")
    destinations = _wrapped.resolve_destinations(destinations, default=value.devices)
    return self._run("reduce", aggregation, [(value, destinations)])[0]

  @keeps_errors_in_tf_function
  def batch_reduce(self, aggregation: Any,
                   value_destination_pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
    """Like `reduce` on each `(value, destinations)` pair, all in one launch.

    Args:
      aggregation: as in `reduce`, for every pair.
      value_destination_pairs: a list of `(per_device_value, destinations)` pairs, each as
        the arguments of `reduce`.

    Returns:
      A list with one `Mirrored` per pair, in order.

    Example:
      >>> import tensorflow as tf
      >>> from diststrat.cross_tower_ops import ReductionToOneDevice
      >>> from diststrat.values import PerDevice
      >>> a = PerDevice({"/cpu:0": tf.constant(1.0), "/cpu:1": tf.constant(2.0)})
      >>> b = PerDevice({"/cpu:0": tf.ones([2]), "/cpu:1": tf.ones([2])})
      >>> sums = ReductionToOneDevice().batch_reduce("sum", [(a, None), (b, "/cpu:0")])
      >>> float(sums[0].values[1]), sums[1].values[0].numpy().tolist()
      (3.0, [2.0, 2.0])
    """
    aggregation = canonical_aggregation(aggregation)
    items = []
    for pair in _arguments.check_value_destination_pairs("batch_reduce",
                                                        value_destination_pairs):
      value = _reducible(_as_per_device(pair[0], "batch_reduce", pair[1]), "batch_reduce")
      items.append((value, _wrapped.resolve_destinations(pair[1], default=value.devices)))
    if not items:
      return []
    return self._run("batch_reduce", aggregation, items)

  @keeps_errors_in_tf_function
  def broadcast(self, tensor: Any, destinations: Any) -> Any:
    """Copies `tensor` to every destination device.

    Args:
      tensor: a tensor, `tf.IndexedSlices`, variable (its value) or anything
        `tf.convert_to_tensor` takes.
      destinations: a device string, a list of them, a variable or a wrapped value.

    Returns:
      A `Mirrored` with a copy of `tensor` on each destination device.

    Example:
      >>> import tensorflow as tf
      >>> from diststrat.cross_tower_ops import ReductionToOneDevice
      >>> copies = ReductionToOneDevice().broadcast(tf.constant(1.0), ["/cpu:0", "/cpu:1"])
      >>> [float(v) for v in copies.values]
      [1.0, 1.0]
    """
    destinations = _wrapped.resolve_destinations(destinations, _wrapped.REQUIRED, "broadcast")
    if isinstance(tensor, _wrapped.DistributedValues):
      raise ValueError(f"broadcast() takes one tensor, not a wrapped value. Received: "
                       f"{tensor!r}. Use reduce() to combine the components of a wrapped "
                       "value.")
    value = _as_per_device(tensor, "broadcast", destinations)
    return self._run("broadcast", None, [(value, destinations)])[0]

  def __repr__(self):
    return f"{type(self).__name__}()"

  def _run(self, kind, aggregation, items):
    """Builds the work for `items` in the current graph, or in eager mode runs it as one."""
    if tf.executing_eagerly():
      return self._launch(kind, aggregation, items)
    return self._build(kind, aggregation, items)

  def _build(self, kind, aggregation, items):
    """Routes each item to the hook that reduces it; returns Mirrored results in order."""
    if kind == "broadcast":
      results = [self._broadcast(value.primary, destinations) for value, destinations in items]
      return [_in_order(r, d, self, "_broadcast") for r, (_, d) in zip(results, items, strict=True)]
    results = [None] * len(items)
    dense = []
    for i, (value, destinations) in enumerate(items):
      if len(value) == 1 and self._one_value_is_the_total:
        results[i] = mirror(value.primary, destinations, source_device=value.devices[0])
      elif any(isinstance(c, tf.IndexedSlices) for c in value.values):
        results[i] = self._reduce_indexed_slices(aggregation, value, destinations)
      else:
        dense.append(i)
    if kind == "reduce" and dense:
      reduced = [self._reduce(aggregation, *items[dense[0]])]
    elif dense:
      reduced = self._batch_reduce(aggregation, [items[i] for i in dense])
    else:
      reduced = []
    # strict=False: a subclass's hook that returns too few results is named by _in_order.
    for i, r in zip(dense, reduced, strict=False):
      results[i] = r
    return [_in_order(r, d, self, f"_{kind}") for r, (_, d) in zip(results, items, strict=True)]

  def _launch(self, kind, aggregation, items):
    """Runs `_build` for `items` as one cached `tf.function` (eager mode)."""
    try:
      return self._launcher.launch(kind, aggregation, items)
    except tf.errors.OpError as e:
      message = (f"{self!r}.{kind}() failed ({type(e).__name__}).{self._failure_hint()} "
                 f"TensorFlow's message: {e.message}")
      raise _with_message(e, message) from e


# --- helpers for algorithms -----------------------------------------------------------


def mirror(tensor, destinations, source_device=None):
  """A `Mirrored` of `tensor`: a `tf.identity` on each destination but `source_device`.

  Between logical CPU devices the identity shares the buffer; between GPUs it copies.
  """
  copies = {}
  for device in destinations:
    if device == source_device:
      copies[device] = tensor
    else:
      with tf.device(device):
        copies[device] = _identity(tensor)
  return _wrapped.Mirrored(copies)


def divide(tensor, count):
  """`tensor / count` for the MEAN aggregation; integers use floor division."""
  if count == 1:
    return tensor
  if tensor.dtype.is_integer:
    return tensor // count
  return tensor / count


def divide_slices(values, indices, count):
  """`(values / count, indices)` for the MEAN of slices at `indices`.

  Floats divide each slice. Integers floor each row's total, as the dense tensors the
  slices stand for do: floor division is not linear, so the slices of one row are first
  added into one (the result has each row once, in order of first appearance).
  """
  if count == 1 or not values.dtype.is_integer:
    return divide(values, count), indices
  rows, positions = tf.unique(indices)
  values = tf.math.unsorted_segment_sum(values, positions, tf.shape(rows)[0])
  return divide(values, count), rows


def concat_indexed_slices(aggregation, per_device_value, device):
  """The `IndexedSlices` components concatenated on `device`; MEAN divides the values
  (`divide_slices`: integer slices of one row are added into one first).

  Dense components are taken as slices that cover every row. Nothing is densified.
  """
  parts = [_as_indexed_slices(c) for c in per_device_value.values]
  index_dtypes = {p.indices.dtype for p in parts}
  with tf.device(device):
    if len(index_dtypes) > 1:
      parts = [tf.IndexedSlices(p.values, tf.cast(p.indices, tf.int64), p.dense_shape)
               for p in parts]
    values = tf.concat([p.values for p in parts], axis=0)
    indices = tf.concat([p.indices for p in parts], axis=0)
    if aggregation is Aggregation.MEAN:
      values, indices = divide_slices(values, indices, len(parts))
    dense_shape = next((tf.identity(p.dense_shape) for p in parts
                        if p.dense_shape is not None), None)
  return tf.IndexedSlices(values, indices, dense_shape)


def _as_indexed_slices(value):
  if isinstance(value, tf.IndexedSlices):
    return value
  shape = tf.shape(value, out_type=tf.int64)
  return tf.IndexedSlices(value, tf.range(shape[0]), shape)


def _identity(value):
  if isinstance(value, tf.IndexedSlices):
    return tf.IndexedSlices(
        tf.identity(value.values), tf.identity(value.indices),
        None if value.dense_shape is None else tf.identity(value.dense_shape))
  return tf.identity(value)


def _with_message(error, message):
  """`error` again, same type, with `message`."""
  try:
    return type(error)(error.node_def, error.op, message)
  except TypeError:
    return RuntimeError(message)


# --- normalizing arguments ------------------------------------------------------------


def _as_per_device(value, method, destinations):
  """`value` as a `PerDevice` of tensors and `IndexedSlices`, checked."""
  if value is None:
    raise ValueError(f"{method}() needs a value. Received: None")
  value = as_tf_variable(value)
  if isinstance(value, _wrapped.DistributedValues):
    index = dict(zip(value.devices, value.values, strict=True))
  elif _wrapped.is_distributed_variable_like(value):
    index = {d: value.get(d) for d in _devices.canonicalize_all(value.devices)}
  else:
    index = {_home_device(value, destinations): value}
  index = {d: _as_tensor(v, d) for d, v in index.items()}
  dtypes = {v.dtype for v in index.values()}
  if len(dtypes) > 1:
    raise ValueError(f"{method}() needs components of one dtype. Received: "
                     f"{ {d: v.dtype.name for d, v in index.items()} }. Cast them to one "
                     "dtype first.")
  shapes = {d: _dense_shape(v) for d, v in index.items()}
  merged = tf.TensorShape(None)
  for shape in shapes.values():
    if not shape.is_compatible_with(merged):
      received = ", ".join(f"{d}: {_describe_shape(v, shapes[d])}" for d, v in index.items())
      raise ValueError(f"{method}() needs components of one shape (an IndexedSlices' is its "
                       f"dense_shape). Received: {received}.")
    merged = merged.merge_with(shape)
  return _wrapped.PerDevice(index)


def _dense_shape(component):
  """The shape of the dense tensor `component` stands for, as far as it is known.

  An `IndexedSlices`' is its `dense_shape` when that is known before running (always in
  eager mode), else any number of rows of its values' shape.
  """
  if not isinstance(component, tf.IndexedSlices):
    return component.shape
  rows = tf.TensorShape([None]).concatenate(component.values.shape[1:])
  if component.shape.is_compatible_with(rows):
    return rows.merge_with(component.shape)
  return component.shape


def _describe_shape(component, shape):
  if isinstance(component, tf.IndexedSlices):
    return f"IndexedSlices of {shape}"
  return str(shape)


def _reducible(value, method):
  """`value` (a `PerDevice` of tensors) if its dtype can be summed, else `TypeError`."""
  return _arguments.check_reducible(method, value, _wrapped.DistributedValues)


def _home_device(value, destinations):
  """The device of a plain value: its own, else the current scope's, else a destination."""
  device = getattr(value, "device", None)
  if isinstance(value, tf.IndexedSlices):
    device = value.values.device
  if device:
    return _devices.canonicalize(device)
  current = _devices.current_device()
  if current:
    return current
  if destinations is not None:
    return _wrapped.resolve_destinations(destinations, default=None)[0]
  return _devices.canonicalize("/cpu:0")


def _as_tensor(value, device):
  value = as_tf_variable(value)
  if isinstance(value, (tf.Tensor, tf.IndexedSlices)):
    return value
  with tf.device(device):
    return tf.convert_to_tensor(value)


def _in_order(result, destinations, ops, hook):
  """`result` as a `Mirrored` over exactly `destinations`, in that order."""
  if not isinstance(result, _wrapped.DistributedValues):
    raise TypeError(f"{type(ops).__name__}.{hook}() must return a Mirrored. Received: "
                    f"{result!r}")
  if result.devices == destinations:
    return result
  return _wrapped.Mirrored({d: result.get(d) for d in destinations})
