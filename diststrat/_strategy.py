"""`DistributionStrategy`: the base class every strategy fills in.

Each public method validates its arguments and the context it is called in, then calls
an underscored hook. A new strategy is a subclass that implements the hooks listed under
"Subclasses implement"; everything under "Shared behaviour" comes for free. See
docs/write_your_own_strategy.md for a complete example.
"""

import contextlib
import threading
from typing import Any, Callable, Sequence, Union

import wrapt

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _context
from diststrat import _input
from diststrat import _tf_internal
from diststrat import errors
from diststrat._arguments import as_tf_variable
from diststrat._arguments import canonical_aggregation
from diststrat.values import _variables
from diststrat.values import _wrapped

AggregationArgument = Union[str, tf.VariableAggregation]
""""sum", "mean", or `tf.VariableAggregation.SUM`/`MEAN`: what the public methods take."""
Destinations = Any
"""None, a device string or a list of them, a variable, or a wrapped value."""

_towers_entered_lock = threading.Lock()

# Functions `hook(strategy)` called whenever a variable is created in a strategy's scope,
# before the strategy creates it (`add_variable_creation_hook`).
_variable_creation_hooks: list[Callable[[Any], None]] = []


def add_variable_creation_hook(hook):
  """Registers `hook(strategy)`, called when a variable is being created in the scope of
  `strategy`, before the strategy's `_create_variable` (so from inside the code creating
  it). A library above the core (the Keras support) uses it to learn which of its
  objects are made in a strategy's scope. Registering a hook twice registers it once."""
  if hook not in _variable_creation_hooks:
    _variable_creation_hooks.append(hook)


def _needs_cross_tower(wrapped, instance, args, kwargs):
  with instance._cross_tower_guard(wrapped.__name__):
    try:
      return wrapped(*args, **kwargs)
    except Exception as e:
      # Inside a tf.function, AutoGraph would rebuild it with "in user code:" in front,
      # without its notes, or as a StagingError. Marked here, the one place for every
      # strategy, an argument check or an error of the functions the method ran (a
      # tower's, a merge_fn's, with the notes saying where) keeps its type and text.
      _tf_internal.pass_through_autograph(e)
      raise


def cross_tower_method(method):
  # AutoGraph must call library methods as they are (it warns on wrapt wrappers and
  # would convert our internals); do_not_convert marks the function, and the wrapt
  # wrapper exposes that mark.
  return wrapt.decorator(_needs_cross_tower)(tf.autograph.experimental.do_not_convert(method))


cross_tower_method.__doc__ = """Decorator for strategy methods that run in the strategy's cross-tower context.

It keeps the method's signature and docstring (wrapt), and raises a `ContextError`
naming the fix when the method is called from a tower context or from another strategy's
scope. From the default context (no strategy entered) the method enters the strategy's
scope for its duration.
"""


class _StrategyScope:
  """What `scope()` returns: enters the cross-tower context of a strategy.

  One object may be entered again while it is entered (nested, or in another thread):
  each `__enter__` pushes what its `__exit__` undoes on a stack of this thread's.
  """

  def __init__(self, strategy):
    self._strategy = strategy
    self._local = threading.local()

  def _exit_stacks(self):
    stacks = getattr(self._local, "exit_stacks", None)
    if stacks is None:
      stacks = self._local.exit_stacks = []
    return stacks

  def __enter__(self):
    strategy = self._strategy
    mode = _context.current_mode()
    if mode.strategy is strategy and not _context.in_default_context():
      # Already in this strategy's cross-tower (or tower) context: nothing to do.
      self._exit_stacks().append(None)
      return strategy
    if _context.has_distribution_strategy():
      raise errors.ContextError(
          f"Cannot enter the scope of {strategy!r} inside {_context.describe_current_context()}: "
          f"strategies do not mix. Leave the scope of {mode.strategy!r} first, or use only "
          "one strategy.")
    stack = contextlib.ExitStack()
    try:
      stack.enter_context(_context.cross_tower_mode(strategy))
      for manager in strategy._scope_context_managers():
        stack.enter_context(manager)
    except BaseException:
      stack.close()
      raise
    self._exit_stacks().append(stack)
    return strategy

  def __exit__(self, exc_type, exc, tb):
    stack = self._exit_stacks().pop()
    if stack is not None:
      # The exception, if any, goes through the managers entered (mode listeners may
      # explain it); it is never suppressed.
      stack.__exit__(exc_type, exc, tb)
    return False


