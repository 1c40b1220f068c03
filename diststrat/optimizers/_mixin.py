"""`DistributedOptimizerMixin`: the cross-tower half of training with an optimizer."""

from typing import TYPE_CHECKING, Any

from diststrat._tf import tf
from diststrat import _context
from diststrat import errors
from diststrat.errors import keeps_errors_in_tf_function
from diststrat.optimizers import _optimizer
from diststrat.values import _wrapped

# The mixin goes before `Optimizer` in a subclass's bases; the type checker reads it as
# an `Optimizer` subclass, so that it knows what `super()` and `self` have.
if TYPE_CHECKING:
  _MixinBase = _optimizer.Optimizer
else:
  _MixinBase = object


def _strategy_of(grads_and_vars):
  """The strategy whose distributed variables `grads_and_vars` trains, or None for plain
  variables. Items that are not (gradient, variable) pairs are left to the check of the
  path taken, which raises for them.

  Raises:
    ValueError: the variables belong to several strategies.
  """
  owners = []
  for item in grads_and_vars:
    if not isinstance(item, (tuple, list)) or len(item) != 2 or item[0] is None:
      continue
    owner = _optimizer.state_owner(item[1])
    strategy = getattr(owner, "distribution_strategy", None) \
        if isinstance(owner, _wrapped.DistributedValues) else None
    if strategy is not None and all(strategy is not o for o in owners):
      owners.append(strategy)
  if len(owners) > 1:
    raise ValueError(
        "apply_gradients() updates the variables of one strategy at a time. Received: "
        f"variables of {owners[0]!r} and of {owners[1]!r}. Apply each strategy's "
        "gradients in its own towers (strategy.call_for_each_tower).")
  return owners[0] if owners else None


class DistributedOptimizerMixin(_MixinBase):
  """Makes an `Optimizer` subclass distribution-aware. Put it first in the bases.

  Model code in each tower calls `compute_gradients` and `apply_gradients` as on one
  device; `apply_gradients` then `merge_call`s `_distributed_apply`, which sums the
  towers' gradients onto each variable, updates every copy, runs `_finish` on the
  non-slot devices, and increments `global_step` once.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> s = ds.MirroredStrategy(["/cpu:0"])
    >>> with s.scope():
    ...   w = tf.Variable(1.0)
    ...   opt = ds.optimizers.GradientDescent(0.5)
    ...   _ = s.call_for_each_tower(lambda: opt.minimize(lambda: w * 2.0, var_list=[w]))
    >>> float(w.numpy())
    0.0
  """

  def _loss_scale(self):
    """1/num_towers for a "mean" loss; the tower's share n_i/B of a split batch if known.

    With the share, a batch whose size the towers do not divide (a ragged last batch)
    still gives one device's gradient: each tower's mean loss weighs by its examples.
    """
    if self._loss_reduction != "mean":
      return 1.0
    tower = _context.get_tower_context()
    if tower is not None and tower.batch_share is not None:
      return tower.batch_share
    num_towers = tower.num_towers if tower is not None else \
        _context.get_distribution_strategy().num_towers
    return 1.0 / num_towers

  @keeps_errors_in_tf_function
  def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                      name: str | None = None) -> Any:
    """From a tower: merges the towers' gradients and applies them (see the class doc).

    Outside any scope it applies them directly; variables a strategy created (mirrored
    ones) are updated through that strategy, every copy with the same value.

    Returns:
      `global_step` if given (incremented once per step), else None: values a
      `tf.function` can return.
    """
    grads_and_vars = list(grads_and_vars)
    if not _context.has_distribution_strategy():
      owner = _strategy_of(grads_and_vars)
      if owner is None:
        return super().apply_gradients(grads_and_vars, global_step=global_step, name=name)
      # Variables of a strategy, outside its scope: each gradient is one value for every
      # copy (written directly, only the first copy would change) and the state is the
      # strategy's, as in its scope.
      with owner.scope():
        return self._distributed_apply(owner, grads_and_vars, global_step, name)
    tower = _context.get_tower_context()
    if tower is None:
      raise errors.ContextError(
          "apply_gradients() was called in the cross-tower context of "
          f"{_context.get_distribution_strategy()!r}; it must be called from a tower "
          "(inside call_for_each_tower). In cross-tower context, call "
          "optimizer._distributed_apply(strategy, grads_and_vars) with per-tower gradients.")
    self._check_pairs(grads_and_vars)  # In the tower, where the mistake was made.
    _optimizer.check_global_step(global_step)
    return tower.merge_call(self._distributed_apply, grads_and_vars, global_step, name)

  @tf.autograph.experimental.do_not_convert
  def _distributed_apply(self, distribution, grads_and_vars, global_step=None, name=None):
    """Sums per-tower gradients onto each variable and updates every copy of it."""
    pairs = self._check_pairs(grads_and_vars)
    pairs = [(g, _optimizer.state_owner(v)) for g, v in pairs]
    var_list = [v for _, v in pairs]
    reduced = distribution.batch_reduce("sum", [(g, v) for g, v in pairs])
    self._create_state(var_list, distribution)
    self._prepare()
    updates = [distribution.update(v, lambda component, grad: self._apply_one(grad, component), g)
               for g, (_, v) in zip(reduced, pairs, strict=True)]
    non_slot = distribution.non_slot_devices(var_list)
    # One op that runs every copy's update (none in eager mode): a group per variable
    # would add a no-op per device and variable to the step's graph, and `_finish` runs
    # on every non-slot device. The group's root sits on the first of them, where
    # `_finish` waits for it (unplaced, it would land on the caller's device: with
    # parameter servers, a control edge to the worker and back).
    with tf.device(_wrapped.devices_of(non_slot)[0]):
      update_ops = [op for op in [distribution.group(updates)] if op is not None]
    finish = distribution.update_non_slot(non_slot, self._finish, update_ops, name or self.name)
    if global_step is not None:
      deps = [c for leaf in tf.nest.flatten(finish) for c in distribution.unwrap(leaf)]
      with _optimizer.control_dependencies(deps):
        distribution.update(global_step, lambda step: step.assign_add(
            tf.ones([], step.dtype), read_value=False))
    return global_step
