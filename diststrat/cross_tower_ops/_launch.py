"""Running a reduction eagerly: traced once per input signature, launched as one call.

In eager mode `CrossTowerOps` does not run its hooks op by op: a `Launcher` traces the
work for a batch of values into a `tf.function` and calls that. One call starts the work
on every device together (eager collectives launched one device at a time hang) and
costs one dispatch instead of one per op. Traces are cached per signature (devices,
dtypes, shapes, sparse or dense, destinations), the least recently used dropped first.
An `IndexedSlices`' number of slices is left out of its signature (traced as unknown):
it differs between the worker processes of a `MultiWorkerMirroredStrategy` (a ragged
last batch), and a trace takes new collective keys, so a worker that traced for its new
count while another reused its trace would no longer meet the others' collectives.

The traced function takes and returns flat lists of tensors: the values' components
(an `IndexedSlices` as its parts) in order, so a call binds no Python structure.
"""

import collections
import inspect
import threading
import weakref

from diststrat._tf import tf
from diststrat import _tf_internal
from diststrat.values import _wrapped

MAX_CACHED_FUNCTIONS = 256


class Launcher:
  """Runs `build(kind, aggregation, items)` as one cached `tf.function` per signature.

  Args:
    build: builds the work in the current graph: `(kind, aggregation, items)`, where
      `items` is a list of `(PerDevice, destinations)`, returns one `Mirrored` per item.
  """

  def __init__(self, build):
    # Weakly when `build` is a method: its object (a `CrossTowerOps`) holds this
    # launcher, and a cycle through them would free a dropped strategy's reductions, and
    # the strategy, only at a later garbage collection than its model.
    self._build = weakref.WeakMethod(build) if inspect.ismethod(build) else lambda: build
    self._lock = threading.Lock()
    self._functions = collections.OrderedDict()

  @property
  def num_cached(self):
    """How many traced functions the cache holds."""
    with self._lock:
      return len(self._functions)

  def launch(self, kind, aggregation, items):
    """The results of `build` for `items`, computed eagerly in one call."""
    flat, signature = _flatten_items(items)
    key = (kind, aggregation, signature)
    with self._lock:
      entry = self._functions.get(key)
      if entry is not None:
        self._functions.move_to_end(key)
    if entry is None:
      entry = self._trace(kind, aggregation, signature, flat)
      with self._lock:
        self._functions[key] = entry
        while len(self._functions) > MAX_CACHED_FUNCTIONS:
          self._functions.popitem(last=False)
    function, out_kinds = entry
    outputs = _tf_internal.call_flat(function, flat)
    return _unflatten_results(outputs, out_kinds, [d for _, d in items])

  def _trace(self, kind, aggregation, signature, flat):
    out_kinds = []

    build = self._build  # Weak (see __init__); alive while its object launches.

    def body(*args):
      items = _unflatten_items(args, signature)
      results = build()(kind, aggregation, items)
      outputs, kinds = _flatten_results(results, [d for _, d in items])
      out_kinds.extend(kinds)
      return outputs

    specs = [tf.TensorSpec(shape, dtype) for components, _ in signature
             for _, _, parts in components for dtype, shape in parts]
    function = tf.function(body, autograph=False).get_concrete_function(*specs)
    return function, out_kinds



def _component_tensors(component):
  """The tensors a component is made of: itself, or an IndexedSlices' parts."""
  if isinstance(component, tf.IndexedSlices):
    parts = [component.values, component.indices]
    if component.dense_shape is not None:
      parts.append(component.dense_shape)
    return parts
  return [component]


def _flatten_items(items):
  """The tensors of `items` as one flat list, and a hashable signature to rebuild them."""
  flat = []
  signature = []
  for value, destinations in items:
    components = []
    for device, component in zip(value.devices, value.values, strict=True):
      parts = _component_tensors(component)
      flat.extend(parts)
      sparse = isinstance(component, tf.IndexedSlices)
      shapes = [tuple(p.shape) for p in parts]
      if sparse:  # Values and indices: any number of slices (see the module's doc).
        shapes[0], shapes[1] = (None,) + shapes[0][1:], (None,) + shapes[1][1:]
      components.append((device, sparse, tuple(
          (p.dtype, shape) for p, shape in zip(parts, shapes, strict=True))))
    signature.append((tuple(components), destinations))
  return flat, tuple(signature)


def _unflatten_items(flat, signature):
  items = []
  position = 0
  for components, destinations in signature:
    index = {}
    for device, sparse, parts in components:
      taken = flat[position:position + len(parts)]
      position += len(parts)
      index[device] = tf.IndexedSlices(*taken) if sparse else taken[0]
    items.append((_wrapped.PerDevice(index), destinations))
  return items


def _flatten_results(results, destinations_list):
  outputs = []
  kinds = []
  for result, destinations in zip(results, destinations_list, strict=True):
    for device in destinations:
      component = result.get(device)
      parts = _component_tensors(component)
      outputs.extend(parts)
      kinds.append(len(parts) if isinstance(component, tf.IndexedSlices) else 0)
  return outputs, kinds


def _unflatten_results(outputs, kinds, destinations_list):
  outputs = _relabel(outputs, kinds, destinations_list)
  results = []
  position = 0
  kinds = iter(kinds)
  for destinations in destinations_list:
    index = {}
    for device in destinations:
      kind = next(kinds)
      parts = outputs[position:position + (kind or 1)]
      position += kind or 1
      index[device] = tf.IndexedSlices(*parts) if kind else parts[0]
    results.append(_wrapped.Mirrored(index))
  return results


def _relabel(outputs, kinds, destinations_list):
  """The function's outputs, each with `.device` naming the device it lives on.

  An eager tensor returned by a `tf.function` lives where the op that made it ran (its
  `backing_device`), but its `.device` names the device the call ran on. An identity on
  the right device fixes the name without copying the data: one `IdentityN` per device.
  """
  wanted = []
  kinds = iter(kinds)
  for destinations in destinations_list:
    for device in destinations:
      wanted.extend([device] * (next(kinds) or 1))
  wrong = collections.defaultdict(list)
  for i, (tensor, device) in enumerate(zip(outputs, wanted, strict=True)):
    if tensor.device != device:
      wrong[device].append(i)
  if not wrong:
    return outputs
  outputs = list(outputs)
  for device, positions in wrong.items():
    with tf.device(device):
      relabelled = tf.raw_ops.IdentityN(input=[outputs[i] for i in positions])
    for i, tensor in zip(positions, relabelled, strict=True):
      outputs[i] = tensor
  return outputs
