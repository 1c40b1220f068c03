"""`AllReduceCrossTowerOps`: every device ends with the sum, by one of four algorithms.

An algorithm is a small function `(devices, columns, mean, first) -> reduced columns`: a
column holds one tensor's value on each device, in `devices` order, and its result holds
the reduced tensor on each device. `first` is the index of the first column in the batch
(algorithms that spread work over the devices start there). Packing turns many columns
into a few before the algorithm runs and back after it.
"""

from diststrat._tf import tf
from diststrat import _arguments
from diststrat._arguments import Aggregation
from diststrat import _devices
from diststrat.errors import keeps_errors_in_tf_function
from diststrat.cross_tower_ops import _base
from diststrat.cross_tower_ops import _collective
from diststrat.cross_tower_ops import _packing
from diststrat.cross_tower_ops._one_device import ReductionToOneDevice
from diststrat.values import _wrapped

_DEFAULT_TIMEOUT = None


def _naive(ops, devices, columns, mean, first):
  """Each column is summed on one device, round-robin over the devices, then copied back."""
  del ops  # Unused.
  results = []
  for j, column in enumerate(columns):
    home = devices[(first + j) % len(devices)]
    with tf.device(home):
      total = tf.math.add_n(list(column))
      if mean:
        total = _base.divide(total, len(devices))
    results.append(_base.mirror(total, devices, source_device=home).values)
  return results


def _hierarchical_copy(ops, devices, columns, mean, first):
  """Two groups each sum on one device; the two partial sums are added and sent back.

  The groups are the first ceil(N/2) and the last floor(N/2) devices (on an 8-GPU DGX-1,
  the two fully connected quads). Each group's summing device rotates with the column.
  """
  del ops  # Unused.
  half = (len(devices) + 1) // 2
  groups = (devices[:half], devices[half:])
  results = []
  for j, column in enumerate(columns):
    homes = [group[(first + j) % len(group)] for group in groups]
    partials = []
    for home, values in zip(homes, (column[:half], column[half:]), strict=True):
      with tf.device(home):
        partials.append(tf.math.add_n(list(values)))
    with tf.device(homes[0]):
      total = partials[0] + partials[1]
      if mean:
        total = _base.divide(total, len(devices))
    with tf.device(homes[1]):
      sent_back = tf.identity(total)
    result = _base.mirror(total, groups[0], source_device=homes[0]).values
    result += _base.mirror(sent_back, groups[1], source_device=homes[1]).values
    results.append(result)
  return results


def _collective_all_reduce(ops, devices, columns, mean, first, communication_hint="auto"):
  """One TensorFlow collective all-reduce per column."""
  del first  # Unused.
  reduced = {}
  for j, column in enumerate(columns):
    if column[0].shape.num_elements() != 0:  # An empty tensor is its own sum.
      reduced[j] = _collective.all_reduce(list(column), devices,
                                          mean and not column[0].dtype.is_integer,
                                          ops.timeout or 0, communication_hint)
  if reduced:
    together = _collective.run_together(list(reduced.values()), devices)
    reduced = dict(zip(reduced, together, strict=True))
  results = []
  for j, column in enumerate(columns):
    result = reduced.get(j, column)
    if mean and column[0].dtype.is_integer:  # The collective's division truncates; ours floors.
      result = [_on(d, _base.divide, r, len(devices)) for d, r in zip(devices, result, strict=True)]
    results.append(tuple(result))
  return results


def _nccl(ops, devices, columns, mean, first):
  """The collective all-reduce, run by NCCL on GPUs."""
  return _collective_all_reduce(ops, devices, columns, mean, first, communication_hint="nccl")


_ALGORITHMS = {
    "collective": _collective_all_reduce,
    "nccl": _nccl,
    "hierarchical_copy": _hierarchical_copy,
    "naive": _naive,
}
_USES_COLLECTIVES = ("collective", "nccl")


def _on(device, fn, *args):
  with tf.device(device):
    return fn(*args)


