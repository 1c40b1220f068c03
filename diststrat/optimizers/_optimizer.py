"""`Optimizer`: slot and non-slot state, gradients, and the hooks concrete optimizers fill."""

import contextlib
import threading

from typing import Any, Sequence

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _context
from diststrat import errors
from diststrat._arguments import as_tf_variable
from diststrat.errors import keeps_errors_in_tf_function
from diststrat.values import _wrapped


def state_owner(var):
  """The variable that owns optimizer state for `var`: a distributed variable for its copies."""
  var = as_tf_variable(var)
  container = _wrapped.container_of(var)  # Not `or`: a variable's truth is its value's.
  return var if container is None else container


def _local(value):
  """The component of a distributed state variable for the device being updated."""
  if isinstance(value, _wrapped.DistributedValues):
    device = _context.get_update_device()
    if device is not None and device in value:
      return value.get(device)
  return value


def check_global_step(global_step):
  """Raises `TypeError` unless `global_step` is None or a variable."""
  if global_step is not None:
    _arguments.check_variable("apply_gradients", global_step, name="global_step")


def _check_gradient(grad, var):
  """Raises unless every component of `grad` has `var`'s dtype and a compatible shape:
  TensorFlow's update ops would fail later, without naming the variable."""
  components = grad.values if isinstance(grad, _wrapped.DistributedValues) else (grad,)
  for component in components:
    if isinstance(component, tf.IndexedSlices):
      dtype, shape = component.values.dtype, None
    elif isinstance(component, (tf.Tensor, tf.Variable)):
      dtype, shape = component.dtype, component.shape
    else:
      continue  # A Python or numpy value: converted to the variable's dtype later.
    name = var.name.split(":")[0]
    if dtype.base_dtype != var.dtype.base_dtype:
      raise TypeError(
          f"apply_gradients() got a gradient of dtype {dtype.base_dtype.name} for variable "
          f"{name!r} of dtype {var.dtype.base_dtype.name}. Cast the gradient to the "
          "variable's dtype, or check that each gradient is paired with its own variable.")
    if shape is not None and not shape.is_compatible_with(var.shape):
      raise ValueError(
          f"apply_gradients() got a gradient of shape {_shape(shape)} for variable "
          f"{name!r} of shape {tuple(var.shape.as_list())}. Pair each gradient with its "
          "own variable: zip(grads, variables) with both lists in the same order.")


def _shape(shape):
  return tuple(shape.as_list()) if shape.rank is not None else "(unknown)"


class _State:
  """Slots and pending restores; a plain object so tf.Module does not track it as children.

  Slots reach checkpoints through get_slot_names()/get_slot(), linked to their variables.
  """

  def __init__(self):
    self.slots = {}             # slot name -> {id(variable): (variable, slot)}
    self.non_slot_names = []    # in creation order
    self.deferred_restores = {}  # (slot name, id(variable)) -> [checkpoint positions]
    # Thread id -> whether the last save that thread ran was a SavedModel's (see
    # Optimizer.__dir__): per thread, since a checkpoint saved meanwhile by another
    # thread must not change what this thread's SavedModel save sees.
    self.slots_as_children = {}


