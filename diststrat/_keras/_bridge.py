"""The tf.distribute bridge: diststrat's contexts, as seen by tf.distribute-aware code.

Keras 3 (TensorFlow backend) and parts of TensorFlow learn about distribution only
through `tf.distribute.get_strategy()`, `get_replica_context()` and friends, which read a
per-thread stack that TensorFlow keeps. While a thread is in a diststrat context of a
real strategy, that stack holds an entry naming a `StrategyAdapter` (cross-tower
context) or a `ReplicaContextAdapter` (a tower): small objects that answer the part of
the tf.distribute interface Keras uses by calling diststrat. No tf.distribute strategy
is created or used; TensorFlow's and Keras's own code is not patched.

What Keras then does by itself, unchanged:

* A model created inside `strategy.scope()` keeps the adapter, and `fit`, `evaluate`
  and `predict` call `adapter.run(step, args=(global_batch,))` inside their traced step.
  `run` splits each batch across the towers (`_input.split_batch`), runs the step in
  every tower with `call_for_each_tower`, and returns the model's metrics read once more
  in cross-tower context (exact over all towers), or the towers' predictions
  concatenated in input order.
* A Keras optimizer sums its gradients with `ReplicaContextAdapter.all_reduce` and
  applies them through `merge_call` and `extended.update`: once per copy of each
  variable.
* Keras losses divide a tower's mean loss by `num_replicas_in_sync`, which in a tower
  given part of a batch is `TowerShare`: it divides by B / n_i, so a ragged batch weighs
  each tower by its examples.
* `BatchNormalization(synchronized=True)` all-reduces its moments (differentiably).

`diststrat._keras.install()` registers `tf_mode` with the context module
(`_context.add_mode_listener`); `import diststrat` calls it. See docs/keras.md.
"""

import contextlib
import threading
import weakref
from typing import Any

from diststrat._tf import tf
from diststrat import _context
from diststrat import _input
from diststrat import _tf_internal
from diststrat import errors
from diststrat._keras import _file_callbacks
from diststrat._arguments import as_tf_variable
from diststrat.values import _variables
from diststrat.values import _wrapped


# strategy -> its StrategyAdapter
_adapters: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = weakref.WeakKeyDictionary()
# Keras model -> the adapter that checked it
_checked_models: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = weakref.WeakKeyDictionary()


def adapter_for(strategy):
  """The one `StrategyAdapter` of `strategy` (made on first use)."""
  adapter = _adapters.get(strategy)
  if adapter is None:
    adapter = _adapters.setdefault(strategy, StrategyAdapter(strategy))
  return adapter


def tf_mode(strategy, tower_context):
  """The mode listener: what TensorFlow should report while this diststrat mode is current."""
  if _context.is_default_strategy(strategy):
    return None  # TensorFlow's own default strategy stands for ours.
  adapter = adapter_for(strategy)
  current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
  if current is not None and not isinstance(current, StrategyAdapter) and \
      not getattr(_entering, "by_adapter", False):
    raise errors.ContextError(
        f"Cannot enter the scope of diststrat's {strategy!r} inside the scope of the "
        f"tf.distribute strategy {current!r}: the two libraries' strategies do not mix "
        "(Keras and TensorFlow would see two current strategies). Leave the "
        "tf.distribute scope first, or use only one library's strategies.")
  if tower_context is None:
    mode = _tf_internal.tf_distribution_mode(adapter)
  else:
    mode = _tf_internal.tf_distribution_mode(adapter,
                                             ReplicaContextAdapter(adapter, tower_context))
  return _explain_mixing(mode, strategy)


_entering = threading.local()  # by_adapter: a StrategyAdapter enters its strategy's scope.


_MIXING = "Mixing different tf.distribute.Strategy objects"  # TensorFlow's error text.
_MIXING_NOTE = "diststrat: a tf.distribute strategy was used inside the scope of "


