"""The per-thread context stack: which strategy is in effect, and in which mode.

Code runs in exactly one of two modes, decided per thread by the top of a stack:

* **tower context**: model code for one tower. `get_tower_context()` gives its
  `TowerContext` and `get_cross_tower_context()` is None.
* **cross-tower context**: code that sees every tower at once (reductions, updates).
  `get_cross_tower_context()` gives the strategy and `get_tower_context()` is None.

A thread starts in the default tower context (tower 0 of 1, under the default strategy)::

    default tower context            (nothing entered)
      | with s.scope():
      v
    cross-tower context of s         (create variables, call reduce/update/...)
      | s.call_for_each_tower(fn)
      v
    tower context of s, in each tower's thread, tower_id 0..N-1
      | get_tower_context().merge_call(merge_fn)
      v
    cross-tower context of s         (merge_fn runs once, for all towers)
      | merge_fn returns: each tower gets its part and goes on in its tower context
      | fn returns: back to the cross-tower context of s; leaving scope(): the default

`merge_call` from the default tower context enters the default strategy's cross-tower
context. Contexts nest to any depth. Every push is paired with a pop in a `finally`.

Code above this module can follow the mode changes: `add_mode_listener(listener)`
registers a function that is called with each mode entered (in `enter_mode`, and when a
`ThreadState` is entered in another thread) and returns a context manager to hold while
that mode is current. The Keras support's mode listener
(diststrat/_keras/_mode_listener.py) uses this to keep TensorFlow's own idea of the
current strategy in step with ours.

`add_thread_state_carrier(capture)` registers state of another library that a thread
running the calling thread's code (a tower) should share: `capture()` runs when a
`ThreadState` is made, in the calling thread, and returns a function that gives the
context manager the other thread holds while it runs with that state. The Keras support
carries Keras's global seed generator this way (diststrat/_keras/_thread_globals.py).
"""

import contextlib
import functools
import inspect
import numbers
import threading
import types
import typing

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _devices
from diststrat import _integrations
from diststrat import _tf_internal
from diststrat import errors

if typing.TYPE_CHECKING:  # _strategy imports this module: no import at run time.
  from diststrat._strategy import DistributionStrategy

_state = threading.local()


class _Mode(typing.NamedTuple):
  strategy: typing.Any
  tower_context: typing.Any  # None means cross-tower context of `strategy`.


def _stack():
  stack = getattr(_state, "stack", None)
  if stack is None:
    stack = _state.stack = []
  return stack


_default: list[typing.Any] = []  # The default strategy, once registered.


def set_default_strategy(strategy):
  """Registers the strategy in effect when none is entered (strategies/_default.py does,
  when imported)."""
  _default[:] = [strategy]


def default_strategy():
  """The default strategy (see `set_default_strategy`).

  Registered when `diststrat.strategies` is imported. A program may import only some
  submodules (`from diststrat.values import Mirrored`), and `import diststrat` loads its
  names lazily, so neither imports it for sure: the first need does, through the loader
  the package registered (`_integrations.load_default_strategy`).
  """
  if not _default:
    _integrations.load_default_strategy()
  if not _default:  # pragma: no cover - the package always registers the loader.
    raise RuntimeError("diststrat's default strategy is not registered: import "
                       "diststrat.strategies before using diststrat's contexts.")
  return _default[0]


def _default_mode():
  return _Mode(default_strategy(), default_tower_context())


def current_mode():
  stack = _stack()
  return stack[-1] if stack else _default_mode()


_mode_listeners: list[typing.Callable[[typing.Any, typing.Any], typing.Any]] = []


def add_mode_listener(listener):
  """Calls `listener(strategy, tower_context)` whenever this module enters a mode.

  `listener` returns a context manager (or None), entered for as long as that mode is
  the current one (in this thread); `tower_context` None means the cross-tower context
  of `strategy`. Registering the same listener twice registers it once.
  """
  if listener not in _mode_listeners:
    _mode_listeners.append(listener)


_thread_state_carriers: list[typing.Callable[[], typing.Any]] = []


def add_thread_state_carrier(capture):
  """Carries more of a thread's state into the threads that take it (`ThreadState`).

  `capture()` is called in the thread a `ThreadState` is made in; it returns a function
  called in the thread that enters that state, after its diststrat context is set, with
  the `slot` given to `enter` (a tower's index among the towers of its call, or None),
  which
  returns a context manager (or None) held while that thread runs with the state.
  Registering the same function twice registers it once.
  """
  if capture not in _thread_state_carriers:
    _thread_state_carriers.append(capture)


