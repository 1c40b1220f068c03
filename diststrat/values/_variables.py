"""Distributed variables: one TensorFlow variable per device, used as one variable.

`MirroredVariable` keeps its copies equal (every write goes to all of them).
`TowerLocalVariable` lets each tower write its own copy and aggregates them on read.

Both subclass `tf.Variable`, so TensorFlow ops, operators, `tf.GradientTape`, `tf.Module`,
Keras 3 layers, `tf.train.Checkpoint` and `tf.saved_model.save` accept them. Every read
and write goes to one component chosen by context (`_component()`), so there is no
operator code here: the operators `tf.Variable` defines call `value()`.

Libraries may give the variables they make rules of their own (`VariableRules`), found
by a creation hook (`add_rules_finder`) when the variable is made. Keras does
(diststrat/_keras/_variable_rules.py): the state it keeps in variables and writes inside
the model's call (batch normalization's moving statistics, the state of a
`SeedGenerator`) has aggregation NONE, so a `MirroredVariable` it made is written in a
tower by merging the towers' values; a seed's state is read in each tower with the
tower's id hashed in. See docs/keras.md.

`tf.saved_model.save` saves a distributed variable as one plain variable (the primary
copy's, holding the value a checkpoint saves) and traces the saved functions again in
its save context: in that trace every read and write is the primary copy's, so that
the loaded functions, whose copies are all that one variable, compute what they did.
"""

import copy
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional
import weakref

import numpy as np

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat.values import _wrapped

if TYPE_CHECKING:  # _strategy imports this module: no import at run time.
  from diststrat._strategy import DistributionStrategy

_VARIABLE_VALUE = "VARIABLE_VALUE"  # The key a plain tf.Variable saves its value under.


def _in_real_tower():
  tower = _context.get_tower_context()
  return tower is not None and tower is not _context.default_tower_context()


# Sparse and sliced writes, by what a tower-local variable's cross-tower write does with
# the value: spread it over the copies as `assign*` do (so that the copies' aggregate
# takes it), refuse (the min or max of an aggregate is not the aggregate of mins), or,
# for `scatter_mul` and `scatter_div`, give every copy the whole value (a product scales
# the sum and the mean alike; an integer sum's floored quotient is refused).
_SPREAD_WRITES = frozenset([
    "scatter_update", "scatter_add", "scatter_sub", "batch_scatter_update",
    "scatter_nd_update", "scatter_nd_add", "scatter_nd_sub", "sliced assign"])
_ORDER_WRITES = frozenset(["scatter_max", "scatter_min", "scatter_nd_max", "scatter_nd_min"])


def _named(method):
  """How an error message names a write: "assign to a slice of" for a sliced assign."""
  return "assign to a slice of" if method == "sliced assign" else f"{method}()"


def _scaled(data, weight, dtype):
  """`data` (a tensor-like or `tf.IndexedSlices`) times `weight`, in `dtype`."""
  if isinstance(data, tf.IndexedSlices):
    values = tf.convert_to_tensor(data.values, dtype=dtype) * tf.cast(weight, dtype)
    return tf.IndexedSlices(values, data.indices, data.dense_shape)
  return tf.convert_to_tensor(data, dtype=dtype) * tf.cast(weight, dtype)


# --- which strategy made a plain variable ---------------------------------------------

# id(plain variable) -> the strategy that made it (entries die with it)
_creators: dict[int, Any] = {}
_creators_lock = threading.Lock()


def _forget_creator(key):
  with _creators_lock:
    _creators.pop(key, None)


def mark_created_by(variable, strategy):
  """Records that `strategy` created the plain `tf.Variable` `variable` (see `created_by`)."""
  key = id(variable)
  with _creators_lock:
    _creators[key] = strategy
  weakref.finalize(variable, _forget_creator, key)
  return variable


def created_by(variable):
  """The strategy that created `variable` (a distributed or a marked plain one), or None."""
  if isinstance(variable, DistributedVariable):
    return variable.distribution_strategy
  with _creators_lock:
    return _creators.get(id(variable))


# --- rules a library gives the variables it makes ---------------------------------------


