"""The exceptions diststrat raises.

Each subclasses a builtin exception, so code that catches the builtin types keeps
working: a wrong context (`ContextError`), towers that do not all reach a `merge_call`
(`MergeCallMismatchError`) or overrun their timeout (`TowerTimeoutError`), and cluster
faults (`ClusterError`) are `RuntimeError`s; towers' structures that differ
(`StructureMismatchError`) are a `ValueError`. Bad arguments raise plain `ValueError` or
`TypeError` (docs/concepts.md, "Errors"). Inside a `tf.function` they reach the caller as
themselves (type, message and notes), as in eager mode: AutoGraph is told to let them
through.
"""

import functools
from typing import Any, Callable, TypeVar

from diststrat._tf import tf
from diststrat import _tf_internal

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "ContextError",
    "MergeCallMismatchError",
    "StructureMismatchError",
    "TowerTimeoutError",
    "ClusterError",
]


@_tf_internal.pass_through_autograph_class
class ContextError(RuntimeError):
  """A method was called in a context where it cannot run.

  The message names the current context, the one the method needs and the strategy.
  """


@_tf_internal.pass_through_autograph_class
class MergeCallMismatchError(RuntimeError):
  """Some towers reached a `merge_call` that other towers returned without calling."""


@_tf_internal.pass_through_autograph_class
class StructureMismatchError(ValueError):
  """Towers returned (or passed to `merge_call`) structures that differ."""


@_tf_internal.pass_through_autograph_class
class TowerTimeoutError(RuntimeError):
  """A tower neither reached `merge_call` nor returned within the strategy's timeout."""


@_tf_internal.pass_through_autograph_class
class ClusterError(RuntimeError):
  """A task of a cluster died, froze or could not be reached, or a cluster was misused.

  Attributes:
    task: the task's name, such as "/job:ps/replica:0/task:0", or None when unknown.
  """

  def __init__(self, message, task=None):
    super().__init__(message)
    self.task = task

  def __reduce__(self):  # Keeps `task` when a worker process sends the error back.
    return (type(self), (self.args[0] if self.args else "", self.task), self.__dict__)


def add_note(error, text):
  """Adds `text` to `error` as a note (Python >= 3.11), else to the end of its message."""
  if hasattr(error, "add_note"):
    error.add_note(text)
  elif error.args and isinstance(error.args[0], str):
    error.args = (f"{error.args[0]}\n{text}",) + error.args[1:]


def keeps_errors_in_tf_function(fn: _F) -> _F:
  """Decorator for a public function or method of diststrat: AutoGraph does not convert
  it, and every error leaving it reaches a `tf.function`'s caller as itself (same type,
  message and notes), as in eager mode, instead of being rebuilt with "in user code:"
  in front (or as a `StagingError`)."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except Exception as e:
      _tf_internal.pass_through_autograph(e)
      raise

  return tf.autograph.experimental.do_not_convert(wrapper)  # type: ignore[return-value]
