"""Keras 3 objects, where Keras has no public accessor.

- A Keras 3 variable holds its TensorFlow variable in `_value`
  (`keras_backing_variable`); a Keras optimizer keeps the tf.distribute strategy it was
  created under in `_distribution_strategy` (`keras_optimizer_strategy`).
- A compiled model's per-output loss trackers live on its `_compile_loss`
  (`keras_output_loss_trackers`), which is also the loss `compile` was given
  (`keras_compile_loss`).
- Whether Keras's trainer or loss module is the caller (`called_by_keras_trainer`,
  `called_by_keras_loss`).
- The dataset of `fit`'s and `evaluate`'s epoch iterator
  (`keras_epoch_iterator_dataset`), and the model's build from a batch before the first
  step (`wrap_keras_symbolic_build`).
- The callbacks of the `fit` call running (`keras_fit_callbacks`), and the file paths a
  `BackupAndRestore` callback derives from its directory (`set_keras_backup_dir`,
  `restore_keras_backup_dir`).
- Where a recurrent cell caches its dropout masks between its RNN layer's steps
  (`keras_rnn_dropout_mask_slots`).
- Which Keras code is creating a variable (layer state, a random seed's state) is told
  by no argument of the variable creator; the creating frames say it
  (`keras_variable_origin`).
- Keras 3 writes a variable's `assign_add(delta)` as `assign(self + delta)`; the calling
  frames tell the delta (`keras_assign_increment`).
- Keras 3 keeps its global state (layer-name counters, the global dtype policy, the global
  seed generator that `keras.random.*` draws from without a seed) per thread, with no
  public accessor for another thread's (`keras_thread_globals`,
  `keras_global_seed_generator`, `set_keras_global_seed_generator`,
  `keras_name_counters`, `set_keras_name_counters`, `keras_dtype_policy`,
  `set_keras_dtype_policy`).

Keras's modules are looked up among those already imported (a Keras variable being
created means Keras is loaded), never imported here.
"""

import collections
import functools
import inspect
import os
import sys
import weakref

from diststrat._tf import tf


def keras_backing_variable(value):
  """The `tf.Variable` a Keras 3 variable holds, or None if `value` is not one.

  Keras 3 keeps it in `_value`; its public `.value` reads the variable instead.
  """
  if type(value).__module__.startswith("keras") and hasattr(value, "_value"):
    inner = value._value  # pylint: disable=protected-access
    if isinstance(inner, tf.Variable):
      return inner
  return None


def keras_seed_generators(layer):
  """The `SeedGenerator`s a Keras 3 layer and its sublayers made (Dropout's,
  GaussianNoise's, an LSTM's cell's, those of a nested model's layers, ...), which Keras
  tracks per layer without a public accessor; [] for anything else."""
  flatten = getattr(layer, "_flatten_layers", None)
  layers = list(flatten(include_self=True, recursive=True)) if flatten else [layer]
  generators, seen = [], set()
  for sublayer in layers:
    for generator in getattr(sublayer, "_seed_generators", None) or ():
      if id(generator) not in seen:
        seen.add(id(generator))
        generators.append(generator)
  return generators


def keras_rnn_dropout_mask_slots(layer):
  """Where Keras 3 caches the dropout masks of the recurrent cells of `layer` and its
  sublayers: one `(cell, attribute, get_method, reset_method)` per mask, [] for a layer
  with no such cell.

  A cell that mixes in Keras's `DropoutRNNCell` (`LSTMCell`, `GRUCell`,
  `SimpleRNNCell`, ...) draws its input and recurrent dropout masks once per call of its
  RNN layer and keeps them in the plain attributes `_dropout_mask` and
  `_recurrent_dropout_mask` until the layer resets them; there is no public accessor.
  """
  flatten = getattr(layer, "_flatten_layers", None)
  layers = list(flatten(include_self=True, recursive=True)) if flatten else [layer]
  slots, seen = [], set()
  for cell in layers:
    if id(cell) in seen:
      continue
    seen.add(id(cell))
    for attribute, get_method, reset_method in (
        ("_dropout_mask", "get_dropout_mask", "reset_dropout_mask"),
        ("_recurrent_dropout_mask", "get_recurrent_dropout_mask",
         "reset_recurrent_dropout_mask")):
      if callable(getattr(type(cell), get_method, None)) and \
          callable(getattr(type(cell), reset_method, None)):
        slots.append((cell, attribute, get_method, reset_method))
  return slots


