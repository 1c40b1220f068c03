"""The tf.distribute facade: what tf.distribute-aware code sees in a diststrat context.

Keras 3 (TensorFlow backend) and parts of TensorFlow learn about distribution only
through `tf.distribute.get_strategy()`, `get_replica_context()` and the objects they
return. While a thread is in a diststrat context of a real strategy, those return the
objects of this module (`_mode_listener.py` puts them on TensorFlow's per-thread
distribution stack): a `StrategyAdapter` (with its `ExtendedAdapter` as `.extended`) in
cross-tower context, a `ReplicaContextAdapter` in a tower. They are diststrat's own small
objects, not `tf.distribute` strategies: each answers the part of that interface Keras
and TensorFlow use by calling the diststrat strategy. No tf.distribute strategy is
created or used.

What Keras then does by itself:

* A model or optimizer created inside `strategy.scope()` keeps the adapter (Keras's
  optimizer stores it as the strategy it applies updates through), and `fit`,
  `evaluate` and `predict` call `adapter.run(step, args=(global_batch,))` inside their
  traced step. `run` checks the model (`_model_checks.py`) and does what training needs
  to match one device (`_training.py`: it splits the batch across the towers, routes the
  optimizer and loss trackers, combines the towers' results).
* A Keras optimizer sums its gradients with `ReplicaContextAdapter.all_reduce` and
  applies them through `merge_call` and `extended.update`: once per copy of each
  variable.
* `BatchNormalization(synchronized=True)` all-reduces its moments (differentiably).

The facade replaces no attribute of a Keras or TensorFlow object; the ones `run` replaces
on Keras objects are listed in `_training.py` (an optimizer's `apply`, a loss tracker's
`update_state`) and `_file_callbacks.py` (paths and hooks of file-writing callbacks in
workers other than the chief). See docs/keras.md.
"""

import contextlib
import enum
import threading
import weakref
from typing import Any

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat import errors
from diststrat._arguments import as_tf_variable
from diststrat._keras import _file_callbacks
from diststrat._keras import _model_checks
from diststrat._keras import _training
from diststrat.values import _variables
from diststrat.values import _wrapped


# strategy -> a weak reference to its StrategyAdapter. Weak: the adapter holds its
# strategy, and a value holding its key keeps the entry, and the strategy, alive forever.
_adapters: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()
_adapters_lock = threading.Lock()


def adapter_for(strategy):
  """The `StrategyAdapter` of `strategy`: one while anything holds it (Keras models and
  optimizers do, and the scope while entered), made again after nothing does."""
  with _adapters_lock:
    ref = _adapters.get(strategy)
    adapter = None if ref is None else ref()
    if adapter is None:
      adapter = StrategyAdapter(strategy)
      _adapters[strategy] = weakref.ref(adapter)
    return adapter


_entering = threading.local()  # by_adapter: a StrategyAdapter enters its strategy's scope.


def entering_by_adapter():
  """Whether this thread is entering a strategy's scope for its `StrategyAdapter`.

  Code that asked the adapter for its scope (a Keras model made under the strategy) may
  enter it inside a tf.distribute strategy's scope; a user's own `scope()` may not.
  """
  return getattr(_entering, "by_adapter", False)


def _is_per_tower(value):
  """Whether `value` holds one value per tower (a variable is one value)."""
  return isinstance(value, _wrapped.DistributedValues) and not isinstance(value, tf.Variable)


def _reduce_op_name(reduce_op, method):
  """"sum" or "mean" for a `tf.distribute.ReduceOp`, a `tf.VariableAggregation` or a
  string (any case); anything else raises `ValueError`, as tf.distribute's methods do."""
  name = reduce_op.name if isinstance(reduce_op, enum.Enum) else reduce_op
  if isinstance(name, str) and name.lower() in ("sum", "mean"):
    return name.lower()
  raise ValueError(
      f"{method}() takes reduce_op tf.distribute.ReduceOp.SUM or MEAN, or the string "
      f"'sum' or 'mean' (any case). Received: reduce_op={reduce_op!r}. A maximum or "
      "minimum over the towers is not a reduction diststrat does: gather the values "
      "(strategy.gather, or all_gather in a tower) and take it from them.")


class _MergeFn(_context.WrappedMergeFn):
  """A tf.distribute `merge_fn(strategy, ...)` called with the adapter.

  Two of them are equal when they wrap the same function, so diststrat's check that
  every tower passes the same merge_fn compares what Keras passed.
  """

  def __init__(self, merge_fn, adapter):
    super().__init__(merge_fn)
    self.adapter = adapter

  def __call__(self, strategy, *args, **kwargs):
    del strategy  # tf.distribute code expects its own kind of strategy: the adapter.
    return self.tower_merge_fn(self.adapter, *args, **kwargs)