class Optimizer(tf.Module):
  """Base class of optimizers: state management and the update loop.

  A concrete optimizer fills the hooks under "Subclasses implement". Used on its own, it
  applies gradients directly; put `DistributedOptimizerMixin` first in the bases to make
  it distribution-aware.

  Args:
    name: the optimizer's name (used for its state variables).
    loss_reduction: "mean" (each tower's loss is a mean over its part of the global
      batch) or "sum"; decides how `compute_gradients` scales the loss with several
      towers.

  Example (a custom optimizer)::

      class SignSGD(diststrat.optimizers.DistributedOptimizerMixin,
                    diststrat.optimizers.Optimizer):
        def __init__(self, learning_rate):
          super().__init__("SignSGD")
          self._lr = learning_rate
        def _apply_dense(self, grad, var):
          return var.assign_sub(self._lr * tf.sign(grad))
        def _apply_sparse(self, grad, var):
          return var.scatter_sub(tf.IndexedSlices(self._lr * tf.sign(grad.values), grad.indices))
  """

  @keeps_errors_in_tf_function
  def __init__(self, name: str, loss_reduction: str = "mean") -> None:
    super().__init__(name=name)
    if loss_reduction not in ("mean", "sum"):
      raise ValueError("loss_reduction must be 'mean' or 'sum'. Received: "
                       f"loss_reduction={loss_reduction!r}")
    self._loss_reduction = loss_reduction
    self._state = _State()

  # ---------------------------------------------------------------------------------
  # Subclasses implement:
  # ---------------------------------------------------------------------------------

  def _create_slots(self, var_list):
    """Creates the slots of each variable with `_zeros_slot` (called before each apply)."""

  def _prepare(self):
    """Converts hyperparameters to tensors once per apply."""

  def _apply_dense(self, grad, var):
    """Returns the op that updates `var` (one component) with the dense `grad`."""
    raise NotImplementedError(f"{type(self).__name__} must implement _apply_dense()")

  def _apply_sparse(self, grad, var):
    """Returns the op that updates `var` with `grad`, a `tf.IndexedSlices`.

    `grad.indices` may repeat; `_deduplicate(grad)` sums repeated rows.
    """
    raise NotImplementedError(f"{type(self).__name__} must implement _apply_sparse()")

  def _finish(self, update_ops, name):
    """Runs once per non-slot device after the variable updates; returns an op."""
    del name
    return _group(update_ops)

  # ---------------------------------------------------------------------------------
  # Shared behaviour:
  # ---------------------------------------------------------------------------------

  def _loss_scale(self):
    return 1.0

  @keeps_errors_in_tf_function
  def compute_gradients(self, loss: Any, var_list: Sequence[Any] | None = None,
                        tape: tf.GradientTape | None = None) -> list[tuple[Any, Any]]:
    """Returns a list of (gradient, variable) pairs, without the None gradients.

    Args:
      loss: a callable returning the loss, or a loss tensor computed under `tape`.
      var_list: the variables to differentiate; default: the trainable variables the
        loss read.
      tape: the `tf.GradientTape` that recorded a tensor `loss`.
    """
    var_list = _arguments.check_variable_list("compute_gradients", var_list)
    if not callable(loss) and not isinstance(loss, (tf.Tensor, tf.Variable)):
      raise TypeError(
          "compute_gradients() takes loss, a callable that returns the loss (or a loss "
          "tensor computed under the tf.GradientTape passed as tape=). Received: "
          f"loss={_arguments.short_repr(loss)} ({type(loss).__name__}).")
    scale = self._loss_scale()
    if callable(loss):
      with tf.GradientTape(watch_accessed_variables=var_list is None) as tape:
        if var_list is not None:
          tape.watch([as_tf_variable(v) for v in var_list])
        loss_value = loss()
        if not _is_one(scale):
          loss_value = loss_value * tf.cast(scale, loss_value.dtype)
      if var_list is None:
        var_list = tape.watched_variables()
      grads = tape.gradient(loss_value, [as_tf_variable(v) for v in var_list])
    else:
      if tape is None:
        raise ValueError(
            "compute_gradients() got a loss tensor but no tape: pass the tf.GradientTape "
            "that computed it as tape=, or pass the loss as a callable.")
      if var_list is None:
        var_list = tape.watched_variables()
      grads = tape.gradient(loss, [as_tf_variable(v) for v in var_list])
      if not _is_one(scale):
        grads = [_scale(g, scale) for g in grads]
    # strict=False: as before for a var_list the caller gave as an iterator.
    return [(g, v) for g, v in zip(grads, var_list, strict=False) if g is not None]

  @keeps_errors_in_tf_function
  def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                      name: str | None = None) -> Any:
    """Applies gradients to variables; increments `global_step` by one if given.

    Returns:
      `global_step` if given, else None: values a `tf.function` can return (inside one,
      every update runs whether or not its result is used).
    """
    self._check_not_in_a_tower()
    pairs = self._check_pairs(grads_and_vars)
    check_global_step(global_step)
    var_list = [v for _, v in pairs]
    self._create_state(var_list, _context.get_distribution_strategy())
    self._prepare()
    update_ops = [self._apply_one(g, v) for g, v in pairs]
    finish = self._finish(update_ops, name or self.name)
    if global_step is not None:
      with control_dependencies([finish]):
        as_tf_variable(global_step).assign_add(tf.ones([], global_step.dtype))
    return global_step

  @keeps_errors_in_tf_function
  def build(self, var_list: Sequence[Any]) -> None:
    """Creates the optimizer's state (slots, non-slot variables) for `var_list` now.

    Optional: state is otherwise created on the first apply. Building first lets
    `tf.train.Checkpoint(...).restore(...).assert_consumed()` see every saved value.
    Call it where the variables were created (inside the strategy's scope).
    """
    var_list = _arguments.check_variable_list("build", var_list, required=True)
    self._create_state([as_tf_variable(v) for v in var_list],
                       _context.get_distribution_strategy())

  @keeps_errors_in_tf_function
  def minimize(self, loss: Any, var_list: Sequence[Any] | None = None, global_step: Any = None,
               name: str | None = None, tape: tf.GradientTape | None = None) -> Any:
    """`compute_gradients` then `apply_gradients`; returns what `apply_gradients` returns."""
    var_list = _arguments.check_variable_list("minimize", var_list)
    if var_list is not None and not var_list:
      raise ValueError(
          "minimize() got var_list=[], which names no variable to train. Pass the "
          "variables (such as model.trainable_variables, once the model is built), or leave "
          "var_list out to train every trainable variable the loss reads.")
    grads_and_vars = self.compute_gradients(loss, var_list=var_list, tape=tape)
    return self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

  def _check_not_in_a_tower(self):
    """Raises ContextError in a tower of a strategy: this class alone does not merge the
    towers (DistributedOptimizerMixin does), so each tower would write on its own."""
    tower = _context.get_tower_context()
    if tower is None or not _context.has_distribution_strategy():
      return
    name = type(self).__name__
    raise errors.ContextError(
        f"{name} {self.name!r} is not distribution-aware: its apply_gradients() was called "
        f"in tower {tower.tower_id} of {tower.distribution_strategy!r}, where every tower "
        "would update the variables on its own. Put DistributedOptimizerMixin first in "
        f"its bases (class {name}(diststrat.optimizers.DistributedOptimizerMixin, "
        "diststrat.optimizers.Optimizer)) so that the towers' gradients are summed and "
        "every copy is updated once, or apply gradients you reduced yourself in "
        "cross-tower context.")

  def _apply_one(self, grad, var):
    """`_apply_sparse` for an `IndexedSlices` gradient, else `_apply_dense`."""
    if isinstance(grad, tf.IndexedSlices):
      return self._apply_sparse(grad, var)
    return self._apply_dense(grad, var)

  def _check_pairs(self, grads_and_vars):
    pairs = []
    for item in grads_and_vars:
      if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError("apply_gradients() takes (gradient, variable) pairs. Received: "
                         f"{item!r}")
      grad, var = item
      if grad is None:
        continue
      var = as_tf_variable(var)
      if not isinstance(var, tf.Variable):
        raise ValueError(f"apply_gradients() needs variables; received {var!r} paired "
                         "with a gradient.")
      _check_gradient(grad, var)
      pairs.append((grad, var))
    if not pairs:
      raise ValueError("apply_gradients() got no gradients: every gradient is None. Check "
                       "that the loss depends on the variables.")
    return pairs

  # --- state: slots and non-slot variables ---

  def _create_state(self, var_list, strategy):
    """Creates missing state outside any tf.function graph, in `strategy`'s policy."""
    with tf.init_scope(), strategy._variable_creation_scope():
      self._create_slots([state_owner(v) for v in var_list])

  def _zeros_slot(self, var, slot_name, dtype=None):
    """Returns the slot `slot_name` of `var`, creating it (zeros, colocated) if missing:
    of `var`'s dtype, or of `dtype` if given."""
    dtype = dtype or var.dtype.base_dtype
    return self._get_or_make_slot(var, slot_name, lambda: tf.zeros(var.shape, dtype), dtype)

  def _get_or_make_slot(self, var, slot_name, initial_value, dtype=None):
    var = state_owner(var)
    named = self._state.slots.setdefault(slot_name, {})
    entry = named.get(id(var))
    if entry is not None:
      return entry[1]
    strategy = _context.get_distribution_strategy()
    var_name = var.name.split(":")[0]
    with tf.init_scope(), strategy._variable_creation_scope(), \
        strategy.colocate_vars_with(var):
      slot = tf.Variable(initial_value, name=f"{var_name}/{self.name}/{slot_name}",
                         trainable=False, dtype=dtype or var.dtype)
    named[id(var)] = (var, slot)
    for position in self._state.deferred_restores.pop((slot_name, id(var)), []):
      position.restore(slot)
    return slot

  def _non_slot_variable(self, name, initial_value, var_list):
    """Returns the non-slot variable `name`, creating it on `non_slot_devices(var_list)`."""
    existing = getattr(self, name, None)
    if existing is None:
      strategy = _context.get_distribution_strategy()
      with tf.init_scope(), strategy._variable_creation_scope():
        colocate = strategy.non_slot_devices(list(var_list))
        with strategy.colocate_vars_with(colocate):
          existing = tf.Variable(initial_value, name=f"{self.name}/{name}", trainable=False)
      setattr(self, name, existing)  # Tracked by name: checkpoints save and restore it.
      self._state.non_slot_names.append(name)
    return existing

  def _get_non_slot_variable(self, name):
    """The non-slot variable `name` (its copy on the update device inside an update)."""
    return _local(getattr(self, name))

  @tf.autograph.experimental.do_not_convert
  def get_slot(self, var: Any, name: str) -> Any:
    """The slot `name` of `var`, or None. Inside `update()`, the update device's copy."""
    entry = self._state.slots.get(name, {}).get(id(state_owner(var)))
    if entry is None:
      return None
    return _local(entry[1])

  def get_slot_names(self) -> list[str]:
    """The names of the slots this optimizer created, sorted."""
    return sorted(self._state.slots)

  # A SavedModel holds the slots as the optimizer's children, not as slots: TensorFlow's
  # loader rebuilds slots only for the optimizers it knows (a `tf.Module` holding this
  # optimizer saved, then failed to load: "'_UserObject' object has no attribute
  # 'add_slot'"). TensorFlow finds slots in objects whose dir() lists get_slot_names,
  # after it lists every object's children for the save (in the save's own context and
  # again, outside it, to write the SavedModel's checkpoint); so a SavedModel save
  # (children listed for "savedmodel") hides it from dir() in that thread until the
  # next save there lists them again.

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = super()._trackable_children(save_type, **kwargs)
    as_children = save_type == "savedmodel"
    self._state.slots_as_children[threading.get_ident()] = as_children
    if as_children:
      for name in sorted(self._state.slots):
        for i, (_, slot) in enumerate(self._state.slots[name].values()):
          children[f"{name}_slot_{i}"] = slot
    return children

  def __dir__(self):
    names = super().__dir__()
    state = vars(self).get("_state")  # None while __init__ runs.
    if state is not None and state.slots_as_children.get(threading.get_ident()):
      return [n for n in names if n != "get_slot_names"]
    return names

  def variables(self) -> list[Any]:
    """Every variable of the optimizer's state: slots, then non-slot variables."""
    result: list[Any] = []
    for name in sorted(self._state.slots):
      result.extend(slot for _, slot in self._state.slots[name].values())
    result.extend(getattr(self, n) for n in self._state.non_slot_names)
    return result

  def _create_or_restore_slot_variable(self, slot_variable_position, slot_name, variable,
                                       slot_variable_shape=None):
    """Called by tf.train.Checkpoint when it restores a slot of `variable`."""
    del slot_variable_shape
    var = state_owner(variable)
    entry = self._state.slots.get(slot_name, {}).get(id(var))
    if entry is None and tf.executing_eagerly():
      strategy = getattr(var, "distribution_strategy", None) or \
          _context.get_distribution_strategy()
      with strategy.scope() if strategy is not _context.get_distribution_strategy() else \
          contextlib.nullcontext():
        self._zeros_slot(var, slot_name)
      entry = self._state.slots[slot_name][id(var)]
    if entry is None:
      self._state.deferred_restores.setdefault((slot_name, id(var)), []).append(
          slot_variable_position)
      return None
    slot_variable_position.restore(entry[1])
    return entry[1]

  @staticmethod
  def _deduplicate(grad):
    """Sums the rows of an IndexedSlices that share an index."""
    unique, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def _is_one(scale):
  """True when `scale` is the number 1 (a tensor scale always applies)."""
  return isinstance(scale, (int, float)) and scale == 1.0


def _scale(grad, scale):
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                            grad.dense_shape)
  return grad * tf.cast(scale, grad.dtype)


def _group(ops):
  ops = [op for op in tf.nest.flatten(ops) if op is not None]
  if tf.executing_eagerly():
    return None
  return tf.group(*ops)


def control_dependencies(ops):
  ops = [op for op in tf.nest.flatten(ops) if op is not None]
  if tf.executing_eagerly() or not ops:
    return contextlib.nullcontext()
  return tf.control_dependencies(ops)
