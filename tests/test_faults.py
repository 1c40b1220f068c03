"""Which TensorFlow errors are cluster faults (diststrat/_cluster_runtime/_faults.py).

The cluster tests (tests/test_cluster.py, tests/test_multi_worker.py) feed these
functions real errors from killed and restarted tasks; here, the formats those errors
had in TensorFlow 2.21, so that a TensorFlow that rewords them fails here by name.
"""

import pytest
import tensorflow as tf

import diststrat  # noqa: F401  # pylint: disable=unused-import
from diststrat._cluster_runtime import _faults


def test_as_op_error():
  lost = _faults.as_op_error(RuntimeError("Failed copying input tensor: Socket closed"))
  assert isinstance(lost, tf.errors.UnavailableError) and "Socket closed" in lost.message
  other = RuntimeError("Incompatible shapes")
  assert _faults.as_op_error(other) is other


def test_error_summary():
  error = tf.errors.UnavailableError(
      None, None, "Graph execution error:\n\nDetected at node x\n(0) UNAVAILABLE: Socket "
      "closed\nAdditional GRPC error information from remote target /job:ps/replica:0/task:0")
  assert _faults.error_summary(error) == "UNAVAILABLE: Socket closed"
  assert len(_faults.error_summary(RuntimeError("x" * 500))) == 200


def test_tasks_named_in_error():
  tasks = ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"]
  error = tf.errors.UnavailableError(
      None, None, "Failed to connect to /job:ps/replica:0/task:1 (Connection refused)")
  assert _faults.tasks_named_in_error(error, tasks) == tasks[1:]


@pytest.mark.parametrize("error_type, text, restarted", [
    (tf.errors.AbortedError, "Unable to find a context_id matching the specified one", True),
    (tf.errors.InvalidArgumentError, "Unable to find the relevant tensor remote_handle", True),
    (tf.errors.NotFoundError, "The remote task was probably restarted", True),
    (tf.errors.InvalidArgumentError, "Incompatible shapes: [2] vs. [3]", False),
    (tf.errors.UnavailableError, "context_id", False),
])
def test_error_means_task_restarted(error_type, text, restarted):
  assert _faults.error_means_task_restarted(error_type(None, None, text)) is restarted, text


@pytest.mark.parametrize("error_type, text, lost", [
    (tf.errors.InternalError, "This should never happen. Additional GRPC error information "
     "from remote target /job:ps/replica:0/task:1 while calling /tensorflow.WorkerService/"
     "RecvTensor: {grpc_status:14, grpc_message:\"failed to connect to all addresses\"}", True),
    (tf.errors.UnavailableError, "Socket closed", True),
    (tf.errors.InternalError, "Blas GEMM launch failed", False),
])
def test_error_means_connection_lost(error_type, text, lost):
  assert _faults.error_means_connection_lost(error_type(None, None, text)) is lost, text


@pytest.mark.parametrize("text, nothing_listens", [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:37957: "
     "Failed to connect to remote host: Connection refused", True),  # A killed task's.
    ("Socket closed", False),  # A healthy task's stream being re-opened.
    ("recvmsg:Connection reset by peer", False),  # The old connection of a killed task.
])
def test_error_means_nothing_listens(text, nothing_listens):
  error = tf.errors.UnavailableError(None, None, text)
  assert _faults.error_means_nothing_listens(error) is nothing_listens, text


@pytest.mark.parametrize("error, fault", [
    (tf.errors.UnavailableError(None, None, "Connection refused"), True),
    (tf.errors.DeadlineExceededError(None, None, "Timed out"), True),
    (tf.errors.AbortedError(None, None, "Unable to find a context_id matching"), True),
    (tf.errors.InternalError(None, None, "{grpc_status:14, grpc_message:\"x\"}"), True),
    (tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]"), False),
    (RuntimeError("Socket closed"), False),  # Not an op error: as_op_error makes it one.
])
def test_is_cluster_fault(error, fault):
  assert _faults.is_cluster_fault(error) is fault