class ReplicaContextAdapter:
  """What `tf.distribute.get_replica_context()` returns inside a diststrat tower."""

  def __init__(self, adapter, tower_context):
    self._adapter = adapter
    self._tower = tower_context

  @property
  def strategy(self):
    return self._adapter

  @property
  def num_replicas_in_sync(self):
    return self._adapter.diststrat_strategy.num_towers

  @property
  def replica_id_in_sync_group(self):
    return self._tower.tower_id

  @property
  def devices(self):
    return (self._tower.device,)

  @errors.keeps_errors_in_tf_function
  def merge_call(self, merge_fn, args=(), kwargs=None):
    _model_checks.check_optimizer_merging(self._adapter, merge_fn)
    return self._merged(_MergeFn(merge_fn, self._adapter), *args, **(kwargs or {}))

  def _merged(self, merge_fn, *args, **kwargs):
    """The tower's `merge_call`, giving back this tower's part of the result, as
    tf.distribute's does: a strategy that keeps `TowerContext`'s own `_merge_call`
    (docs/write_your_own_strategy.md) hands `merge_fn`'s result back as it is, a
    `Mirrored` from a reduction included."""
    return _wrapped.tower_part(self._tower.device,
                               self._tower.merge_call(merge_fn, *args, **kwargs))

  @errors.keeps_errors_in_tf_function
  def all_reduce(self, reduce_op, value, options=None):
    """Reduces `value` (a tensor or a structure of them) over the towers; all get the result.

    Differentiable for float tensors, as tf.distribute's: a tower's tape does not see
    the reduction (it runs in `merge_call`, in another thread), so the gradient is
    declared here: the same reduction of the towers' upstream gradients.
    """
    del options
    op = _reduce_op_name(reduce_op, "all_reduce")
    # Python numbers as tensors, as tf.distribute takes them: every tower
    # passing the same number regrouped to that one number, which a reduction took as one
    # value (a "sum" of 1.0 over N towers gave 1.0, not N).
    flat = [tf.convert_to_tensor(v) if isinstance(v, (int, float, complex)) else v
            for v in _wrapped.flatten(value)]

    def merge_fn(strategy, *leaves):
      # The token, one object for every tower, marks the results as one reduction's.
      return tuple(_all_reduced(strategy, op, leaves)) + (object(),)

    *reduced, token = self._merged(merge_fn, *flat)
    # The float tensors get a gradient, also among integers (as all_gather's, and
    # tf.distribute's): the same reduction of the towers' upstream gradients.
    floats = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor) and v.dtype.is_floating]
    if floats:
      context = weakref.ref(self)  # Held weakly by the gradient: see _gradient_context.

      def backward(leaves, upstream):
        del leaves
        grads = _gradient_context(context, "all_reduce")._merged(merge_fn, *upstream)[:-1]
        # A tape recording this gradient (a gradient of it: a gradient penalty) gets its
        # gradient: the same reduction again.
        return tuple(_differentiable_if_recorded("AllReduce", grads, upstream, backward))

      differentiable = _with_gradient("AllReduce", [reduced[i] for i in floats],
                                      [flat[i] for i in floats], backward)
      for i, result in zip(floats, differentiable, strict=True):
        reduced[i] = result
    _remember_copies(reduced, token)
    return _wrapped.pack_as(value, reduced)

  @errors.keeps_errors_in_tf_function
  def all_gather(self, value, axis, options=None):
    """Every tower's `value` (a tensor or a structure of them) concatenated along `axis`
    in tower order (of every worker process); every tower gets the result.

    Float tensors are differentiable, as tf.distribute's: each tower's gradient is its
    own part, along `axis`, of the towers' upstream gradients summed (every tower used
    every part). A negative `axis` counts from each value's last dimension.
    """
    del options
    tower_id = self._tower.tower_id
    flat = [tf.convert_to_tensor(v) for v in _wrapped.flatten(value)]
    axes = [_gather_axis(v, axis) for v in flat]

    def gather_along(leaf_axes):
      def gather_fn(strategy, *leaves):
        return tuple(strategy.gather(leaf, axis=a, destinations=strategy.worker_devices)
                     for leaf, a in zip(leaves, leaf_axes, strict=True))
      return gather_fn

    floats = [i for i, v in enumerate(flat) if v.dtype.is_floating]
    others = [i for i in range(len(flat)) if i not in floats]
    results: list = [None] * len(flat)
    if others:
      gathered = self._merged(gather_along([axes[i] for i in others]),
                                  *[flat[i] for i in others])
      for i, g in zip(others, gathered, strict=True):
        results[i] = g
    if floats:
      float_axes = [axes[i] for i in floats]

      def backward_fn(strategy, upstream, sizes):
        totals = strategy.batch_reduce("sum", [(u, None) for u in upstream])
        parts = [strategy.gather(size, axis=0, destinations=strategy.worker_devices)
                 for size in sizes]
        return tuple(totals), tuple(parts)

      context = weakref.ref(self)  # Held weakly by the gradient: see _gradient_context.

      def sum_fn(strategy, *upstream):
        return tuple(strategy.batch_reduce("sum", [(u, None) for u in upstream]))

      def sum_backward(leaves, upstream):
        # The towers' upstream gradients summed: the gradient of that sum is again one.
        del leaves
        totals = _gradient_context(context, "all_gather")._merged(sum_fn, *upstream)
        return tuple(_differentiable_if_recorded("AllGatherGrad", totals, upstream,
                                                 sum_backward))

      def backward(leaves, upstream):
        own = [tf.reshape(tf.shape(leaf)[a], [1]) for leaf, a in
               zip(leaves, float_axes, strict=True)]
        totals, sizes = _gradient_context(context, "all_gather")._merged(
            backward_fn, tuple(upstream), tuple(own))
        # A tape recording this gradient gets its gradient (the slices below it sees).
        totals = _differentiable_if_recorded("AllGatherGrad", totals, upstream, sum_backward)
        # This tower's part starts after the parts of the towers before it.
        return tuple(
            tf.gather(total, tf.range(tf.reduce_sum(size[:tower_id]),
                                      tf.reduce_sum(size[:tower_id + 1])), axis=a)
            for total, size, a in zip(totals, sizes, float_axes, strict=True))

      leaves = [flat[i] for i in floats]
      gathered = self._merged(gather_along(float_axes), *leaves)
      for i, g in zip(floats, _with_gradient("AllGather", gathered, leaves, backward),
                      strict=True):
        results[i] = g
    return _wrapped.pack_as(value, results)


