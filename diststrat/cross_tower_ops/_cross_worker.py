"""`CrossWorkerAllReduce`: reductions over the towers of every worker process.

`MultiWorkerMirroredStrategy` runs the same program in several processes. Each process
holds its own towers' values; a reduction must give every tower of every process the
total. TensorFlow's collective ops do the communication, over its gRPC runtime.

Two schemes:

- **hierarchical** (the default): each worker first adds its towers' values on its first
  device, then the workers all-reduce those partial sums with one collective member per
  worker, then each worker copies the total to its towers. Across processes, each
  worker sends one value per tensor, whatever its number of towers.
- **flat**: one collective over every tower of every worker (group size: all towers).

Values are placed on a worker's own devices only. Every worker must run the same
reductions in the same order (the same program does): collective instances are matched
across processes by the order in which they are built.
"""

from typing import Any, Optional, Sequence

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _tf_internal
from diststrat.errors import keeps_errors_in_tf_function
from diststrat._arguments import Aggregation
from diststrat.cross_tower_ops import _base
from diststrat.cross_tower_ops import _collective
from diststrat.cross_tower_ops import _packing
from diststrat.values import _wrapped

SCHEMES = ("hierarchical", "flat")
_NO_TIMEOUT = 0  # The collectives' own timeout: none (see `timeout` below).
DEFAULT_TIMEOUT = 60.0
DEFAULT_BUCKET_BYTES = 2**20
"""Tensors of one dtype reduced across workers together, up to this many bytes a collective.

Fewer collectives cost fewer launches. Larger tensors go alone: several concurrent rings move big tensors faster over gRPC than
one ring of their concatenation (measured with 4 MiB buckets: the 64 MiB all-reduce of 50
tensors of 1.3 MB fell from 1.39x to 0.92x of tf.distribute on 2 workers x 1).
"""


