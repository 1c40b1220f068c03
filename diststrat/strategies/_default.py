"""`DefaultStrategy`: what is in effect when no strategy is entered."""

import threading

from diststrat._tf import tf
from diststrat import _context
from diststrat import _devices
from diststrat import _input
from diststrat import errors
from diststrat._strategy import DistributionStrategy
from diststrat.strategies import _tower_threads
from diststrat.values import _variables

_LOCK = threading.Lock()
_INSTANCE = None


def _owner_of(var):
  """The strategy that made `var` (a mirrored or tower-local variable of a strategy other
  than the default one), or None (a plain variable)."""
  if isinstance(var, _variables.DistributedVariable):
    strategy = var.distribution_strategy
    if strategy is not None and not isinstance(strategy, DefaultStrategy):
      return strategy
  return None


class DefaultStrategy(DistributionStrategy):
  """One tower, wherever the current `tf.device` scope puts it; reductions are identities.

  There is one instance: `DefaultStrategy()` always returns it, and it is what
  `get_distribution_strategy()` gives outside of any scope. Code written against the
  strategy API therefore also runs with no strategy at all.

  Example:
    >>> import diststrat as ds
    >>> s = ds.DefaultStrategy()
    >>> s is ds.get_distribution_strategy(), s.num_towers
    (True, 1)
    >>> s.reduce("sum", 3.0)
    3.0
  """

  def __new__(cls):
    global _INSTANCE
    if _INSTANCE is None:
      with _LOCK:
        if _INSTANCE is None:
          instance = super().__new__(cls)
          DistributionStrategy.__init__(instance)
          _INSTANCE = instance
    return _INSTANCE

  def __init__(self) -> None:  # pylint: disable=super-init-not-called
    pass  # The singleton was initialized once, in __new__.

  def _scope_context_managers(self):
    return []  # Variables are created as TensorFlow creates them.

  def _create_variable(self, next_creator, kwargs, colocate_with):
    if colocate_with is None:
      return next_creator(**kwargs)
    with tf.device(colocate_with.device):
      return next_creator(**kwargs)

  def _colocate_vars_with(self, var):
    return tf.device(var.device)

  def _call_for_each_tower(self, fn, args, kwargs):
    if not tf.executing_eagerly():
      fn = _tower_threads.autograph_tower_fn(fn)
    with self._tower_scope(_context.TowerContext(self, 0, 1)):
      return fn(*args, **kwargs)

  def _default_destinations(self):
    return None  # No devices of its own: results stay where they are.

  def _reduce(self, aggregation, value, destinations):
    del aggregation, destinations  # One tower: nothing to combine.
    return value

  def _broadcast(self, tensor, destinations):
    del destinations
    return tensor

  def _update(self, var, fn, args, kwargs):
    owner = _owner_of(var)
    if owner is not None:
      # Another strategy's copies: its update writes each (colocated with the first
      # copy alone, `fn` would write only that one: a mirrored variable's copies would
      # differ, and a tower-local one's other copies would keep their old values).
      return owner.update(var, fn, *args, **kwargs)
    return self._run_colocated(var, fn, (var,) + tuple(args), kwargs)

  def _update_non_slot(self, colocate_with, fn, args, kwargs):
    return self._run_colocated(colocate_with, fn, args, kwargs)

  def _run_colocated(self, var, fn, args, kwargs):
    device = getattr(var, "device", None) or None
    if device is None:
      with _context.update_device_scope(None):
        return fn(*args, **kwargs)
    with tf.device(device), _context.update_device_scope(_devices.canonicalize(device)):
      return fn(*args, **kwargs)

  def _non_slot_devices(self, var_list):
    return min(var_list, key=lambda v: v.name)

  def _read_var(self, v):
    return tf.identity(v)

  def _distribute_dataset(self, dataset_fn):
    return _input.PerDeviceDataset(dataset_fn(), devices=None)

  def _num_towers(self):
    return 1

  def _worker_devices(self):
    raise errors.ContextError(
        "The default strategy has no worker devices: it runs wherever the current "
        "tf.device() scope puts it. Use MirroredStrategy or ParameterServerStrategy to "
        "run on a given list of devices.")

  def _parameter_devices(self):
    raise errors.ContextError(
        "The default strategy has no parameter devices: variables live wherever the "
        "current tf.device() scope puts them. Use MirroredStrategy or "
        "ParameterServerStrategy to place variables on given devices.")

  def _worker_device_index(self):
    return 0


def default_strategy():
  """The default strategy (a singleton)."""
  return DefaultStrategy()


# The context module asks for the default strategy whenever nothing is entered.
_context.set_default_strategy(DefaultStrategy())