@contextlib.contextmanager
def _explain_mixing(mode, strategy):
  """`mode`; TensorFlow's "Mixing different tf.distribute.Strategy objects" error raised
  inside it gets a note saying what happened and the fix (TensorFlow raises it from its
  own scope, where diststrat cannot check first)."""
  with mode:
    try:
      yield
    except RuntimeError as e:
      if _MIXING in str(e) and not any(
          _MIXING_NOTE in note for note in getattr(e, "__notes__", ())):
        errors.add_note(e, (
            f"{_MIXING_NOTE}diststrat's {strategy!r}, where tf.distribute.get_strategy() "
            "is diststrat's adapter: the two libraries' strategies do not mix. Enter the "
            "tf.distribute strategy's scope outside any diststrat scope (and build its "
            "models there), or use only diststrat's strategies. See docs/keras.md."))
      raise



def _reduce_op_name(reduce_op):
  """"sum" or "mean" for a `tf.distribute.ReduceOp` or a string."""
  return str(getattr(reduce_op, "value", reduce_op)).lower()


class TowerShare:
  """`num_replicas_in_sync` inside a tower that was given part of a global batch.

  Keras multiplies each tower's mean loss by `1.0 / num_replicas_in_sync` and the loss
  it reports by `cast(num_replicas_in_sync)`. With B examples of which this tower got
  n, the weight that makes the towers' summed gradients one device's is n / B. So this
  object compares, hashes and multiplies as the tower count N (for Keras's
  `num_replicas > 1`), while `1.0 / share` is the tensor n / B and converting it to a
  tensor gives B / n (0 for a tower with no example).
  """

  def __init__(self, num_towers, batch_share):
    self._num_towers = int(num_towers)
    self._share = batch_share  # n / B, a float or a float32 scalar tensor.

  def __int__(self):
    return self._num_towers

  __index__ = __int__

  def __eq__(self, other):
    return self._num_towers == other

  def __lt__(self, other):
    return self._num_towers < other

  def __le__(self, other):
    return self._num_towers <= other

  def __gt__(self, other):
    return self._num_towers > other

  def __ge__(self, other):
    return self._num_towers >= other

  def __hash__(self):
    return hash(self._num_towers)

  def __mul__(self, other):
    return self._num_towers * other

  __rmul__ = __mul__

  def __rtruediv__(self, other):
    share = tf.convert_to_tensor(self._share, tf.float32)
    return tf.cast(other, tf.float32) * share

  def inverse(self, dtype=None):
    """B / n as a tensor (0 when n is 0)."""
    share = tf.convert_to_tensor(self._share, tf.float32)
    inverse = tf.math.divide_no_nan(tf.ones([], tf.float32), share)
    return inverse if dtype is None else tf.cast(inverse, dtype)

  def __repr__(self):
    return f"TowerShare(num_towers={self._num_towers}, batch_share={self._share!r})"


tf.register_tensor_conversion_function(
    TowerShare, lambda value, dtype=None, name=None, as_ref=False: value.inverse(dtype))


class _MergeFn:
  """A tf.distribute `merge_fn(strategy, ...)` called with the adapter.

  Two of them are equal when they wrap the same function, so diststrat's check that
  every tower passes the same merge_fn compares what Keras passed.
  """

  def __init__(self, merge_fn, adapter):
    self.merge_fn = merge_fn
    self.adapter = adapter
    self.__name__ = getattr(merge_fn, "__name__", type(merge_fn).__name__)

  def __call__(self, strategy, *args, **kwargs):
    del strategy  # tf.distribute code expects its own kind of strategy: the adapter.
    return self.merge_fn(self.adapter, *args, **kwargs)

  def __eq__(self, other):
    return isinstance(other, _MergeFn) and _context.same_merge_fn(
        self.merge_fn, other.merge_fn)

  def __hash__(self):
    return hash(getattr(self.merge_fn, "__code__", None))


# --- a Keras optimizer's apply, once per step with the summed gradients ---------------

# Keras optimizer -> its StrategyAdapter
_routed_optimizers: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = weakref.WeakKeyDictionary()