@contextlib.contextmanager
def _announced(mode):
  """Enters what the listeners return for `mode`, for the body's duration."""
  with contextlib.ExitStack() as stack:
    for listener in _mode_listeners:
      manager = listener(mode.strategy, mode.tower_context)
      if manager is not None:
        stack.enter_context(manager)
    yield


def in_default_context():
  """True when nothing is entered in this thread: the default tower context."""
  return current_mode().tower_context is default_tower_context()


@contextlib.contextmanager
def enter_mode(strategy, tower_context=None):
  """Pushes (strategy, tower_context) on this thread's stack for the body's duration."""
  _integrations.install_pending()  # The Keras support, however diststrat was imported.
  entry = _Mode(strategy, tower_context)
  stack = _stack()
  stack.append(entry)
  try:
    with _announced(entry):
      yield
  finally:
    # Remove our own entry even if an inner context forgot to pop its own.
    for i in range(len(stack) - 1, -1, -1):
      if stack[i] is entry:
        del stack[i:]
        break


def cross_tower_mode(strategy):
  """Context manager: the cross-tower context of `strategy`."""
  return enter_mode(strategy, None)


def get_tower_context() -> typing.Optional["TowerContext"]:
  """Returns the current `TowerContext`, or None in a cross-tower context.

  Outside of any strategy this is the default tower context (tower 0 of 1).

  Example:
    >>> import diststrat as ds
    >>> ds.get_tower_context().tower_id
    0
  """
  return current_mode().tower_context


def get_cross_tower_context() -> typing.Optional["DistributionStrategy"]:
  """Returns the strategy whose cross-tower context this is, or None in a tower context.

  Example:
    >>> import diststrat as ds
    >>> ds.get_cross_tower_context() is None
    True
  """
  mode = current_mode()
  return mode.strategy if mode.tower_context is None else None


def get_distribution_strategy() -> "DistributionStrategy":
  """Returns the strategy in effect: the one entered, else the default strategy.

  Example:
    >>> import diststrat as ds
    >>> type(ds.get_distribution_strategy()).__name__
    'DefaultStrategy'
  """
  return current_mode().strategy


def has_distribution_strategy() -> bool:
  """True when a strategy other than the default one is in effect."""
  return current_mode().strategy is not default_strategy()


def is_default_strategy(strategy):
  """True when `strategy` is the default strategy (the one in effect outside any scope)."""
  return strategy is default_strategy()


# --- the device being updated inside update() / update_non_slot() ---


def get_update_device() -> typing.Optional[str]:
  """The device whose copy `update()`/`update_non_slot()` is writing, else None."""
  stack = getattr(_state, "update_devices", None)
  return stack[-1] if stack else None


@contextlib.contextmanager
def update_device_scope(device):
  stack = getattr(_state, "update_devices", None)
  if stack is None:
    stack = _state.update_devices = []
  stack.append(device)
  try:
    yield
  finally:
    stack.pop()


# --- the variables new variables are colocated with (colocate_vars_with) ---


def colocation_target(strategy):
  """The variable of the innermost `colocate_vars_with()` of `strategy` in this thread's
  context (carried into tower threads), or None."""
  for owner, var in reversed(getattr(_state, "colocations", None) or []):
    if owner is strategy:
      return var
  return None


@contextlib.contextmanager
def colocation_scope(strategy, var):
  """Context manager: `strategy`'s new variables are colocated with `var` in the body."""
  stack = getattr(_state, "colocations", None)
  if stack is None:
    stack = _state.colocations = []
  stack.append((strategy, var))
  try:
    yield
  finally:
    stack.pop()


