"""Keras training semantics under diststrat: routing, summing, splitting, combining.

What a Keras 3 step must do under a diststrat strategy to train as it does on one
device, when Keras's trainer calls `StrategyAdapter.run(step, args=(global_batch,))`
(`_facade.py`):

* Splitting: each global batch is split across the towers (`split_step_inputs`), a
  tower may get no example.
* Weighing: Keras divides a tower's mean loss by `num_replicas_in_sync`, which in a
  tower given part of a batch is a `TowerShare`: it divides by B / n_i, so a ragged
  batch weighs each tower by its examples.
* Summing: a Keras optimizer's `apply` called in a tower is taken at its top, the
  towers' gradients are summed, and Keras's own `apply` runs once, in cross-tower
  context, on the sum (`route_optimizer`, `apply_from_tower`). Keras sees the first
  device's sum; each copy of a variable is updated from the sum on its own device
  (`summed_copies`), not from a copy of the first device's.
* Combining: the step's results are the model's metrics read in cross-tower context
  (exact over all towers), or the towers' predictions concatenated in input order
  (`combine_step_outputs`).

To do this, diststrat replaces two instance attributes of Keras objects, on the
instance (`object.__setattr__`, so Keras does not track them); Keras's classes are not
changed, and the replacement calls the class's own method wherever it is not in a tower
of the strategy:

* `optimizer.apply` of a Keras optimizer created in a strategy's scope
  (`route_optimizer`): Keras applies an update in the tower that calls it, clipping
  before any sum, with `merge_call`s inside `tf.cond` branches that towers tracing a
  graph cannot merge from.
* `tracker.update_state` of a compiled model's loss trackers (the "loss" `Mean` and
  each "<output>_loss" `Mean`; `route_loss_tracker`): Keras weighs a tower's update by
  the part's static batch size, unknown in a traced step, so the towers' means would
  be averaged unweighted.

Under a `ParameterServerStrategy` of a cluster, three more of a model's attributes
(`bound_steps`): `make_train_function`, `make_test_function` and `make_predict_function`,
so that the compiled steps they make (which `fit`, `evaluate` and `predict` call for
each batch, directly) run through the strategy's `run_step`, bounded by `step_timeout`:
a frozen parameter server would block them forever. The same three, for a model
compiled with XLA (`jit_compile=True`) under a strategy of one device, so that its
steps are called on that device: XLA compiles Keras's step for the device its call is
placed on, by default the first one.

Importing this module registers a tensor conversion for `TowerShare` with TensorFlow.
"""

import contextlib
import threading
import typing
import weakref
from typing import Any

import numpy as np

from diststrat._tf import tf
from diststrat import _context
from diststrat import _input
from diststrat import _tf_internal
from diststrat._keras import _replay
from diststrat.values import _wrapped

if typing.TYPE_CHECKING:  # _facade imports this module: no import at run time.
  from diststrat._keras._facade import StrategyAdapter


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


# --- a Keras optimizer's apply, once per step with the summed gradients ---------------

# Keras optimizer -> its StrategyAdapter
_routed_optimizers: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = weakref.WeakKeyDictionary()