# A tensor `all_reduce` gave a tower: id -> (weak reference to it, (the reduction's
# token, leaf index)). The towers' results of one reduction are copies of one value,
# which `ExtendedAdapter.update` takes as such when a merge_call regrouped them.
_all_reduce_results: dict[int, tuple[Any, Any]] = {}
_all_reduce_lock = threading.Lock()


def _remember_copies(tensors, token):
  for index, tensor in enumerate(tensors):
    if not isinstance(tensor, tf.Tensor):
      continue
    key = id(tensor)

    def forget(ref, key=key):
      with _all_reduce_lock:
        if _all_reduce_results.get(key, (None,))[0] is ref:
          del _all_reduce_results[key]

    with _all_reduce_lock:
      _all_reduce_results[key] = (weakref.ref(tensor, forget), (token, index))


def _results_of_one_all_reduce(values):
  """Whether `values` (a `PerDevice`'s) are the towers' results of one `all_reduce`."""
  found = set()
  with _all_reduce_lock:
    for v in values:
      entry = _all_reduce_results.get(id(v))
      if entry is None or entry[0]() is not v:
        return False
      found.add(entry[1])
  return len(found) == 1


def _as_copies(x):
  """`x`, a `PerDevice` given to `update` as copies of one value (tf.distribute code
  passes an `all_reduce`'s results through `merge_call`, which regroups them per tower),
  as a `Mirrored`, or `x` itself when its values differ: `update` then refuses it,
  naming the fix (a Keras optimizer's `apply_gradients` in `merge_fn` given each tower's
  own gradients updated each copy of a variable with its tower's gradient, and the
  copies parted). The results of one `all_reduce` are taken as they are; other values
  are compared: eagerly at once, in a graph by an assertion when the step runs."""
  values = x.values
  if _results_of_one_all_reduce(values) or not all(
      isinstance(v, tf.Tensor) for v in values):
    return _wrapped.Mirrored(dict(zip(x.devices, values, strict=True)))
  first = values[0]
  if tf.executing_eagerly():
    same = all(v.shape == first.shape and bool(tf.reduce_all(_same_values(v, first)))
               for v in values[1:])
    return _wrapped.Mirrored(dict(zip(x.devices, values, strict=True))) if same else x
  checked = {}
  for device, v in zip(x.devices, values, strict=True):
    with tf.device(device):
      check = tf.debugging.Assert(tf.reduce_all(_same_values(v, first)), [
          "update() (a Keras optimizer's apply_gradients in merge_call) takes values "
          "mirrored over the devices it updates, but was given one value per tower, and "
          "they differ. Combine the towers' values first: strategy.reduce('sum' or "
          "'mean', value, destinations=var), or call apply_gradients in the towers"])
      with tf.control_dependencies([check]):
        checked[device] = tf.identity(v)
  return _wrapped.Mirrored(checked)


def _same_values(v, first):
  """Elementwise: whether `v` and `first` are copies of one value, up to float rounding.
  Equal infinities, and NaN in both, are the same value: a diverging loss's gradients,
  all-reduced and then scaled in every tower, are still copies."""
  v, first = tf.cast(v, tf.float64), tf.cast(first, tf.float64)
  both_nan = tf.logical_and(tf.math.is_nan(v), tf.math.is_nan(first))
  close = tf.abs(v - first) <= 1e-6 + 1e-5 * tf.abs(first)
  return tf.logical_or(tf.logical_or(tf.equal(v, first), both_nan), close)


# The gradient of the replica context's reductions inside a graph (see _with_gradient):
# registered once, it finds each reduction's own in `_graph_gradients`.
_GRADIENT = "DiststratTowerReduction"
# graph -> {name of a reduction's IdentityN op: (number of outputs, backward)}. Weak: an
# entry lives as long as its graph; a value holds no tensor (which would hold its graph).
_graph_gradients: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_graph_gradients_lock = threading.Lock()


@tf.RegisterGradient(_GRADIENT)
def _registered_gradient(op, *upstream):
  """`tf.gradients`' way to a reduction's gradient: its inputs are the reduced values,
  which get none, then the tower's own values (see `_with_gradient`)."""
  with _graph_gradients_lock:
    count, backward = _graph_gradients[op.graph][op.name]
  leaves = list(op.inputs[count:])
  return [None] * count + list(backward(leaves, upstream[:count]))