def _is_int(value):
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class TowerContext:
  """The context of one tower: its id, the tower count, and `merge_call`.

  Model code gets it with `get_tower_context()`. Outside of any strategy, that is the
  default tower context (tower 0 of 1), whose `merge_call` enters the default
  strategy's cross-tower context.

  Example:
    >>> import diststrat as ds
    >>> def fn():
    ...   ctx = ds.get_tower_context()
    ...   return ctx.merge_call(lambda strategy, x: x + 1, ctx.tower_id)
    >>> fn()
    1
  """

  def __init__(self, distribution_strategy: typing.Any, tower_id: typing.Any,
               num_towers: int = 1, device: typing.Optional[str] = None,
               batch_share: typing.Any = None) -> None:
    if not _is_int(num_towers) or num_towers < 1:
      raise ValueError(
          "TowerContext(distribution_strategy, tower_id, num_towers, device) takes the "
          "number of towers of the call as num_towers, an integer >= 1. Received: "
          f"num_towers={num_towers!r}."
          + (" Pass the device by name: TowerContext(strategy, tower_id, num_towers, "
             "device=device)." if isinstance(num_towers, str) else ""))
    if not _is_int(tower_id) or not 0 <= tower_id < num_towers:
      raise ValueError(
          f"TowerContext takes tower_id, an integer from 0 to num_towers - 1 "
          f"({num_towers - 1}). Received: tower_id={tower_id!r}.")
    self._strategy = distribution_strategy
    self._tower_id = int(tower_id)
    self._num_towers = int(num_towers)
    self._device = _devices.canonicalize(device) if device else None
    self._batch_share = batch_share

  @property
  def distribution_strategy(self) -> "DistributionStrategy":
    return self._strategy

  @property
  def tower_id(self) -> int:
    return self._tower_id

  @property
  def num_towers(self) -> int:
    return self._num_towers

  @property
  def is_single_tower(self) -> bool:
    return self._num_towers == 1

  @property
  def batch_share(self) -> typing.Any:
    """This tower's fraction of the global batch it was given a part of, or None.

    When `call_for_each_tower` gets a batch split by `distribute_dataset` (or by Keras's
    `fit` under diststrat), tower i's share is n_i / B: its examples over the batch's.
    It is a float, or a float32 scalar tensor when the sizes are known only at run time.
    Weighting each tower's mean loss by it makes the summed gradients equal to one
    device's even when B does not divide evenly; diststrat's optimizers and Keras's
    losses do so. None when no split batch was given (each tower then weighs
    `1 / num_towers`).

    Example:
      >>> import diststrat as ds, tensorflow as tf
      >>> s = ds.MirroredStrategy(["/cpu:0", "/cpu:1"])
      >>> with s.scope():
      ...   data = s.distribute_dataset(lambda: tf.data.Dataset.range(3).batch(3))
      ...   shares = s.call_for_each_tower(
      ...       lambda x: ds.get_tower_context().batch_share, next(iter(data)))
      >>> [round(float(v), 3) for v in shares.values]
      [0.667, 0.333]
    """
    return self._batch_share

  @property
  def step_cache(self) -> typing.Any:
    """State the strategy keeps for the `call_for_each_tower` call this tower runs in,
    such as `ParameterServerStrategy`'s read cache; None when there is none."""
    return None

  @property
  def device(self) -> str | None:
    """The tower's device (for the default tower context: the current device scope)."""
    if self._device is None:
      return _devices.current_device()
    return self._device

  @errors.keeps_errors_in_tf_function
  def merge_call(self, merge_fn: typing.Callable[..., typing.Any], *args: typing.Any,
                 **kwargs: typing.Any) -> typing.Any:
    """Runs `merge_fn(strategy, *args, **kwargs)` once, in cross-tower context.

    Every tower pauses here. `merge_fn` sees each argument as the towers' values
    regrouped (a `PerDevice` where they differ), and each tower gets back its own part
    of the result.

    Args:
      merge_fn: called as `merge_fn(distribution_strategy, *merged_args, **merged_kwargs)`.
      *args: this tower's positional arguments to merge.
      **kwargs: this tower's keyword arguments to merge.

    Returns:
      This tower's part of `merge_fn`'s result.

    Raises:
      RuntimeError: this `TowerContext` is not the current one of this thread.
    """
    if get_tower_context() is None:
      raise errors.ContextError(
          "merge_call() needs a tower context: it pauses the towers that "
          "call_for_each_tower runs. It was called on the TowerContext of tower "
          f"{self._tower_id} of {self._strategy!r} in {describe_current_context()}, "
          "where there are no towers to pause (and get_tower_context() is None). Call "
          "merge_call() from the function you pass to strategy.call_for_each_tower(fn), "
          "or, in cross-tower code, call merge_fn(strategy, *args) directly.")
    if get_tower_context() is not self:
      raise errors.ContextError(
          f"merge_call() was called on the TowerContext of tower {self._tower_id} "
          f"of {self._strategy!r} from outside that tower (the current context is "
          f"{describe_current_context()}). Call merge_call() on "
          "get_tower_context() from inside the tower's own function.")
    if not callable(merge_fn):
      raise TypeError("merge_call() takes a callable as merge_fn, called as "
                      "merge_fn(strategy, *args, **kwargs). Received: "
                      f"merge_fn={merge_fn!r} ({type(merge_fn).__name__})")
    _arguments.check_runs_when_called("merge_call", "merge_fn", merge_fn,
                                      "in the towers, not in cross-tower context")
    _check_not_tf_distribute_form(merge_fn, args, kwargs)
    return self._merge_call(merge_fn, args, kwargs)

  def _merge_call(self, merge_fn, args, kwargs):
    """Runs merge_fn in this thread. Strategies with several towers override this."""
    with cross_tower_mode(self._strategy):
      return merge_fn(self._strategy, *args, **kwargs)

  def __repr__(self):
    return (f"TowerContext(tower_id={self._tower_id}, num_towers={self._num_towers}, "
            f"strategy={self._strategy!r})")