def route_optimizer(optimizer, adapter, created_now=False):
  """Makes `optimizer.apply` (and so `apply_gradients`) run once per step, in cross-tower
  context, with the gradients summed over the towers.

  Keras's optimizer applies its update in the tower that calls it: it clips the
  gradient there (before any sum), and gradient accumulation, `LossScaleOptimizer` and
  EMA put `merge_call`s or `strategy.update` inside `tf.cond` branches, which towers
  tracing a graph cannot merge from. So the call from a tower is taken at its top: one
  `merge_call` hands the towers' gradients over, they are summed, and Keras's own
  `apply` runs once in cross-tower context on the sum (`apply_summed`), as on one
  device: every write to a mirrored variable there goes to all its copies.
  Called from anywhere but a tower of the adapter's strategy, `apply` is Keras's own.

  The instance's `apply` attribute is set (once per optimizer); Keras's classes are not
  changed. Only optimizers created in the adapter's scope are routed: by `fit` (its
  model's optimizer, `route_step`), and when they are created in the scope
  (`created_now`: from the variable creation hook, while Keras's constructor runs and
  before it stores its strategy, so `apply` checks it when called), so that a custom
  loop's `apply_gradients` in towers gets the same single apply as `fit`.
  """
  if optimizer is None or _routed_optimizers.get(optimizer) is adapter:
    return
  if not callable(getattr(type(optimizer), "apply", None)) or (
      not created_now and _tf_internal.keras_optimizer_strategy(optimizer) is not adapter):
    return
  optimizer_ref = weakref.ref(optimizer)

  def apply(grads, trainable_variables=None):
    return apply_from_tower(adapter, optimizer_ref(), grads, trainable_variables)

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

  The instance's `update_state` attribute is set (once per tracker); Keras's classes are
  not changed.
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


# Keras CompileLoss -> its StrategyAdapter
_routed_compile_losses: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = \
    weakref.WeakKeyDictionary()


def route_compile_loss(compile_loss, adapter):
  """Makes a model's compiled loss a scalar in an eager tower given no example.

  On a part with no example (`run_eagerly=True`, a batch smaller than the number of
  towers), Keras's loss reduction returns the empty vector of per-example losses as it
  is, and Keras's `compute_loss` then fails to add it to the model's other losses
  (regularizers, `add_loss`): `InvalidArgumentError` "Shapes of all inputs must match".
  Such a tower's loss is its sum, 0: it adds nothing (its gradients are zeros, its
  tracker update is skipped), as on one device, which never sees the empty part.

  The instance's `call` attribute is set (once per compiled loss); Keras's classes are
  not changed.
  """
  if _routed_compile_losses.get(compile_loss) is adapter:
    return
  loss_ref = weakref.ref(compile_loss)

  def call(y_true, y_pred, sample_weight=None):
    loss = type(loss_ref()).call(loss_ref(), y_true, y_pred, sample_weight)
    tower = _context.get_tower_context()
    if tower is None or tower.distribution_strategy is not adapter.diststrat_strategy \
        or tower.batch_share is None:
      return loss
    if isinstance(loss, tf.Tensor) and loss.shape.rank and loss.shape.num_elements() == 0:
      return tf.reduce_sum(loss)
    return loss

  # Plain instance attribute: Keras's own __setattr__ would try to track it.
  object.__setattr__(compile_loss, "call", call)
  _routed_compile_losses[compile_loss] = adapter


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


# StrategyAdapter -> how many `apply_summed` of its strategy are running
_applying_summed: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def apply_from_tower(adapter, optimizer, grads, trainable_variables=None):
  """A routed Keras optimizer's `apply` (see `route_optimizer`).

  Keras's own `apply` runs where there is nothing to sum: outside a tower of the
  adapter's strategy, for an optimizer not of that strategy, and in the towers an
  `apply_summed` runs (a `LossScaleOptimizer` applies its inner optimizer there, on the
  summed gradients).
  """
  tower = _context.get_tower_context()
  if tower is None or tower is _context.default_tower_context() or \
      tower.distribution_strategy is not adapter.diststrat_strategy or \
      _tf_internal.keras_optimizer_strategy(optimizer) is not adapter or \
      _applying_summed.get(adapter, 0):
    return type(optimizer).apply(optimizer, grads, trainable_variables)
  grads = _nothing_without_an_example(list(grads), tower.batch_share)
  variables = None if trainable_variables is None else list(trainable_variables)
  tower.merge_call(apply_summed, adapter, optimizer, grads, variables)
  return None


def _on_a_ps_cluster(strategy):
  """Whether `strategy` is a `ParameterServerStrategy` of a cluster: its steps are bounded
  by `run_step`, and its variables are shared by workers that train at once."""
  return (getattr(strategy, "cluster_spec", None) is not None
          and callable(getattr(strategy, "run_step", None)))


