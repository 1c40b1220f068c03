"""Wrapped values: one value per device, and moving between per-tower and wrapped forms."""

import collections
from typing import Any, Sequence

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _context
from diststrat import _devices
from diststrat import _tf_internal
from diststrat import errors


class DistributedValues:
  """A map from device to value, in the strategy's device order.

  Device strings are canonicalized: `"/cpu:1"`, `"/device:CPU:1"` and
  `"/job:localhost/replica:0/task:0/device:CPU:1"` name one device.

  Example:
    >>> from diststrat.values import PerDevice
    >>> v = PerDevice({"/cpu:0": 1, "/cpu:1": 2})
    >>> v.get("/device:CPU:1"), len(v), "/cpu:0" in v
    (2, 2, True)
  """

  _holds_copies = False  # True when every component is a copy of one value.

  def __init__(self, index: dict[Any, Any]) -> None:
    if not isinstance(index, dict) or not index:
      raise _tf_internal.pass_through_autograph(ValueError(
          f"{type(self).__name__} takes a non-empty dict from device to value. "
          f"Received: {index!r}"))
    self._index: dict[str, Any] = {}
    for device, value in index.items():
      key = _devices.canonicalize(device)
      if key in self._index:
        raise _tf_internal.pass_through_autograph(ValueError(
            f"{type(self).__name__} got device {device!r} twice (as {key}). "
            "Give each device once."))
      self._index[key] = value

  @property
  def devices(self) -> tuple[str, ...]:
    """The devices, as a tuple of canonical names, in strategy order."""
    return tuple(self._index)

  @property
  def values(self) -> tuple[Any, ...]:
    """The values, as a tuple, in the order of `devices`."""
    return tuple(self._index.values())

  @property
  def primary(self) -> Any:
    """The value on the first device."""
    return next(iter(self._index.values()))

  def get(self, device: str | None = None) -> Any:
    """The value on `device`.

    Args:
      device: a device string. None means the current tower's device, else the device
        being updated (inside `update()`), else the current `tf.device` scope.

    Raises:
      ValueError: no value lives on that device.
    """
    explicit = device is not None
    if device is None:
      device = _implicit_device()
    if device is not None:
      key = _devices.canonicalize(device)
      if key in self._index:
        return self._index[key]
    if not explicit and self._holds_copies:
      return self.primary  # Every copy holds the same value.
    raise _tf_internal.pass_through_autograph(ValueError(
        f"{type(self).__name__} has no value on device {device!r}"
        f"{'' if explicit else ' (the current device)'}; it has values on "
        f"{list(self._index)}. Pass one of these devices to get(), or run the code "
        "under tf.device() of one of them."))

  def __len__(self):
    return len(self._index)

  def __contains__(self, device):
    try:
      return _devices.canonicalize(device) in self._index
    except ValueError:
      return False

  def __repr__(self):
    items = ", ".join(f"{d!r}: {v!r}" for d, v in self._index.items())
    return f"{type(self).__name__}({{{items}}})"


class _NestedValues(DistributedValues):
  """A wrapped value that tf.nest sees as a structure whose leaves are its components.

  So `tf.function` takes and returns wrapped values of tensors (tracing once per
  devices, shapes and dtypes, not once per Python object), and `tf.nest.map_structure`
  maps over the components. Distributed variables are not structures: `tf.Module` and
  Keras must see one variable, not its copies.
  """

  def __tf_flatten__(self):
    return (type(self), self.devices), self.values

  @classmethod
  def __tf_unflatten__(cls, metadata, components):
    wrapped_class, devices = metadata
    return wrapped_class(dict(zip(devices, components, strict=True)))


# A SavedModel describes a function's arguments and results for a loader that has no
# diststrat: a wrapped value there is the tuple of its components, in device order (a
# `BatchParts` of a global batch size: its parts, then that size).
_tf_internal.save_as_tuple_of_components(_NestedValues, lambda v: v.__tf_flatten__()[1])


class PerDevice(_NestedValues):
  """A wrapped value whose components may differ: one per tower (locality T)."""


class Mirrored(_NestedValues):
  """A wrapped value whose components are copies of one value (localities M, V(v), N)."""

  _holds_copies = True