def _check_not_tf_distribute_form(merge_fn, args, kwargs):
  """Raises `TypeError` for tf.distribute's `merge_call(merge_fn, args=..., kwargs=...)`
  when `merge_fn` takes no such keywords: it would fail, called with `args=` as a
  keyword, with Python's "unexpected keyword argument 'args'" and no word of the cause."""
  given = [k for k in ("args", "kwargs") if k in kwargs]
  if not given:
    return
  try:
    inspect.signature(merge_fn).bind(None, *args, **kwargs)
    return  # merge_fn takes them: its own keywords.
  except ValueError:  # No signature to read.
    return
  except TypeError:
    pass
  name = getattr(merge_fn, "__name__", None) or type(merge_fn).__name__
  raise TypeError(
      f"merge_call() calls merge_fn(strategy, *args, **kwargs) with its arguments as they "
      f"are, but merge_fn={name} takes no keyword argument {given[0]!r}: "
      "merge_call(merge_fn, args=(...), kwargs={...}) is the form of tf.distribute's "
      "ReplicaContext.merge_call. Pass the arguments themselves: "
      "get_tower_context().merge_call(merge_fn, *args, **kwargs).")


def same_merge_fn(a, b):
  """Whether two merge_fns are the same function: equal, or closures of one `def`.

  Each tower runs the same code, so a function defined inside the tower function is a
  new object in every tower; it is still the same function if its code is. So is a
  `functools.partial` made in every tower: the same if it wraps the same function and
  binds as many positional arguments and the same keywords (like a closure's captured
  values, the bound values may differ: tower 0's merge_fn runs), except that functions
  it binds must be the same functions (a wrapper bound to each tower's merge_fn).
  """
  if a is b or a == b:
    return True
  if isinstance(a, functools.partial) and isinstance(b, functools.partial):
    return (len(a.args) == len(b.args) and a.keywords.keys() == b.keywords.keys()
            and same_merge_fn(a.func, b.func)
            and all(same_merge_fn(x, y) for x, y in zip(a.args, b.args, strict=True)
                    if isinstance(x, types.FunctionType)))
  self_a, self_b = getattr(a, "__self__", None), getattr(b, "__self__", None)
  if self_a is not self_b:
    return False
  code_a = getattr(getattr(a, "__func__", a), "__code__", None)
  code_b = getattr(getattr(b, "__func__", b), "__code__", None)
  return code_a is not None and code_a is code_b


class WrappedMergeFn:
  """Base of a wrapper that diststrat puts around a tower's merge_fn on its way to
  `merge_call` (the tf.distribute bridge's, a GPipe stage's).

  It holds the tower's own merge_fn as `tower_merge_fn`, which errors name. Two
  wrappers of one class are equal when their merge_fns are the same (`same_merge_fn`),
  so the check that every tower passes the same merge_fn compares what they passed.
  """

  def __init__(self, merge_fn):
    self.tower_merge_fn = merge_fn
    self.__name__ = getattr(merge_fn, "__name__", type(merge_fn).__name__)

  def __eq__(self, other):
    return type(other) is type(self) and same_merge_fn(self.tower_merge_fn,
                                                       other.tower_merge_fn)

  def __hash__(self):
    return hash(getattr(self.tower_merge_fn, "__code__", None))


