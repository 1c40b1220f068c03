"""What diststrat refuses before it runs a Keras step, with the fix in the message.

`StrategyAdapter.run` (`_facade.py`) calls `check_step` before every step Keras's trainer
hands it; `StrategyAdapter.scope` calls `check_no_other_strategy` and, for the Keras
model asking for it (`fit` building its optimizer there), `check_model`; the
`ExtendedAdapter`'s `update` and `colocate_vars_with` call `check_used_outside` (an
optimizer of the strategy run outside it on a model built outside it). A Keras model
runs under the strategy it was built under, on every tower, or not at all: never
silently on one device. These checks only read Keras objects; they change none.
"""

import typing
import weakref
from typing import Any

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat import errors
from diststrat._arguments import as_tf_variable
from diststrat.values import _variables

if typing.TYPE_CHECKING:  # _facade imports this module: no import at run time.
  from diststrat._keras._facade import StrategyAdapter

# Keras model -> the adapter that checked it
_checked_models: "weakref.WeakKeyDictionary[Any, StrategyAdapter]" = weakref.WeakKeyDictionary()


def check_step(adapter, fn):
  """Refuses to run `fn` (a Keras model's step, or other tf.distribute-aware code) under
  `adapter`'s strategy where it cannot run as on one device."""
  strategy = adapter.diststrat_strategy
  model = getattr(fn, "__self__", None)
  if hasattr(model, "get_metrics_result"):  # A Keras model's step.
    check_no_other_strategy(strategy, f"The Keras model {model.name!r}")  # As in scope().
    check_jit_compile(strategy, model)
  else:
    check_no_other_strategy(strategy, "A function run by tf.distribute-aware code")
  check_model(adapter, model)


def check_model_asking_for_scope(adapter):
  """Checks the Keras model that enters `adapter`'s scope (its `fit`, `evaluate` or
  `predict` building its state there), before Keras builds the optimizer: an optimizer
  created outside the scope would fail there with TensorFlow's "Mixing different
  tf.distribute.Strategy objects", which names no model and no fix. Returns that model
  when it is the adapter's, else None."""
  model = _tf_internal.keras_model_on_stack(max_frames=3, skip=2)
  if model is not None and _tf_internal.keras_model_strategy(model) is adapter:
    check_model(adapter, model)
    return model
  return None


def check_used_outside(adapter, var, what):
  """Refuses `what` (a Keras optimizer of `adapter`'s strategy writing or colocating with
  `var`) outside the strategy when `var` is not the strategy's: a model built outside the
  scope and compiled inside it, run outside it, would train on one device (or fail in
  `colocate_vars_with`)."""
  strategy = adapter.diststrat_strategy
  if _context.get_distribution_strategy() is strategy or \
      _variables.created_by(as_tf_variable(var)) is strategy:
    return
  model = _tf_internal.keras_model_on_stack(max_frames=40)
  where = _context.describe_current_context()
  if model is not None:
    raise errors.ContextError(
        f"The Keras model {model.name!r} was built outside the scope of {strategy!r}, but "
        f"its optimizer ({type(getattr(model, 'optimizer', None)).__name__}) was created "
        f"in it (compile() ran inside `with strategy.scope():`), and it runs in {where}: "
        "the model would train on one device while its optimizer belongs to the "
        "strategy. Build the model inside `with strategy.scope():` too (then compile it "
        "there and call fit as usual), or build and compile it outside any strategy to "
        "train on one device.")
  raise errors.ContextError(
      f"A Keras optimizer created in the scope of {strategy!r} ran {what} on a variable "
      f"created outside that scope ({getattr(var, 'name', var)!r}), in {where}: it would "
      "update it on one device. Create the model's variables inside "
      "`with strategy.scope():` too, or create the optimizer outside any strategy.")