def keras_optimizer_step_count(optimizer):
  """The Keras 3 variable an optimizer counts its applied steps in, or None: its
  `iterations`, which with `gradient_accumulation_steps` is a tensor computed from it."""
  count = getattr(optimizer, "_iterations", None)
  return count if count is not None else getattr(optimizer, "iterations", None)


def keras_in_stateless_scope():
  """Whether Keras 3 is in a `StatelessScope` (its variables' writes are recorded, not
  made)."""
  try:
    from keras.src.backend.common import stateless_scope  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - another Keras layout
    return False
  return bool(stateless_scope.in_stateless_scope())


_KERAS_GLOBAL_STATE_MODULE = "keras.src.backend.common.global_state"
_KERAS_SEED_GENERATOR_MODULE = "keras.src.random.seed_generator"


def keras_thread_globals():
  """This thread's Keras 3 global state, a dict that another thread may read and write
  (Keras reads it with `getattr` on a `threading.local`), or None before Keras is
  loaded. `keras.backend.clear_session()` replaces every thread's."""
  module = sys.modules.get(_KERAS_GLOBAL_STATE_MODULE)
  tracker = getattr(module, "GLOBAL_STATE_TRACKER", None)
  return None if tracker is None else tracker.__dict__


def _global_seed_generator_key():
  module = sys.modules.get(_KERAS_SEED_GENERATOR_MODULE)
  return getattr(module, "GLOBAL_SEED_GENERATOR", "global_seed_generator")


def keras_global_seed_generator(thread_globals):
  """The global `SeedGenerator` recorded in `thread_globals` (from
  `keras_thread_globals`), or None: Keras makes it on the first draw without a seed in
  that thread, and `keras.utils.set_random_seed` drops the calling thread's."""
  return thread_globals.get(_global_seed_generator_key())


def set_keras_global_seed_generator(thread_globals, generator):
  """Makes `generator` (a `SeedGenerator`, or None: Keras makes a new one when needed)
  the global seed generator of the thread whose `keras_thread_globals` these are."""
  thread_globals[_global_seed_generator_key()] = generator


def keras_name_counters(thread_globals):
  """The counters Keras numbers new objects' default names by (`dense`, `dense_1`, ...)
  in the thread whose `keras_thread_globals` these are: a dict of prefix to count, made
  as Keras makes it if that thread has none yet."""
  counters = thread_globals.get("object_name_uids")
  if counters is None:
    counters = collections.defaultdict(int)
    thread_globals["object_name_uids"] = counters
  return counters


def keras_dtype_policy(thread_globals):
  """The global dtype policy (`keras.config.set_dtype_policy`) set in the thread whose
  `keras_thread_globals` these are, or None (Keras's default: `keras.config.floatx()`)."""
  return thread_globals.get("dtype_policy")


def set_keras_dtype_policy(thread_globals, policy):
  """Makes `policy` (from `keras_dtype_policy`) the global dtype policy of the thread
  whose `keras_thread_globals` these are."""
  thread_globals["dtype_policy"] = policy


def set_keras_name_counters(thread_globals, counters):
  """Makes `counters` (from `keras_name_counters`) the name counters of the thread whose
  `keras_thread_globals` these are."""
  thread_globals["object_name_uids"] = counters