def route_optimizer(optimizer, adapter):
  """Makes `optimizer.apply` (and so `apply_gradients`) run once per step, in cross-tower
  context, with the gradients summed over the towers.

  Keras's optimizer applies its update in the tower that calls it: it clips the
  gradient there (before any sum), and gradient accumulation, `LossScaleOptimizer` and
  EMA put `merge_call`s or `strategy.update` inside `tf.cond` branches, which towers
  tracing a graph cannot merge from. So the call from a tower is taken at its top: one
  `merge_call` hands the towers' gradients over, they are summed, and Keras's own
  `apply` runs once in cross-tower context on the sum (`StrategyAdapter.apply_summed`),
  as on one device: every write to a mirrored variable there goes to all its copies.
  Called from anywhere but a tower of the adapter's strategy, `apply` is Keras's own.

  The instance's `apply` attribute is set (once per optimizer); Keras's classes are not
  changed. Only optimizers created in the adapter's scope are routed.
  """
  if optimizer is None or _routed_optimizers.get(optimizer) is adapter:
    return
  if _tf_internal.keras_optimizer_strategy(optimizer) is not adapter or not callable(
      getattr(type(optimizer), "apply", None)):
    return
  optimizer_ref = weakref.ref(optimizer)

  def apply(grads, trainable_variables=None):
    return adapter.apply_from_tower(optimizer_ref(), grads, trainable_variables)

  # Plain instance attribute: Keras's own __setattr__ would try to track it.
  object.__setattr__(optimizer, "apply", apply)
  _routed_optimizers[optimizer] = adapter


# Keras loss tracker -> its StrategyAdapter
_routed_trackers: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = weakref.WeakKeyDictionary()


def route_loss_tracker(tracker, adapter):
  """Weighs a loss tracker's tower updates by the tower's share of the batch.

  For the model's "loss" tracker, Keras gives the part's dynamic batch size as weight;
  only an empty tower's nan (0 / 0) is replaced by 0, so it adds nothing.

  Keras updates the "<output>_loss" `Mean` of a multi-output model with the loss
  computed on the tower's part and `sample_weight` the part's static batch size, which
  is unknown (None) in a traced step: each tower would then count as one whole step,
  and the towers' means would be averaged unweighted (wrong on a ragged batch, and N
  updates per step where one device makes one). In a tower given part of a batch, a
  missing `sample_weight` becomes the tower's share n_i / B: the towers' updates add up
  to one update of the batch's mean, as on one device. A static size (eager steps) is
  the tower's n_i, already right.
  """
  if _routed_trackers.get(tracker) is adapter:
    return
  tracker_ref = weakref.ref(tracker)

  def update_state(values, sample_weight=None):
    tracker = tracker_ref()
    tower = _context.get_tower_context()
    if tower is None or tower.distribution_strategy is not adapter.diststrat_strategy \
        or tower.batch_share is None:
      return type(tracker).update_state(tracker, values, sample_weight=sample_weight)
    share = tower.batch_share
    if sample_weight is None:
      sample_weight = tf.cast(share, tf.float32)

    def update():
      type(tracker).update_state(tracker, values, sample_weight=sample_weight)

    # A tower without an example has no loss (an empty tensor, or 0 / 0): it updates
    # nothing, where Keras's Mean would add nan.
    if isinstance(share, (int, float)):
      return update() if share > 0 else None
    return tf.cond(tf.cast(share, tf.float32) > 0, update, lambda: None)

  object.__setattr__(tracker, "update_state", update_state)
  _routed_trackers[tracker] = adapter


