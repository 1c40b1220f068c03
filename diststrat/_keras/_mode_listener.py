"""The mode listener: TensorFlow's idea of the current strategy, kept in step with ours.

`diststrat._keras.install()` registers `tf_mode` with the context module
(`_context.add_mode_listener`); `import diststrat` calls it. The context module then
calls `tf_mode` with every mode a thread enters (a strategy's cross-tower context, or a
tower), and holds the context manager it returns while that mode is current. For a real
strategy that is an entry on TensorFlow's per-thread distribution stack
(`_tf_internal.tf_distribution_mode`, a reach past TensorFlow's public API, which has no
setter for it) naming the strategy's `StrategyAdapter`, and in a tower its
`ReplicaContextAdapter` (`_facade.py`): `tf.distribute.get_strategy()` and
`get_replica_context()` then answer for diststrat. The default strategy pushes nothing:
TensorFlow's own default strategy stands for it.

The entry is pushed and popped with the mode; no attribute of a TensorFlow or Keras
object is replaced. The listener also refuses to enter a diststrat strategy inside a
tf.distribute strategy's scope, and explains TensorFlow's own error when a tf.distribute
strategy is used inside diststrat's: the two libraries' strategies do not mix.
"""

import contextlib

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat import errors
from diststrat._keras import _facade


def tf_mode(strategy, tower_context):
  """The mode listener: what TensorFlow should report while this diststrat mode is current."""
  if _context.is_default_strategy(strategy):
    return None  # TensorFlow's own default strategy stands for ours.
  adapter = _facade.adapter_for(strategy)
  current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
  if current is not None and not isinstance(current, _facade.StrategyAdapter) and \
      not _facade.entering_by_adapter():
    raise errors.ContextError(
        f"Cannot enter the scope of diststrat's {strategy!r} inside the scope of the "
        f"tf.distribute strategy {current!r}: the two libraries' strategies do not mix "
        "(Keras and TensorFlow would see two current strategies). Leave the "
        "tf.distribute scope first, or use only one library's strategies.")
  if tower_context is None:
    mode = _tf_internal.tf_distribution_mode(adapter)
  else:
    mode = _tf_internal.tf_distribution_mode(
        adapter, _facade.ReplicaContextAdapter(adapter, tower_context))
  return _explain_mixing(mode, strategy)


_MIXING = "Mixing different tf.distribute.Strategy objects"  # TensorFlow's error text.
_MIXING_NOTE = "diststrat: a tf.distribute strategy was used inside the scope of "
# How TensorFlow's error names its default strategy (the class of the strategy that
# `tf.distribute.get_strategy()` returns outside any scope).
_TF_DEFAULT_STRATEGY = "DefaultDistributionStrategy object"


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
        if _TF_DEFAULT_STRATEGY in str(e):
          errors.add_note(e, (
              f"{_MIXING_NOTE}diststrat's {strategy!r}: TensorFlow's default strategy, "
              "kept by an object created outside any strategy's scope, such as a Keras "
              "optimizer (it keeps the strategy it was created under, and makes its "
              "slots under it). Create the optimizer inside `with strategy.scope():`. "
              "See docs/keras.md."))
        else:
          errors.add_note(e, (
              f"{_MIXING_NOTE}diststrat's {strategy!r}, where tf.distribute.get_strategy() "
              "is diststrat's adapter: the two libraries' strategies do not mix. Enter the "
              "tf.distribute strategy's scope outside any diststrat scope (and build its "
              "models there), or use only diststrat's strategies. See docs/keras.md."))
      raise