def keras_optimizer_strategy(optimizer):
  """The `tf.distribute` strategy a Keras 3 optimizer captured when created, or None.

  Keras's TensorFlow optimizer applies its updates through that strategy, and has no
  public accessor for it.
  """
  return getattr(optimizer, "_distribution_strategy", None)


def keras_model_strategy(model):
  """The `tf.distribute` strategy a Keras 3 model captured when created in a strategy's
  scope, or None (created outside any).

  Keras's TensorFlow trainer runs `fit`/`evaluate`/`predict` under that strategy (else
  under the current one), and has no public accessor for it.
  """
  return getattr(model, "_distribute_strategy", None)


def _frames_above(depth, limit):
  """At most `limit` frames, from the one `depth` levels above the function that iterates
  this (1: that function's caller) outwards."""
  frame = sys._getframe(depth + 1)  # pylint: disable=protected-access
  for _ in range(limit):
    if frame is None:
      return
    yield frame
    frame = frame.f_back


def _local_of_caller_running(code, name, limit):
  """The local `name` of the nearest frame, among `limit` above the function that calls
  this one, that runs `code`; None if none does."""
  for frame in _frames_above(2, limit):
    if frame.f_code is code:
      return frame.f_locals.get(name)
  return None


def keras_model_on_stack(max_frames, skip=1):
  """The innermost Keras model whose method runs in this thread, within `max_frames`
  frames above the caller's caller (`skip` more frames up), or None.

  Keras hands the tf.distribute strategy it calls (diststrat's adapter) no model; its
  trainer's methods (`fit`, `train_step`, ...) have it as `self`. diststrat asks only to
  check that model and to name it in an error.
  """
  for frame in _frames_above(skip + 1, max_frames):
    candidate = frame.f_locals.get("self")
    if hasattr(candidate, "get_metrics_result"):  # A Keras model (Trainer), not a layer.
      return candidate
  return None


def keras_output_loss_trackers(model):
  """The `keras.metrics.Mean` trackers of a compiled Keras 3 model's per-output losses.

  Keras keeps them on the model's `_compile_loss` (a `CompileLoss`, built on the first
  step); they are the "<output>_loss" entries of the logs. No public accessor tells them
  from the model's other metrics. Empty when the model has none (one output, not
  compiled, not built yet).
  """
  compile_loss = getattr(model, "_compile_loss", None)
  return list(getattr(compile_loss, "metrics", None) or [])


def keras_compile_loss(model):
  """The `CompileLoss` a Keras 3 model computes its compiled loss with, or None.

  Keras's trainer calls the model's `_compile_loss` (built from `compile`'s `loss`, None
  before `compile`) in `compute_loss`; no public accessor returns it. Calling it calls
  its `call` method, looked up on the instance.
  """
  return getattr(model, "_compile_loss", None)


def keras_loss_tracker(model):
  """The `keras.metrics.Mean` behind the "loss" entry of a Keras 3 model's logs, or None.

  Keras's trainer updates it in every train/test step with the step's loss and the
  batch size as weight; it keeps it as `model._loss_tracker`, with no public accessor.
  """
  return getattr(model, "_loss_tracker", None)


def keras_epoch_iterator_dataset(iterator):
  """The dataset a Keras 3 `fit`/`evaluate` epoch iterator iterates, or None.

  Keras's TensorFlow trainer (`TFEpochIterator`) keeps what the strategy's
  `experimental_distribute_dataset` returned in `_distributed_dataset`, with no public
  accessor.
  """
  return getattr(iterator, "_distributed_dataset", None)