def _refuse_tensor_conversion(value, dtype=None, name=None, as_ref=False):
  """Raises the `ValueError` for a wrapped value used where TensorFlow wants one tensor.

  Registered for `PerDevice` and `Mirrored`, so the error is this one in eager mode and
  inside a `tf.function` (where TensorFlow, seeing a structure of tensors, said "Expected
  any non-tensor type, but got a tensor instead").
  """
  del dtype, name, as_ref  # Unused.
  devices = list(value.devices)
  if isinstance(value, Mirrored):
    raise _tf_internal.pass_through_autograph(ValueError(
        f"A {type(value).__name__} (copies of one value, on {devices}) is not a tensor. "
        "Take one copy: value.get(device), or value.get() for the current device's (else "
        "the first)."))
  raise _tf_internal.pass_through_autograph(ValueError(
      f"A {type(value).__name__} (one value per tower, on {devices}) is not a tensor. "
      "Reduce it first (strategy.reduce(aggregation, value)), or take one tower's value: "
      "value.get(device) (value.values has them all). In a tower, call_for_each_tower "
      "gives each tower its own value."))


tf.register_tensor_conversion_function(PerDevice, _refuse_tensor_conversion)
tf.register_tensor_conversion_function(Mirrored, _refuse_tensor_conversion)


class BatchParts(PerDevice):
  """A `PerDevice` whose components are the parts of one global batch, in tower order.

  `distribute_dataset` (and Keras's `fit` under diststrat) split batches into these, so
  `call_for_each_tower` knows each tower's share of the batch (`TowerContext.batch_share`).

  Args:
    index: device -> this process's parts.
    global_size: the number of examples in the whole global batch, when this process
      holds only some of its parts (several worker processes): an int or a scalar
      tensor. None: the parts are the whole batch.
  """

  def __init__(self, index, global_size=None):
    super().__init__(index)
    self.global_size = global_size

  def __tf_flatten__(self):
    if self.global_size is None:
      return (type(self), self.devices, False), self.values
    return (type(self), self.devices, True), self.values + (self.global_size,)

  @classmethod
  def __tf_unflatten__(cls, metadata, components):
    wrapped_class, devices, sized = metadata
    if sized:
      return wrapped_class(dict(zip(devices, components[:-1], strict=True)),
                           global_size=components[-1])
    return wrapped_class(dict(zip(devices, components, strict=True)))


def batch_shares(structure: Any) -> dict[str, Any] | None:
  """Each component's share of the first `BatchParts` in `structure`, or None.

  Returns a dict device -> n_i / B: Python floats when the parts' sizes are static,
  float32 scalar tensors otherwise (0 for every part of an empty batch). A strategy's
  `_call_for_each_tower` gives each tower's `TowerContext` its share of the arguments
  (docs/write_your_own_strategy.md).
  """
  parts = next((leaf for leaf in flatten(structure) if isinstance(leaf, BatchParts)), None)
  if parts is None:
    return None
  sizes: list[Any] = [p.shape[0] if p.shape.rank else None for p in parts.values]
  total = parts.global_size
  if all(isinstance(n, int) for n in sizes) and (total is None or isinstance(total, int)):
    total = sum(sizes) if total is None else total
    return {d: (n / total if total else 0.0) for d, n in zip(parts.devices, sizes, strict=True)}
  counts = [tf.cast(tf.shape(p)[0], tf.float32) for p in parts.values]
  total = tf.add_n(counts) if total is None else tf.cast(total, tf.float32)
  return {d: tf.math.divide_no_nan(c, total) for d, c in zip(parts.devices, counts, strict=True)}


def _implicit_device():
  """The device `get()` means with no argument, or None when nothing names one."""
  tower = _context.get_tower_context()
  if tower is not None and tower is not _context.default_tower_context():
    return tower.device
  device = _context.get_update_device()
  if device is not None:
    return device
  return _devices.current_device()


def container_of(component):
  """The distributed variable that `component` is one copy of, or None."""
  container = _tf_internal.distributed_container(component)
  return container if isinstance(container, DistributedValues) else None