def check_building_inside(adapter, var):
  """Refuses a Keras optimizer of `adapter`'s strategy making its variables (slots for
  `var`, which Keras colocates with `var`) outside the strategy's scope: an optimizer
  created in the scope, not built, applied first outside it. Keras's own call,
  `colocate_vars_with()`, would otherwise be the one named, which the user never made."""
  strategy = adapter.diststrat_strategy
  if _context.get_distribution_strategy() is strategy:
    return
  raise errors.ContextError(
      f"A Keras optimizer created in the scope of {strategy!r} is creating its variables "
      f"(its state for {getattr(var, 'name', var)!r}) in "
      f"{_context.describe_current_context()}, outside that scope: it builds them on its "
      "first apply, and they must be the strategy's. Build the optimizer inside "
      "`with strategy.scope():` (optimizer.build(model.trainable_variables)), or make "
      "its first apply_gradients() there.")


def check_no_other_strategy(strategy, what):
  """Raises when a diststrat strategy other than `strategy` has its context current.

  A Keras model fit inside the scope of a strategy other than its own would otherwise
  fail entering its own strategy's scope, with a message naming a scope the user
  never entered.
  """
  mode = _context.current_mode()
  if not _context.has_distribution_strategy() or mode.strategy is strategy:
    return
  raise errors.ContextError(
      f"{what} created in the scope of {strategy!r} was used inside "
      f"{_context.describe_current_context()}: it runs under the strategy it was "
      "created under, and strategies do not mix. Call fit/evaluate/predict outside any "
      f"strategy's scope (the model keeps its strategy), or inside the scope of "
      f"{strategy!r}; to train under {mode.strategy!r}, build and compile the model "
      "inside that strategy's scope (move the weights with get_weights()/set_weights() "
      "or a checkpoint).")


def check_jit_compile(strategy, model):
  """Refuses `jit_compile=True` where XLA cannot compile the step (several devices)."""
  if model is None or not getattr(model, "jit_compile", False):
    return
  devices = set(strategy.worker_devices) | set(strategy.parameter_devices)
  if len(devices) <= 1 and strategy.num_towers <= 1:
    return  # One device: XLA compiles the step as it would without a strategy.
  raise ValueError(
      f"The Keras model {model.name!r} was compiled with jit_compile=True, but under "
      f"{strategy!r} its step runs on {max(len(devices), strategy.num_towers)} devices "
      f"({strategy.num_towers} towers, each with its own copy or read of the variables, "
      "reduced with the others'), and XLA compiles a step for one device: it cannot "
      "reach the other devices' variables and reductions. Compile it "
      "with jit_compile=False under this strategy (the default, jit_compile='auto', "
      "chooses False under a strategy), or train on one device with XLA.")


def check_model(adapter, model):
  """Refuses (never a silent run on one device) a Keras model not made in the scope of
  `adapter`'s strategy: its variables, and its optimizer. A model that passed is not
  checked again under the same adapter."""
  strategy = adapter.diststrat_strategy
  if model is None or not hasattr(model, "get_metrics_result") or \
      _checked_models.get(model) is adapter:
    return
  foreign = [v.path for v in model.variables
             if _variables.created_by(as_tf_variable(v)) is not strategy]
  if foreign:
    raise errors.ContextError(
        f"The Keras model {model.name!r} runs under {strategy!r}, so its variables must "
        f"be that strategy's. Received: {len(foreign)} variables created outside its "
        f"scope, such as {foreign[:3]}. Build and compile the model inside "
        "`with strategy.scope():` so that its variables are distributed, or train "
        "it outside any strategy.")
  check_stateful_layers(strategy, model)
  optimizer = getattr(model, "optimizer", None)
  captured = _tf_internal.keras_optimizer_strategy(optimizer)
  if captured is not None and captured is not adapter:
    raise errors.ContextError(
        f"The Keras model {model.name!r} runs under {strategy!r}, so its optimizer must "
        "be created in that strategy's scope. Received: an optimizer created outside it "
        f"({type(optimizer).__name__}). Create the optimizer and compile the model inside "
        "`with strategy.scope():`.")
  if model.variables:
    _checked_models[model] = adapter