def wrap_keras_symbolic_build(model, wrapper):
  """Replaces a Keras 3 model's `_maybe_symbolic_build` on the instance (its class is not
  changed) by `wrapper(own, iterator=None, data_batch=None)`, `own` being the class's
  method bound to the model. False if the model's class has no such method.

  Under a strategy, Keras's TensorFlow trainer calls it at the start of `fit` and of
  each `evaluate` (validation included), to build the model, its compiled metrics and
  loss and the optimizer before the first step. Given the epoch iterator, it takes a
  batch from a pass of its own over the data, which one device never makes; given a
  `data_batch`, it takes the batch's shapes and dtypes only. No public argument or hook
  chooses which.
  """
  own = getattr(type(model), "_maybe_symbolic_build", None)
  if own is None:
    return False
  model_ref = weakref.ref(model)

  def maybe_symbolic_build(iterator=None, data_batch=None):
    return wrapper(functools.partial(own, model_ref()), iterator=iterator,
                   data_batch=data_batch)

  object.__setattr__(model, "_maybe_symbolic_build", maybe_symbolic_build)  # Not tracked.
  return True


_KERAS_TF_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
_FIT_FRAMES_SEARCHED = 12


def keras_fit_callbacks():
  """The `callbacks` argument of the Keras `fit` call running in this thread, or None.

  Keras passes a strategy nothing about `fit`'s callbacks, and it builds its
  `CallbackList` (which calls `set_model` and then `on_train_begin`) after it asked the
  strategy to distribute the dataset. Called from there, the calling frames reach
  `TensorFlowTrainer.fit` and its `callbacks` argument (a list, a `CallbackList` or None)
  while they can still be changed. None outside a `fit` (evaluate, predict, custom code).
  """
  trainer = getattr(sys.modules.get(_KERAS_TF_TRAINER_MODULE), "TensorFlowTrainer", None)
  # Keras wraps `fit` (traceback filtering): the frame runs the wrapped function's code.
  fit = getattr(inspect.unwrap(getattr(trainer, "fit", None)), "__code__", None)
  if fit is None:
    return None
  return _local_of_caller_running(fit, "callbacks", _FIT_FRAMES_SEARCHED)


def called_by_keras_trainer():
  """Whether the function calling this was called by Keras 3's TensorFlow trainer.

  Keras's trainer calls `strategy.run` for its train, test and predict steps, and then
  combines the per-replica results with code of its own that knows only tf.distribute's
  values; nothing it passes says it is the caller. The caller's caller's module says it.
  """
  frame = next(_frames_above(2, 1), None)
  return frame is not None and frame.f_globals.get("__name__") == _KERAS_TF_TRAINER_MODULE


_KERAS_LOSS_MODULE = "keras.src.losses.loss"


def called_by_keras_loss():
  """Whether the function calling this was called by Keras 3's loss module.

  Keras scales and unscales its losses for distribution there
  (`scale_loss_for_distribution`, `unscale_loss_for_distribution`) by
  `tf.distribute.get_strategy().num_replicas_in_sync`, which tells nothing of the caller;
  the caller's caller's module says it.
  """
  frame = next(_frames_above(2, 1), None)
  return frame is not None and frame.f_globals.get("__name__") == _KERAS_LOSS_MODULE


_BACKUP_PATHS = ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                 "_prev_training_metadata_path")


def set_keras_backup_dir(callback, backup_dir):
  """Points a Keras `BackupAndRestore` callback at `backup_dir`; returns what it had.

  The callback derives its file paths (`_weights_path`, ...) from `backup_dir` once, in
  `__init__`, and keeps them in private attributes; they are derived here the same way
  (relative to the old directory). Pass the returned state to
  `restore_keras_backup_dir` to point it back.
  """
  old_dir = callback.backup_dir
  state = {"backup_dir": old_dir}
  for name in _BACKUP_PATHS:
    old = getattr(callback, name)
    state[name] = old
    relative = os.path.relpath(old, old_dir)
    setattr(callback, name, os.path.join(backup_dir, relative))
  callback.backup_dir = backup_dir
  return state


def restore_keras_backup_dir(callback, state):
  """Undoes `set_keras_backup_dir` with the state it returned."""
  for name, value in state.items():
    setattr(callback, name, value)