def _with_gradient(name, outputs, leaves, backward):
  """`outputs`, computed by `merge_call` from this tower's `leaves` and the other towers'
  values, as tensors whose gradient with respect to `leaves` is
  `backward(leaves, upstream)` (a tower's tape does not see `merge_call`'s ops: they are
  built in another thread).

  What `tf.custom_gradient` does, without its process-wide registry: inside a
  `tf.function` it registers each gradient there for ever, with the tensors, so the
  graph, of the trace, and with the graph the buffers of every variable the trace
  captured (a Keras model's, on every device): a sweep making a model per trial never got
  that memory back. Here tapes get the gradient in their own record (gone with the tape),
  and `tf.gradients` through one gradient registered once, which finds `backward` in a map
  that lives as long as the graph.
  """
  outputs, leaves = list(outputs), list(leaves)
  if not outputs:
    return outputs
  if _tf_internal.forward_accumulator_watching(leaves) and \
      not _tf_internal.forward_accumulator_watching(outputs):
    method = {"AllReduce": "all_reduce", "AllGather": "all_gather"}.get(name, name)
    raise NotImplementedError(
        f"A tower's {method}() was given a value that a tf.autodiff.ForwardAccumulator "
        "watches: forward-mode differentiation through the replica context's reductions "
        "is not supported (they run in merge_call, in another thread, which the tower's "
        "accumulators do not see: the result would have no tangent). Use a "
        "tf.GradientTape (reverse mode) in the tower function, or compute the JVP "
        "outside the towers.")
  if tf.executing_eagerly():
    results = [tf.identity(t) for t in outputs]
  else:
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"IdentityN": _GRADIENT}):
      results = tf.identity_n(outputs + leaves)[:len(outputs)]
    with _graph_gradients_lock:
      _graph_gradients.setdefault(graph, {})[results[0].op.name] = (len(outputs), backward)
  _tf_internal.record_backward(name, results, leaves,
                               lambda *upstream: backward(leaves, upstream))
  return results


def _differentiable_if_recorded(name, outputs, upstream, backward):
  """`outputs`, a reduction's gradient computed by `merge_call` from this tower's
  `upstream`, recorded as `_with_gradient` records a reduction when a tape of this thread
  watches `upstream` (a tape around `tape.gradient`: a gradient of the gradient), which
  it could not see otherwise; else `outputs` as they are."""
  upstream = list(upstream)
  if all(isinstance(u, tf.Tensor) for u in upstream) and _tf_internal.should_record(upstream):
    return _with_gradient(name, outputs, upstream, backward)
  return list(outputs)


def _gradient_context(context, method):
  """The `ReplicaContextAdapter` a gradient of `method` merges through, from the weak
  reference `context`.

  The gradient lives as long as the graph it was traced in (`_with_gradient`): a Keras
  model's train function keeps it. Holding its replica context weakly, it does not keep,
  through it, the strategy and the tower (and the function the tower ran) as long. The
  context is alive whenever the gradient can run: in its tower, while the tower runs.
  """
  adapter = context()
  if adapter is None:  # The type merge_call raises outside its tower, as it was.
    raise errors.ContextError(
        f"The gradient of a tower's {method}() was asked for after the tower had ended "
        "(its replica context is gone). A tower's reductions can be differentiated only "
        "inside that tower's function: compute gradients there (tf.GradientTape in the "
        "function passed to call_for_each_tower or strategy.run).")
  return adapter


def _all_reduced(strategy, op, leaves):
  """`leaves` (per-tower values) reduced by `op` over the towers, mirrored to each.

  As tf.distribute's `all_reduce`, a "mean" of integers over several towers is a true
  division (float64 for int32, as `tf.math.truediv` gives); diststrat's own reduce
  floors and keeps the dtype (docs/cross_tower_ops.md).
  """
  integer_means = [i for i, leaf in enumerate(leaves)
                   if op == "mean" and _is_per_tower(leaf) and len(leaf.values) > 1 and
                   tf.as_dtype(leaf.values[0].dtype).is_integer]
  if not integer_means:
    return strategy.batch_reduce(op, [(leaf, None) for leaf in leaves])
  pairs = [(leaf, None) for i, leaf in enumerate(leaves) if i not in integer_means]
  reduced = strategy.batch_reduce(op, pairs) if pairs else []
  sums = []
  for i in integer_means:
    leaf = leaves[i]
    ones = _wrapped.PerDevice({d: tf.ones([], leaf.values[0].dtype) for d in leaf.devices})
    sums.append(strategy.batch_reduce("sum", [(leaf, None), (ones, None)]))
  results, rest, means = [], iter(reduced), iter(sums)
  for i in range(len(leaves)):
    if i not in integer_means:
      results.append(next(rest))
      continue
    total, count = next(means)
    quotients = {}
    for device in total.devices:
      with tf.device(device):
        quotients[device] = tf.math.truediv(total.get(device), count.get(device))
    results.append(_wrapped.Mirrored(quotients))
  return results


def _gather_axis(value, axis):
  """`axis` of `value` as a non-negative index (a negative one counts from the end)."""
  if axis >= 0:
    return axis
  rank = value.shape.rank
  if rank is None:
    raise ValueError(f"all_gather() with a negative axis ({axis}) needs values of known "
                     "rank; give a non-negative axis.")
  return axis + rank