class VariableRules:
  """How a distributed variable behaves where diststrat has no rule of its own.

  The default rules: none. A library whose variables need some (Keras's layer state
  and seeds) subclasses this and registers a finder with `add_rules_finder`.
  """

  merges_tower_writes = False
  """Writes in a tower to a mirrored variable with aggregation NONE are merged over the
  towers (floats: a mean weighted by each tower's share of the batch; others: tower 0's
  value) instead of raising. Under `ParameterServerStrategy`, non-trainable variables
  with this rule are wrapped so that the merge happens."""

  def tower_read(self, value):
    """The value a tower reads (called in a tower context, with the component's value)."""
    return value

  def tower_write(self, variable, method, value):
    """The write `(method, value)` that a tower's dense write to the mirrored `variable`
    (with an aggregation, not NONE) stands for, combined across the towers by that
    aggregation: by default the write as it is."""
    del variable
    return method, value


_NO_RULES = VariableRules()
_rules_finders: list[Callable[[], Optional[VariableRules]]] = []


def add_rules_finder(finder):
  """Registers `finder()`: called when a distributed variable is being created, it returns
  the `VariableRules` of the variable being made, or None if it does not know it.
  Registering the same finder twice registers it once."""
  if finder not in _rules_finders:
    _rules_finders.append(finder)


def rules_for_new_variable():
  """The rules of the variable being created now (call it from a variable creator)."""
  for finder in _rules_finders:
    rules = finder()
    if rules is not None:
      return rules
  return _NO_RULES


