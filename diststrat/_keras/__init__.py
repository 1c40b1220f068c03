"""Keras 3 under diststrat: everything diststrat does for Keras, in one package.

Keras 3 learns about distribution only through `tf.distribute.get_strategy()`. While a
diststrat context is current, that returns an adapter that answers for diststrat, so
`model.fit`/`evaluate`/`predict` run on every tower, Keras optimizers all-reduce and
update every copy, and batch normalization synchronizes. One module per concept:

- `_mode_listener.py`: keeps TensorFlow's per-thread distribution stack in step with
  diststrat's contexts (an entry naming the adapter while a diststrat context is
  current).
- `_facade.py`: the tf.distribute facade: `StrategyAdapter`, its `extended`, and
  `ReplicaContextAdapter`, which answer the part of tf.distribute Keras uses.
- `_training.py`: Keras training semantics under towers: splitting each batch, weighing
  losses by each tower's share, summing gradients before Keras's optimizer applies them
  once, combining the towers' results.
- `_model_checks.py`: what is refused before a Keras step runs (a model or optimizer
  made outside the strategy's scope, `jit_compile` on several devices, another
  strategy's scope).
- `_file_callbacks.py`: where Keras's file-writing callbacks write in worker processes
  other than the chief.
- `_variable_rules.py`: how the variables Keras makes behave in towers (batch
  normalization's moving statistics, random seeds).
- `_thread_globals.py`: the towers draw unseeded `keras.random` numbers from the calling
  thread's global seed generator (Keras keeps one per thread).

Keras's classes are not changed, but diststrat replaces instance attributes of some
Keras objects, on the instance, while they run under a strategy:

- a Keras optimizer's `apply` (an optimizer created in a strategy's scope), and a
  compiled model's loss trackers' `update_state` (`_training.py`: so that gradients are
  summed before one apply, and each tower's loss counts by its examples);
- in a worker other than the chief, the path attribute of `ModelCheckpoint`,
  `CSVLogger` and `TensorBoard` (`filepath`, `filename`, `log_dir`), `on_train_end`,
  and `BackupAndRestore`'s `on_train_begin` and backup paths (`_file_callbacks.py`:
  so that two workers never write one path), all given back when `fit` ends.

`install()` connects the package to diststrat's core, which knows nothing of Keras: the
mode listener follows the context stack (`_context.add_mode_listener`), tower threads
take the calling thread's global seed generator (`_context.add_thread_state_carrier`), the variable
rules are found by a creation hook (`values._variables.add_rules_finder`), and Keras
variables are unwrapped to the `tf.Variable` they hold wherever diststrat takes a
variable (`_arguments.register_variable_unwrapper`). `import diststrat` calls it. See
docs/keras.md.
"""

from diststrat import _arguments
from diststrat import _context
from diststrat import _strategy
from diststrat import _tf_internal
from diststrat._keras import _facade
from diststrat._keras import _mode_listener
from diststrat._keras import _thread_globals
from diststrat._keras import _training
from diststrat._keras import _variable_rules
from diststrat.values import _variables


def install():
  """Connects the Keras support to diststrat's contexts and variables (idempotent)."""
  _context.add_mode_listener(_mode_listener.tf_mode)
  _context.add_thread_state_carrier(_thread_globals.capture)
  _variables.add_rules_finder(_variable_rules.find_rules)
  _arguments.register_variable_unwrapper(_tf_internal.keras_backing_variable)
  _strategy.add_variable_creation_hook(_route_new_optimizer)


def _route_new_optimizer(strategy):
  """Variable creation hook: a Keras optimizer being created in a real strategy's scope
  (its `iterations`) is routed as `fit` routes its model's (`_training.route_optimizer`),
  so its `apply_gradients` in a custom loop's towers applies once, on the summed
  gradients."""
  if _context.is_default_strategy(strategy):
    return
  optimizer = _tf_internal.keras_optimizer_being_created()
  if optimizer is not None:
    _training.route_optimizer(optimizer, _facade.adapter_for(strategy), created_now=True)


__all__ = ["install"]