def _atomic_step_counts(strategy, optimizer):
  """Under a `ParameterServerStrategy` of a cluster, makes the step count of `optimizer`
  (and of the optimizer it wraps, for a `LossScaleOptimizer`) go up with one atomic
  `assign_add` on its parameter server.

  Keras 3 increments `iterations` as `self.assign(self + 1)`, a read and then a write:
  workers training at once lost each other's increments (and Adam's bias correction
  and learning-rate schedules read the count). The variable's own `assign_add` is
  replaced on the instance; it adds on the PS, under the variable's lock.
  """
  if not _on_a_ps_cluster(strategy):
    return
  for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
    count = _tf_internal.keras_optimizer_step_count(opt)
    backing = _tf_internal.keras_backing_variable(count)
    if backing is None or "assign_add" in vars(count):
      continue

    def assign_add(value, count=count, backing=backing):
      if _tf_internal.keras_in_stateless_scope():  # Keras records the update there.
        return type(count).assign_add(count, value)
      # The new value, as Keras's own returns.
      return backing.assign_add(tf.cast(value, backing.dtype), read_value=True)

    object.__setattr__(count, "assign_add", assign_add)


def _nothing_without_an_example(grads, share):
  """The tower's gradients, or zeros when its part of the batch has no example.

  A model's gradients on no example are mostly sums over nothing, 0, but not all:
  `BatchNormalization`'s batch mean of no example is 0 / 0, and its gamma's gradient
  gets nan from it, which the sum would spread to every tower. `share` is the tower's
  n / B (None when it was given no part of a batch: every tower counts). In a traced
  step the choice is a `tf.cond` that passes the gradients through (no copy) or zeros.
  """
  if share is None:
    return grads
  present = [i for i, g in enumerate(grads) if g is not None]
  if not present:
    return grads

  def zeros():
    return [tf.IndexedSlices(tf.zeros_like(grads[i].values), grads[i].indices,
                             grads[i].dense_shape)
            if isinstance(grads[i], tf.IndexedSlices) else tf.zeros_like(grads[i])
            for i in present]

  if isinstance(share, (int, float)):
    chosen = [grads[i] for i in present] if share > 0 else zeros()
  else:
    chosen = tf.cond(tf.cast(share, tf.float32) > 0,
                     lambda: [grads[i] for i in present], zeros)
  result = list(grads)
  for i, g in zip(present, chosen, strict=True):
    result[i] = g
  return result


_summed = threading.local()  # state: (copies, Replayer) while Keras applies sums


def summed_copies(value, devices=()):
  """The `Mirrored` sum (a copy on every device) whose first device's copy is `value`,
  for a variable on `devices`.

  While `apply_summed` runs Keras's `apply`, Keras passes the first device's sum of a
  gradient to `extended.update`; this finds the copies of that sum on the other
  devices, so that each copy of the variable is updated from the sum on its own device
  (no copy from the first device). A gradient Keras transformed after the sum (clipped,
  unscaled by a `LossScaleOptimizer`) is, in a traced step, computed again on each
  device from that device's sum (`_replay.Replayer`). Returns None for anything else
  (eager steps, gradient accumulation): `update` then copies the value to each device.
  """
  state = getattr(_summed, "state", None)
  if state is None or not isinstance(value, tf.Tensor):
    return None
  copies, replayer = state
  found = copies.get(value.ref())
  if found is not None:
    return found
  if not set(devices) <= set(replayer.devices):
    return None  # A variable elsewhere (a parameter device): copied there anyway.
  computed = replayer.per_device(value)
  return None if computed is None else _wrapped.Mirrored(computed)


@contextlib.contextmanager
def _remembering(copies, sources, devices):
  saved = getattr(_summed, "state", None)
  _summed.state = (copies, _replay.Replayer(sources, devices)) if sources else None
  try:
    yield
  finally:
    _summed.state = saved