# --- structures -----------------------------------------------------------------------


def _is_namedtuple(x):
  return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _describe(structure):
  """A short rendering of a structure's shape, with leaves as `*`."""
  if structure is None:
    return "None"
  if _is_namedtuple(structure):
    # strict=False: a message never fails, whatever tuple subclass claims `_fields`.
    inner = ", ".join(f"{k}={_describe(v)}"
                      for k, v in zip(structure._fields, structure, strict=False))
    return f"{type(structure).__name__}({inner})"
  if isinstance(structure, tuple):
    return "(" + ", ".join(_describe(v) for v in structure) + ("," if len(structure) == 1 else "") + ")"
  if isinstance(structure, list):
    return "[" + ", ".join(_describe(v) for v in structure) + "]"
  if isinstance(structure, dict):
    return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in structure.items()) + "}"
  return "*"


def _kind(x):
  if x is None:
    return ("none",)
  if _is_namedtuple(x):
    return ("namedtuple", type(x), len(x))
  if isinstance(x, tuple):
    return ("tuple", len(x))
  if isinstance(x, list):
    return ("list", len(x))
  if isinstance(x, dict):
    return ("dict", tuple(sorted(map(repr, x))))
  return ("leaf",)


def _dict_like(template, items):
  """A dict of `template`'s type (OrderedDict, defaultdict, ...) holding `items` in order."""
  if type(template) is dict:  # pylint: disable=unidiomatic-typecheck
    return dict(items)
  if isinstance(template, collections.defaultdict):
    result = collections.defaultdict(template.default_factory)
    result.update(items)
    return result
  try:
    return type(template)(items)
  except TypeError:  # A mapping class built otherwise.
    return dict(items)


def regroup(values_per_tower: Sequence[Any], devices: Sequence[str],
            wrap_class: type | None = None) -> Any:
  """Merges per-tower structures leaf by leaf into one structure of wrapped values.

  Args:
    values_per_tower: a list with one structure per tower. Structures are nested lists,
      tuples, namedtuples, dicts and None; anything else is a leaf.
    devices: the towers' devices, one per structure.
    wrap_class: the class of the wrapped leaves (default `PerDevice`; `Mirrored` where
      the values are known to be copies, as after `update`).

  Returns:
    The common structure where each leaf is: the same object if every tower has the
    same object; the distributed variable if every tower has one copy of it; else a
    `PerDevice` of the towers' leaves.

  Raises:
    ValueError: the towers' structures differ (names the towers and both structures).

  Example:
    >>> from diststrat.values import regroup
    >>> r = regroup([{"a": 1, "b": None}, {"a": 2, "b": None}], ["/cpu:0", "/cpu:1"])
    >>> r["a"].values, r["b"]
    ((1, 2), None)
  """
  values_per_tower = list(values_per_tower)
  devices = _devices.canonicalize_all(devices)
  if not values_per_tower:
    raise _tf_internal.pass_through_autograph(ValueError(
        "regroup() needs at least one tower's structure (and its device). "
        f"Received: values_per_tower=[], devices={list(devices)}."))
  if len(values_per_tower) != len(devices):
    raise _tf_internal.pass_through_autograph(ValueError(
        f"regroup() needs one structure per device: got "
        f"{len(values_per_tower)} structures for {len(devices)} devices."))
  return _regroup(values_per_tower, devices, values_per_tower, wrap_class or PerDevice)


def _regroup(items, devices, roots, wrap_class):
  first = items[0]
  kind = _kind(first)
  for i, item in enumerate(items[1:], start=1):
    if _kind(item) != kind:
      raise errors.StructureMismatchError(
          f"Towers must return (and pass to merge_call) the same structure, but tower 0 "
          f"gave {_describe(roots[0])} and tower {i} gave {_describe(roots[i])}. Make "
          "every tower build the same structure.")
  if kind[0] == "none":
    return None
  if kind[0] == "namedtuple":
    return type(first)(*[_regroup([it[j] for it in items], devices, roots, wrap_class)
                         for j in range(len(first))])
  if kind[0] in ("tuple", "list"):
    merged = [_regroup([it[j] for it in items], devices, roots, wrap_class) for j in range(len(first))]
    return tuple(merged) if kind[0] == "tuple" else merged
  if kind[0] == "dict":
    return _dict_like(first, [(k, _regroup([it[k] for it in items], devices, roots, wrap_class))
                              for k in first])
  if all(item is first for item in items):
    return first
  container = container_of(first)
  if container is not None and len(container.devices) == len(items) and all(
      item is container.get(d) for item, d in zip(items, container.devices, strict=True)):
    return container
  return wrap_class(dict(zip(devices, items, strict=True)))