class ExtendedAdapter:
  """The part of `tf.distribute.Strategy.extended` that Keras and TensorFlow use."""

  def __init__(self, strategy):
    self._ds = strategy

  def _use_merge_call(self):
    # In a tower, Keras's optimizer applies gradients through merge_call. In cross-tower
    # context (an optimizer's apply run once with the summed gradients, see
    # `_training.route_optimizer`) there is nothing to merge: tf.distribute's `maybe_merge_call`
    # then calls its function directly.
    return _context.get_tower_context() is not None

  @property
  def _retrace_functions_for_each_device(self):
    # A tf.function called in towers is traced once per tower device (it reads that
    # tower's copies), as under tf.distribute.
    return self._ds.num_towers > 1

  def value_container(self, value):
    return value  # What a tower's tape watches: the variable read, as diststrat does.

  @property
  def worker_devices(self):
    return self._ds.worker_devices

  @property
  def parameter_devices(self):
    return self._ds.parameter_devices

  @errors.keeps_errors_in_tf_function
  def colocate_vars_with(self, var):
    _model_checks.check_used_outside(self._adapter(), var, "colocate_vars_with()")
    _model_checks.check_building_inside(self._adapter(), var)
    return self._ds.colocate_vars_with(var)

  def _adapter(self):
    return adapter_for(self._ds)

  def variable_created_in_scope(self, v):
    return _variables.created_by(as_tf_variable(v)) is self._ds

  @errors.keeps_errors_in_tf_function
  def update(self, var, fn, args=(), kwargs=None, group=True):
    """`strategy.update(var, fn, *args)`: `fn` once on each device holding `var`.

    Keras hands over values it all-reduced, so every component is the same value: one
    without a component on the variable's device (ParameterServer: towers on workers,
    the variable on a parameter device) stands for any of its components. A gradient
    that is the first device's copy of a sum the towers' gradients were reduced to
    (`_training.summed_copies`) stands for that sum: each copy of `var` is updated from
    the sum on its own device.
    """
    var = as_tf_variable(var)
    _model_checks.check_used_outside(self._adapter(), var, "update()")
    devices = _wrapped.devices_of(var)

    def local(x):
      copies = _training.summed_copies(x, devices)  # The sum Keras got: its copy on each device.
      if copies is not None and all(d in copies for d in devices):
        return copies
      if isinstance(x, _wrapped.DistributedValues) and not isinstance(x, tf.Variable):
        if isinstance(x, _wrapped.PerDevice):
          # All-reduced: per tower (as merge_call regroups the towers' copies), but
          # copies; values that differ stay per tower, which update() refuses.
          x = _as_copies(x)
          if isinstance(x, _wrapped.PerDevice):
            return x
        if not all(d in x for d in devices):
          return x.primary
        return x
      return x

    args = _wrapped.pack_as(tuple(args), [local(x) for x in _wrapped.flatten(tuple(args))])
    kwargs = dict(kwargs or {})
    kwargs = _wrapped.pack_as(kwargs, [local(x) for x in _wrapped.flatten(kwargs)])
    result = self._ds.update(var, fn, *args, **kwargs)
    return self._grouped(result) if group else self._ungrouped(result)

  @errors.keeps_errors_in_tf_function
  def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
    """`strategy.update_non_slot(colocate_with, fn, *args)` (tf.compat.v1 optimizers
    finish their step with it)."""
    result = self._ds.update_non_slot(colocate_with, fn, *args, **(kwargs or {}))
    return self._grouped(result) if group else self._ungrouped(result)

  def _ungrouped(self, result):
    """`update(..., group=False)`'s result, as tf.distribute gives it: each leaf as the
    tuple of its per-device values (code iterates over it: tf.compat.v1 optimizers)."""
    if result is None:
      return ()
    if not _wrapped.is_structure(result):
      return tuple(self._ds.unwrap(result))
    return _wrapped.pack_as(result, [tuple(self._ds.unwrap(leaf))
                                     for leaf in _wrapped.flatten(result)])

  def _grouped(self, result):
    """`update(..., group=True)`'s result: one value per leaf, after every copy's update.

    tf.distribute returns values there, and code uses them (`tf.random.Generator.skip`
    in cross-replica context slices the state it read): a leaf whose copies are tensors
    gives its first copy, made to wait for every copy's update; anything else (ops,
    variables) gives one op that runs them all.
    """
    leaves = _wrapped.flatten(result)
    parts = [self._ds.unwrap(leaf) for leaf in leaves]
    if not leaves or not all(isinstance(c, tf.Tensor) for p in parts for c in p):
      return self._ds.group(result)
    if tf.executing_eagerly():
      return _wrapped.pack_as(result, [p[0] for p in parts])
    with tf.control_dependencies([c for p in parts for c in p]):
      return _wrapped.pack_as(result, [tf.identity(p[0]) for p in parts])

  @errors.keeps_errors_in_tf_function
  def call_for_each_replica(self, fn, args=(), kwargs=None):
    return self._ds.call_for_each_tower(fn, *args, **(kwargs or {}))

  @errors.keeps_errors_in_tf_function
  def reduce_to(self, reduce_op, value, destinations, options=None):
    del options
    op = _reduce_op_name(reduce_op, "reduce_to")
    return self._ds.reduce(op, value, destinations=destinations)

  @errors.keeps_errors_in_tf_function
  def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
    del options
    op = _reduce_op_name(reduce_op, "batch_reduce_to")
    return self._ds.batch_reduce(op, value_destination_pairs)

  @errors.keeps_errors_in_tf_function
  def broadcast_to(self, tensor, destinations):
    return self._ds.broadcast(tensor, destinations)

  @errors.keeps_errors_in_tf_function
  def non_slot_devices(self, var_list):
    return self._ds.non_slot_devices(var_list)