def _updated_devices(where):
  """The devices an update of `where` (a variable, wrapped value or devices) runs on: all
  of them; only the first while `tf.saved_model.save` traces, since it saves one
  variable for all the copies (diststrat/values/_variables.py)."""
  devices = _wrapped.devices_of(where)
  return devices[:1] if _tf_internal.in_saved_model_trace() else devices


def _as_saved(value):
  """`value`, with each tower-local variable in it taken as the shares its copies hold in
  a SavedModel's one variable while the save traces (`_variables.saved_shares`):
  a reduction or `unwrap` of one then adds up after loading as it did before."""
  if not _tf_internal.in_saved_model_trace():
    return value

  def view(leaf):
    if isinstance(leaf, _variables.TowerLocalVariable):
      return _variables.saved_shares(leaf)
    return leaf

  if _wrapped.is_structure(value):
    return _wrapped.pack_as(value, [view(leaf) for leaf in _wrapped.flatten(value)])
  return view(value)


def _check_update_values(method, args, kwargs, var=None):
  """Raises `ValueError` if an argument of `update`/`update_non_slot` is per-tower.

  They take values mirrored over the devices they update: a `PerDevice` would give
  each copy of a variable its own tower's value, and the copies would differ.
  """
  for leaf in _wrapped.flatten((args, kwargs)):
    if isinstance(leaf, _wrapped.PerDevice):
      # A tower-local variable's copies differ on purpose: each tower writes its own.
      towers_way = (" A tower-local variable's copies are written one per tower in the "
                    "towers: strategy.call_for_each_tower(lambda x: var.assign(x), value)."
                    if isinstance(var, _variables.TowerLocalVariable) else "")
      raise ValueError(
          f"{method}() takes values mirrored over the devices it updates (each copy of "
          "the variable is written with the same value), not one value per tower. "
          f"Received: a PerDevice over {list(leaf.devices)}. Combine the towers' values "
          "first: strategy.reduce('sum' or 'mean', value, destinations=var) gives one "
          f"value on every device holding var.{towers_way}")


def _broadcast_leaf(leaf):
  """`leaf`, checked for `broadcast` (a wrapped value is refused by its `_broadcast`)."""
  if isinstance(leaf, _wrapped.DistributedValues):
    return leaf
  return _arguments.check_broadcast_leaf(leaf)


def _names_devices(var):
  """Whether `colocate_vars_with` can place variables by `var`: a variable, a wrapped
  value, or devices (what `non_slot_devices` returns)."""
  return (isinstance(as_tf_variable(var), (tf.Variable, _wrapped.DistributedValues)) or
          isinstance(var, (str, tf.DeviceSpec, tf.Tensor)) or
          (isinstance(var, (list, tuple)) and bool(var) and
           all(isinstance(d, (str, tf.DeviceSpec)) for d in var)))


def _missing_copy(method, devices, device, error):
  """The `ValueError` of an update whose wrapped argument has no copy on `device`."""
  return ValueError(
      f"{method}() takes values mirrored over the devices it updates {list(devices)}. "
      f"Received: a Mirrored with no copy on {device} ({error}). Reduce or broadcast "
      "the value onto the variable: strategy.reduce(..., destinations=var) or "
      "strategy.broadcast(value, destinations=var).")


def _static_rank(component):
  shape = getattr(component, "shape", None)
  if shape is None:
    return 0 if isinstance(component, (int, float, complex)) else None
  try:
    return tf.TensorShape(shape).rank
  except (TypeError, ValueError):
    return None


def _check_gather_axis(axis, components):
  """Raises `ValueError` unless `axis` is an axis of the gathered components' rank.

  Scalars are stacked into a vector, which has axis 0 (or -1). Unknown ranks pass: the
  concatenation then checks at run time.
  """
  ranks = [_static_rank(c) for c in components]
  if not ranks or any(r is None for r in ranks):
    return
  rank = max(max(ranks), 1)  # Scalars become a vector.
  shapes = [tf.TensorShape(getattr(c, "shape", ())) for c in components]
  if not -rank <= axis < rank:
    raise ValueError(
        f"gather() concatenates along an axis of the towers' values, which have rank "
        f"{max(ranks)} (shapes {', '.join(str(s) for s in shapes[:4])}"
        f"{', ...' if len(components) > 4 else ''}): axis "
        f"must be from {-rank} to {rank - 1}. Received: axis={axis}. Pass an axis the "
        "values have (axis=0 concatenates the towers' batches).")
  if max(ranks) == 0:
    return  # Scalars are stacked.
  other = [s[:axis % rank].concatenate(s[axis % rank + 1:]) if s.rank == rank else None
           for s in shapes]
  if any(o is None or not o.is_compatible_with(other[0]) for o in other):
    raise ValueError(
        f"gather() concatenates the towers' values along axis {axis}, so their other "
        f"dimensions must agree. Received: shapes "
        f"{', '.join(str(tuple(s.as_list())) for s in shapes[:4])}"
        f"{', ...' if len(shapes) > 4 else ''}. Make every tower return values of one "
        "shape but along axis, or gather along "
        f"{_differing_axis(shapes, rank) or 'the axis where they differ'}.")