class DistributedVariable(_wrapped.DistributedValues, tf.Variable):
  """Base of the distributed variables: one `tf.Variable` component per device."""

  # Makes tf.GradientTape and friends treat this object as a resource variable: they
  # then use `.handle`, the handle of the component for the current context.
  _should_act_as_resource_variable = True
  # TensorFlow reads it on any tf.Variable (its slot creator, for the averages of
  # tf.train.ExponentialMovingAverage): a distributed variable is not partitioned.
  _save_slice_info = None

  def is_tensor_like(self) -> bool:
    """Makes `tf.is_tensor()` true, as for a tf.Variable (tf.GradientTape.watch checks it)."""
    return True

  def __init__(self, index: dict[Any, Any],
               aggregation: Any = tf.VariableAggregation.NONE,
               strategy: Any = None) -> None:
    _wrapped.DistributedValues.__init__(self, index)
    self._aggregation = aggregation
    self._strategy = strategy
    self._rules = rules_for_new_variable()  # Made inside a variable creator.
    container = weakref.ref(self)
    for component in self._index.values():
      # How diststrat (`container_of`) and a Keras optimizer find, from a copy, the
      # variable it belongs to.
      _tf_internal.set_distributed_container(component, container)

  # --- which component a read or write uses ---

  def _component(self):
    """The component for the current context: tower, then update device, then primary.

    While a SavedModel traces, always the primary: it saves one variable for all the
    copies, and one handle keeps the traced reads and writes in their order.
    """
    if _tf_internal.in_saved_model_trace():
      return self.primary
    device = None
    if _in_real_tower():
      device = _context.get_tower_context().device
    if device is None or device not in self._index:
      device = _context.get_update_device()
    if device is not None and device in self._index:
      return self._index[device]
    return self.primary

  @property
  def distribution_strategy(self) -> Optional["DistributionStrategy"]:
    """The strategy that created this variable (None if unknown)."""
    return self._strategy

  # --- tf.Variable's properties, from the component ---

  @property
  def name(self) -> str:
    return self.primary.name

  @property
  def _shared_name(self):
    return _tf_internal.shared_name(self.primary)

  @property
  def _unique_id(self):
    return _tf_internal.unique_id(self.primary)

  @property
  def dtype(self) -> tf.DType:
    return self.primary.dtype

  @property
  def shape(self) -> tf.TensorShape:
    return self.primary.shape

  def get_shape(self) -> tf.TensorShape:
    return self.primary.get_shape()

  def set_shape(self, shape: Any) -> None:
    for component in self._index.values():
      component.set_shape(shape)

  @property
  def trainable(self) -> bool:
    return self.primary.trainable

  @property
  def synchronization(self) -> tf.VariableSynchronization:
    return self.primary.synchronization

  @property
  def aggregation(self) -> tf.VariableAggregation:
    return self._aggregation

  @property
  def constraint(self) -> Any:
    return self.primary.constraint

  @property
  def device(self) -> str:
    return self._component().device

  @property
  def handle(self) -> Any:
    return self._component().handle

  @property
  def graph(self) -> Any:
    return self.primary.graph

  @property
  def op(self) -> Any:
    return self._component().op

  @property
  def initializer(self) -> Any:
    if tf.executing_eagerly():
      return None
    return tf.group(*[c.initializer for c in self._index.values()])

  @property
  def initial_value(self) -> Any:
    return self.primary.initial_value

  @property
  def _in_graph_mode(self):
    return _tf_internal.in_graph_mode(self.primary)

  def is_initialized(self, name: Optional[str] = None) -> Any:
    return tf.reduce_all([c.is_initialized() for c in self._index.values()], name=name)

  # --- reads ---

  def _tower_stream(self, value):
    """A value read in a tower, as this variable's rules give it (unchanged by default)."""
    if self._rules is _NO_RULES or not _in_real_tower():
      return value
    return self._rules.tower_read(value)

  @tf.autograph.experimental.do_not_convert
  def value(self) -> tf.Tensor:
    return self._tower_stream(self._component().value())

  @tf.autograph.experimental.do_not_convert
  def read_value(self) -> tf.Tensor:
    return self._tower_stream(self._component().read_value())

  @tf.autograph.experimental.do_not_convert
  def read_value_no_copy(self) -> tf.Tensor:
    return self._tower_stream(self._component().read_value_no_copy())

  @tf.autograph.experimental.do_not_convert
  def sparse_read(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
    return self._component().sparse_read(indices, name=name)

  @tf.autograph.experimental.do_not_convert
  def gather_nd(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
    return self._component().gather_nd(indices, name=name)

  def numpy(self) -> Any:
    if not tf.executing_eagerly():
      raise NotImplementedError("numpy() is only available in eager mode.")
    return self.read_value().numpy()

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    value = _tf_internal.dense_var_to_tensor(self._component(), dtype=dtype, name=name,
                                             as_ref=as_ref)
    return value if as_ref else self._tower_stream(value)

  def __array__(self, dtype=None, copy=None):
    del copy  # numpy() always returns a new array.
    value = np.asarray(self.numpy())
    return value if dtype is None else value.astype(dtype)

  # tf.Variable defines __hash__/__eq__ elementwise; keep identity semantics for keys.
  __hash__ = tf.Variable.__hash__
  __eq__ = tf.Variable.__eq__
  __ne__ = tf.Variable.__ne__

  def __repr__(self):
    items = ", ".join(f"{d!r}: {c!r}" for d, c in self._index.items())
    return f"{type(self).__name__}({{{items}}})"

  # --- Python numbers and copies, as a tf.Variable gives them ---

  def __float__(self) -> float:
    return float(self.read_value())

  def __int__(self) -> int:
    return int(self.read_value())

  def __complex__(self) -> complex:
    return complex(self.read_value())

  def __bool__(self) -> bool:
    return bool(self.read_value())

  def __copy__(self):
    return self  # As a tf.Variable: a shallow copy is the variable itself.

  def __deepcopy__(self, memo):
    """A new variable of this kind, with new copies on the same devices, each holding
    its copy's current value (eager only, as for a tf.Variable)."""
    if not tf.executing_eagerly():
      raise NotImplementedError(
          "copy.deepcopy() of a distributed variable is only available when eager "
          "execution is enabled, as for a tf.Variable.")
    index = {}
    for device, component in self._index.items():
      with tf.device(device):
        index[device] = copy.deepcopy(component, memo)
    new = type(self).__new__(type(self))
    DistributedVariable.__init__(new, index, self._aggregation, self._strategy)
    new._rules = self._rules
    memo[id(self)] = new
    return new

  def __reduce__(self):
    raise _tf_internal.pass_through_autograph(TypeError(
        f"The distributed variable {self.name!r} cannot be pickled: its copies live on "
        "its strategy's devices. Pickle its value (v.numpy()), or save it with "
        "tf.train.Checkpoint."))

  # --- writes: subclasses decide ---

  @tf.autograph.experimental.do_not_convert
  def assign(self, value: Any, use_locking: bool = False, name: Optional[str] = None,
             read_value: bool = True) -> Any:
    return self._write("assign", value, read_value)

  @tf.autograph.experimental.do_not_convert
  def assign_add(self, delta: Any, use_locking: bool = False, name: Optional[str] = None,
                 read_value: bool = True) -> Any:
    return self._write("assign_add", delta, read_value)

  @tf.autograph.experimental.do_not_convert
  def assign_sub(self, delta: Any, use_locking: bool = False, name: Optional[str] = None,
                 read_value: bool = True) -> Any:
    return self._write("assign_sub", delta, read_value)

  def _write(self, method, value, read_value):
    raise NotImplementedError

  # Sparse and sliced writes go where `assign*` go (by context); subclasses decide with
  # `_write_sparse(method, data, write)`, where `write(component, data)` does it to one
  # copy. Each returns the variable, as a tf.Variable's does.

  def scatter_sub(self, sparse_delta: Any, use_locking: bool = False,
                  name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_sub", sparse_delta, lambda c, d: c.scatter_sub(
        d, use_locking=use_locking, name=name))

  def scatter_add(self, sparse_delta: Any, use_locking: bool = False,
                  name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_add", sparse_delta, lambda c, d: c.scatter_add(
        d, use_locking=use_locking, name=name))

  def scatter_max(self, sparse_delta: Any, use_locking: bool = False,
                  name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_max", sparse_delta, lambda c, d: c.scatter_max(
        d, use_locking=use_locking, name=name))

  def scatter_min(self, sparse_delta: Any, use_locking: bool = False,
                  name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_min", sparse_delta, lambda c, d: c.scatter_min(
        d, use_locking=use_locking, name=name))

  def scatter_mul(self, sparse_delta: Any, use_locking: bool = False,
                  name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_mul", sparse_delta, lambda c, d: c.scatter_mul(
        d, use_locking=use_locking, name=name))

  def scatter_div(self, sparse_delta: Any, use_locking: bool = False,
                  name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_div", sparse_delta, lambda c, d: c.scatter_div(
        d, use_locking=use_locking, name=name))

  def scatter_update(self, sparse_delta: Any, use_locking: bool = False,
                     name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_update", sparse_delta, lambda c, d: c.scatter_update(
        d, use_locking=use_locking, name=name))

  def batch_scatter_update(self, sparse_delta: Any, use_locking: bool = False,
                           name: Optional[str] = None) -> Any:
    return self._write_sparse(
        "batch_scatter_update", sparse_delta,
        lambda c, d: c.batch_scatter_update(d, use_locking=use_locking, name=name))

  def scatter_nd_sub(self, indices: Any, updates: Any, name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_nd_sub", updates, lambda c, u: c.scatter_nd_sub(
        indices, u, name=name))

  def scatter_nd_add(self, indices: Any, updates: Any, name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_nd_add", updates, lambda c, u: c.scatter_nd_add(
        indices, u, name=name))

  def scatter_nd_update(self, indices: Any, updates: Any, name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_nd_update", updates, lambda c, u: c.scatter_nd_update(
        indices, u, name=name))

  def scatter_nd_max(self, indices: Any, updates: Any, name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_nd_max", updates, lambda c, u: c.scatter_nd_max(
        indices, u, name=name))

  def scatter_nd_min(self, indices: Any, updates: Any, name: Optional[str] = None) -> Any:
    return self._write_sparse("scatter_nd_min", updates, lambda c, u: c.scatter_nd_min(
        indices, u, name=name))

  def _strided_slice_assign(self, begin, end, strides, value, name, begin_mask, end_mask,
                            ellipsis_mask, new_axis_mask, shrink_axis_mask):
    # `v[1:3].assign(x)`: TensorFlow's slice helper calls this with the slice's spec.
    spec = dict(begin=begin, end=end, strides=strides, name=name, begin_mask=begin_mask,
                end_mask=end_mask, ellipsis_mask=ellipsis_mask,
                new_axis_mask=new_axis_mask, shrink_axis_mask=shrink_axis_mask)
    return self._write_sparse("sliced assign", value, lambda c, v: (
        _tf_internal.strided_slice_assign(c, value=v, **spec)))

  def _write_sparse(self, method, data, write):
    raise NotImplementedError

  def _written_copies(self):
    """(device, component) pairs a cross-tower write goes to: every copy; only the
    primary while a SavedModel traces (it saves one variable for all the copies)."""
    if _tf_internal.in_saved_model_trace():
      return [next(iter(self._index.items()))]
    return list(self._index.items())

  def _write_by_aggregation(self, method, value, read_value):
    """A tower's write through `merge_call`: the towers' values combined by the
    aggregation (ONLY_FIRST_REPLICA: tower 0's), then written by `strategy.update`."""
    aggregation = self._aggregation
    # Each tower's value is its own tensor: the same object in every tower (a Python
    # number, a tensor made outside the towers) would count once in the reduction, so
    # `counter.assign_add(1)` in every tower would add 1, not 1 per tower, with SUM. A
    # Python or numpy value takes this variable's dtype (1 becomes an int64 for an int64
    # counter), as it does for a plain variable.
    if isinstance(value, (tf.Tensor, tf.Variable)):
      value = tf.identity(value)
    elif not isinstance(value, (tf.IndexedSlices, _wrapped.DistributedValues)):
      value = tf.convert_to_tensor(value, dtype=self.dtype)

    def merge_fn(strategy, value):
      if aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA:
        value = strategy._first_tower_value(value)
      else:
        value = strategy.reduce(aggregation, value, destinations=self)
      return strategy.update(self, lambda component, v: getattr(component, method)(
          v, read_value=False), value)

    _context.get_tower_context().merge_call(merge_fn, value)
    if read_value:
      return self
    return None if tf.executing_eagerly() else tf.no_op()

  def _write_all(self, method, value, read_value, scale=None):
    """Writes `value` (plain or wrapped) into every component; returns like tf.Variable."""
    ops = []
    if _tf_internal.in_saved_model_trace():
      scale = None  # Its one variable takes the whole value.
    for device, component in self._written_copies():
      with tf.device(device):
        v = _wrapped.select_device(device, value)
        weight = scale[device] if isinstance(scale, dict) else scale
        if weight is not None:
          v = tf.convert_to_tensor(v, dtype=self.dtype) * tf.cast(weight, self.dtype)
        ops.append(getattr(component, method)(v, read_value=False))
    if read_value:
      return self
    if tf.executing_eagerly():
      return None
    return tf.group(*ops)

  # --- checkpoints: one value under the plain variable's key ---

  def _saved_value(self):
    return self.primary.read_value()

  def _serialize_to_tensors(self):
    return {_VARIABLE_VALUE: self._saved_value()}

  def _restore_from_tensors(self, restored_tensors):
    value = restored_tensors[_VARIABLE_VALUE]
    if not self.shape.is_compatible_with(value.shape):  # As TensorFlow says it.
      raise ValueError(
          f"Received incompatible tensor with shape {value.shape} when attempting to "
          f"restore variable with shape {self.shape} and name {self.name}.")
    return self._restore_value(value)

  def _restore_value(self, value):
    ops = []
    for device, component in self._index.items():
      with tf.device(device):
        ops.append(component.assign(tf.cast(value, self.dtype), read_value=False))
    return None if tf.executing_eagerly() else tf.group(*ops)

  def _copy_trackable_to_cpu(self, object_map):
    # Asynchronous checkpoints copy the variable to the host; one copy is the value.
    _tf_internal.copy_trackable_to_cpu(self.primary, object_map)
    object_map[self] = object_map[self.primary]

  # --- SavedModel: one plain variable, the primary copy ---

  def _export_to_saved_model_graph(self, object_map=None, tensor_map=None, options=None,
                                   **kwargs):
    # The exported functions may have captured any copy's handle (each was traced in
    # some context): every copy stands for the primary's exported variable.
    primary = self.primary
    resources = _tf_internal.export_to_saved_model_graph(
        primary, object_map=object_map, tensor_map=tensor_map, options=options, **kwargs)
    for component in self._index.values():
      if component is not primary:
        object_map[component] = object_map[primary]
        tensor_map[component.handle] = tensor_map[primary.handle]
        resources.append(component.handle)
    object_map[self] = object_map[primary]
    return resources

  def _write_object_proto(self, proto, options):
    _tf_internal.write_object_proto(self.primary, proto, options)