def apply_summed(strategy, adapter, optimizer, grads, variables):
  """merge_fn: sums the towers' gradients, then runs Keras's `apply` once on the sum."""
  present = [i for i, g in enumerate(grads) if g is not None]
  reduced = strategy.batch_reduce("sum", [(grads[i], None) for i in present]) \
      if present else []
  first_device = strategy.worker_devices[0]
  summed = [None] * len(grads)
  copies = {}  # a dense sum's first copy -> the sum (Mirrored)
  sources = {}  # a tensor of a first copy -> that tensor's copy on each device
  for i, value in zip(present, reduced, strict=True):
    if not isinstance(value, _wrapped.DistributedValues):
      summed[i] = value
      continue
    summed[i] = value.get(first_device)
    if isinstance(summed[i], tf.Tensor):
      copies[summed[i].ref()] = value
      sources[summed[i].ref()] = {d: value.get(d) for d in value.devices}
    elif isinstance(summed[i], tf.IndexedSlices):  # A sparse gradient (an embedding's).
      for part in ("values", "indices"):
        sources[getattr(summed[i], part).ref()] = {
            d: getattr(value.get(d), part) for d in value.devices}
  _atomic_step_counts(strategy, optimizer)
  _applying_summed[adapter] = _applying_summed.get(adapter, 0) + 1
  try:
    with _tf_internal.tf_distribution_mode(adapter, SummedGradientsContext(adapter)), \
        _remembering(copies, sources, strategy.worker_devices):
      type(optimizer).apply(optimizer, summed, variables)
  finally:
    _applying_summed[adapter] -= 1


# --- the step: routing, splitting, combining -------------------------------------------


# --- a recurrent cell's dropout masks, one set per tower ------------------------------


def route_dropout_masks(model):
  """Makes each recurrent cell of `model` cache its dropout masks per tower.

  Keras's recurrent cells (`LSTMCell`, `GRUCell`, `SimpleRNNCell`) draw their input and
  recurrent dropout masks when their RNN layer is called, keep them in attributes of
  the cell for every time step, and clear them at the end of the call. The towers share
  the cell, and run one at a time, pausing at each `merge_call`, which every draw makes
  (it advances the seed's state): a tower then found the masks another tower had just
  drawn (another device's, with that tower's part of the batch: a shape error on a
  ragged batch, another tower's mask otherwise), or found them cleared by another tower
  and drew again where the others did not (`MergeCallMismatchError`). The cell's
  `get_*` and `reset_*` methods are replaced on the instance: in a tower, each gives
  Keras's own method that tower's cached mask, and keeps what it returns; anywhere
  else they are Keras's own.
  """
  for cell, attribute, get_name, reset_name in \
      _tf_internal.keras_rnn_dropout_mask_slots(model):
    if get_name in vars(cell):
      continue
    masks = {}  # tower id -> the mask that tower drew
    cell_ref = weakref.ref(cell)

    def get(step_input, attribute=attribute, get_name=get_name, masks=masks,
            cell_ref=cell_ref):
      cell = cell_ref()
      own = getattr(type(cell), get_name)
      tower_id = _tower_id()
      if tower_id is None:
        return own(cell, step_input)
      setattr(cell, attribute, masks.get(tower_id))
      mask = own(cell, step_input)  # A draw pauses the tower; others may run.
      masks[tower_id] = mask
      return mask

    def reset(reset_name=reset_name, masks=masks, cell_ref=cell_ref):
      tower_id = _tower_id()
      if tower_id is not None:
        masks.pop(tower_id, None)
      return getattr(type(cell_ref()), reset_name)(cell_ref())

    # Plain instance attributes: Keras's own __setattr__ would try to track them.
    object.__setattr__(cell, get_name, get)
    object.__setattr__(cell, reset_name, reset)


