"""Read caching for parameter-server variables (docs/parameter_server.md): one read per step.

Without caching, every dense use of a `SharedVariable` in a tower (`value()`,
`tf.convert_to_tensor`, an operator, a Keras layer's call) is its own `ReadVariableOp`
on the parameter server, whose result crosses the network; eagerly, every op that
consumes that result pulls it again (the forward and the backward matmul each fetch the
weights). With a `ReadCache`, the first dense read of a variable in a
`call_for_each_tower` call reads it once, onto this worker's CPU, and every later use in
any tower of that call is made from that one value.

Lifetime: `ParameterServerStrategy` makes one `ReadCache` per `call_for_each_tower`
call and closes it when the call returns. `TowerRunner` empties it after every
`merge_fn` (its `step_cache` hook): cross-tower code may write any variable, also
through raw ops on its handle, as the fused optimizer kernels do. A write through a
`SharedVariable` (`assign*`, `scatter_*`, slice assignment) drops that variable from
every open cache, so a tower's read after its own write reads the PS again and sees it.

What is cached: dense reads of a variable of at most `max_bytes` bytes, in a tower of the
call, in the graph the call is built in (or eagerly when the call runs eagerly). Read
where used, as before: reads in cross-tower code, in nested graphs (`tf.cond` branches,
`while_loop` bodies, inner `tf.function`s), under `tf.init_scope`, sparse reads
(`sparse_read`, `tf.gather`), and variables that are larger or not numeric.

How a cached use stays differentiable: each use is a new tensor (`tf.identity` of the
cached value on the tower's device) that this thread's tapes are told is a read of the
variable (`_tf_internal.variable_accessed`, `_tf_internal.record_variable_read`), so
`tape.gradient(loss, variable)` sums the gradients of every use, as for real reads. In a
graph the use also descends from the one `ReadVariableOp` through real ops, so symbolic
gradients (`tf.gradients`) need no record.
"""

import threading
import weakref

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal

DEFAULT_MAX_BYTES = 64 * 2**20
"""Variables up to this size are cached; larger ones are read where they are used.

A cached value is a dense copy of the whole variable in the worker's memory from its
first use until the next `merge_call` or the end of the call, whatever the towers use
of it. 64 MiB (16M float32 elements) holds every dense layer of common models (the PS
benchmark's largest weight is 4 MiB); variables past it are in practice embedding
tables, which are better read sparsely (`tf.nn.embedding_lookup`, `tf.gather`).
"""

# Caches of calls still running, for invalidate().
_open_caches: "weakref.WeakSet[ReadCache]" = weakref.WeakSet()
_open_lock = threading.Lock()


def _num_bytes(variable):
  """The size of `variable`'s value in bytes, or None if unknown or not numeric."""
  dtype = variable.dtype.base_dtype
  if not variable.shape.is_fully_defined() or not (
      dtype.is_floating or dtype.is_integer or dtype.is_complex or dtype.is_bool):
    return None
  return variable.shape.num_elements() * dtype.size


class ReadCache:
  """The values of parameter-server variables, read once for one `call_for_each_tower`.

  Made by `ParameterServerStrategy` for each call, given to its `TowerRunner` as the
  `step_cache`; `SharedVariable`'s read methods ask `active_cache()` for it.

  Args:
    device: where cached values live: this worker's CPU.
    max_bytes: variables larger than this are not cached (None: no limit).

  Attributes:
    stats: counts, for debugging: `fills` (reads of the PS), `hits` (uses served from a
      value read before), `invalidations` (values dropped by writes and merge calls),
      `too_large` and `other_graph` (reads left alone: a variable over `max_bytes` or
      not numeric, or a read outside the call's graph).
  """

  def __init__(self, device, max_bytes=DEFAULT_MAX_BYTES):
    self.device = device
    self.max_bytes = max_bytes
    self.stats = {"fills": 0, "hits": 0, "invalidations": 0, "too_large": 0,
                  "other_graph": 0}
    # The graph the call is built in; None when it runs eagerly.
    self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    self._lock = threading.RLock()
    self._values = {}  # id(variable) -> (variable, cached tensor)
    self._closed = False
    with _open_lock:
      _open_caches.add(self)

  def applies_to(self, variable):
    """Whether a read of `variable` here and now may be served by this cache."""
    if self._closed:
      return False
    if self._graph is None:
      same_graph = tf.executing_eagerly()
    else:
      same_graph = (not tf.executing_eagerly()
                    and tf.compat.v1.get_default_graph() is self._graph)
    with self._lock:
      if not same_graph:
        self.stats["other_graph"] += 1
        return False
      size = _num_bytes(variable)
      if size is None or (self.max_bytes is not None and size > self.max_bytes):
        self.stats["too_large"] += 1
        return False
    return True

  def read(self, variable, read_uncached):
    """A new tensor holding `variable`'s cached value, recorded as a read of it.

    Args:
      variable: the variable read.
      read_uncached: reads the variable on its device, bypassing this cache; called
        once per variable until the value is dropped.
    """
    with self._lock:  # Towers run one at a time; the lock only keeps this tidy.
      entry = self._values.get(id(variable))
      if entry is None:
        entry = self._values[id(variable)] = (variable, self._fill(variable, read_uncached))
        self.stats["fills"] += 1
      else:
        self.stats["hits"] += 1
    cached = entry[1]
    _tf_internal.variable_accessed(variable)
    value = tf.identity(cached)  # A new tensor per use, on the current (tower) device.
    if not tf.executing_eagerly():
      value.set_shape(variable.shape)
    _tf_internal.record_variable_read(variable, value)
    return value

  def _fill(self, variable, read_uncached):
    with tf.name_scope("cached_read"):
      raw = read_uncached()
      with tf.device(self.device):
        cached = tf.identity(raw)
    if not tf.executing_eagerly():
      cached.set_shape(variable.shape)
    return cached

  def invalidate(self, variable):
    """Drops `variable`'s value: the next read reads the variable again."""
    with self._lock:
      if self._values.pop(id(variable), None) is not None:
        self.stats["invalidations"] += 1

  def invalidate_all(self):
    """Drops every value. `TowerRunner` calls this after each `merge_fn`."""
    with self._lock:
      self.stats["invalidations"] += len(self._values)
      self._values.clear()

  def close(self):
    """Drops every value and serves no more reads (the call returned)."""
    with self._lock:
      self._closed = True
      self._values.clear()
    with _open_lock:
      _open_caches.discard(self)


def active_cache():
  """The `ReadCache` that a read in this thread, now, goes through, or None.

  The one of the `call_for_each_tower` call whose tower this thread runs, if that
  call caches reads.
  """
  context = _context.get_tower_context()
  cache = None if context is None else context.step_cache
  return cache if isinstance(cache, ReadCache) else None


def invalidate(variable):
  """Drops `variable` from every open cache: it was just written."""
  with _open_lock:
    caches = list(_open_caches)
  for cache in caches:
    cache.invalidate(variable)