def check_optimizer_merging(adapter, merge_fn):
  """Refuses a Keras optimizer created outside `adapter`'s strategy scope applying its
  update in one of that strategy's towers (`merge_fn` is its method). Such an optimizer
  is not routed: each tower applied it on its own, so its `iterations` (and with it a
  learning-rate schedule and Adam's bias correction) went up once per tower each step;
  one with slots failed with TensorFlow's "Mixing different tf.distribute.Strategy
  objects"."""
  optimizer = getattr(merge_fn, "__self__", None)
  captured = _tf_internal.keras_optimizer_strategy(optimizer)
  if captured is None or captured is adapter:
    return
  raise errors.ContextError(
      f"A Keras optimizer ({type(optimizer).__name__}) created outside the scope of "
      f"{adapter.diststrat_strategy!r} is applied in one of its towers. It would apply "
      "once per tower: create the optimizer inside `with strategy.scope():`, where its "
      "apply_gradients sums the towers' gradients and applies once per step.")


def check_stateful_layers(strategy, model):
  """Refuses a Keras model with stateful recurrent layers (`stateful=True`) where each
  batch is split across several towers: the layer keeps one state per example of the
  batch from one batch to the next, and no tower sees the whole batch. Keras's own
  error said the batch size was wrong (a tower's part against the batch the state was
  built for), and a fix of the batch size would have averaged the towers' states.
  Checked with the model (`check_model`) and when `predict` asks for its dataset; a
  program whose only call is `predict_on_batch` gets Keras's error."""
  if model is None or not hasattr(model, "get_metrics_result") or strategy.num_towers <= 1:
    return
  stateful = [layer.name for layer in _layers(model) if getattr(layer, "stateful", False) is True]
  if stateful:
    raise ValueError(
        f"The Keras model {model.name!r} has stateful recurrent layers {stateful} "
        f"(stateful=True), but under {strategy!r} each batch is split across "
        f"{strategy.num_towers} towers: a stateful layer carries one state per example "
        "of the whole batch from batch to batch, which no tower sees. Train it with "
        "stateful=False (pass the states as inputs, initial_state=, if batches must "
        "continue each other), or on one device (outside any strategy, or a "
        "MirroredStrategy with one device).")


def check_shuffled_arrays(strategy, dataset):
  """Refuses the dataset Keras made of arrays with `shuffle=True` (or "batch") when
  several worker processes train in step and TensorFlow has no global random seed.

  Every worker runs the same `fit` and keeps its towers' parts of each global batch, so
  the workers must read the same batches. Keras shuffles the arrays with an unseeded
  `tf.random.shuffle`: without a global seed each worker draws its own order, and the
  workers' parts come from different batches (some examples trained on twice an epoch,
  others never), silently. Keras marks that dataset by letting its random state go
  uncheckpointed (`experimental_external_state_policy=IGNORE`), which is how it is
  recognized here.
  """
  if strategy._num_processes() <= 1 or tf.compat.v1.random.get_seed(None)[0] is not None:
    return
  policy = dataset.options().experimental_external_state_policy
  if policy != tf.data.experimental.ExternalStatePolicy.IGNORE:
    return
  raise ValueError(
      f"Keras shuffles the arrays given to fit (shuffle=True, its default) in each of the "
      f"{strategy._num_processes()} worker processes of {strategy!r}, and without a "
      "random seed each worker shuffles them in another order: the workers would split "
      "different global batches, training on some examples twice an epoch and on others "
      "never. Set the same seed in every worker before fit "
      "(keras.utils.set_random_seed(seed), or tf.random.set_seed(seed)), pass "
      "shuffle=False, or pass a tf.data dataset that yields the same batches in every "
      "worker (shuffle(..., seed=seed)).")


def _layers(layer):
  """`layer` and every layer nested in it through `.layers` (models) or a wrapper's
  `.layer`, `.forward_layer` and `.backward_layer` (`Bidirectional`, `TimeDistributed`)."""
  found, stack, seen = [], [layer], set()
  while stack:
    current = stack.pop()
    if id(current) in seen:
      continue
    seen.add(id(current))
    found.append(current)
    stack.extend(getattr(current, "layers", None) or ())
    for name in ("layer", "forward_layer", "backward_layer"):
      inner = getattr(current, name, None)
      if inner is not None and hasattr(inner, "stateful"):
        stack.append(inner)
  return found