def _tower_id():
  """The id of the tower of a strategy running now, or None outside any."""
  tower = _context.get_tower_context()
  if tower is None or tower is _context.default_tower_context():
    return None
  return tower.tower_id


def route_step(adapter, fn):
  """Routes what the Keras step `fn` updates: its model's optimizer and loss trackers,
  and the dropout masks of its recurrent cells."""
  model = getattr(fn, "__self__", None)
  route_optimizer(getattr(model, "optimizer", None), adapter)
  if model is not None:
    route_dropout_masks(model)
  if is_train_or_test_step(fn):
    for tracker in _tf_internal.keras_output_loss_trackers(model):
      route_loss_tracker(tracker, adapter)
    tracker = _tf_internal.keras_loss_tracker(model)
    if tracker is not None:
      route_loss_tracker(tracker, adapter)
    compile_loss = _tf_internal.keras_compile_loss(model)
    if compile_loss is not None:
      route_compile_loss(compile_loss, adapter)


def split_step_inputs(strategy, args, kwargs):
  """`(args, kwargs)` with every tensor (or numpy array) with a batch axis split across
  the towers.

  Each is split as `distribute_dataset` does (`BatchParts`; a tower may get no
  example); with several worker processes training on one global batch
  (MultiWorkerMirroredStrategy), this process's towers take their share. Wrapped values
  give each tower its component; anything else is passed to every tower as it is.
  """
  devices = strategy.worker_devices
  first_tower, num_towers = strategy._batch_split()

  def split(x):
    # Keras's eager steps (`run_eagerly=True`) hand `train_on_batch`, `test_on_batch` and
    # `predict_on_batch`'s numpy arrays to `run` as they are: they are batches too.
    if isinstance(x, np.ndarray) and x.ndim != 0:
      x = tf.convert_to_tensor(x)
    if isinstance(x, tf.Tensor) and x.shape.rank != 0:
      return _input.split_batch(x, devices, allow_empty=True, first_tower=first_tower,
                                num_towers=num_towers)
    return check_splittable(x)

  structure = (tuple(args), dict(kwargs or {}))
  return _wrapped.pack_as(structure, [split(x) for x in _wrapped.flatten(structure)])


def combine_step_outputs(strategy, fn, outputs):
  """What `run` returns for the towers' `outputs` of `fn`.

  For a Keras model's `train_step`/`test_step`: its metrics, read in cross-tower context
  after every tower ran (each tower-local metric summed over towers). For anything else:
  each output leaf concatenated over the towers, in tower order (the order of the input
  batch), of every worker process.
  """
  if is_train_or_test_step(fn):
    model = fn.__self__
    metrics = model.get_metrics_result()  # Cross-tower: tower-local metrics summed.
    return _combine_step_logs(strategy, outputs, metrics)
  # Every tower's output, in tower order (the input batch's); with several worker
  # processes, every worker's (MultiWorkerMirroredStrategy gathers across them).
  return _wrapped.pack_as(outputs, [strategy.gather(v, axis=0)
                                    for v in _wrapped.flatten(outputs)])


def _combine_step_logs(strategy, outputs, metrics):
  """A train or test step's `outputs` with each value named by a metric replaced by the
  metric's global value (`metrics`, read in cross-tower context), at any depth of nested
  dicts, and every other value averaged over the towers (`_mean`).

  Nested dicts are what a custom `train_step` returning `{m.name: m.result() for m in
  self.metrics}` gives (Keras's own guide does): the compiled metrics' result is a dict
  (`"compile_metrics": {"mae": ...}`), which Keras flattens into the logs.
  """
  if isinstance(outputs, dict):
    return {k: metrics[k] if k in metrics and not isinstance(v, dict)
            else _combine_step_logs(strategy, v, metrics)
            for k, v in outputs.items()}
  return _wrapped.pack_as(outputs, [_mean(strategy, v) for v in _wrapped.flatten(outputs)])