# Where Keras 3 (TensorFlow backend) makes the tf.Variable behind a `keras.Variable`, and
# where a SeedGenerator makes its state.
_KERAS_VARIABLE_MODULE = "keras.src.backend.tensorflow.core"
_KERAS_SEED_MODULE = "keras.src.random.seed_generator"
_KERAS_OPTIMIZER_MODULE = "keras.src.optimizers.base_optimizer"
_KERAS_FRAMES_SEARCHED = 60


def keras_optimizer_being_created():
  """The Keras 3 optimizer whose constructor is running in this thread, or None.

  Call it from a variable creator: a Keras optimizer creates its `iterations` variable in
  `BaseOptimizer.__init__`, before anything else could name it (its TensorFlow subclass
  stores the current strategy after that). Keras passes nothing that says so, so the
  calling frames are searched for `BaseOptimizer.__init__`, and its `self` is the
  optimizer.
  """
  optimizer_init = _keras_code(_KERAS_OPTIMIZER_MODULE, ("BaseOptimizer", "__init__"))
  if optimizer_init is None:
    return None
  return _local_of_caller_running(optimizer_init, "self", _KERAS_FRAMES_SEARCHED)


def _keras_code(module_name, path):
  obj = sys.modules.get(module_name)
  for name in path:
    obj = getattr(obj, name, None)
  return getattr(obj, "__code__", None)


_KERAS_COMMON_VARIABLE_MODULE = "keras.src.backend.common.variables"
_ASSIGN_FRAMES_SEARCHED = 16


def keras_assign_increment(variable):
  """`("assign_add", delta)` or `("assign_sub", delta)` when the write to `variable` (a
  `tf.Variable` a Keras 3 variable holds) running in this thread is that Keras variable's
  `assign_add(delta)` or `assign_sub(delta)`; None for any other write.

  Keras 3 writes `assign_add(delta)` as `assign(self + delta)`, so the TensorFlow
  variable is handed the new value, never the delta. Call it from the variable's
  `assign`: the calling frames are searched for Keras's `Variable.assign` of the Keras
  variable holding `variable`, and the frame that called it says whether it was
  `assign_add` or `assign_sub`, and with which delta (its `value`).
  """
  keras_variable = getattr(sys.modules.get(_KERAS_COMMON_VARIABLE_MODULE), "Variable", None)
  if keras_variable is None:
    return None
  assign = getattr(keras_variable.assign, "__code__", None)
  increments = {getattr(keras_variable.assign_add, "__code__", None): "assign_add",
                getattr(keras_variable.assign_sub, "__code__", None): "assign_sub"}
  for frame in _frames_above(1, _ASSIGN_FRAMES_SEARCHED):
    if frame.f_code is not assign:
      continue
    owner = frame.f_locals.get("self")
    caller = frame.f_back
    if (keras_backing_variable(owner) is not variable or caller is None
        or caller.f_code not in increments or caller.f_locals.get("self") is not owner):
      return None
    return increments[caller.f_code], caller.f_locals.get("value")
  return None


def keras_variable_origin():
  """Who is creating the variable being created now: "seed", "keras" or None.

  "keras": a `keras.Variable` (layer weights and state, optimizer and metric variables)
  is making its TensorFlow variable; "seed": that variable is the state of a Keras
  `SeedGenerator` (Dropout and every random layer); None: anything else. Call it from a
  variable creator. Keras passes nothing that says so, so the calling frames are
  searched for `keras.Variable._initialize` and `SeedGenerator.__init__`.
  """
  variable_init = _keras_code(_KERAS_VARIABLE_MODULE, ("Variable", "_initialize"))
  if variable_init is None:
    return None
  seed_init = _keras_code(_KERAS_SEED_MODULE, ("SeedGenerator", "__init__"))
  origin = None
  for frame in _frames_above(1, _KERAS_FRAMES_SEARCHED):
    if frame.f_code is variable_init:
      origin = "keras"
    elif frame.f_code is seed_init:
      return "seed" if origin else None
  return origin