class SummedGradientsContext:
  """What `tf.distribute.get_replica_context()` returns while a Keras optimizer applies the
  gradients summed over the towers, once, in cross-tower context.

  To that code it is the one replica: the gradients are already the global ones, so
  `all_reduce` returns its value, and `merge_call` calls its function at once (the
  context is already cross-tower). Keras's `LossScaleOptimizer` asks for a replica
  context before it applies; this is it.
  """

  num_replicas_in_sync = 1
  replica_id_in_sync_group = 0

  def __init__(self, adapter):
    self._adapter = adapter

  @property
  def strategy(self):
    return self._adapter

  @property
  def devices(self):
    return tuple(self._adapter.diststrat_strategy.worker_devices[:1])

  def merge_call(self, merge_fn, args=(), kwargs=None):
    return merge_fn(self._adapter, *args, **(kwargs or {}))

  def all_reduce(self, reduce_op, value, options=None):
    del reduce_op, options  # One replica: the sum and the mean are the value.
    return value


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
    return self._adapter.num_replicas_in_sync

  @property
  def replica_id_in_sync_group(self):
    return self._tower.tower_id

  @property
  def devices(self):
    return (self._tower.device,)

  def merge_call(self, merge_fn, args=(), kwargs=None):
    return self._tower.merge_call(_MergeFn(merge_fn, self._adapter), *args,
                                  **(kwargs or {}))

  def all_reduce(self, reduce_op, value, options=None):
    """Reduces `value` (a tensor or a structure of them) over the towers; all get the result.

    Differentiable for float tensors, as tf.distribute's: a tower's tape does not see
    the reduction (it runs in `merge_call`, in another thread), so the gradient is
    declared here: the same reduction of the towers' upstream gradients.
    """
    del options
    op = _reduce_op_name(reduce_op)
    tower = self._tower
    flat = _wrapped.flatten(value)

    def merge_fn(strategy, *leaves):
      return tuple(strategy.batch_reduce(op, [(leaf, None) for leaf in leaves]))

    if not all(isinstance(v, tf.Tensor) and v.dtype.is_floating for v in flat):
      return _wrapped.pack_as(value, tower.merge_call(merge_fn, *flat))

    @tf.custom_gradient
    def all_reduce(*leaves):
      reduced = tower.merge_call(merge_fn, *leaves)

      def grad(*upstream):
        return tower.merge_call(merge_fn, *upstream)

      return tuple(tf.identity(r) for r in reduced), grad

    return _wrapped.pack_as(value, all_reduce(*flat))