def flatten(structure):
  """The leaves of a nested structure, in order; wrapped values are leaves, None is not.

  The structures are those `regroup` knows (lists, tuples, namedtuples, dicts).
  """
  if structure is None:
    return []
  if isinstance(structure, (list, tuple)):
    return [leaf for item in structure for leaf in flatten(item)]
  if isinstance(structure, dict):
    return [leaf for value in structure.values() for leaf in flatten(value)]
  return [structure]


def per_device_off(structure: Any, devices: Sequence[str]) -> Any:
  """The first `PerDevice` leaf of `structure` (not a variable) whose devices are not
  `devices` (in any order), or None.

  A per-tower value stands for one value per tower: one over other devices, or over more
  or fewer of them, is some other strategy's, and its components cannot be the towers'.
  """
  wanted = set(devices)
  for leaf in flatten(structure):
    if (isinstance(leaf, PerDevice) and not isinstance(leaf, tf.Variable)
        and set(leaf.devices) != wanted):
      return leaf
  return None


def pack_as(structure, leaves):
  """`structure` with its leaves replaced, in order, by `leaves` (the inverse of `flatten`).

  Example:
    >>> from diststrat.values import _wrapped
    >>> _wrapped.pack_as({"a": [1, None], "b": 2}, ["x", "y"])
    {'a': ['x', None], 'b': 'y'}
  """
  leaves = iter(leaves)
  packed = _pack(structure, leaves)
  if next(leaves, _END) is not _END:
    raise ValueError("pack_as() got more leaves than the structure has.")
  return packed


_END = object()


def _pack(x, leaves):
  if x is None:
    return None
  if _is_namedtuple(x):
    return type(x)(*[_pack(v, leaves) for v in x])
  if isinstance(x, (list, tuple)):
    return type(x)(_pack(v, leaves) for v in x)
  if isinstance(x, dict):
    return _dict_like(x, [(k, _pack(v, leaves)) for k, v in x.items()])
  return next(leaves)


def is_structure(x):
  """True for the containers `flatten` opens (list, tuple, namedtuple, dict)."""
  return isinstance(x, (list, tuple, dict))


def select_device(device: str, structure: Any) -> Any:
  """Replaces every wrapped leaf of `structure` by its component on `device`.

  The inverse of `regroup`: `select_device(devices[i], regroup(vals, devices))` gives
  back tower i's structure.

  Example:
    >>> from diststrat.values import PerDevice, select_device
    >>> select_device("/cpu:1", [PerDevice({"/cpu:0": "a", "/cpu:1": "b"}), 3])
    ['b', 3]
  """
  device = _devices.canonicalize(device)
  return _select(device, structure)


def tower_part(device, structure):
  """`select_device(device, structure)` for what a tower receives: its arguments, its
  part of a `merge_fn`'s result.

  A distributed variable with no copy on `device` is kept whole, where `select_device`
  would raise: the tower uses (and writes) the variable itself, as it would the plain
  variable it stands for. `ParameterServerStrategy` keeps such variables (a variable
  with an aggregation, Keras's non-trainable state) as one-copy `MirroredVariable`s on
  their parameter device.
  """
  device = _devices.canonicalize(device)
  return _select(device, structure, keep_remote_variables=True)