def _mean(strategy, value):
  """A custom step's output that is not a metric: its mean over every tower.

  With several worker processes (MultiWorkerMirroredStrategy) the mean is over the
  towers of every worker (a collective: every worker runs the same steps), so every
  worker logs the same value, as for metrics.
  """
  if not isinstance(value, _wrapped.DistributedValues):
    return value
  parts = list(value.values)
  if strategy._num_processes() > 1 and all(
      isinstance(p, tf.Tensor) and p.dtype.is_floating for p in parts):
    return strategy.reduce("mean", value).get(strategy.worker_devices[0])
  with tf.device(strategy.worker_devices[0]):
    return tf.add_n(parts) / len(parts)


def is_train_or_test_step(fn):
  """Whether `fn` is a Keras model's own `train_step` or `test_step` (bound to it)."""
  model = getattr(fn, "__self__", None)
  if model is None or not hasattr(model, "get_metrics_result"):
    return False
  return fn == getattr(model, "train_step", None) or fn == getattr(model, "test_step", None)


def check_splittable(value):
  """`value` if `split_step_inputs` may pass it to every tower whole, else raises."""
  if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
    raise TypeError(
        "diststrat splits each batch of model.fit/evaluate/predict across the towers "
        "along its first axis, which it does for dense tensors only. Received: a "
        f"{type(value).__name__}. Convert it to a dense tensor (for example in the "
        "tf.data pipeline) or run the model outside any strategy.")
  return value


# --- a Keras model's compiled steps: bounded on a cluster of parameter servers, placed
# on the one device of an XLA-compiled step -----------------------------------------------

_STEP_FUNCTIONS = {"make_train_function": "train_function",
                   "make_test_function": "test_function",
                   "make_predict_function": "predict_function"}
# Keras model -> the strategy whose run_step runs its steps, or on whose device they run
_bounded_models: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _xla_device(strategy, model):
  """The one device of `strategy` when `model` is compiled with XLA (`jit_compile=True`),
  else None.

  Keras compiles its whole step, the strategy's `run` included, as one XLA function, and
  XLA compiles it for the device its call is placed on: without a device scope, the
  first GPU or CPU, not the strategy's device (`MirroredStrategy(["/gpu:1"])`), whose
  variables XLA then cannot reach. Several devices are refused (`check_jit_compile`).
  """
  if getattr(model, "jit_compile", False) is not True or strategy.num_towers != 1:
    return None
  devices = set(strategy.worker_devices) | set(strategy.parameter_devices)
  return next(iter(devices)) if len(devices) == 1 else None


def bound_steps(adapter, model):
  """Under a `ParameterServerStrategy` of a cluster, makes `model`'s compiled steps run
  through the strategy's `run_step` (bounded by `step_timeout`, and returning once their
  writes reached the parameter servers), as a custom loop's steps do. For a model
  compiled with XLA under a strategy of one device, makes its steps run on that device
  (`_xla_device`).

  Keras calls the function `make_train_function` (and its test and predict siblings)
  made for each batch, directly; a tf.function called directly blocks forever on a
  frozen parameter server. The model's `make_*_function` attributes are replaced on the
  instance: each calls Keras's own, then wraps the function it made; a function made
  already is wrapped at once. Called where diststrat meets the model: its `fit` and
  `evaluate` entering the scope, `predict` asking for its dataset, and each step of
  `fit` and `evaluate` handed to the strategy. (A program whose only Keras call is
  `predict_on_batch` is not met before its steps: they are not bounded.)

  One bound covers one call of a compiled step: `steps_per_execution` steps, and, for
  the first call, the model's trace too; give `step_timeout` room for them.
  """
  strategy = adapter.diststrat_strategy
  if not hasattr(model, "get_metrics_result") or not (
      _on_a_ps_cluster(strategy) or _xla_device(strategy, model) is not None):
    return  # (Only a Keras model (Trainer) has get_metrics_result.)
  if _bounded_models.get(model) is strategy:
    _wrap_step_functions(model, strategy)  # Made since, outside `make_*` (rare).
    return
  model_ref = weakref.ref(model)
  for make_name in _STEP_FUNCTIONS:
    own = getattr(type(model), make_name, None)
    if own is None:
      continue

    def make(*args, own=own, **kwargs):  # A subclass may take other arguments.
      made = own(model_ref(), *args, **kwargs)
      _wrap_step_functions(model_ref(), strategy)
      return made

    object.__setattr__(model, make_name, make)  # Plain instance attribute: not tracked.
  _bounded_models[model] = strategy
  _wrap_step_functions(model, strategy)


