"""Which TensorFlow errors are cluster faults, and what their text says.

TensorFlow tells a dead task, a restarted task and a lost connection apart only in the
text of its errors (and with types that other failures share), so this module reads
that text: the one place diststrat does. A TensorFlow upgrade that rewords an error
fails tests/test_cluster_runtime.py (the cases below), not a user's recovery.
"""

import re

from diststrat._tf import tf

_TASK_PATTERN = re.compile(r"/job:[A-Za-z0-9_]+/replica:\d+/task:\d+")
_RESTARTED_PATTERN = re.compile(
    r"context_id|Unable to find the relevant tensor|incarnation|was probably restarted")
_CONNECTION_LOST = re.compile(
    r"failed to connect|Connection refused|Connection reset|Socket closed|UNAVAILABLE|"
    r"grpc_status:14", re.IGNORECASE)
_NOISE = ("Graph execution error", "Detected at node", "<stack traces", "root error(s)",
          "(most recent call last)", "Additional GRPC error information")


def error_summary(error, limit=200):
  """The line of a TensorFlow error's message that says what happened (at most `limit`).

  Example:
    >>> error_summary(RuntimeError("Graph execution error:\\n(0) UNAVAILABLE: Socket closed"))
    'UNAVAILABLE: Socket closed'
  """
  text = error.message if isinstance(error, tf.errors.OpError) else str(error)
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  useful = [line for line in lines if not any(noise in line for noise in _NOISE)]
  line = (useful or lines or [""])[0]
  line = re.sub(r"^\(\d+\)\s*", "", line)  # "(0) UNAVAILABLE: ..." -> "UNAVAILABLE: ..."
  return line if len(line) <= limit else line[:limit - 3] + "..."


def tasks_named_in_error(error, tasks):
  """The tasks of `tasks` (such as "/job:ps/replica:0/task:0") that `error` names."""
  named = set(_TASK_PATTERN.findall(str(error)))
  return [t for t in tasks if t in named]


def error_means_connection_lost(error):
  """Whether an error's text says a connection to a remote task failed.

  TensorFlow reports some lost connections as `InternalError` or `UnknownError` ("This
  should never happen"), and a failed remote copy as a bare `RuntimeError`, with the
  gRPC status (14, UNAVAILABLE) only in the text.
  """
  return bool(_CONNECTION_LOST.search(str(error)))


def error_means_nothing_listens(error):
  """Whether an error's text says the task's address refused the connection: no process
  listens there (it died, or has not started yet). A healthy task never says this;
  one whose stream TensorFlow is re-opening says "Socket closed" instead."""
  return "Connection refused" in str(error)


def error_means_task_restarted(error):
  """Whether a TensorFlow error says a remote task restarted (its state is gone).

  TensorFlow raises these as `AbortedError`, `InvalidArgumentError` or `NotFoundError`,
  told apart from other errors of those types only by their text.
  """
  return isinstance(error, (tf.errors.AbortedError, tf.errors.InvalidArgumentError,
                            tf.errors.NotFoundError)) and bool(
                                _RESTARTED_PATTERN.search(str(error)))


def is_cluster_fault(error):
  """Whether a TensorFlow error means a task died, restarted or could not be reached."""
  if isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
    return True
  return (error_means_task_restarted(error) or
          (isinstance(error, tf.errors.OpError) and error_means_connection_lost(error)))


def may_follow_a_fault(error):
  """Whether `error` may be the echo of a fault elsewhere: TensorFlow cancels the other
  parts of a function when one part fails on a remote task (a restarted task's "unknown
  context", a dead one's lost connection), and the caller may get a part's
  `CancelledError` first. Only probing the tasks tells such an echo from a cancellation
  of the caller's own."""
  return isinstance(error, tf.errors.CancelledError)


def as_op_error(error):
  """A bare `RuntimeError` whose text says the connection was lost, as `UnavailableError`
  (the type an op's failure would have had); any other error as it is."""
  if not isinstance(error, tf.errors.OpError) and error_means_connection_lost(error):
    return tf.errors.UnavailableError(None, None, str(error))
  return error
