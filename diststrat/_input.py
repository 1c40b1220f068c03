"""Input splitting: global batches from a tf.data pipeline become per-tower batches."""

from typing import Any, Sequence

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _tf_internal
from diststrat.errors import keeps_errors_in_tf_function
from diststrat.values import _wrapped


class PerDeviceDataset:
  """A dataset of global batches, seen as per-tower batches.

  Each element of the underlying dataset is a global batch (any nested structure of
  tensors whose first axis is the batch). Iterating gives the same structure with a
  `PerDevice` at each leaf: the batch split along its first axis as evenly as possible
  (sizes differ by at most one, the first towers get the larger parts), part i placed
  on tower i's device. With no devices (the default strategy) batches pass through
  unchanged.

  Iterate it in eager mode (`for batch in ds`), or make an iterator with `iter(ds)` or
  `make_one_shot_iterator()` and call `next(it)` / `it.get_next()` /
  `it.get_next_as_optional()`, also inside a `tf.function`.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.MirroredStrategy(["/cpu:0"])
    >>> with s.scope():
    ...   data = s.distribute_dataset(lambda: tf.data.Dataset.range(6).batch(3))
    >>> [b.values[0].numpy().tolist() for b in data]
    [[0, 1, 2], [3, 4, 5]]
  """

  @keeps_errors_in_tf_function
  def __init__(self, dataset: tf.data.Dataset, devices: Sequence[str] | None = None,
               prefetch: bool = True, first_tower: int = 0, num_towers: int | None = None) -> None:
    """See the class docstring.

    Args:
      dataset: a `tf.data.Dataset` of global batches.
      devices: the towers' devices (None: batches pass through unchanged).
      prefetch: prefetch batches.
      first_tower, num_towers: with several processes, each batch is split into
        `num_towers` parts (default: one per device) and this process takes the
        `len(devices)` parts from `first_tower` on: its share of every global batch.

    Raises:
      TypeError: `dataset` is not a `tf.data.Dataset`.
      ValueError: with devices, `first_tower` is negative or the `len(devices)` parts
        from it on are not all among the `num_towers` parts.
    """
    if not isinstance(dataset, tf.data.Dataset):
      raise TypeError(
          "PerDeviceDataset takes a tf.data.Dataset of global batches (distribute_dataset() "
          "gives it what dataset_fn returns, so it needs dataset_fn to return a "
          f"tf.data.Dataset). Received: {type(dataset).__name__}")
    self._devices = tuple(devices) if devices else None
    self._share = (first_tower, num_towers or len(self._devices or ()))
    if self._devices is not None:
      _check_share(len(self._devices), first_tower, num_towers)
    self._dataset = dataset.prefetch(tf.data.AUTOTUNE) if prefetch else dataset

  @property
  def dataset(self) -> tf.data.Dataset:
    """The underlying dataset of global batches."""
    return self._dataset

  @property
  def element_spec(self) -> Any:
    """The type specification of the per-tower batches, as tf.distribute's datasets give
    it: the dataset's structure with a `BatchParts` of one `tf.TensorSpec` per tower at
    each leaf (the part's size when the global batch size is static, else None), for a
    `tf.function`'s `input_signature`. With no devices, the dataset's own."""
    return _element_spec(self._dataset.element_spec, self._devices, self._share)

  def __iter__(self):
    return PerDeviceIterator(iter(self._dataset), self._devices, self._share)

  def make_one_shot_iterator(self) -> Any:
    """An iterator over the per-tower batches, with `get_next()`."""
    return iter(self)


class PerDeviceIterator(tf.Module):
  """Iterator of a `PerDeviceDataset`: `next(it)` or `it.get_next()`.

  It can be checkpointed like a tf.data iterator (`tf.train.Checkpoint(iterator=it)`,
  also with `tf.train.CheckpointManager`): its state is the position in the dataset of
  global batches, so restoring it, also into an iterator of the same dataset made by
  another strategy or another number of towers, resumes with the next global batch.
  """

  def __init__(self, iterator, devices, share=None):
    # A tf.Module, so checkpoints track the tf.data iterator (its state is saved as a
    # plain tf.data iterator's, under this object).
    super().__init__(name="per_device_iterator")
    self._iterator = iterator
    self._devices = devices
    self._first, self._total = share or (0, len(devices or ()))

  def __iter__(self):
    return self

  def __next__(self):
    return self._split(next(self._iterator))

  @property
  def element_spec(self) -> Any:
    """The type specification of the per-tower batches (see
    `PerDeviceDataset.element_spec`)."""
    return _element_spec(self._iterator.element_spec, self._devices,
                         (self._first, self._total))

  def get_next(self):
    """The next per-tower batch (raises `tf.errors.OutOfRangeError` at the end)."""
    return self._split(self._iterator.get_next())

  def get_next_as_optional(self) -> "PerDeviceOptional":
    """The next per-tower batch, or nothing at the end of the data, as tf.distribute's
    iterators give it: `has_value()` is a boolean tensor, `get_value()` the batch split
    across the towers. Inside a `tf.function`, `if opt.has_value():` with the step in
    its branch runs the last, possibly ragged, batch and stops without an error, and
    `while opt.has_value():` (taking the next optional at the end of the body) runs
    every batch left, as with a tf.data iterator."""
    return PerDeviceOptional(self._iterator.get_next_as_optional(), self._devices,
                             (self._first, self._total))

  def __tf_flatten__(self):
    # A tf.nest structure whose one leaf is the tf.data iterator: a `tf.function` given
    # a new iterator every epoch (`step(iter(data))`) takes its resource as an input and
    # is traced once, as with a plain tf.data iterator (an opaque Python object would
    # be traced again for each one).
    return (self._devices, (self._first, self._total)), (self._iterator,)

  @classmethod
  def __tf_unflatten__(cls, metadata, components):
    devices, share = metadata
    return cls(components[0], devices, share)

  def _split(self, element):
    return _split_element(element, self._devices, (self._first, self._total))


