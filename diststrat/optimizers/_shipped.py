"""The optimizers diststrat ships: plain SGD, momentum (optionally Nesterov), and Adam."""

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from diststrat._tf import tf
from diststrat import _arguments
from diststrat.errors import keeps_errors_in_tf_function
from diststrat.optimizers._mixin import DistributedOptimizerMixin
from diststrat.optimizers._optimizer import Optimizer


def _hyperparameter(optimizer, name, value):
  """`value` if it can be a hyperparameter: a number, a scalar tensor or variable, or a
  callable returning one (a schedule); else a TypeError naming it, at construction
  (it failed at the first apply, in TensorFlow's cast)."""
  numeric = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
  if numeric or callable(value) or isinstance(value, (tf.Tensor, tf.Variable)):
    return value
  raise TypeError(
      f"{optimizer}({name}=...) takes a number, a scalar tensor or variable, or a "
      f"callable that returns one (a schedule). Received: {value!r} "
      f"({type(value).__name__}).")


def _check_trainable_dtype(optimizer, method, var):
  """Raises `TypeError` unless `var` is floating-point or complex: the update kernels have
  no integer version, and TensorFlow's error ("No OpKernel was registered ...") names
  neither the variable nor the fix."""
  dtype = var.dtype.base_dtype
  if not (dtype.is_floating or dtype.is_complex):
    raise TypeError(
        f"{optimizer}.{method}() got variable {var.name.split(':')[0]!r} of dtype "
        f"{dtype.name}, which it cannot train: its update needs a floating-point or complex "
        "variable. Leave the variable out of var_list (a counter or other state: create "
        "it with trainable=False), or make it a float variable.")


def _math_dtype(var):
  """The dtype an optimizer keeps `var`'s state and computes its update in: float32 for
  a float16 or bfloat16 variable (their rounding breaks the formulas), else its own."""
  dtype = var.dtype.base_dtype
  return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _in_dtype(value, dtype):
  """`value` as a tensor of `dtype`; a number converts exactly (tf.cast(0.1, tf.float64)
  goes through float32: 0.10000000149...)."""
  if isinstance(value, (int, float, np.number)):
    return tf.constant(value, dtype)
  return tf.cast(value, dtype)


# Read by the type checker as an `Optimizer` subclass (it comes first in the bases), so
# that it knows what `super()` has.
if TYPE_CHECKING:
  _HyperBase = Optimizer
else:
  _HyperBase = object


class _HyperMixin(_HyperBase):
  """Converts hyperparameters to tensors once per apply, per dtype (not per variable);
  refuses variables the update kernels cannot train (integers, booleans)."""

  def _check_pairs(self, grads_and_vars):
    pairs = super()._check_pairs(grads_and_vars)
    for _, var in pairs:
      _check_trainable_dtype(type(self).__name__, "apply_gradients", var)
    return pairs

  @keeps_errors_in_tf_function
  def build(self, var_list: Sequence[Any]) -> None:
    """Creates the optimizer's state for `var_list` now (see `Optimizer.build`)."""
    var_list = _arguments.check_variable_list("build", var_list, required=True)
    for var in var_list:
      _check_trainable_dtype(type(self).__name__, "build", _arguments.as_tf_variable(var))
    super().build(var_list)

  def _hyper_value(self, name):
    """The hyperparameter `name` as given, or what its callable returns now."""
    value = getattr(self, "_" + name)
    return value() if callable(value) else value

  def _prepare(self):
    self._state.hyper_cache = {}  # Plain state: tf.Module must not track these tensors.

  def _hyper(self, name, dtype):
    key = (name, dtype)
    cache = getattr(self._state, "hyper_cache", None)
    if cache is None:
      cache = self._state.hyper_cache = {}
    if key not in cache:
      cache[key] = _in_dtype(self._hyper_value(name), dtype)
    return cache[key]


class GradientDescent(_HyperMixin, DistributedOptimizerMixin, Optimizer):
  """`var -= learning_rate * grad`.

  Example:
    >>> import diststrat as ds, tensorflow as tf
    >>> v = tf.Variable(1.0)
    >>> _ = ds.optimizers.GradientDescent(0.1).apply_gradients([(tf.constant(2.0), v)])
    >>> round(float(v.numpy()), 6)
    0.8
  """

  @keeps_errors_in_tf_function
  def __init__(self, learning_rate: Any, loss_reduction: str = "mean",
               name: str = "GradientDescent") -> None:
    super().__init__(name, loss_reduction=loss_reduction)
    self._learning_rate = _hyperparameter(type(self).__name__, "learning_rate", learning_rate)

  def _apply_dense(self, grad, var):
    # The fused kernel updates in place: no temporary for lr * grad.
    return tf.raw_ops.ResourceApplyGradientDescent(
        var=var.handle, alpha=self._hyper("learning_rate", var.dtype), delta=grad)

  def _apply_sparse(self, grad, var):
    lr = self._hyper("learning_rate", var.dtype)
    return var.scatter_sub(tf.IndexedSlices(lr * grad.values, grad.indices, grad.dense_shape))