def _differing_axis(shapes, rank):
  """`axis=i` when the shapes (of one rank) differ along exactly one axis i, else None."""
  if any(s.rank != rank for s in shapes):
    return None
  differ = [i for i in range(rank)
            if len({s[i] for s in shapes if s[i] is not None}) > 1]
  return f"axis={differ[0]}" if len(differ) == 1 else None


class DistributionStrategy:
  """Runs model code on several devices: the base class of every strategy.

  Use a strategy by entering its scope, creating variables, and running the model
  function once per tower::

      strategy = diststrat.MirroredStrategy()
      with strategy.scope():
        v = tf.Variable(1.0)                        # one copy per device
        per_tower = strategy.call_for_each_tower(lambda: v * 2.0)
        total = strategy.reduce("sum", per_tower)   # mirrored over the devices

  To write a strategy, subclass this and implement the hooks (methods whose names
  start with an underscore) listed under "Subclasses implement" below.
  """

  def __init__(self) -> None:
    self._local = threading.local()

  # ---------------------------------------------------------------------------------
  # Shared behaviour: context checks and argument checks, then a hook.
  # ---------------------------------------------------------------------------------

  def scope(self) -> contextlib.AbstractContextManager:
    """Returns a context manager: the cross-tower context of this strategy.

    Variables created inside are made by this strategy's policy (mirrored copies for
    `MirroredStrategy`). Entering it again inside itself does nothing; entering another
    strategy's scope inside it raises `RuntimeError`.

    Example:
      >>> import diststrat as ds
      >>> s = ds.DefaultStrategy()
      >>> with s.scope():
      ...   ds.get_cross_tower_context() is s
      True
    """
    return _StrategyScope(self)

  @cross_tower_method
  def call_for_each_tower(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs `fn(*args, **kwargs)` once per tower, each in that tower's context.

    Wrapped arguments (`PerDevice`, `Mirrored`, distributed variables) are unwrapped:
    tower i gets component i. Inside `fn`, `get_tower_context()` is the tower's context.

    Returns:
      The towers' results regrouped (see `diststrat.values.regroup`).
    """
    _arguments.check_callable("call_for_each_tower", "fn", fn)
    _arguments.check_runs_when_called("call_for_each_tower", "fn", fn,
                                      "outside the towers (no tower context)")
    entered = self._towers_entered()
    try:
      result = self._call_for_each_tower(fn, args, kwargs)
    except Exception as e:
      if self._towers_entered() == entered:  # The likely cause of what fn raised.
        errors.add_note(e, f"(note: {self._no_tower_message()})")
      raise
    if self._towers_entered() == entered:
      raise errors.ContextError(self._no_tower_message())
    return result

  @cross_tower_method
  def reduce(self, aggregation: AggregationArgument, value: Any,
             destinations: Destinations = None) -> Any:
    """Combines a per-tower value (or a nested structure of them) across towers.

    Args:
      aggregation: "sum", "mean", or `tf.VariableAggregation.SUM`/`MEAN`.
      value: a `PerDevice` (or a plain tensor, taken as one value), or a dict, list,
        tuple or namedtuple of them (nested to any depth); a structure's leaves are
        reduced together, as by `batch_reduce`.
      destinations: None (the worker devices), a device string or a list of them, or
        a variable (the devices holding it).

    Returns:
      The result mirrored over `destinations`; for a structure, the same structure
      with each leaf reduced.

    Example:
      >>> import diststrat as ds, tensorflow as tf
      >>> s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
      >>> def tower_fn():
      ...   tower_id = tf.constant(float(ds.get_tower_context().tower_id))
      ...   return {"n": tf.ones([]), "ids": [tower_id, 10.0 * tower_id]}
      >>> with s.scope():
      ...   total = s.reduce("sum", s.call_for_each_tower(tower_fn))
      >>> float(total["n"].primary), [float(v.primary) for v in total["ids"]]
      (2.0, [1.0, 10.0])
    """
    aggregation = canonical_aggregation(aggregation)
    destinations = _wrapped.resolve_destinations(destinations, self._default_destinations)
    value = _as_saved(value)
    if not _wrapped.is_structure(value):
      _arguments.check_reducible("reduce", value, _wrapped.DistributedValues)
      self._check_per_tower_devices("reduce", value)
      return self._reduce(aggregation, value, destinations)
    leaves = _wrapped.flatten(value)
    for leaf in leaves:
      _arguments.check_reducible("reduce", leaf, _wrapped.DistributedValues)
    self._check_per_tower_devices("reduce", leaves)
    reduced = self._batch_reduce(aggregation, [(leaf, destinations) for leaf in leaves]) \
        if leaves else []
    return _wrapped.pack_as(value, reduced)

  @cross_tower_method
  def batch_reduce(self, aggregation: AggregationArgument,
                   value_destination_pairs: Sequence[tuple[Any, Destinations]]) -> list[Any]:
    """Like `reduce` for each (value, destinations) pair, done together (faster).

    A pair's value may be a nested structure, as in `reduce`; its result then has the
    same structure.
    """
    aggregation = canonical_aggregation(aggregation)
    values: list[tuple[Any, int]] = []
    pairs: list[tuple[Any, Any]] = []
    for pair in _arguments.check_value_destination_pairs("batch_reduce",
                                                        value_destination_pairs):
      destinations = _wrapped.resolve_destinations(pair[1], self._default_destinations)
      pair = (_as_saved(pair[0]), pair[1])
      leaves = _wrapped.flatten(pair[0]) if _wrapped.is_structure(pair[0]) else [pair[0]]
      for leaf in leaves:
        _arguments.check_reducible("batch_reduce", leaf, _wrapped.DistributedValues)
      self._check_per_tower_devices("batch_reduce", leaves)
      values.append((pair[0], len(leaves)))
      pairs.extend((leaf, destinations) for leaf in leaves)
    reduced = self._batch_reduce(aggregation, pairs) if pairs else []
    results, start = [], 0
    for value, count in values:
      part = reduced[start:start + count]
      start += count
      results.append(_wrapped.pack_as(value, part) if _wrapped.is_structure(value)
                     else part[0])
    return results

  @cross_tower_method
  def broadcast(self, tensor: Any, destinations: Destinations = None) -> Any:
    """Copies `tensor` to `destinations` (default: the worker devices): a mirrored value.

    `tensor` may be a dict, list, tuple or namedtuple of tensors (nested to any depth),
    as in `reduce`: each leaf is copied, and the result has the same structure.
    """
    destinations = _wrapped.resolve_destinations(destinations, self._default_destinations)
    if not _wrapped.is_structure(tensor):
      return self._broadcast(_broadcast_leaf(tensor), destinations)
    return _wrapped.pack_as(tensor, [self._broadcast(_broadcast_leaf(leaf), destinations)
                                     for leaf in _wrapped.flatten(tensor)])

  @cross_tower_method
  def update(self, var: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs `fn(component, *args, **kwargs)` on each device that holds `var`.

    Wrapped arguments are unwrapped to the component on the device being updated, and
    `get_update_device()` names that device while `fn` runs.

    Returns:
      The results regrouped, with locality V(var).
    """
    var = _arguments.check_variable("update", var)
    _arguments.check_callable("update", "fn", fn)
    _check_update_values("update", args, kwargs, var)
    return self._update(var, fn, args, kwargs)

  @cross_tower_method
  def update_non_slot(self, colocate_with: Any, fn: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    """Runs `fn(*args, **kwargs)` on each of the non-slot devices `colocate_with`.

    Args:
      colocate_with: the result of `non_slot_devices(var_list)`.
    """
    _arguments.check_callable("update_non_slot", "fn", fn)
    _check_update_values("update_non_slot", args, kwargs)
    return self._update_non_slot(colocate_with, fn, args, kwargs)

  @errors.keeps_errors_in_tf_function
  def non_slot_devices(self, var_list: Sequence[Any]) -> Any:
    """A consistent choice of devices for variables that belong to no one variable."""
    var_list = [as_tf_variable(v) for v in
                _arguments.check_variable_list("non_slot_devices", var_list, required=True)]
    if not var_list:
      raise ValueError("non_slot_devices() needs at least one variable. Received: var_list=[]")
    return self._non_slot_devices(var_list)

  @errors.keeps_errors_in_tf_function
  def colocate_vars_with(self, var: Any) -> contextlib.AbstractContextManager:
    """Context manager: variables created inside it live where `var` lives.

    Must be used inside `scope()`.
    """
    if not _names_devices(var):
      # None would be ignored (the variables would go where they always go); anything
      # else failed only when a variable was created, naming "destinations".
      _arguments.check_variable("colocate_vars_with", var)
    if _context.get_distribution_strategy() is not self and not self._is_default():
      raise errors.ContextError(
          f"colocate_vars_with() of {self!r} must be used inside its scope(), but the "
          f"current context is {_context.describe_current_context()}. Wrap the code in "
          "`with strategy.scope():`.")
    return self._colocate_vars_with(as_tf_variable(var))

  @cross_tower_method
  def read_var(self, v: Any) -> Any:
    """The value of variable `v`; a tower-local variable gives its aggregated value."""
    return self._read_var(_arguments.check_variable("read_var", v, name="v"))

  @cross_tower_method
  def unwrap(self, value: Any) -> list[Any]:
    """The per-device components of `value`, as a list (`[value]` for a plain value)."""
    return self._unwrap(_as_saved(as_tf_variable(value)))

  @cross_tower_method
  def group(self, value: Any, name: str | None = None) -> Any:
    """One op that runs every component of `value` (a no-op in eager mode).

    Components that run nothing (None, Python and numpy values, strings) are left out,
    so the result of a tower function that returns some may be grouped.
    """
    components = []
    for leaf in tf.nest.flatten(value, expand_composites=False):
      for component in self._unwrap(as_tf_variable(leaf)):
        component = as_tf_variable(component)
        if isinstance(component, tf.Operation) or tf.is_tensor(component):
          components.append(component)
    if tf.executing_eagerly():
      return None
    return tf.group(*components, name=name)

  @cross_tower_method
  def distribute_dataset(self, dataset_fn: Callable[[], Any]) -> _input.PerDeviceDataset:
    """Splits each global batch of `dataset_fn()` into per-tower batches."""
    if isinstance(dataset_fn, tf.data.Dataset):
      raise TypeError(
          "distribute_dataset() takes a function returning the tf.data.Dataset of global "
          "batches, not the dataset itself: pass `lambda: dataset`. Received: "
          f"dataset_fn={_arguments.short_repr(dataset_fn)}")
    _arguments.check_callable("distribute_dataset", "dataset_fn", dataset_fn)
    _arguments.check_called_without_arguments(
        "distribute_dataset", "dataset_fn", dataset_fn,
        " It returns the dataset of global batches, which diststrat splits across the "
        "towers (a function taking a tf.distribute.InputContext, as for tf.distribute's "
        "distribute_datasets_from_function, returns each worker's batches instead): "
        "build the dataset of global batches in a function of no arguments.")
    return self._distribute_dataset(dataset_fn)

  @cross_tower_method
  def gather(self, value: Any, axis: int = 0, destinations: Destinations = None) -> Any:
    """Concatenates the towers' values along `axis`, in tower order.

    The result lives on the first worker device, or is mirrored to `destinations`.
    Scalars, which have no axis to concatenate, are stacked into a vector.
    `value` may be a dict, list, tuple or namedtuple of per-tower values (nested to any
    depth): each leaf is gathered, and the result has the same structure.
    """
    axis = _arguments.check_int("axis", axis)
    destinations = _wrapped.resolve_destinations(destinations, default=None)  # No copy.
    value = _as_saved(value)
    if not _wrapped.is_structure(value):
      value = self._in_tower_order(value)
      _check_gather_axis(axis, self._unwrap(as_tf_variable(value)))
      return self._gather(value, axis, destinations)
    leaves = [self._in_tower_order(leaf) for leaf in _wrapped.flatten(value)]
    for leaf in leaves:
      _check_gather_axis(axis, self._unwrap(as_tf_variable(leaf)))
    return _wrapped.pack_as(value, [self._gather(leaf, axis, destinations)
                                    for leaf in leaves])

  @property
  def num_towers(self) -> int:
    return self._num_towers()

  @property
  def is_single_tower(self) -> bool:
    return self._num_towers() == 1

  @property
  def worker_devices(self) -> tuple[str, ...]:
    """The devices the towers run on, in tower order."""
    return self._worker_devices()

  @property
  def parameter_devices(self) -> tuple[str, ...]:
    """The devices variables live on."""
    return self._parameter_devices()

  @property
  def worker_device_index(self) -> Any:
    """A wrapped value that gives each tower its index into `worker_devices`."""
    with self._cross_tower_guard("worker_device_index"):
      return self._worker_device_index()

  def __repr__(self):
    return f"{type(self).__name__}()"

  # --- helpers shared by the public methods and by subclasses ---

  def _is_default(self):
    return self is _context.default_strategy()

  def _in_tower_order(self, value):
    """`value`, with its components in tower order if it has one on each worker device.

    A wrapped value keeps the order it was built in, which need not be the towers'.
    """
    if self._is_default() or not isinstance(value, (_wrapped.PerDevice, _wrapped.Mirrored)):
      return value
    workers = self._worker_devices()
    if value.devices == workers or set(value.devices) != set(workers):
      return value
    wrap = _wrapped.Mirrored if isinstance(value, _wrapped.Mirrored) else _wrapped.PerDevice
    return wrap({device: value.get(device) for device in workers})

  def _check_per_tower_devices(self, method, value):
    """Raises `ValueError` if a `PerDevice` in `value` is not over the towers' devices."""
    if self._is_default():
      return  # One tower, wherever the caller runs: any value is its value.
    try:
      towers = self._worker_devices()
    except NotImplementedError:
      return  # A strategy that names no devices cannot be checked.
    leaf = _wrapped.per_device_off(value, towers)
    if leaf is not None:
      raise ValueError(
          f"{method}() of {self!r} got a PerDevice over {list(leaf.devices)}, but its "
          f"towers are on {list(towers)}. A per-tower value has one component per tower, "
          "on the towers' devices: reduce what this strategy's call_for_each_tower "
          "returned (a value of another strategy is reduced by that strategy).")

  def _cross_tower_guard(self, method_name):
    """Returns a context manager in which `method_name` may run, or raises."""
    mode = _context.current_mode()
    if mode.tower_context is None and mode.strategy is self:
      return contextlib.nullcontext()
    default = _context.default_strategy()
    in_default_context = _context.in_default_context()
    if in_default_context and self is default:
      return _context.cross_tower_mode(self)  # The default strategy's own context.
    if mode.tower_context is not None and not in_default_context and (
        mode.strategy is self or mode.strategy is default):
      raise errors.ContextError(
          f"{type(self).__name__}.{method_name}() needs the cross-tower context, but it "
          f"was called in {_context.describe_current_context()}. Use "
          "get_tower_context().merge_call(merge_fn, ...) and call "
          f"{method_name}() from merge_fn, which runs in the cross-tower context.")
    if mode.strategy is default:
      return self.scope()  # From the default context, a strategy's method enters its scope.
    if self is default:  # Its scope cannot be entered here: "its own scope()" is no fix.
      raise errors.ContextError(
          f"DefaultStrategy.{method_name}() was called in "
          f"{_context.describe_current_context()}, where {mode.strategy!r} is in effect: "
          "strategies do not mix, and the default strategy runs only where no strategy "
          "is entered. Call the method of the strategy in effect, "
          "ds.get_distribution_strategy(), where the code runs (not a strategy kept "
          "from outside the scope), or call it outside the scope.")
    raise errors.ContextError(
        f"{type(self).__name__}.{method_name}() of {self!r} was called in "
        f"{_context.describe_current_context()}: strategies do not mix. Call it "
        "inside its own scope().")

  def _colocation_target(self):
    """The variable given to the innermost `colocate_vars_with()` of this strategy in
    this thread's context (tower threads get their caller's), or None."""
    return _context.colocation_target(self)

  def _push_colocation(self, var):
    return _context.colocation_scope(self, var)

  def _tower_scope(self, tower_context):
    """Context manager for subclasses: run the body as the tower of `tower_context`."""
    with _towers_entered_lock:  # Counted first: a bad context is not "no tower".
      self.__dict__["_towers_entered_count"] = self._towers_entered() + 1
    if tower_context.distribution_strategy is not self or \
        tower_context.num_towers != self._num_towers():
      raise ValueError(
          f"{type(self).__name__}._tower_scope() takes this strategy's TowerContext for "
          f"one of its {self._num_towers()} towers (_num_towers()): "
          "ds.TowerContext(self, tower_id, num_towers, device). Received: "
          f"{tower_context!r}. Pass self and the tower count: diststrat's optimizers "
          "and Keras's losses weigh each tower by 1/num_towers.")
    return _context.enter_mode(self, tower_context)

  def _towers_entered(self):
    """How many towers `_tower_scope` has run, in any thread: `call_for_each_tower`
    checks that its hook ran at least one."""
    return self.__dict__.get("_towers_entered_count", 0)

  def _no_tower_message(self):
    name = type(self).__name__
    return (f"{name}._call_for_each_tower() ran no tower: it must run fn inside "
            "`with tf.device(device), self._tower_scope(ds.TowerContext(self, tower_id, "
            "num_towers, device)):`, once per tower, so that get_tower_context() and "
            "merge_call() work in fn (docs/write_your_own_strategy.md).")

  def _capture_thread_state(self):
    """For a strategy that runs its towers in threads: what a tower's thread must share
    with the thread that called `call_for_each_tower`, captured in that calling thread.

    Returns an object whose `enter(device=None, slot=None)` is a context manager, entered
    in the tower's thread (around `_tower_scope`): the body then runs with the caller's
    graph (a `tf.function` being traced), name scope, variable creators (so variables the
    tower creates go through `_create_variable`), control dependencies, device scope
    (`device` replaces it), op callbacks, diststrat context (this strategy's cross-tower
    context, `colocate_vars_with`) and Keras's per-thread state (its seed generator,
    dtype policy and layer name counters; `slot` is the tower's index: tower 0 counts
    names in the caller's counters, the others in a copy, so every tower names the
    layers it creates alike). One captured state serves every tower of one call.
    """
    return _context.ThreadState()

  def _variable_creation_scope(self):
    """Context manager in which tf.Variable() follows this strategy's policy.

    `scope()` installs the strategy's variable creator on the graph that is current when
    it is entered; code that creates variables under `tf.init_scope()` (optimizer
    state) may be on another graph, so this installs the creator there if missing.
    """
    managers = self._scope_context_managers()
    if not managers or any(getattr(c, "__self__", None) is self and
                           getattr(c, "__name__", "") == "_variable_creator"
                           for c in _tf_internal.variable_creators()):
      return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for manager in managers:
      stack.enter_context(manager)
    return stack

  def _variable_creator(self, next_creator, **kwargs):
    try:
      return self._checked_create_variable(next_creator, kwargs)
    except Exception as e:
      # Reached through tf.Variable() from the user's code: inside a tf.function,
      # AutoGraph would rewrite it ("in user code:" in front), as _needs_cross_tower says.
      _tf_internal.pass_through_autograph(e)
      raise

  def _checked_create_variable(self, next_creator, kwargs):
    for hook in _variable_creation_hooks:
      hook(self)
    variable = self._create_variable(next_creator, kwargs, self._colocation_target())
    if not isinstance(variable, tf.Variable):
      # TensorFlow would go on with it, and fail with a bare NotImplementedError (for
      # None) or far from here.
      raise TypeError(
          f"{type(self).__name__}._create_variable() must return the variable it created "
          "(a tf.Variable, or a distributed variable such as "
          "diststrat.values.MirroredVariable). Received: "
          f"{_arguments.short_repr(variable)} ({type(variable).__name__}) for the "
          f"variable {_arguments.variable_name(kwargs)!r}. Return what "
          "next_creator(**kwargs) gives (or the distributed variable wrapping the copies "
          "it made).")
    if _variables.created_by(variable) is None:
      # A plain variable made by this strategy's policy (a strategy that keeps one copy,
      # as docs/write_your_own_strategy.md's example does): code checking where a
      # variable comes from (a Keras model's) then knows it is this strategy's.
      _variables.mark_created_by(variable, self)
    return variable

  def _run_on_devices(self, devices, fn, args, kwargs, first_arg=None):
    """Runs `fn` once per device with the update device set; regroups the results.

    `first_arg`, if given, is a wrapped value whose component on each device becomes
    fn's first argument (the variable in `update`).
    """
    method = "update" if first_arg is not None else "update_non_slot"
    results = []
    for device in devices:
      with tf.device(device), _context.update_device_scope(device):
        try:
          call_args = _wrapped.select_device(device, args)
          call_kwargs = _wrapped.select_device(device, kwargs)
        except ValueError as e:
          raise _missing_copy(method, devices, device, e) from e
        if first_arg is not None:
          call_args = (_wrapped.select_device(device, first_arg),) + tuple(call_args)
        results.append(fn(*call_args, **call_kwargs))
    return _wrapped.regroup(results, devices, wrap_class=_wrapped.Mirrored)

  # ---------------------------------------------------------------------------------
  # Subclasses implement:
  # ---------------------------------------------------------------------------------

  def _scope_context_managers(self):
    """Context managers entered with `scope()` (default: this strategy's variable creator)."""
    return [tf.variable_creator_scope(self._variable_creator)]

  def _create_variable(self, next_creator, kwargs, colocate_with):
    """Creates a variable by this strategy's policy. `next_creator(**kwargs)` makes one."""
    raise NotImplementedError(f"{type(self).__name__} must implement _create_variable()")

  def _colocate_vars_with(self, var):
    return self._push_colocation(var)

  def _call_for_each_tower(self, fn, args, kwargs):
    raise NotImplementedError(f"{type(self).__name__} must implement _call_for_each_tower()")

  def _get_cross_tower_ops(self):
    """The `CrossTowerOps` that does `_reduce`, `_batch_reduce` and `_broadcast`, or None.

    A strategy that returns one gets those three hooks for free. One that returns None
    (the default) implements `_reduce` and `_broadcast` itself; `_batch_reduce` then
    reduces the pairs one at a time through `_reduce`.
    """
    return None

  def _default_destinations(self):
    """Where `reduce`, `batch_reduce` and `broadcast` put their result when the caller
    names no destinations: the worker devices.

    The public methods resolve `destinations=None` to this before they call a hook
    (`values._wrapped.resolve_destinations`), so hooks never see None there.
    """
    return self._worker_devices()

  def _reduce(self, aggregation, value, destinations):
    return self._required_cross_tower_ops("_reduce").reduce(aggregation, value, destinations)

  def _batch_reduce(self, aggregation, value_destination_pairs):
    ops = self._get_cross_tower_ops()
    if ops is None:
      return [self._reduce(aggregation, value, destinations)
              for value, destinations in value_destination_pairs]
    return ops.batch_reduce(aggregation, value_destination_pairs)

  def _broadcast(self, tensor, destinations):
    return self._required_cross_tower_ops("_broadcast").broadcast(tensor, destinations)

  def _required_cross_tower_ops(self, hook):
    ops = self._get_cross_tower_ops()
    if ops is None:
      raise NotImplementedError(
          f"{type(self).__name__} must implement {hook}(), or _get_cross_tower_ops() to "
          "have it done by a CrossTowerOps.")
    return ops

  def _update(self, var, fn, args, kwargs):
    """Default: `fn` once on each device holding `var` (each copy, or its one device)."""
    return self._run_on_devices(_updated_devices(var), fn, args, kwargs, first_arg=var)

  def _update_non_slot(self, colocate_with, fn, args, kwargs):
    """Default: `fn` once on each device `colocate_with` names."""
    return self._run_on_devices(_updated_devices(colocate_with), fn, args, kwargs)

  def _non_slot_devices(self, var_list):
    raise NotImplementedError(f"{type(self).__name__} must implement _non_slot_devices()")

  def _read_var(self, v):
    raise NotImplementedError(f"{type(self).__name__} must implement _read_var()")

  def _unwrap(self, value):
    if isinstance(value, _wrapped.DistributedValues):
      return list(value.values)
    return [value]

  def _distribute_dataset(self, dataset_fn):
    first_tower, num_towers = self._batch_split()
    return _input.PerDeviceDataset(dataset_fn(), self._worker_devices(),
                                   first_tower=first_tower, num_towers=num_towers)

  def _num_processes(self):
    """How many processes share this strategy's variables, each with its own copies.

    1 unless the strategy's processes train together, each holding copies of every
    variable (MultiWorkerMirroredStrategy: its worker count). A `TowerLocalVariable` has
    this many times its local copies.
    """
    return 1

  def _sum_across_processes(self, tensor):
    """`tensor`, summed over the `_num_processes()` processes (each passes its own).

    A collective when there are several: every process must call it, in the same order.
    """
    return tensor

  def _first_tower_value(self, value):
    """The component of the per-tower `value` that tower 0 (of every process) gave: what
    a variable with aggregation ONLY_FIRST_REPLICA is written with.

    A collective when tower 0 is in another process: every process must call it.
    """
    return self._unwrap(value)[0]

  def _batch_split(self):
    """(first_tower, num_towers): this process's towers' share of every global batch.

    Each global batch is split into `num_towers` parts and this process's towers take
    the `len(worker_devices)` parts from `first_tower` on. One process: (0, its tower
    count). A strategy whose processes train on one global batch together (one per
    step, as MultiWorkerMirroredStrategy's) returns its towers' place among all of them.
    """
    return 0, len(self._worker_devices())

  def _gather(self, value, axis, destinations):
    components = self._unwrap(value)
    if len(components) == 1:
      gathered = components[0]
    else:
      with tf.device(self._worker_devices()[0]):
        # Python numbers and numpy values too (a numpy shape is a tuple).
        components = [c if isinstance(c, (tf.Tensor, tf.Variable)) else tf.convert_to_tensor(c)
                      for c in components]
        if all(c.shape.rank == 0 for c in components):
          gathered = tf.stack(components)
        else:
          gathered = tf.concat(components, axis=axis)
    if destinations is None:
      return gathered
    return self._broadcast(gathered, destinations)

  def _num_towers(self):
    raise NotImplementedError(f"{type(self).__name__} must implement _num_towers()")

  def _worker_devices(self):
    raise NotImplementedError(f"{type(self).__name__} must implement _worker_devices()")

  def _parameter_devices(self):
    raise NotImplementedError(f"{type(self).__name__} must implement _parameter_devices()")

  def _worker_device_index(self):
    devices = self._worker_devices()
    return _wrapped.PerDevice({d: i for i, d in enumerate(devices)})