_DEFAULT_TOWER_CONTEXT = None
_DEFAULT_LOCK = threading.Lock()


def default_tower_context():
  global _DEFAULT_TOWER_CONTEXT
  if _DEFAULT_TOWER_CONTEXT is None:
    with _DEFAULT_LOCK:
      if _DEFAULT_TOWER_CONTEXT is None:
        _DEFAULT_TOWER_CONTEXT = TowerContext(default_strategy(), 0, 1)
  return _DEFAULT_TOWER_CONTEXT


def describe_current_context():
  """A phrase naming the current context, for error messages."""
  mode = current_mode()
  if mode.tower_context is default_tower_context():
    return "the default tower context (no strategy entered)"
  if mode.tower_context is not None:
    return f"the tower context of tower {mode.tower_context.tower_id} of {mode.strategy!r}"
  return f"the cross-tower context of {mode.strategy!r}"


class ThreadState:
  """This thread's diststrat and TensorFlow state, to carry into another thread.

  Made in one thread, entered in another (`with state.enter():`): the other thread then
  runs in the same diststrat context (strategy, tower or cross-tower, update device,
  `colocate_vars_with`) and
  with the same TensorFlow state: graph (so it can add to a `tf.function` being traced),
  name scope, variable creator stack, control dependencies, device scope, op callbacks
  (`tf.debugging.enable_check_numerics()` and the like: the same list, as
  tf.distribute's replica threads share it), and the
  context of a SavedModel save tracing its functions, plus what the registered carriers
  carry (`add_thread_state_carrier`: Keras's global seed generator). Tower
  threads and the cluster watchdog's helper thread start from one.
  """

  def __init__(self):
    self.eager = tf.executing_eagerly()
    self.graph = tf.compat.v1.get_default_graph()
    self.name_scope = tf.get_current_name_scope()
    self.creator_stack = _tf_internal.variable_creator_stack()
    self.control_inputs = _tf_internal.current_control_dependencies()
    self.device = _tf_internal.current_device()
    self.modes = list(_stack())
    self.update_devices = list(getattr(_state, "update_devices", None) or [])
    self.colocations = list(getattr(_state, "colocations", None) or [])
    self.save_options = _tf_internal.saved_model_trace_options()
    self.op_callbacks = _tf_internal.op_callbacks()
    self.carried = [capture() for capture in _thread_state_carriers]

  @contextlib.contextmanager
  def enter(self, device=None, slot=None):
    """Runs the body with this state; `device`, if given, replaces the device scope.

    `slot` says which of the threads that take this state this one is (a tower's index
    in its call), for the carriers that keep state per slot; None (a helper thread that
    runs the calling thread's code for it) shares the calling thread's own.
    """
    with contextlib.ExitStack() as stack:
      if not self.eager:
        stack.enter_context(self.graph.as_default())
      saved_creators = _tf_internal.variable_creator_stack()
      _tf_internal.set_variable_creator_stack(self.creator_stack)
      stack.callback(_tf_internal.set_variable_creator_stack, saved_creators)
      if self.control_inputs:
        stack.enter_context(self.graph.control_dependencies(self.control_inputs))
      if self.name_scope:
        stack.enter_context(tf.name_scope(self.name_scope + "/"))
      if device or self.device:
        stack.enter_context(tf.device(device or self.device))
      if self.save_options is not None and not _tf_internal.in_saved_model_trace():
        stack.enter_context(_tf_internal.saved_model_trace(self.save_options))
      saved_callbacks = _tf_internal.op_callbacks()
      _tf_internal.set_op_callbacks(self.op_callbacks)
      stack.callback(_tf_internal.set_op_callbacks, saved_callbacks)
      saved_modes, saved_updates = list(_stack()), getattr(_state, "update_devices", None)
      saved_colocations = getattr(_state, "colocations", None)
      _state.stack = list(self.modes)
      _state.update_devices = list(self.update_devices)
      _state.colocations = list(self.colocations)

      def restore():
        _state.stack = saved_modes
        _state.update_devices = saved_updates
        _state.colocations = saved_colocations

      stack.callback(restore)
      if self.modes:
        stack.enter_context(_announced(self.modes[-1]))
      for carried in self.carried:
        manager = carried(slot)
        if manager is not None:
          stack.enter_context(manager)
      yield