def _select(device, x, keep_remote_variables=False):
  if isinstance(x, DistributedValues):
    if keep_remote_variables and isinstance(x, tf.Variable) and device not in x:
      return x
    return x.get(device)
  if x is None:
    return None
  if _is_namedtuple(x):
    return type(x)(*[_select(device, v, keep_remote_variables) for v in x])
  if isinstance(x, tuple):
    return tuple(_select(device, v, keep_remote_variables) for v in x)
  if isinstance(x, list):
    return [_select(device, v, keep_remote_variables) for v in x]
  if isinstance(x, dict):
    return _dict_like(x, [(k, _select(device, v, keep_remote_variables)) for k, v in x.items()])
  return x


def devices_of(destinations):
  """The canonical devices that `destinations` names, as a tuple.

  `destinations` may be a device string, a list of them, a wrapped value or distributed
  variable (its devices), a variable or a tensor (its device).
  """
  if isinstance(destinations, DistributedValues):
    return destinations.devices
  if isinstance(destinations, (str, tf.DeviceSpec)):
    return _devices.check_exist((_devices.canonicalize(destinations),), "destinations")
  if isinstance(destinations, (list, tuple)) and destinations and all(
      isinstance(d, (str, tf.DeviceSpec)) for d in destinations):
    return _devices.check_exist(_devices.canonicalize_all(destinations), "destinations")
  device = getattr(destinations, "device", None)
  if isinstance(destinations, (tf.Variable, tf.Tensor)) and device:
    return (_devices.canonicalize(device),)
  if isinstance(destinations, tf.Tensor):
    raise ValueError(
        "destinations is a tensor with no device (in a tf.function, a tensor gets one "
        "only when it is made under tf.device(...)). Pass a device string, or make the "
        f"tensor under tf.device(...). Received: destinations={destinations!r}")
  raise ValueError(
      "destinations must be None, a device string, a list of device strings, a variable, "
      f"a tensor with a device or a wrapped value. Received: destinations={destinations!r}")


REQUIRED = object()
"""`resolve_destinations`'s default for a method that refuses `destinations=None`."""


def resolve_destinations(destinations, default, method=None):
  """The devices `destinations` names, as a tuple of canonical device strings.

  The one reading of a `destinations` argument: every public method that takes one
  (a strategy's `reduce`, `batch_reduce`, `broadcast`, `gather`; a `CrossTowerOps`'s
  `reduce`, `batch_reduce`, `broadcast`) resolves it here, once, and its hooks receive
  the result.

  `destinations` may be a device string or a list of them (each must exist), a wrapped
  value or a distributed variable (its devices; also any object with `devices` and
  `get()`), a variable or a tensor (its device), or a variable `as_tf_variable`
  unwraps (a Keras variable).

  None means `default`, which the public method passes: where its result goes when the
  caller names nowhere (a tuple of canonical devices, or None for "nowhere else"), or
  a function that returns it (called only then). The public methods pass:

  - a strategy's `reduce`, `batch_reduce` and `broadcast`: its worker devices (its
    `_default_destinations`; the default strategy, which has none, gives None);
  - a strategy's `gather`: None, no copy (the result stays on the first worker device);
  - `CrossTowerOps.reduce` and `batch_reduce`: the devices of the value reduced;
  - `CrossTowerOps.broadcast`: `REQUIRED`, so None raises a `ValueError` naming
    `method`.

  Example:
    >>> resolve_destinations("/cpu:1", default=None)
    ('/job:localhost/replica:0/task:0/device:CPU:1',)
    >>> resolve_destinations(None, default=("/job:localhost/replica:0/task:0/device:CPU:0",))
    ('/job:localhost/replica:0/task:0/device:CPU:0',)
  """
  if destinations is None:
    if default is REQUIRED:
      raise ValueError(f"{method}() needs destinations: a device string, a list of them, a "
                       "variable or a wrapped value. Received: destinations=None")
    return default() if callable(default) else default
  destinations = _arguments.as_tf_variable(destinations)
  if is_distributed_variable_like(destinations):
    return _devices.canonicalize_all(destinations.devices)
  return devices_of(destinations)


def is_distributed_variable_like(value):
  """A distributed variable that is not a `DistributedValues`: it has devices and get()."""
  return (not isinstance(value, (DistributedValues, tf.Variable, tf.Tensor, tf.IndexedSlices))
          and isinstance(getattr(value, "devices", None), (tuple, list))
          and callable(getattr(value, "get", None)))