def _check_share(num_devices, first_tower, num_towers):
  """Raises `ValueError` unless parts `first_tower` to `first_tower + num_devices - 1`
  are among the `num_towers` parts of a batch (None: one per device)."""
  _arguments.check_int("first_tower", first_tower, minimum=0)
  if num_towers is not None:
    _arguments.check_int("num_towers", num_towers, minimum=1)
  total = num_towers or num_devices
  if first_tower + num_devices > total:
    raise ValueError(
        f"PerDeviceDataset splits each batch into num_towers={total} parts and gives the "
        f"{num_devices} devices the parts from first_tower={first_tower} on, one each: parts "
        f"{first_tower} to {first_tower + num_devices - 1} do not all exist. Give "
        "first_tower + len(devices) <= num_towers (num_towers defaults to len(devices)).")


def _not_dense(kind):
  return TypeError("distribute_dataset() splits dense tensors along their first axis; "
                   f"got a {kind}. Convert it to a dense tensor in the dataset (for "
                   "example with .map()).")


_SCALAR = ("distribute_dataset() needs batched elements (a first axis to split); got a "
           "scalar. Batch the dataset with .batch(global_batch_size).")


def _split_element(element, devices, share):
  """A global batch (a nested structure) split across `devices` (None: unchanged)."""
  if devices is None:
    return element
  first, total = share

  def split_leaf(batch):
    if batch is None:  # A None component (such as no sample weights) goes to every tower.
      return None
    if not isinstance(batch, tf.Tensor):
      raise _not_dense(type(batch).__name__)
    return split_batch(batch, devices, first_tower=first, num_towers=total)

  return _keeping_errors(tf.nest.map_structure, split_leaf, element)


def _keeping_errors(fn, *args):
  """`fn(*args)`; an error (data that cannot be split, from `next(it)` in the user's
  code) reaches a `tf.function`'s caller as itself, not rewritten by AutoGraph."""
  try:
    return fn(*args)
  except Exception as e:
    _tf_internal.pass_through_autograph(e)
    raise


def _element_spec(spec, devices, share):
  """The spec of `_split_element` of elements of `spec` (a dataset's element spec)."""
  if devices is None:
    return spec
  first, total = share

  def split_leaf(leaf):
    if isinstance(leaf, type(tf.type_spec_from_value(None))):  # A None component.
      return leaf
    if not isinstance(leaf, tf.TensorSpec):
      raise _not_dense(getattr(leaf, "value_type", type(leaf)).__name__)
    if leaf.shape.rank == 0:
      raise ValueError(_SCALAR)
    static = leaf.shape[0] if leaf.shape.rank else None
    # A static batch splits into parts of static sizes (split_batch's); else, as for a
    # dataset whose last batch may be partial, the parts' sizes are unknown.
    sizes = (split_sizes(static, total) if static is not None and static >= total
             else [None] * total)
    parts = {device: tf.TensorSpec(None if leaf.shape.rank is None
                                   else [size] + leaf.shape[1:], leaf.dtype)
             for device, size in zip(devices, sizes[first:first + len(devices)],
                                     strict=True)}
    if total == len(devices):
      return _wrapped.BatchParts(parts)
    return _wrapped.BatchParts(parts, global_size=tf.TensorSpec([], tf.int64))

  return _keeping_errors(tf.nest.map_structure, split_leaf, spec)


class PerDeviceOptional:
  """What `PerDeviceIterator.get_next_as_optional()` returns: a tf.data optional of the
  next global batch, whose value is split across the towers when it is read.

  A tf.nest structure whose one leaf is that tf.data optional, so that it can be a loop
  variable in a `tf.function` (`while opt.has_value(): ...; opt = it.get_next_as_optional()`),
  as a tf.data or tf.distribute optional can.
  """

  def __init__(self, optional, devices, share):
    self._optional = optional
    self._devices = devices
    self._share = share

  def has_value(self) -> Any:
    """A boolean tensor: whether there was a next batch."""
    return self._optional.has_value()

  def get_value(self) -> Any:
    """The batch, split as `next()` splits it (an error if there was none)."""
    return _split_element(self._optional.get_value(), self._devices, self._share)

  def __tf_flatten__(self):
    return (self._devices, self._share), (self._optional,)

  @classmethod
  def __tf_unflatten__(cls, metadata, components):
    devices, share = metadata
    return cls(components[0], devices, share)