class MirroredVariable(DistributedVariable):
  """A variable with one copy per device, kept equal.

  Reads in a tower give that tower's copy; in cross-tower context, the copy on the
  device being updated, else the primary (first) copy. In cross-tower context
  `assign*` writes every copy. In a tower, `assign*` needs an aggregation other than
  NONE: the towers' values are combined through `merge_call`, then every copy is
  written. Create one inside `MirroredStrategy.scope()` with `tf.Variable(...)`.

  It is a `DistributedValues` (with `.devices`, `.values`, `.get()`) and a `tf.Variable`;
  unlike a `Mirrored` value, tf.nest treats it as one leaf.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.MirroredStrategy(["/cpu:0"])
    >>> with s.scope():
    ...   v = tf.Variable(1.0)
    >>> type(v).__name__, float(v + 1.0)
    ('MirroredVariable', 2.0)
  """

  _holds_copies = True

  def _serialize_to_tensors(self):
    # Every copy holds the value: saved as the primary saves itself, read only when a
    # save writes, never by a restore (which builds the same saver). A restore onto a
    # parameter-server task that restarted empty must not read what it then writes.
    return _tf_internal.serialize_to_tensors(self.primary)

  def _write(self, method, value, read_value):
    if not _in_real_tower():
      device = _context.get_update_device()
      if device is not None and device in self._index:
        # Inside update(): the function runs once per copy, each writing its own.
        return self._write_one(device, method, value, read_value)
      if isinstance(value, _wrapped.PerDevice):
        # Each copy would take its own tower's value, and the copies would differ.
        raise _tf_internal.pass_through_autograph(ValueError(
            f"Cannot {method}() the mirrored variable {self.name!r} in cross-tower "
            "context with one value per tower (a PerDevice over "
            f"{list(value.devices)}): every copy of it holds the same value. Combine "
            "the towers' values first: strategy.reduce('sum' or 'mean', value, "
            "destinations=var), or take one tower's: value.get(device)."))
      return self._write_all(method, value, read_value)
    if self._aggregation == tf.VariableAggregation.NONE:
      if self._rules.merges_tower_writes:
        return self._merge_tower_writes(method, value, read_value)
      raise _tf_internal.pass_through_autograph(ValueError(
          f"Cannot {method}() the mirrored variable {self.name!r} in a tower context "
          "with aggregation NONE: diststrat would not know how to combine the towers' "
          "values. Create it with tf.Variable(..., aggregation=tf.VariableAggregation.SUM) "
          "(or MEAN, ONLY_FIRST_REPLICA), or write it in cross-tower context "
          "(strategy.update() or merge_call). If a library created it (a "
          "tf.train.Checkpoint's save_counter, when a tower saves), call that library "
          "in cross-tower context: outside call_for_each_tower, or in merge_call."))
    method, value = self._rules.tower_write(self, method, value)
    return self._write_by_aggregation(method, value, read_value)

  def _write_sparse(self, method, data, write):
    if not _in_real_tower():
      device = _context.get_update_device()
      if device is not None and device in self._index:
        write(self._index[device], _wrapped.select_device(device, data))
        return self
      for device, component in self._written_copies():
        with tf.device(device):
          write(component, _wrapped.select_device(device, data))
      return self
    aggregation = self._aggregation
    if (method in ("scatter_add", "scatter_sub") and isinstance(data, tf.IndexedSlices)
        and aggregation in (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)):
      # The towers' rows, reduced as sparse gradients are, go to every copy. Each
      # tower's rows are its own tensors (as in `_write`).
      rows = tf.IndexedSlices(tf.identity(data.values), tf.identity(data.indices),
                              data.dense_shape)

      def merge_fn(strategy, rows):
        reduced = strategy.reduce(aggregation, rows, destinations=self)
        return strategy.update(self, lambda component, r: getattr(component, method)(r),
                               reduced)

      _context.get_tower_context().merge_call(merge_fn, rows)
      return self
    raise _tf_internal.pass_through_autograph(ValueError(
        f"Cannot {_named(method)} the mirrored variable {self.name!r} in a tower context "
        f"(aggregation {aggregation.name}): the towers would write different parts, and "
        "diststrat keeps every copy equal. Only scatter_add and scatter_sub of "
        "tf.IndexedSlices, with aggregation SUM or MEAN, combine the towers' writes in a "
        "tower. Write it in cross-tower context (outside call_for_each_tower, in "
        "merge_call, or with strategy.update(v, fn), which runs fn on each copy), or "
        "write a dense value with assign, assign_add or assign_sub, which combine the "
        "towers' values by the variable's aggregation."))

  def _write_one(self, device, method, value, read_value):
    op = getattr(self._index[device], method)(_wrapped.select_device(device, value),
                                              read_value=False)
    if read_value:
      return self
    return None if tf.executing_eagerly() else op

  def _merge_tower_writes(self, method, value, read_value):
    """A NONE variable whose rules merge tower writes: merge the towers' values, write all.

    Floats: the towers' values averaged, each weighted by its tower's share of the batch
    (so batch normalization's moving mean equals one device's); integers (a seed
    state, the same in every tower): tower 0's.
    """
    tower = _context.get_tower_context()
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    share = tower.batch_share
    weight = 1.0 / tower.num_towers if share is None else share
    floating = self.dtype.is_floating
    weight = tf.cast(weight, self.dtype) if floating else None

    def merge_fn(strategy, value, weight):
      parts = strategy.unwrap(value)
      if floating:
        devices = strategy.worker_devices
        # One component when every tower gave the same tensor (or weight): each tower's.
        parts = parts * len(devices) if len(parts) == 1 else parts
        weights = strategy.unwrap(weight)
        weights = weights * len(devices) if len(weights) == 1 else weights
        weighted = {}
        for device, part, w in zip(devices, parts, weights, strict=True):
          with tf.device(device):
            # multiply_no_nan: a tower that got no example weighs 0 and may hold NaN.
            weighted[device] = tf.math.multiply_no_nan(part, w)
        # Summed by the strategy: over every tower of every worker process, if several.
        merged = strategy.reduce("sum", _wrapped.PerDevice(weighted), destinations=self)
      else:
        merged = parts[0]
      return strategy.update(self, lambda component, v: getattr(component, method)(
          v, read_value=False), merged)

    tower.merge_call(merge_fn, value, weight)
    if read_value:
      return self
    return None if tf.executing_eagerly() else tf.no_op()