class AllReduceCrossTowerOps(_base.CrossTowerOps):
  """Reduces values that live on the destination devices with an all-reduce.

  A value whose devices are not exactly its destinations (for example a reduction onto a
  variable that lives on one device) is reduced by `ReductionToOneDevice` instead.
  `IndexedSlices` are concatenated on the first destination, for every algorithm.

  Args:
    algorithm: one of
      - `"collective"`: TensorFlow collective ops (a ring on CPUs); works on any devices.
      - `"nccl"`: collective ops run by NCCL; GPUs only.
      - `"hierarchical_copy"`: the devices form two groups (the first ceil(N/2) and the
        last floor(N/2)); each group sums on one device, the two partial sums are added
        and sent back, then copied within each group. Built for 8-GPU DGX-1 machines.
      - `"naive"`: each tensor is summed on one device, the tensors spread round-robin
        over the devices, and copied back. The fastest choice for logical CPU devices.
    num_packs: 1 reduces tensor by tensor. More than 1 first concatenates all tensors of
      one dtype into `num_packs` flat chunks, reduces the chunks and splits them back (when
      every shape is fully known; otherwise it silently goes tensor by tensor). Fewer,
      bigger transfers help on GPUs; on CPUs the concatenation costs more than it saves.
    timeout: None (the default): the collectives (`"collective"`, `"nccl"`) have no
      timeout. Their members are launched together, in one function call, so none waits
      for a member that is not coming, and an error in the call ends them all. A number:
      seconds a collective waits for the other devices before it fails with
      `DeadlineExceededError`; TensorFlow then holds a native thread per collective run
      for that long, finished or not (thousands at fast steps), so use it to debug only.

  Raises:
    ValueError: an unknown algorithm, a bad `num_packs` or `timeout`; `"nccl"` used on
      devices that are not GPUs (raised when the values are reduced).

  Example:
    >>> import tensorflow as tf
    >>> from diststrat.cross_tower_ops import AllReduceCrossTowerOps
    >>> from diststrat.values import PerDevice
    >>> x = PerDevice({"/cpu:0": tf.constant(1.0), "/cpu:1": tf.constant(3.0)})
    >>> ops = AllReduceCrossTowerOps("naive")
    >>> [float(v) for v in ops.reduce("mean", x).values]
    [2.0, 2.0]
  """

  @keeps_errors_in_tf_function
  def __init__(self, algorithm: str = "collective", num_packs: int = 1,
               timeout: float | None = _DEFAULT_TIMEOUT) -> None:
    super().__init__()
    if algorithm not in _ALGORITHMS:
      raise ValueError(f"algorithm must be one of {', '.join(map(repr, _ALGORITHMS))}. "
                       f"Received: algorithm={algorithm!r}")
    if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
      raise ValueError("num_packs must be an integer >= 1 (1: no packing). Received: "
                       f"num_packs={num_packs!r}")
    self._algorithm = algorithm
    self._num_packs = num_packs
    self._timeout = _arguments.seconds("timeout", timeout)
    self._fallback = ReductionToOneDevice()

  @property
  def algorithm(self) -> str:
    return self._algorithm

  @property
  def num_packs(self) -> int:
    return self._num_packs

  @property
  def timeout(self) -> float | None:
    """Seconds a collective waits for its peers, or None (forever)."""
    return self._timeout

  def __repr__(self):
    return (f"AllReduceCrossTowerOps(algorithm={self._algorithm!r}, "
            f"num_packs={self._num_packs})")

  def _reduce(self, aggregation, per_device_value, destinations):
    return self._batch_reduce(aggregation, [(per_device_value, destinations)])[0]

  def _batch_reduce(self, aggregation, value_destination_pairs):
    results = [None] * len(value_destination_pairs)
    groups = {}  # (device set, dtype) -> indices of the pairs that all-reduce together
    for i, (value, destinations) in enumerate(value_destination_pairs):
      if set(value.devices) == set(destinations):
        key = (frozenset(destinations), value.primary.dtype)
        groups.setdefault(key, []).append(i)
      else:
        results[i] = self._fallback._reduce(aggregation, value, destinations)
    mean = aggregation is Aggregation.MEAN
    first = 0
    for indices in groups.values():
      devices = value_destination_pairs[indices[0]][1]
      self._check_devices(devices)
      columns = [tuple(value_destination_pairs[i][0].get(d) for d in devices)
                 for i in indices]
      reduced = self._all_reduce(devices, columns, mean, first)
      first += len(columns)
      for i, column in zip(indices, reduced, strict=True):
        results[i] = _wrapped.Mirrored(dict(zip(devices, column, strict=True)))
    return results

  def _all_reduce(self, devices, columns, mean, first):
    """Runs the algorithm on `columns`, packed into a few chunks when asked and possible."""
    algorithm = _ALGORITHMS[self._algorithm]
    tensors = [t for column in columns for t in column]
    if (self._num_packs == 1 or not _packing.fully_defined(tensors)
        or sum(c[0].shape.num_elements() for c in columns) == 0):
      return algorithm(self, devices, columns, mean, first)
    packing = _packing.Packing([c[0].shape for c in columns], self._num_packs)
    packed = [_on(device, packing.pack, [c[k] for c in columns])
              for k, device in enumerate(devices)]
    chunks = [tuple(p[c] for p in packed) for c in range(packing.num_chunks)]
    reduced = algorithm(self, devices, chunks, mean, first)
    unpacked = [_on(device, packing.unpack, [r[k] for r in reduced])
                for k, device in enumerate(devices)]
    return [tuple(u[j] for u in unpacked) for j in range(len(columns))]

  def _check_devices(self, devices):
    if self._algorithm == "nccl" and any(
        _devices.device_type(d) != "GPU" for d in devices):
      raise ValueError(
          "AllReduceCrossTowerOps(algorithm='nccl') runs on GPUs only, but the values live "
          f"on {list(devices)}. Use algorithm='collective' or 'naive' for other devices, or "
          "choose_cross_tower_ops(devices) to pick one.")

  def _failure_hint(self):
    if self._algorithm not in _USES_COLLECTIVES:
      return ""
    timeout = "none" if self._timeout is None else f"{self._timeout:g} s"
    return (f" A collective all-reduce (algorithm={self._algorithm!r}, timeout="
            f"{timeout}) fails when some device never joins it or a device dies. "
            "After such a failure TensorFlow aborts every later collective in this process: "
            "restart the process. To avoid collectives, use "
            "AllReduceCrossTowerOps(algorithm='naive') or ReductionToOneDevice().")