def split_batch(batch, devices, allow_empty=False, first_tower=0, num_towers=None):
  """`batch` split along its first axis into one part per device, as `BatchParts`.

  Sizes are as even as possible, the larger parts first; part i is placed on
  `devices[i]`. Works on static and dynamic batch sizes (eager and in `tf.function`).

  Args:
    batch: a tensor with a first (batch) axis.
    devices: the towers' devices, in tower order.
    allow_empty: let towers get no example when the batch is smaller than the number
      of devices (Keras's `predict` on a short last batch); else that raises.
    first_tower, num_towers: with several processes, the batch is split into
      `num_towers` parts (default: one per device) and this process keeps the
      `len(devices)` parts from `first_tower` on; the parts then carry the global size.

  Raises:
    ValueError: `batch` is a scalar, or (unless `allow_empty`) has fewer examples than
      towers.
  """
  n = num_towers or len(devices)
  if batch.shape.rank == 0:
    raise ValueError(_SCALAR)
  static = batch.shape[0] if batch.shape.rank else None
  if static is not None and (static >= n or not allow_empty):
    sizes = split_sizes(static, n)
  else:
    size = tf.shape(batch, out_type=tf.int64)[0]
    # The message of `split_sizes`, with the batch size known only when the step runs.
    checks = [] if allow_empty else [tf.debugging.Assert(size >= n, [
        "A batch of", size, f"examples cannot be split across {n} towers: each tower "
        f"needs at least one example. Use a global batch size of at least {n} (or "
        "drop_remainder=True when batching)."])]
    with tf.control_dependencies(checks):
      base = size // n
      extra = size % n
      sizes = base + tf.cast(tf.range(n, dtype=tf.int64) < extra, tf.int64)
  parts = tf.split(batch, sizes, num=n, axis=0)[first_tower:first_tower + len(devices)]
  if static is not None and static < n and not tf.executing_eagerly():
    # Fewer examples than towers, in a graph: TensorFlow infers each part's size (some
    # 0) from the static batch size. Keras reads a 0 there as a squeezable axis
    # (`keras.ops.add`, so `layers.Add` and `x + y` of two such parts, makes it a
    # `BiasAdd`, which then fails to build), so the parts' batch axis is left unknown,
    # as for a batch of unknown size.
    parts = [tf.compat.v1.placeholder_with_default(p, [None] + p.shape[1:]) for p in parts]
  placed = {}
  # strict=False: as before; first_tower and num_towers are the caller's (public arguments).
  for device, part in zip(devices, parts, strict=False):
    with tf.device(device):
      placed[device] = tf.identity(part)
  if n == len(devices):
    return _wrapped.BatchParts(placed)
  global_size = static if static is not None else tf.shape(batch, out_type=tf.int64)[0]
  return _wrapped.BatchParts(placed, global_size=global_size)


def split_sizes(batch_size, num_towers):
  """The per-tower sizes of a batch: as even as possible, larger parts first.

  Raises:
    ValueError: the batch has fewer examples than there are towers.
  """
  if batch_size < num_towers:
    raise ValueError(
        f"A batch of {batch_size} examples cannot be split across {num_towers} towers: each "
        f"tower needs at least one example. Use a global batch size of at least "
        f"{num_towers} (or drop_remainder=True when batching).")
  base, extra = divmod(batch_size, num_towers)
  return [base + 1 if i < extra else base for i in range(num_towers)]


def _for_loop_in_a_function(iter_, extra_test, body, *unused_loop_state):
  """AutoGraph's `for` over a `PerDeviceDataset` or `PerDeviceIterator`: in a traced
  function, refused with the fix (in a graph, `next` of a dataset's iterator gives
  tensors and never raises `StopIteration`, so the Python loop AutoGraph would run
  instead traces forever); converted code run eagerly loops in Python, as before."""
  if tf.executing_eagerly():
    # As AutoGraph's own Python loop: the test (a `break` or `return` in the body) is
    # checked before the loop and after each batch, so a loop that stops takes no
    # batch more from the iterator than it ran.
    if extra_test is not None and not extra_test():
      return
    for element in iter_:
      body(element)
      if extra_test is not None and not extra_test():
        break
    return
  error = TypeError(
      f"A for loop over a {type(iter_).__name__} (from distribute_dataset()) inside a "
      "tf.function cannot end: in a graph the next batch is a tensor and the loop would "
      "be traced forever. Loop outside the function and call it on each batch "
      "(for batch in data: step(batch)), or pass an iterator into the function and call "
      "next() there (it = iter(data); step(it)).")
  raise _tf_internal.pass_through_autograph(error)


_tf_internal.register_for_loop(PerDeviceDataset, _for_loop_in_a_function)
_tf_internal.register_for_loop(PerDeviceIterator, _for_loop_in_a_function)