class TowerLocalVariable(DistributedVariable):
  """A variable each tower writes on its own; reads in cross-tower context aggregate.

  Made by `tf.Variable(..., synchronization=tf.VariableSynchronization.ON_READ,
  aggregation=SUM or MEAN)` inside a strategy's scope; typical for metrics. In a tower,
  reads and writes use the tower's copy. In cross-tower context, reading (or
  `strategy.read_var`) gives the copies summed or averaged; `assign` sets the copies
  so that their aggregate is the value assigned. A checkpoint saves the aggregate.
  """

  def _aggregate(self):
    values = [c.read_value() for c in self._index.values()]
    with tf.device(self.devices[0]):
      total = tf.math.add_n(values) if len(values) > 1 else tf.identity(values[0])
      if self._strategy is not None:  # Several worker processes: every copy of every one.
        total = self._strategy._sum_across_processes(total)
      if self._aggregation == tf.VariableAggregation.MEAN:
        # Integers keep their dtype (floor division), as in reductions; `/` would give
        # a float64.
        count = tf.cast(self._num_copies(), total.dtype)
        total = total // count if total.dtype.is_integer else total / count
    return total

  def _num_copies(self):
    """The copies of this variable in every process of its strategy (this process's
    while a SavedModel traces: its functions run in one process)."""
    if self._strategy is None or _tf_internal.in_saved_model_trace():
      return len(self._index)
    return len(self._index) * self._strategy._num_processes()

  def _reads_one_copy(self):
    """In a tower or an update, the copy there; in a SavedModel's trace, the primary,
    which it saves holding the aggregate. Elsewhere, reads aggregate the copies."""
    return (_in_real_tower() or _context.get_update_device() is not None
            or _tf_internal.in_saved_model_trace())

  # --- while a SavedModel traces: its one variable holds the aggregate ---

  def _saved_share(self, device):
    """What the copy on `device` holds of the aggregate, read from the one variable a
    SavedModel keeps: the aggregate split as a cross-tower `assign` splits it."""
    scale = self._split_scale("assign")
    weight = scale[device] if isinstance(scale, dict) else scale
    with tf.device(device):
      total = self.primary.value()
      return total if weight is None else total * tf.cast(weight, self.dtype)

  def value(self) -> tf.Tensor:
    tower = _context.get_tower_context()
    if tower is not None and self._reads_saved_share():
      return self._saved_share(tower.device)
    if self._reads_one_copy():
      return self._component().value()
    return self._aggregate()

  def read_value(self) -> tf.Tensor:
    return self.value()

  def read_value_no_copy(self) -> tf.Tensor:
    return self.value()

  def _reads_saved_share(self):
    return _in_real_tower() and _tf_internal.in_saved_model_trace()

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    if self._reads_one_copy() and (as_ref or not self._reads_saved_share()):
      return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
    value = self.value()
    return value if dtype is None else tf.cast(value, dtype)

  @tf.autograph.experimental.do_not_convert
  def sparse_read(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
    if self._reads_one_copy() and not self._reads_saved_share():
      return super().sparse_read(indices, name=name)
    return tf.gather(self.value(), indices, name=name)  # The aggregate, or a share.

  @tf.autograph.experimental.do_not_convert
  def gather_nd(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
    if self._reads_one_copy() and not self._reads_saved_share():
      return super().gather_nd(indices, name=name)
    return tf.gather_nd(self.value(), indices, name=name)

  def _write(self, method, value, read_value):
    if self._reads_saved_share():
      # The SavedModel's one variable holds the aggregate: the towers' writes are
      # combined by the aggregation (as the copies' aggregate would change), then
      # written once.
      return self._write_by_aggregation(method, value, read_value)
    if _in_real_tower() or _context.get_update_device() is not None:
      component = self._component()
      result = getattr(component, method)(value, read_value=False)
      return self if read_value else result
    return self._write_all(method, value, read_value, scale=self._split_scale(method))

  def _write_sparse(self, method, data, write):
    if _in_real_tower() or _context.get_update_device() is not None:
      write(self._component(), data)
      return self
    if (method == "scatter_div" and self.dtype.is_integer and not
        _tf_internal.in_saved_model_trace()
        and self._aggregation == tf.VariableAggregation.SUM):
      raise _tf_internal.pass_through_autograph(ValueError(
          f"Cannot scatter_div() the integer tower-local variable {self.name!r} in "
          "cross-tower context: its value is the sum of its copies, and the sum of the "
          "copies' floored quotients is not the floored quotient of their sum. Read it "
          "(v.read_value()), compute the new value, and assign() it."))
    if method in _ORDER_WRITES and not _tf_internal.in_saved_model_trace():
      kind = "sum" if self._aggregation == tf.VariableAggregation.SUM else "mean"
      raise _tf_internal.pass_through_autograph(ValueError(
          f"Cannot {method}() the tower-local variable {self.name!r} in cross-tower "
          f"context: its value is the {kind} of its copies, and the {kind} of the copies' "
          f"{method.rsplit('_', 1)[-1]} is not the {method.rsplit('_', 1)[-1]} of their "
          f"{kind}. Read it (v.read_value()), compute the new value, and assign() it; or "
          "write each tower's copy in its tower."))
    scale = None  # scatter_mul, scatter_div: every copy takes the whole value.
    if method in _SPREAD_WRITES and not _tf_internal.in_saved_model_trace():
      scale = self._split_scale(method)  # The copies' aggregate takes the value.
    for device, component in self._written_copies():
      weight = scale[device] if isinstance(scale, dict) else scale
      with tf.device(device):
        write(component, data if weight is None else _scaled(data, weight, self.dtype))
    return self

  def _split_scale(self, method):
    """For a sum, how the value (or delta) is spread over the copies so that they add up
    to it: each takes 1/N of a float; an integer goes whole to one copy (the first of
    the chief process) and 0 to the others, since 1/N of it would round to 0. None for
    other aggregations: every copy takes the value. A dict maps device to weight."""
    del method
    if self._aggregation != tf.VariableAggregation.SUM:
      return None
    if not self.dtype.is_integer:
      return 1.0 / self._num_copies()
    chief = (self._strategy is None or getattr(self._strategy, "is_chief", True)
             or _tf_internal.in_saved_model_trace())
    first = next(iter(self._index))
    return {device: 1 if chief and device == first else 0 for device in self._index}

  def _saved_value(self):
    return self._aggregate()

  def _copy_trackable_to_cpu(self, object_map):
    # An asynchronous checkpoint saves the host copy: it must hold what a synchronous
    # save writes, the aggregate, not the first copy's part of it.
    super()._copy_trackable_to_cpu(object_map)
    host = object_map[self]
    with tf.device(host.device):
      host.assign(tf.cast(self._saved_value(), host.dtype))

  def _restore_value(self, value):
    # The saved aggregate, split over the copies as a cross-tower assign splits it.
    return self._write_all("assign", tf.cast(value, self.dtype), read_value=False,
                           scale=self._split_scale("assign"))


def saved_shares(variable: TowerLocalVariable) -> _wrapped.PerDevice:
  """A `PerDevice` of what each copy of the tower-local `variable` holds of the aggregate
  a SavedModel's one variable keeps: what reductions, `unwrap` and `gather` take as its
  copies while a SavedModel traces, so that they add up after loading as before."""
  return _wrapped.PerDevice({d: variable._saved_share(d) for d in variable.devices})


# One registration covers every distributed variable: TensorFlow then reads the
# component for the current context, so the read is visible to tf.GradientTape.
tf.register_tensor_conversion_function(DistributedVariable, _tf_internal.dense_var_to_tensor)
