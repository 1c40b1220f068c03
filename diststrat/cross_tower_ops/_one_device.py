"""`ReductionToOneDevice`: gather every value on one device, reduce there, copy back."""

from typing import Any, Callable

from diststrat._tf import tf
from diststrat import _devices
from diststrat.errors import keeps_errors_in_tf_function
from diststrat._arguments import Aggregation
from diststrat.cross_tower_ops import _base


class ReductionToOneDevice(_base.CrossTowerOps):
  """Reduces each value on one device, then copies the result to the destinations.

  Works for any devices and any destinations (they need not match the values' devices),
  which makes it the fallback of the all-reduce algorithms.

  Args:
    reduce_to_device: the device that does the reduction. None: the first destination of
      each value.
    accumulation_fn: adds a list of dense tensors of one shape; `tf.math.add_n` by default.

  Example:
    >>> import tensorflow as tf
    >>> from diststrat.cross_tower_ops import ReductionToOneDevice
    >>> from diststrat.values import PerDevice
    >>> x = PerDevice({"/cpu:0": tf.constant(1.0), "/cpu:1": tf.constant(3.0)})
    >>> ReductionToOneDevice().reduce("sum", x, destinations="/cpu:0").values
    (<tf.Tensor: shape=(), dtype=float32, numpy=4.0>,)
  """

  @keeps_errors_in_tf_function
  def __init__(self, reduce_to_device: str | None = None,
               accumulation_fn: Callable[[list[Any]], Any] = tf.math.add_n) -> None:
    super().__init__()
    if not callable(accumulation_fn):
      raise ValueError("accumulation_fn must be a callable that adds a list of tensors, "
                       f"such as tf.math.add_n. Received: accumulation_fn={accumulation_fn!r}")
    self._reduce_to_device = (None if reduce_to_device is None
                              else _devices.canonicalize(reduce_to_device))
    self._accumulation_fn = accumulation_fn

  @property
  def reduce_to_device(self) -> str | None:
    """The device that reduces, or None for the first destination of each value."""
    return self._reduce_to_device

  def __repr__(self):
    return f"ReductionToOneDevice(reduce_to_device={self._reduce_to_device!r})"

  def _device_for(self, destinations):
    if self._reduce_to_device is None:
      return destinations[0]
    # Checked at first use, not in the constructor: listing devices starts TensorFlow.
    return _devices.check_exist((self._reduce_to_device,), "reduce_to_device")[0]

  def _reduce(self, aggregation, per_device_value, destinations):
    device = self._device_for(destinations)
    with tf.device(device):
      total = self._accumulation_fn(list(per_device_value.values))
      if aggregation is Aggregation.MEAN:
        total = _base.divide(total, len(per_device_value))
    return _base.mirror(total, destinations, source_device=device)

  def _reduce_indexed_slices(self, aggregation, per_device_value, destinations):
    device = self._device_for(destinations)
    total = _base.concat_indexed_slices(aggregation, per_device_value, device)
    return _base.mirror(total, destinations, source_device=device)