class StrategyAdapter:
  """What `tf.distribute.get_strategy()` returns in a diststrat context.

  It is not a `tf.distribute.Strategy`: it answers, by calling its diststrat strategy,
  the part of that interface that Keras 3's TensorFlow backend and TensorFlow itself
  use. Users call diststrat; this object is for the code that only knows tf.distribute.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> with s.scope():
    ...   adapter = tf.distribute.get_strategy()
    ...   adapter.diststrat_strategy is s, adapter.num_replicas_in_sync
    (True, 2)
  """

  # TensorFlow's loss-reduction helper (tf.compat.v1 optimizers call it) reads it on the
  # current strategy: no Estimator scaling, so losses are summed over towers as written.
  _scale_loss_for_estimator = False

  def __init__(self, strategy):
    self._ds = strategy
    self.extended = ExtendedAdapter(strategy)
    # A tf.function given to `run` -> the tf.function that runs its towers.
    self._tf_function_runs = weakref.WeakKeyDictionary()  # type: ignore[var-annotated]

  def __repr__(self):
    return f"diststrat StrategyAdapter({self._ds!r})"

  @property
  def diststrat_strategy(self):
    """The diststrat strategy this adapter stands for."""
    return self._ds

  @property
  def num_replicas_in_sync(self):
    """The tower count; for Keras's loss scaling in a tower given part of a batch, a
    `TowerShare` of it.

    Only Keras's loss module gets the `TowerShare` (it weighs the tower's loss by its
    examples); any other code gets the tower count, an int, as from tf.distribute: a
    `TowerShare` converts to the float B / n_i, which `tf.constant`, `tf.fill` refused,
    `tf.range` made floats of and an integer product truncated.
    """
    tower = _context.get_tower_context()
    if tower is not None and tower.distribution_strategy is self._ds and \
        tower.batch_share is not None and _tf_internal.called_by_keras_loss():
      return _training.TowerShare(self._ds.num_towers, tower.batch_share)
    return self._ds.num_towers

  def scope(self):
    _model_checks.check_no_other_strategy(
        self._ds, "A Keras model (or optimizer, or other tf.distribute-aware code)")
    _training.bound_steps(self, _model_checks.check_model_asking_for_scope(self))
    return self._adapter_scope()

  @contextlib.contextmanager
  def _adapter_scope(self):
    """The strategy's scope, entered for code that asked the adapter for it.

    That code (a Keras model made under this strategy) runs under this strategy even
    inside a tf.distribute strategy's scope: the entry for diststrat goes on top of
    TensorFlow's stack. A user's own `with strategy.scope():` there is refused.
    """
    saved = entering_by_adapter()
    _entering.by_adapter = True
    try:
      scope = self._ds.scope()
      scope.__enter__()
    finally:
      _entering.by_adapter = saved
    try:
      yield self
    except BaseException as e:
      if not scope.__exit__(type(e), e, e.__traceback__):
        raise
    else:
      scope.__exit__(None, None, None)

  # --- input ---

  def experimental_distribute_dataset(self, dataset, options=None):
    """`dataset`, prefetched: `run` splits each global batch across the towers.

    The prefetch makes the next batch while a step runs, as `distribute_dataset` does.
    """
    del options
    if not isinstance(dataset, tf.data.Dataset):
      # Marked for AutoGraph here: a decorator would add frames between Keras and the
      # search for its model below.
      raise _tf_internal.pass_through_autograph(TypeError(
          "experimental_distribute_dataset() takes a tf.data.Dataset of global batches "
          f"(run splits each across the towers). Received: {type(dataset).__name__}. "
          "Make one with tf.data.Dataset.from_tensor_slices(...).batch(global_batch_size); "
          f"a function returning it goes to {type(self._ds).__name__}.distribute_dataset()."))
    # Keras's fit asks for its dataset before it builds its callback list: the last
    # moment a worker's file-writing callbacks can be pointed at its scratch directory.
    _file_callbacks.redirect_fit_callbacks(self._ds)
    # And predict asks for it before it makes its step: the one place diststrat meets
    # a model that only predicts, before its steps run.
    model = _tf_internal.keras_model_on_stack(max_frames=8)
    _training.bound_steps(self, model)
    # And fit and evaluate ask for it right before Keras builds the model from a batch
    # of it: from its element spec instead, the data is not read an extra time.
    _training.build_from_element_spec(model)
    _model_checks.check_stateful_layers(self._ds, model)
    _model_checks.check_shuffled_arrays(self._ds, dataset)
    return dataset.prefetch(tf.data.AUTOTUNE)

  @errors.keeps_errors_in_tf_function
  def distribute_datasets_from_function(self, dataset_fn, options=None):
    del dataset_fn, options
    raise NotImplementedError(
        "diststrat's tf.distribute bridge does not implement "
        "distribute_datasets_from_function: it splits global batches itself. Pass a "
        "tf.data.Dataset of global batches (or numpy arrays) to model.fit, or use "
        f"{type(self._ds).__name__}.distribute_dataset() in a custom loop.")

  @errors.keeps_errors_in_tf_function
  def experimental_distribute_values_from_function(self, value_fn):
    """`value_fn(tf.distribute.experimental.ValueContext)` on each of this process's
    towers (under its device), as a per-tower value for `run`: replica ids count every
    tower of every worker process, as tf.distribute's do."""
    first_tower, num_towers = self._ds._batch_split()
    devices = self._ds.worker_devices
    per_tower = []
    for i, device in enumerate(devices):
      context = tf.distribute.experimental.ValueContext(
          replica_id_in_sync_group=first_tower + i, num_replicas_in_sync=num_towers)
      with tf.device(device):
        per_tower.append(value_fn(context))
    # Always per-tower, even when every tower returned the same object: `run` would
    # split a plain tensor as a global batch, and each tower asked for its whole value.
    leaves = [_wrapped.flatten(v) if _wrapped.is_structure(v) else [v] for v in per_tower]
    wrapped = [_wrapped.PerDevice(dict(zip(devices, column, strict=True)))
               for column in zip(*leaves, strict=True)]
    if not _wrapped.is_structure(per_tower[0]):
      return wrapped[0]
    return _wrapped.pack_as(per_tower[0], wrapped)

  @errors.keeps_errors_in_tf_function
  def group(self, value, name=None):
    """One op that runs every part of `value` (None in eager mode)."""
    return self._ds.group(value, name=name)

  @errors.keeps_errors_in_tf_function
  def experimental_local_results(self, value):
    """This process's per-tower values of `value`, in tower order, as a tuple.

    A per-tower value (what `run` returns) or a distributed variable gives its
    components; a structure of them gives one structure per tower, as tf.distribute's
    does; anything else `(value,)`.
    """
    if isinstance(value, _wrapped.DistributedValues):
      return tuple(value.values)
    leaves = _wrapped.flatten(value) if _wrapped.is_structure(value) else []
    if not any(_is_per_tower(leaf) for leaf in leaves):
      return (value,)
    return tuple(
        _wrapped.pack_as(value, [leaf.values[i] if _is_per_tower(leaf) else leaf
                                 for leaf in leaves])
        for i in range(len(self._ds.worker_devices)))

  # --- the step ---

  def run(self, fn, args=(), kwargs=None, options=None):
    """Runs `fn` on every tower, each on its part of the global batch in `args`.

    Keras's trainer calls this with a global batch. Every tensor (or numpy array: Keras's
    eager `*_on_batch` steps pass them) with a batch axis in `args` and `kwargs` is split
    across the towers (`BatchParts`, as `distribute_dataset` does, a tower may get no
    example); with several worker processes training on one
    global batch (MultiWorkerMirroredStrategy), this process's towers take their share.
    Wrapped values give each tower its component; anything else is passed to every
    tower as it is.

    Returns:
      For a Keras model's `train_step`/`test_step`: its metrics, read in cross-tower
      context after every tower ran (each tower-local metric summed over towers). For
      Keras's predict step (called by Keras's trainer): each output leaf concatenated
      over the towers, in tower order (the order of the input batch), of every worker
      process. For anything else, as tf.distribute's `run`: the towers' results, a
      `PerDevice` for each leaf that differs across towers (a plain value with one
      tower), for `reduce` and `experimental_local_results`.

    Raises:
      RuntimeError: `fn` belongs to a Keras model whose variables were not created in
        this strategy's scope.
    """
    del options
    # Keras combines the results itself, with code that knows only tf.distribute's values.
    keras_trainer = _tf_internal.called_by_keras_trainer()
    keras_step = keras_trainer or _training.is_train_or_test_step(fn)
    if not keras_step and isinstance(fn, tf.types.experimental.PolymorphicFunction) and \
        not _tf_internal.tf_function_jit_compile(fn):
      return self._run_tf_function(fn, args, kwargs or {})
    _model_checks.check_step(self, fn)
    _training.route_step(self, fn)
    _training.bound_steps(self, getattr(fn, "__self__", None))
    args, kwargs = _training.split_step_inputs(self._ds, args, kwargs)
    with self._adapter_scope():
      # Keras runs its steps without AutoGraph (as on one device): towers do the same.
      # Any other function is converted in a tf.function (call_for_each_tower does it),
      # as tf.distribute's run converts it.
      step = tf.autograph.experimental.do_not_convert(fn) if keras_step else fn
      outputs = self._ds.call_for_each_tower(step, *args, **kwargs)
      if keras_step:
        return _training.combine_step_outputs(self._ds, fn, outputs)
      return outputs

  def _run_tf_function(self, fn, args, kwargs):
    """`run` of a `tf.function`, as tf.distribute's: the towers run inside one trace of a
    function with `fn`'s options, each calling the Python function `fn` wraps.

    Each tower tracing `fn` on its own could not `merge_call` (a Keras optimizer's
    `apply_gradients`, an `all_reduce`): the other towers would wait for that trace, and
    it for them. A function compiled with XLA is called in each tower as it is.
    """
    wrapped = self._tf_function_runs.get(fn)
    if wrapped is None:
      python_function = fn.python_function

      def run_in_towers(*args, **kwargs):
        return self.run(python_function, args=args, kwargs=kwargs)

      wrapped = _tf_internal.clone_tf_function(fn, run_in_towers)
      self._tf_function_runs[fn] = wrapped
    return wrapped(*args, **kwargs)

  # --- cross-replica reductions Keras may call ---

  @errors.keeps_errors_in_tf_function
  def reduce(self, reduce_op, value, axis=None):
    """Reduces per-tower values over the towers (and over `axis` of each, if given).

    As tf.distribute's: with `axis`, a `"mean"` is over every element along it, of
    every tower (towers of different sizes weigh by their sizes, an empty one adds
    nothing). Per-tower values are reduced by the strategy (over every worker process,
    under MultiWorkerMirroredStrategy); the result is on the first worker device. A
    value that is not per-tower (every tower returned the same object) stands for every
    tower's, as in tf.distribute: its `"sum"` with an `axis` counts it once per tower,
    and without one raises `ValueError` (on one tower it is the value).
    """
    op = _reduce_op_name(reduce_op, "reduce")
    leaves = _wrapped.flatten(value) if _wrapped.is_structure(value) else [value]
    results = [self._reduce_one(op, leaf, axis) for leaf in leaves]
    return _wrapped.pack_as(value, results) if _wrapped.is_structure(value) else results[0]

  def _reduce_one(self, op, value, axis):
    first = self._ds.worker_devices[0]
    if not _is_per_tower(value):
      towers = self._ds.num_towers
      if op == "sum" and towers > 1:
        # As tf.distribute's: the value stands for every tower's (what run returns when
        # every tower returned the same object); without an axis its sum is refused
        # (it was the value itself, as if there were one tower).
        if axis is None:
          raise ValueError(
              f"reduce('sum', value, axis=None) takes what run() returned for each tower, "
              f"but received a value that is not per-tower ({type(value).__name__}) under "
              f"{self._ds!r}, which has {towers} towers: every tower returned the same "
              "object (a Python number, or a tensor or variable made outside the "
              "function), or the value is not a result of run(). Its sum over the towers "
              "is ambiguous, and tf.distribute refuses it too. Return a tensor computed in "
              "the function (tf.constant(...) there), or multiply the value by "
              "num_replicas_in_sync.")
        with tf.device(first):
          total = tf.reduce_sum(value, axis=axis)
          return total * tf.cast(towers, total.dtype)
      if axis is None:
        return value
      if op == "sum":
        return tf.reduce_sum(value, axis=axis)
      value = tf.convert_to_tensor(value)
      if value.dtype.is_integer:
        # A true division, as with several towers (below) and as tf.distribute's: the
        # mean of integers [1, 2] is 1.5 (float64), not tf.reduce_mean's floored 1.
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(value), axis)), value.dtype)
        return tf.math.truediv(tf.reduce_sum(value, axis=axis), count)
      return tf.reduce_mean(value, axis=axis)
    devices = value.devices
    parts = [tf.convert_to_tensor(p) for p in value.values]
    if axis is None:
      per_tower = _wrapped.PerDevice(dict(zip(devices, parts, strict=True)))
      if op == "mean" and parts[0].dtype.is_integer:
        # As tf.distribute's: a true division (float64 for int32), where diststrat's own
        # reduce floors and keeps the dtype (docs/cross_tower_ops.md). The count is
        # reduced with the values: the towers the sum covered (a SavedModel's trace under
        # MultiWorkerMirroredStrategy covers one worker's).
        ones = _wrapped.PerDevice({d: tf.ones([], p.dtype)
                                   for d, p in zip(devices, parts, strict=True)})
        total, count = (r.get(first) for r in self._ds.batch_reduce(
            "sum", [(per_tower, None), (ones, None)]))
        with tf.device(first):
          return tf.math.truediv(total, count)
      return self._ds.reduce(op, per_tower).get(first)
    sums, counts = [], []
    for device, part in zip(devices, parts, strict=True):
      with tf.device(device):
        sums.append(tf.reduce_sum(part, axis=axis))
        counts.append(tf.cast(tf.reduce_prod(tf.gather(tf.shape(part), axis)), part.dtype))
    pairs = [(_wrapped.PerDevice(dict(zip(devices, sums, strict=True))), None)]
    if op == "mean":
      pairs.append((_wrapped.PerDevice(dict(zip(devices, counts, strict=True))), None))
    reduced = [r.get(first) for r in self._ds.batch_reduce("sum", pairs)]
    if op == "sum":
      return reduced[0]
    with tf.device(first):
      return reduced[0] / reduced[1]

  @errors.keeps_errors_in_tf_function
  def gather(self, value, axis):
    return self._ds.gather(value, axis=axis)