class CrossWorkerAllReduce(_base.CrossTowerOps):
  """All-reduces across the towers of all worker processes of a cluster.

  Made by `MultiWorkerMirroredStrategy` (its `cross_worker_ops` argument takes one, not
  yet bound to a cluster); the strategy binds it to its cluster with `bind()`.

  Args:
    scheme: "hierarchical" (within each worker, then across workers) or "flat" (one
      collective over all towers).
    num_packs: 1: buckets (below); more concatenates the tensors of one dtype into
      `num_packs` chunks before the collective, as `AllReduceCrossTowerOps` does.
    bucket_bytes: with `num_packs=1`, the tensors of one dtype, in order, are
      concatenated into buckets of at most this many bytes, one collective each (a larger
      tensor is reduced alone). None: one collective per tensor.
    timeout: seconds a call that runs collectives may wait for the other workers before
      it fails, instead of hanging. The collectives themselves carry no timeout
      (TensorFlow would hold a native thread per run for that long): the strategy's
      watchdog enforces it (diststrat/_cluster_runtime/multi_worker/_collective_watchdog.py).

  Example:
    >>> from diststrat.cross_tower_ops import CrossWorkerAllReduce
    >>> CrossWorkerAllReduce("flat", num_packs=2)
    CrossWorkerAllReduce(scheme='flat', num_packs=2)
  """

  _one_value_is_the_total = False  # Other workers hold values too.

  @keeps_errors_in_tf_function
  def __init__(self, scheme: str = "hierarchical", num_packs: int = 1,
               timeout: float = DEFAULT_TIMEOUT,
               bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES) -> None:
    super().__init__()
    if scheme not in SCHEMES:
      raise ValueError(f"scheme must be one of {', '.join(map(repr, SCHEMES))}. Received: "
                       f"scheme={scheme!r}")
    if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
      raise ValueError("num_packs must be an integer >= 1 (1: no packing). Received: "
                       f"num_packs={num_packs!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or
                                     not isinstance(bucket_bytes, int) or bucket_bytes < 1):
      raise ValueError("bucket_bytes must be a positive integer (bytes per collective) or "
                       f"None (one collective per tensor). Received: bucket_bytes="
                       f"{bucket_bytes!r}")
    self._scheme = scheme
    self._num_packs = num_packs
    self._bucket_bytes = bucket_bytes
    self._timeout = _arguments.seconds("timeout", timeout, allow_none=False)
    # (local devices, all devices, worker index, number of workers), once bound.
    self._cluster: Optional[tuple[tuple[str, ...], tuple[str, ...], int, int]] = None
    # The tf.functions eager broadcasts and gathers run in, made once each (one made per
    # call retraced every time: TensorFlow warned of it in every worker).
    self._eager_functions: dict = {}

  @property
  def scheme(self) -> str:
    return self._scheme

  @property
  def timeout(self) -> float:
    return self._timeout

  def __repr__(self):
    buckets = ("" if self._bucket_bytes == DEFAULT_BUCKET_BYTES
               else f", bucket_bytes={self._bucket_bytes!r}")
    return (f"CrossWorkerAllReduce(scheme={self._scheme!r}, num_packs={self._num_packs}"
            f"{buckets})")

  def __reduce__(self):
    # An unbound one travels by its settings (to LocalCluster's worker processes, in
    # strategy_kwargs); its lock and caches are made anew where it is unpickled.
    if self._cluster is not None:
      raise TypeError(f"{self!r} is bound to a strategy's cluster and cannot be pickled. "
                      "Pickle an unbound one (each worker's strategy binds its own).")
    return (type(self), (self._scheme, self._num_packs, self._timeout, self._bucket_bytes))

  def bind(self, local_devices: Sequence[str], all_devices: Sequence[str],
           worker_index: int, num_workers: int) -> "CrossWorkerAllReduce":
    """Binds this to a cluster. Called by the strategy; every worker binds the same way.

    Args:
      local_devices: this worker's tower devices (canonical), in tower order.
      all_devices: every tower device of every worker, worker-major (the same list in
        every worker).
      worker_index: this worker's index among the workers.
      num_workers: the number of workers.

    Raises:
      ValueError: already bound to another cluster.
    """
    cluster = (tuple(local_devices), tuple(all_devices), worker_index, num_workers)
    if self._cluster is not None and self._cluster != cluster:
      raise ValueError(f"{self!r} is already bound to another cluster; make one per "
                       "strategy.")
    self._cluster = cluster
    per_worker = len(all_devices) // num_workers
    # One collective member per worker in the hierarchical scheme: its first device.
    self._leaders = tuple(all_devices[j * per_worker] for j in range(num_workers))
    return self

  def _bound(self):
    if self._cluster is None:
      raise ValueError(f"{self!r} is not bound to a cluster: it reduces across the "
                       "workers of a MultiWorkerMirroredStrategy, which binds it. Pass it "
                       "as MultiWorkerMirroredStrategy(cross_worker_ops=...).")
    if _tf_internal.in_saved_model_trace():
      # A SavedModel's functions run in one process, with no other worker to meet: they
      # reduce over this worker's towers only, as one worker of its own. No collective
      # is traced, so the save takes no collective keys either (only the chief may
      # save, and the workers' keys must stay in step).
      local = self._cluster[0]
      return (local, local, 0, 1)
    return self._cluster

  # --- reductions ---

  def _reduce(self, aggregation, per_device_value, destinations):
    return self._batch_reduce(aggregation, [(per_device_value, destinations)])[0]

  def _batch_reduce(self, aggregation, value_destination_pairs):
    local, all_devices, _, _ = self._bound()
    mean = aggregation is Aggregation.MEAN
    flat = [i for i, (v, d) in enumerate(value_destination_pairs)
            if self._scheme == "flat" and set(v.devices) == set(d) == set(local)
            and not _tf_internal.in_saved_model_trace()]  # Local sums there (_bound).
    results = [None] * len(value_destination_pairs)
    if flat:
      columns = [tuple(value_destination_pairs[i][0].get(d) for d in local) for i in flat]
      for i, column in zip(flat, self._flat(local, all_devices, columns, mean), strict=True):
        results[i] = _wrapped.Mirrored(dict(zip(local, column, strict=True)))
    rest = [i for i in range(len(results)) if results[i] is None]
    if rest:
      sums = [self._local_sum(value_destination_pairs[i][0]) for i in rest]
      # A MEAN divides by the number of values added: each worker's components (one for a
      # plain value, whatever its towers) in every worker.
      counts = [len(value_destination_pairs[i][0]) for i in rest]
      totals = self._across_workers(sums, mean, counts)
      for i, total in zip(rest, totals, strict=True):
        results[i] = _base.mirror(total, value_destination_pairs[i][1],
                                  source_device=local[0])
    return results

  def _reduce_indexed_slices(self, aggregation, per_device_value, destinations):
    local, _, _, num_workers = self._bound()
    mine = _base.concat_indexed_slices(Aggregation.SUM, per_device_value, local[0])
    with tf.device(local[0]):
      values = self._gather_rows(mine.values)
      indices = self._gather_rows(mine.indices)
      if aggregation is Aggregation.MEAN:  # By the number of values added, as for dense.
        values, indices = _base.divide_slices(values, indices,
                                              len(per_device_value) * num_workers)
      gathered = tf.IndexedSlices(values, indices, mine.dense_shape)
    return _base.mirror(gathered, destinations, source_device=local[0])

  def _broadcast(self, tensor, destinations):
    return _base.mirror(tensor, destinations)

  # --- what the strategy calls besides reductions ---

  def broadcast_from_chief(self, tensor: tf.Tensor) -> tf.Tensor:
    """`tensor` as worker 0 has it, in every worker (on this worker's first device).

    Built as a sum to which the other workers add zeros, so it needs no extra kind of
    collective. A bool travels as an integer (0 or 1, so the sum is the chief's); a
    string, which no collective carries, is returned unchanged.
    """
    local, _, worker_index, num_workers = self._bound()
    dtype = tensor.dtype
    if num_workers == 1 or not (dtype.is_floating or dtype.is_integer or dtype.is_complex
                                or dtype == tf.bool):
      return tensor

    def build(tensor):  # Made once, for every dtype: it reads the dtype of its argument.
      flags = tensor.dtype == tf.bool
      with tf.device(local[0]):
        mine = tf.cast(tensor, tf.int32) if flags else tensor
        mine = mine if worker_index == 0 else tf.zeros_like(mine)
        total = self._across_workers([mine], mean=False)[0]
        return tf.cast(total, tf.bool) if flags else total

    if tf.executing_eagerly():
      return self._eager_function("broadcast_from_chief", build)(tensor)
    return build(tensor)

  def gather(self, per_device_value: Any, axis: int) -> tf.Tensor:
    """Every tower's value of every worker, concatenated along `axis` in tower order."""
    local, _, _, _ = self._bound()

    # A plain value has one component (on the first device): one value per worker.
    components = [per_device_value.get(d) for d in local if d in per_device_value.devices]
    rank = components[0].shape.rank
    if axis < 0 and rank is not None:
      axis += rank  # The axis moved to the front and back must be the same one.

    def build(*components):
      with tf.device(local[0]):
        mine = tf.concat(list(components), axis=axis)
        moved = _move_axis(mine, axis, 0)
        return _move_axis(self._gather_rows(moved), 0, axis)

    if tf.executing_eagerly():
      # Traced once per number, dtypes and ranks of the components (a plain value has
      # one), for any shapes: the workers' shapes differ (a ragged last batch), and a
      # worker that retraced for a new shape while another reused its trace would take
      # new collective keys that the others' collectives never meet.
      components = [tf.convert_to_tensor(c) for c in components]
      specs = tuple(tf.TensorSpec([None] * c.shape.rank, c.dtype)
                    if c.shape.rank is not None else tf.TensorSpec(None, c.dtype)
                    for c in components)
      return self._eager_function(("gather", axis, specs), build, specs)(*components)
    return build(*components)

  def _eager_function(self, key, build, input_signature=None):
    """The tf.function of `build` for `key`, made once. With `input_signature`, its one
    trace serves every call. Without, later calls of the same shapes reuse its trace, and
    other shapes relax into one (`reduce_retracing`): only for values whose shapes are
    the same in every worker, which then make the same calls in the same order and
    trace the same collectives."""
    function = self._eager_functions.get(key)
    if function is None:
      function = self._eager_functions[key] = tf.function(
          build, autograph=False, reduce_retracing=input_signature is None,
          input_signature=input_signature)
    return function

  # --- building blocks ---

  def _local_sum(self, per_device_value):
    local = self._bound()[0]
    with tf.device(local[0]):
      components = [per_device_value.get(d) for d in per_device_value.devices]
      return tf.math.add_n(components) if len(components) > 1 else tf.identity(components[0])

  def _across_workers(self, tensors, mean, counts=None):
    """All-reduces one tensor per entry across the workers' leaders; packs if asked. With
    `mean`, entry i is divided by `counts[i]` (default: every tower's) times the number
    of workers."""
    local, all_devices, _, num_workers = self._bound()
    if num_workers == 1:
      totals = list(tensors)
    elif self._num_packs > 1 and _packing.fully_defined(tensors) and len(
        {t.dtype for t in tensors}) == 1:
      with tf.device(local[0]):
        packing = _packing.Packing([t.shape for t in tensors], self._num_packs)
        chunks = packing.pack(tensors)
        reduced = [(self._leaders_sum(c),) for c in chunks]
        totals = packing.unpack([r for (r,) in _collective.run_together(reduced, local[:1])])
    else:
      totals = self._bucketed_sum(tensors)
    if not mean:
      return totals
    counts = [len(local)] * len(totals) if counts is None else counts
    with tf.device(local[0]):
      return [_base.divide(t, count * num_workers)
              for t, count in zip(totals, counts, strict=True)]

  def _bucketed_sum(self, tensors):
    """The leaders' sums of `tensors`, bucket by bucket (`_packing.bucket_plan`)."""
    local = self._bound()[0]
    plan = _packing.bucket_plan(tensors, self._bucket_bytes)
    with tf.device(local[0]):
      reduced = []
      for bucket in plan:
        if len(bucket) == 1:
          reduced.append((self._leaders_sum(tensors[bucket[0]]),))
        else:
          flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in bucket], axis=0)
          reduced.append((self._leaders_sum(flat),))
      reduced = [r for (r,) in _collective.run_together(reduced, local[:1])]
      totals = [None] * len(tensors)
      for bucket, total in zip(plan, reduced, strict=True):
        if len(bucket) == 1:
          totals[bucket[0]] = total
          continue
        parts = tf.split(total, [tensors[i].shape.num_elements() for i in bucket])
        for i, part in zip(bucket, parts, strict=True):
          totals[i] = tf.reshape(part, tensors[i].shape)
    return totals

  def _leaders_sum(self, tensor):
    if tensor.shape.num_elements() == 0:
      return tensor
    local = self._bound()[0]
    return _collective.all_reduce([tensor], local[:1], mean=False, timeout=_NO_TIMEOUT,
                                  group=self._leaders)[0]

  def _flat(self, local, all_devices, columns, mean):
    reduced = []
    for column in columns:
      if column[0].shape.num_elements() == 0:
        reduced.append(column)
        continue
      float_mean = mean and not column[0].dtype.is_integer
      reduced.append(tuple(_collective.all_reduce(
          list(column), local, float_mean, _NO_TIMEOUT, group=all_devices)))
    reduced = _collective.run_together(reduced, local)
    if mean:
      reduced = [tuple(r if not r.dtype.is_integer else _base.divide(r, len(all_devices))
                       for r in column) for column in reduced]
    return reduced

  def _gather_rows(self, tensor):
    """Every worker's `tensor` stacked along axis 0 in worker order; lengths may differ."""
    _, _, worker_index, num_workers = self._bound()
    if num_workers == 1:
      return tensor
    del worker_index
    device = self._bound()[0][0]
    # The lengths first, with a gather: no CollectiveReduce here. Grappler's
    # ScopedAllocatorOptimizer (on for CollectiveReduce, _worker_group.py) may merge a
    # function's all-reduces into one in one worker and not in another, when their
    # inputs' shapes depend on the data (a worker whose towers got no rows): the members
    # then disagree, and the job failed or crashed (SIGSEGV).
    rows = tf.shape(tensor, out_type=tf.int64)[:1]
    lengths = _collective.all_gather(rows, device, self._leaders, _NO_TIMEOUT)
    # TensorFlow's collective gather crashes the process (SIGSEGV) on an empty tensor
    # (no worker with a row, or rows of no element): each worker sends one row more than
    # the longest, and rows not known to hold elements travel with one more, a zero.
    shape = tf.shape(tensor, out_type=tf.int64)
    static_shape = tensor.shape
    widen = not static_shape[1:].num_elements()
    if widen:
      flat = tf.reshape(tensor, tf.stack([rows[0], tf.reduce_prod(shape[1:])]))
      tensor = tf.concat([flat, tf.zeros(tf.stack([rows[0], 1]), tensor.dtype)], axis=1)
    longest = tf.reduce_max(lengths) + 1
    padding = [[0, longest - rows[0]]] + [[0, 0]] * (tensor.shape.rank - 1)
    padded = tf.pad(tensor, padding)
    gathered = _collective.all_gather(padded, device, self._leaders, _NO_TIMEOUT)
    keep = tf.sequence_mask(lengths, longest)  # [workers, longest]
    gathered = tf.boolean_mask(gathered, tf.reshape(keep, [-1]))
    if widen:
      gathered = tf.reshape(gathered[:, :-1],
                            tf.concat([tf.reduce_sum(lengths, keepdims=True), shape[1:]], 0))
      gathered.set_shape(tf.TensorShape([None]).concatenate(static_shape[1:]))
    return gathered


def _move_axis(tensor, source, destination):
  if source == destination:
    return tensor
  rank = tensor.shape.rank
  order = [i for i in range(rank) if i != source]
  order.insert(destination, source)
  return tf.transpose(tensor, order)
