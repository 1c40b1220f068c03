"""TensorFlow's per-thread distribution-mode stack.

Keras 3 and TensorFlow learn about a distribution strategy only from this stack, which
has no public setter: diststrat puts an entry there while one of its contexts is current
(`tf_distribution_mode`), so that `tf.distribute.get_strategy()` answers for diststrat
(see diststrat/_keras/_mode_listener.py and _facade.py).
"""

import contextlib

from tensorflow.python.framework import ops as _ops  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf_internal import _base


class _DistributionMode:
  """An entry of TensorFlow's per-thread distribution-mode stack (three attributes)."""

  def __init__(self, strategy, cross_replica_context, replica_context):
    self.strategy = strategy
    self.cross_replica_context = cross_replica_context
    self.replica_context = replica_context


def _distribution_mode_stack():
  stack = getattr(_ops.get_default_graph(), "_distribution_strategy_stack", None)
  if not isinstance(stack, list):
    raise _base.missing("the per-thread distribution stack of TensorFlow's graphs "
                        "(Graph._distribution_strategy_stack)",
                        "it is gone, so Keras would train on one device under diststrat")
  return stack


@contextlib.contextmanager
def tf_distribution_mode(strategy, replica_context=None):
  """Makes `tf.distribute` report `strategy` (and `replica_context`) in this thread.

  While entered, `tf.distribute.get_strategy()` returns `strategy`, `has_strategy()` is
  True, and `get_replica_context()` returns `replica_context`; with `replica_context`
  None it is the cross-replica context of `strategy`. The entry goes on the current
  default graph's stack (a `tf.function` being traced copies the stack of the graph
  around it) and is removed from that same stack on exit.
  """
  stack = _distribution_mode_stack()
  entry = _DistributionMode(strategy, strategy if replica_context is None else None,
                            replica_context)
  stack.append(entry)
  try:
    yield
  finally:
    for i in range(len(stack) - 1, -1, -1):
      if stack[i] is entry:
        del stack[i]
        break