class Momentum(_HyperMixin, DistributedOptimizerMixin, Optimizer):
  """`accum = momentum * accum + grad; var -= learning_rate * accum`.

  With `use_nesterov=True`: `var -= learning_rate * (grad + momentum * accum)`. The
  accumulator is the slot `"momentum"`. A float16 or bfloat16 variable gets a float32
  accumulator and its update is computed in float32, then rounded to the variable's
  dtype (in bfloat16, a momentum of 0.9 is 0.898, and an accumulator ten times the
  gradient drops most of each gradient's low bits).
  """

  @keeps_errors_in_tf_function
  def __init__(self, learning_rate: Any, momentum: Any, use_nesterov: bool = False,
               loss_reduction: str = "mean", name: str = "Momentum") -> None:
    super().__init__(name, loss_reduction=loss_reduction)
    self._learning_rate = _hyperparameter(type(self).__name__, "learning_rate", learning_rate)
    self._momentum = _hyperparameter(type(self).__name__, "momentum", momentum)
    self._use_nesterov = use_nesterov

  def _create_slots(self, var_list):
    for var in var_list:
      self._zeros_slot(var, "momentum", _math_dtype(var))

  def _apply_dense(self, grad, var):
    dtype = _math_dtype(var)
    if dtype != var.dtype.base_dtype:  # Half precision: the formula, in float32.
      mu = self._hyper("momentum", dtype)
      grad = tf.cast(grad, dtype)
      accum = self.get_slot(var, "momentum")
      accum_t = accum.assign(mu * accum + grad)
      step = grad + mu * accum_t if self._use_nesterov else accum_t
      step = self._hyper("learning_rate", dtype) * step
      return var.assign_sub(tf.cast(step, var.dtype), read_value=False)
    # One fused kernel: accum = mu * accum + grad; var -= lr * accum (or Nesterov's step).
    return tf.raw_ops.ResourceApplyMomentum(
        var=var.handle, accum=self.get_slot(var, "momentum").handle,
        lr=self._hyper("learning_rate", var.dtype), grad=grad,
        momentum=self._hyper("momentum", var.dtype), use_nesterov=self._use_nesterov)

  def _apply_sparse(self, grad, var):
    grad = self._deduplicate(grad)
    dtype = _math_dtype(var)
    values = tf.cast(grad.values, dtype)
    lr = self._hyper("learning_rate", dtype)
    mu = self._hyper("momentum", dtype)
    accum = self.get_slot(var, "momentum")
    new_rows = mu * tf.gather(accum, grad.indices) + values
    accum.scatter_update(tf.IndexedSlices(new_rows, grad.indices))
    step = values + mu * new_rows if self._use_nesterov else new_rows
    return var.scatter_sub(tf.IndexedSlices(tf.cast(lr * step, var.dtype), grad.indices))