_bounded_functions: "weakref.WeakSet[Any]" = weakref.WeakSet()  # The wrappers below.


def _wrap_step_functions(model, strategy):
  model_ref = weakref.ref(model)
  for attribute in _STEP_FUNCTIONS.values():
    function = getattr(model, attribute, None)
    if function is None or function in _bounded_functions:
      continue

    def step(*args, function=function, **kwargs):
      device = _xla_device(strategy, model_ref())  # Its jit_compile may change.
      if device is None:
        return function(*args, **kwargs)
      with tf.device(device):
        return function(*args, **kwargs)

    step.__name__ = f"Keras's {attribute} of model {model.name!r}"  # run_step names it.
    if _on_a_ps_cluster(strategy):
      def bounded(*args, step=step, **kwargs):
        return strategy.run_step(step, *args, **kwargs)
    else:
      bounded = step
    _bounded_functions.add(bounded)
    object.__setattr__(model, attribute, bounded)


# --- a Keras model built from its dataset's element spec, not from a batch of it -------

_spec_built_models: "weakref.WeakSet[Any]" = weakref.WeakSet()


def build_from_element_spec(model):
  """Makes `model`'s `fit` and `evaluate` build it (and its compiled metrics, loss and
  optimizer) from their dataset's element spec, not from a batch taken from the data.

  Under any strategy (tf.distribute's too), Keras's TensorFlow trainer starts `fit` and
  every `evaluate` (each validation included) by iterating the data once more and taking
  one batch, only for its shapes and dtypes; one device makes no such pass. That pass
  changed what the steps see: a Python generator lost the batches it gave it (the first
  ones, and as many more as the prefetch had taken, so a varying number), and a
  `tf.data` dataset that reshuffles each iteration (`shuffle(..., seed=...)`) gave the
  first epoch its second order. The element spec gives the same shapes, the batch size
  left unknown, as a traced step on one device sees. Where the spec leaves another
  dimension unknown (a generator of batches of varying length), a real batch may be
  needed to build the model, and Keras's own pass runs.
  """
  if not hasattr(model, "get_metrics_result") or model in _spec_built_models:
    return  # (Only a Keras model (Trainer) has get_metrics_result.)
  if _tf_internal.wrap_keras_symbolic_build(model, _build_from_element_spec):
    _spec_built_models.add(model)


def _build_from_element_spec(own, iterator=None, data_batch=None):
  if iterator is not None and data_batch is None:
    dataset = _tf_internal.keras_epoch_iterator_dataset(iterator)
    spec = getattr(dataset, "element_spec", None)
    batch = _symbolic_batch(spec) if spec is not None else None
    if batch is not None:
      return own(data_batch=batch)
  return own(iterator=iterator, data_batch=data_batch)


def _symbolic_batch(spec):
  """`spec` (a dataset's element spec) with each leaf's `tf.TensorSpec`, a `None` for an
  empty optional (Keras's placeholder for a missing sample weight); None if a leaf is
  anything else or has an unknown dimension other than the first."""
  usable = True

  def leaf(s):
    nonlocal usable
    if isinstance(s, tf.OptionalSpec):
      return None
    if not isinstance(s, tf.TensorSpec) or s.shape.rank is None or \
        None in s.shape.as_list()[1:]:
      usable = False
    return s

  batch = tf.nest.map_structure(leaf, spec)
  return batch if usable else None
