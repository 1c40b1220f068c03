"""Test set-up for tests/ and the doctests in diststrat/: four logical CPU devices.

They are configured once, before TensorFlow initializes; this file sits at the top of the
repository so that the doctests of the package get them too.
"""

import os
import subprocess
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

NUM_CPUS = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_CPUS)

CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(NUM_CPUS)]

# The suite starts dozens of LocalClusters one after another: they share one fork server
# (its TensorFlow import paid once), which stops when pytest exits. Each cluster's tasks
# are still fresh forks; tests/test_forkserver.py covers a cluster's own server.
from diststrat.cluster import _local_cluster  # pylint: disable=g-import-not-at-top,wrong-import-position
from diststrat.strategies import _tower_threads  # pylint: disable=g-import-not-at-top,wrong-import-position

_local_cluster.share_fork_server(True)


@pytest.fixture
def no_thread_leak():
  """Fails the test if it leaves more threads running than it found. Idle pooled tower
  threads are not left behind: the next call reuses them (strategies/_tower_threads.py)."""
  before = set(threading.enumerate())
  yield
  idle = set(_tower_threads.idle_tower_threads())
  leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()
            and t not in idle]
  for t in leaked:
    t.join(timeout=5)
  leaked = [t for t in leaked if t.is_alive()]
  assert not leaked, f"threads left behind: {leaked}"


def _children(pid):
  """Process ids whose parent is `pid` (from /proc; zombies count)."""
  result = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    fields = stat[stat.rfind(")") + 2:].split()
    if int(fields[1]) == pid:
      result.append(int(entry))
  return result


@pytest.fixture
def no_child_left():
  """Fails the test if it leaves a child process behind (15 s to exit).

  The clusters' shared fork server lives until pytest exits (see above): its children are
  the tasks, which must be gone too.
  """
  before = set(_children(os.getpid()))
  yield
  deadline = time.monotonic() + 15
  while True:
    server = _local_cluster.shared_fork_server_pid()
    left = set(_children(os.getpid())) - before - {server}
    if server is not None:
      left |= set(_children(server))
    if not left or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  assert not left, f"child processes left behind: {sorted(left)}"


# Modules whose tests measure bounds (timeouts, fault detection, how long a kill takes to
# be seen): under pytest-xdist their process tests run in one worker, one after another.
_BOUNDS_MODULES = ("test_cluster", "test_ps_faults", "test_multi_worker", "test_forkserver",
                   "test_security", "test_tf_internal", "test_pipeline")


def pytest_collection_modifyitems(items):
  """`make test` runs two pytest-xdist workers (`--dist loadgroup`). The tests that start
  processes and measure bounds form one group: one worker runs them one after another,
  as without xdist, so no second cluster of theirs competes for the cores while they
  time a fault. Every other test (in-process ones, doc pages, demo and launcher runs)
  goes to whichever worker is free."""
  for item in items:
    if (item.get_closest_marker("processes") is not None and
        getattr(item, "module", None) is not None and
        item.module.__name__.rsplit(".", 1)[-1] in _BOUNDS_MODULES):
      item.add_marker(pytest.mark.xdist_group("bounds"))


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
  """A test that starts a process must be marked `processes`: `make test-fast` leaves
  those out, so it must know them. Any other test that tries fails here, by name."""
  if request.node.get_closest_marker("processes") is not None:
    yield
    return

  def refuse(*args, **kwargs):
    del kwargs
    raise AssertionError(
        f"{request.node.nodeid} starts a process ({str(args)[:120]}) but is not marked: "
        "add @pytest.mark.processes (or pytestmark = pytest.mark.processes in its module).")

  monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
  monkeypatch.setattr(os, "fork", refuse)
  monkeypatch.setattr(os, "posix_spawn", refuse)
  yield