class ExtendedAdapter:
  """The part of `tf.distribute.Strategy.extended` that Keras and TensorFlow use."""

  def __init__(self, strategy):
    self._ds = strategy

  def _use_merge_call(self):
    # In a tower, Keras's optimizer applies gradients through merge_call. In cross-tower
    # context (an optimizer's apply run once with the summed gradients, see
    # `route_optimizer`) there is nothing to merge: tf.distribute's `maybe_merge_call`
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

  def colocate_vars_with(self, var):
    return self._ds.colocate_vars_with(as_tf_variable(var))

  def variable_created_in_scope(self, v):
    return _variables.created_by(as_tf_variable(v)) is self._ds

  def update(self, var, fn, args=(), kwargs=None, group=True):
    """`strategy.update(var, fn, *args)`: `fn` once on each device holding `var`.

    Keras hands over values it all-reduced, so every component is the same value: one
    without a component on the variable's device (ParameterServer: towers on workers,
    the variable on a parameter device) stands for any of its components.
    """
    var = as_tf_variable(var)
    devices = _wrapped.devices_of(var)

    def local(x):
      if isinstance(x, _wrapped.DistributedValues) and not isinstance(x, tf.Variable) and \
          not all(d in x for d in devices):
        return x.primary
      return x

    args = _wrapped.pack_as(tuple(args), [local(x) for x in _wrapped.flatten(tuple(args))])
    kwargs = dict(kwargs or {})
    kwargs = _wrapped.pack_as(kwargs, [local(x) for x in _wrapped.flatten(kwargs)])
    result = self._ds.update(var, fn, *args, **kwargs)
    return self._grouped(result) if group else result

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

  def call_for_each_replica(self, fn, args=(), kwargs=None):
    return self._ds.call_for_each_tower(fn, *args, **(kwargs or {}))

  def reduce_to(self, reduce_op, value, destinations, options=None):
    del options
    return self._ds.reduce(_reduce_op_name(reduce_op), value, destinations=destinations)

  def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
    del options
    return self._ds.batch_reduce(_reduce_op_name(reduce_op), value_destination_pairs)

  def broadcast_to(self, tensor, destinations):
    return self._ds.broadcast(tensor, destinations)

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

  def __init__(self, strategy):
    self._ds = strategy
    self.extended = ExtendedAdapter(strategy)

  def __repr__(self):
    return f"diststrat StrategyAdapter({self._ds!r})"

  @property
  def diststrat_strategy(self):
    """The diststrat strategy this adapter stands for."""
    return self._ds

  @property
  def num_replicas_in_sync(self):
    """The tower count; in a tower given part of a batch, a `TowerShare` of it."""
    tower = _context.get_tower_context()
    if tower is not None and tower.distribution_strategy is self._ds and \
        tower.batch_share is not None:
      return TowerShare(self._ds.num_towers, tower.batch_share)
    return self._ds.num_towers

  def scope(self):
    self._check_no_other_strategy("A Keras model (or optimizer, or other tf.distribute-"
                                  "aware code)")
    return self._adapter_scope()

  @contextlib.contextmanager
  def _adapter_scope(self):
    """The strategy's scope, entered for code that asked the adapter for it.

    That code (a Keras model made under this strategy) runs under this strategy even
    inside a tf.distribute strategy's scope: the entry for diststrat goes on top of
    TensorFlow's stack. A user's own `with strategy.scope():` there is refused.
    """
    saved = getattr(_entering, "by_adapter", False)
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

  def _check_no_other_strategy(self, what):
    """Raises when another diststrat strategy's context is current.

    A Keras model fit inside the scope of a strategy other than its own would otherwise
    fail entering its own strategy's scope, with a message naming a scope the user
    never entered.
    """
    mode = _context.current_mode()
    if not _context.has_distribution_strategy() or mode.strategy is self._ds:
      return
    raise errors.ContextError(
        f"{what} created in the scope of {self._ds!r} was used inside "
        f"{_context.describe_current_context()}: it runs under the strategy it was "
        "created under, and strategies do not mix. Call fit/evaluate/predict outside any "
        f"strategy's scope (the model keeps its strategy), or inside the scope of "
        f"{self._ds!r}; to train under {mode.strategy!r}, build and compile the model "
        "inside that strategy's scope (move the weights with get_weights()/set_weights() "
        "or a checkpoint).")

  def _check_jit_compile(self, model):
    """Refuses `jit_compile=True` where XLA cannot compile the step (several devices)."""
    if model is None or not getattr(model, "jit_compile", False):
      return
    devices = set(self._ds.worker_devices) | set(self._ds.parameter_devices)
    if len(devices) <= 1 and self._ds.num_towers <= 1:
      return  # One device: XLA compiles the step as it would without a strategy.
    raise ValueError(
        f"The Keras model {model.name!r} was compiled with jit_compile=True, but under "
        f"{self._ds!r} its step runs on {max(len(devices), self._ds.num_towers)} devices "
        f"({self._ds.num_towers} towers, each with its own copy or read of the variables, "
        "reduced with the others'), and XLA compiles a step for one device: it cannot "
        "reach the other devices' variables and reductions. Compile it "
        "with jit_compile=False under this strategy (the default, jit_compile='auto', "
        "chooses False under a strategy), or train on one device with XLA.")

  # --- input ---

  def experimental_distribute_dataset(self, dataset, options=None):
    """`dataset`, prefetched: `run` splits each global batch across the towers.

    The prefetch makes the next batch while a step runs, as `distribute_dataset` does.
    """
    del options
    # Keras's fit asks for its dataset before it builds its callback list: the last
    # moment a worker's file-writing callbacks can be pointed at its scratch directory.
    _file_callbacks.redirect_fit_callbacks(self._ds)
    return dataset.prefetch(tf.data.AUTOTUNE)

  def distribute_datasets_from_function(self, dataset_fn, options=None):
    del dataset_fn, options
    raise NotImplementedError(
        "diststrat's tf.distribute bridge does not implement "
        "distribute_datasets_from_function: it splits global batches itself. Pass a "
        "tf.data.Dataset of global batches (or numpy arrays) to model.fit, or use "
        f"{type(self._ds).__name__}.distribute_dataset() in a custom loop.")

  def experimental_local_results(self, value):
    if isinstance(value, _wrapped.DistributedValues) and not isinstance(value, tf.Variable):
      return tuple(value.values)
    return (value,)

  # --- the step ---

  def run(self, fn, args=(), kwargs=None, options=None):
    """Runs `fn` on every tower, each on its part of the global batch in `args`.

    Keras's trainer calls this with a global batch. Every tensor with a batch axis in
    `args` and `kwargs` is split across the towers (`BatchParts`, as `distribute_dataset`
    does, a tower may get no example); with several worker processes training on one
    global batch (MultiWorkerMirroredStrategy), this process's towers take their share.
    Wrapped values give each tower its component; anything else is passed to every
    tower as it is.

    Returns:
      For a Keras model's `train_step`/`test_step`: its metrics, read in cross-tower
      context after every tower ran (each tower-local metric summed over towers). For
      anything else: each output leaf concatenated over the towers, in tower order (the
      order of the input batch), of every worker process.

    Raises:
      RuntimeError: `fn` belongs to a Keras model whose variables were not created in
        this strategy's scope.
    """
    del options
    model = getattr(fn, "__self__", None)
    if hasattr(model, "get_metrics_result"):  # A Keras model's step.
      self._check_no_other_strategy(f"The Keras model {model.name!r}")  # As in scope().
      self._check_jit_compile(model)
    else:
      self._check_no_other_strategy("A function run by tf.distribute-aware code")
    self._check_model(model)
    route_optimizer(getattr(model, "optimizer", None), self)
    if _is_train_or_test_step(fn):
      for tracker in _tf_internal.keras_output_loss_trackers(model):
        route_loss_tracker(tracker, self)
      tracker = _tf_internal.keras_loss_tracker(model)
      if tracker is not None:
        route_loss_tracker(tracker, self)
    devices = self._ds.worker_devices
    first_tower, num_towers = self._ds._batch_split()  # pylint: disable=protected-access

    def split(x):
      if isinstance(x, tf.Tensor) and x.shape.rank != 0:
        return _input.split_batch(x, devices, allow_empty=True, first_tower=first_tower,
                                  num_towers=num_towers)
      return _check_splittable(x)

    structure = (tuple(args), dict(kwargs or {}))
    args, kwargs = _wrapped.pack_as(structure, [split(x) for x in _wrapped.flatten(structure)])
    with self._adapter_scope():
      # Keras runs its steps without AutoGraph (as on one device): towers do the same.
      step = tf.autograph.experimental.do_not_convert(fn)
      outputs = self._ds.call_for_each_tower(step, *args, **kwargs)
      return self._combine(fn, outputs)

  def apply_from_tower(self, optimizer, grads, trainable_variables=None):
    """A routed Keras optimizer's `apply` (see `route_optimizer`)."""
    tower = _context.get_tower_context()
    if tower is None or tower is _context.default_tower_context() or \
        tower.distribution_strategy is not self._ds:
      return type(optimizer).apply(optimizer, grads, trainable_variables)
    grads = list(grads)
    variables = None if trainable_variables is None else list(trainable_variables)
    tower.merge_call(self.apply_summed, optimizer, grads, variables)
    return None

  def apply_summed(self, strategy, optimizer, grads, variables):
    """merge_fn: sums the towers' gradients, then runs Keras's `apply` once on the sum."""
    present = [i for i, g in enumerate(grads) if g is not None]
    reduced = strategy.batch_reduce("sum", [(grads[i], None) for i in present]) \
        if present else []
    first_device = strategy.worker_devices[0]
    summed = [None] * len(grads)
    for i, value in zip(present, reduced, strict=True):
      summed[i] = value.get(first_device) if isinstance(
          value, _wrapped.DistributedValues) else value
    with _tf_internal.tf_distribution_mode(self, SummedGradientsContext(self)):
      type(optimizer).apply(optimizer, summed, variables)

  def _check_model(self, model):
    """Refuses (never a silent run on one device) a Keras model not made in this scope."""
    if model is None or not hasattr(model, "get_metrics_result") or \
        _checked_models.get(model) is self:
      return
    foreign = [v.path for v in model.variables
               if _variables.created_by(as_tf_variable(v)) is not self._ds]
    if foreign:
      raise errors.ContextError(
          f"The Keras model {model.name!r} runs under {self._ds!r}, so its variables must "
          f"be that strategy's. Received: {len(foreign)} variables created outside its "
          f"scope, such as {foreign[:3]}. Build and compile the model inside "
          "`with strategy.scope():` so that its variables are distributed, or train "
          "it outside any strategy.")
    optimizer = getattr(model, "optimizer", None)
    captured = _tf_internal.keras_optimizer_strategy(optimizer)
    if captured is not None and captured is not self:
      raise errors.ContextError(
          f"The Keras model {model.name!r} runs under {self._ds!r}, so its optimizer must "
          "be created in that strategy's scope. Received: an optimizer created outside it "
          f"({type(optimizer).__name__}). Create the optimizer and compile the model inside "
          "`with strategy.scope():`.")
    if model.variables:
      _checked_models[model] = self

  def _combine(self, fn, outputs):
    if _is_train_or_test_step(fn):
      model = fn.__self__
      metrics = model.get_metrics_result()  # Cross-tower: tower-local metrics summed.
      if isinstance(outputs, dict):
        return {k: metrics[k] if k in metrics else self._mean(v) for k, v in outputs.items()}
      return _wrapped.pack_as(outputs, [self._mean(v) for v in _wrapped.flatten(outputs)])
    # Every tower's output, in tower order (the input batch's); with several worker
    # processes, every worker's (MultiWorkerMirroredStrategy gathers across them).
    return _wrapped.pack_as(outputs, [self._ds.gather(v, axis=0)
                                      for v in _wrapped.flatten(outputs)])

  def _mean(self, value):
    """A custom step's output that is not a metric: its mean over every tower.

    With several worker processes (MultiWorkerMirroredStrategy) the mean is over the
    towers of every worker (a collective: every worker runs the same steps), so every
    worker logs the same value, as for metrics.
    """
    if not isinstance(value, _wrapped.DistributedValues):
      return value
    parts = list(value.values)
    if self._ds._num_processes() > 1 and all(  # pylint: disable=protected-access
        isinstance(p, tf.Tensor) and p.dtype.is_floating for p in parts):
      return self._ds.reduce("mean", value).get(self._ds.worker_devices[0])
    with tf.device(self._ds.worker_devices[0]):
      return tf.add_n(parts) / len(parts)

  # --- cross-replica reductions Keras may call ---

  def reduce(self, reduce_op, value, axis=None):
    """Reduces per-tower values over the towers (and over `axis` of each, if given)."""
    op = _reduce_op_name(reduce_op)

    def one(v):
      parts = list(v.values) if isinstance(v, _wrapped.DistributedValues) else [v]
      if axis is not None:
        reduce_axis = tf.reduce_sum if op == "sum" else tf.reduce_mean
        parts = [reduce_axis(p, axis=axis) for p in parts]
      with tf.device(self._ds.worker_devices[0]):
        total = tf.add_n(parts)
        return total / len(parts) if op == "mean" else total

    if not _wrapped.is_structure(value):
      return one(value)
    return _wrapped.pack_as(value, [one(v) for v in _wrapped.flatten(value)])

  def gather(self, value, axis):
    return self._ds.gather(value, axis=axis)


def _is_train_or_test_step(fn):
  """Whether `fn` is a Keras model's own `train_step` or `test_step` (bound to it)."""
  model = getattr(fn, "__self__", None)
  if model is None or not hasattr(model, "get_metrics_result"):
    return False
  return fn == getattr(model, "train_step", None) or fn == getattr(model, "test_step", None)


def _check_splittable(value):
  if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
    raise TypeError(
        "diststrat splits each batch of model.fit/evaluate/predict across the towers "
        "along its first axis, which it does for dense tensors only. Received: a "
        f"{type(value).__name__}. Convert it to a dense tensor (for example in the "
        "tf.data pipeline) or run the model outside any strategy.")
  return value
