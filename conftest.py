"""Test set-up for tests/ and the doctests in diststrat/: four logical CPU devices.

They are configured once, before TensorFlow initializes; this file sits at the top of the
repository so that the doctests of the package get them too.
"""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

NUM_CPUS = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_CPUS)

CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(NUM_CPUS)]


@pytest.fixture
def no_thread_leak():
  """Fails the test if it leaves more threads running than it found."""
  before = set(threading.enumerate())
  yield
  leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
  for t in leaked:
    t.join(timeout=5)
  leaked = [t for t in leaked if t.is_alive()]
  assert not leaked, f"threads left behind: {leaked}"