class Adam(_HyperMixin, DistributedOptimizerMixin, Optimizer):
  """Adam (Kingma & Ba, 2015), with the bias correction folded into the step size.

  `m = beta1 * m + (1 - beta1) * grad`, `v = beta2 * v + (1 - beta2) * grad**2`,
  `var -= lr * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon)`.
  Slots `"m"` and `"v"`; `beta1**t` and `beta2**t` are non-slot variables
  (`beta1_power`, `beta2_power`; float32, or float64 if a variable is float64). A sparse
  gradient decays `m` and `v` of every row and adds to the rows it names, as the dense
  update would with zero rows. A float16 or bfloat16 variable gets float32 slots and its
  update is computed in float32, then rounded to the variable's dtype: in half
  precision, `epsilon` rounds to 0 in float16 (a zero gradient gave NaN) and `beta2`
  rounds to 1 in bfloat16 (`v` stayed 0 and the steps exploded).
  """

  @keeps_errors_in_tf_function
  def __init__(self, learning_rate: Any = 0.001, beta1: Any = 0.9, beta2: Any = 0.999,
               epsilon: Any = 1e-8, loss_reduction: str = "mean", name: str = "Adam") -> None:
    super().__init__(name, loss_reduction=loss_reduction)
    self._learning_rate = _hyperparameter(type(self).__name__, "learning_rate", learning_rate)
    self._beta1 = _hyperparameter(type(self).__name__, "beta1", beta1)
    self._beta2 = _hyperparameter(type(self).__name__, "beta2", beta2)
    self._epsilon = _hyperparameter(type(self).__name__, "epsilon", epsilon)

  def _create_slots(self, var_list):
    # float32, or float64 beside a float64 variable; never a variable's narrower dtype
    # (float16 beside float32 variables rounded their bias correction). Each update casts
    # the powers to its variable's dtype.
    wide = any(v.dtype.base_dtype.real_dtype == tf.float64 for v in var_list)
    dtype = tf.float64 if wide else tf.float32
    # Initial values as callables: evaluated only when the variable is created (a beta
    # may be a callable schedule, or a tensor or variable of another dtype).
    self._non_slot_variable(
        "beta1_power", lambda: _in_dtype(self._hyper_value("beta1"), dtype), var_list)
    self._non_slot_variable(
        "beta2_power", lambda: _in_dtype(self._hyper_value("beta2"), dtype), var_list)
    for var in var_list:
      self._zeros_slot(var, "m", _math_dtype(var))
      self._zeros_slot(var, "v", _math_dtype(var))

  def _step_size(self, dtype):
    beta1_power = tf.cast(self._get_non_slot_variable("beta1_power"), dtype)
    beta2_power = tf.cast(self._get_non_slot_variable("beta2_power"), dtype)
    return self._hyper("learning_rate", dtype) * tf.sqrt(1 - beta2_power) / (1 - beta1_power)

  def _apply_dense(self, grad, var):
    dtype = _math_dtype(var)
    if dtype != var.dtype.base_dtype:  # Half precision: the formulas, in float32.
      b1, b2 = self._hyper("beta1", dtype), self._hyper("beta2", dtype)
      grad = tf.cast(grad, dtype)
      m, v = self.get_slot(var, "m"), self.get_slot(var, "v")
      m_t = m.assign(b1 * m + (1 - b1) * grad)
      v_t = v.assign(b2 * v + (1 - b2) * tf.square(grad))
      step = self._step_size(dtype) * m_t / (tf.sqrt(v_t) + self._hyper("epsilon", dtype))
      return var.assign_sub(tf.cast(step, var.dtype), read_value=False)
    # One fused kernel computes the same update as _apply_sparse's formulas, in place.
    return tf.raw_ops.ResourceApplyAdam(
        var=var.handle, m=self.get_slot(var, "m").handle, v=self.get_slot(var, "v").handle,
        beta1_power=tf.cast(self._get_non_slot_variable("beta1_power"), var.dtype),
        beta2_power=tf.cast(self._get_non_slot_variable("beta2_power"), var.dtype),
        lr=self._hyper("learning_rate", var.dtype), beta1=self._hyper("beta1", var.dtype),
        beta2=self._hyper("beta2", var.dtype), epsilon=self._hyper("epsilon", var.dtype),
        grad=grad)

  def _apply_sparse(self, grad, var):
    grad = self._deduplicate(grad)
    dtype = _math_dtype(var)
    values = tf.cast(grad.values, dtype)
    b1, b2 = self._hyper("beta1", dtype), self._hyper("beta2", dtype)
    m, v = self.get_slot(var, "m"), self.get_slot(var, "v")
    m.assign(b1 * m, read_value=False)
    m.scatter_add(tf.IndexedSlices((1 - b1) * values, grad.indices))
    v.assign(b2 * v, read_value=False)
    v.scatter_add(tf.IndexedSlices((1 - b2) * tf.square(values), grad.indices))
    step = self._step_size(dtype) * m / (tf.sqrt(v) + self._hyper("epsilon", dtype))
    return var.assign_sub(tf.cast(step, var.dtype), read_value=False)

  def _finish(self, update_ops, name):
    del update_ops, name
    beta1_power = self._get_non_slot_variable("beta1_power")
    beta2_power = self._get_non_slot_variable("beta2_power")
    return [beta1_power.assign(beta1_power * self._hyper("beta1", beta1_power.dtype),
                               read_value=False),
            beta2_power.assign(beta2_power * self._hyper("beta2", beta2_power.dtype),
                               read_value=False)]
