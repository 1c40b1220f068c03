"""The collective watchdog's decisions, with scripted peers (no cluster needed).

The end-to-end cases (a worker killed, frozen, or not calling the collectives, on real
processes) are in tests/test_multi_worker.py; here each rule is checked on its own.
"""

import threading
import time

import pytest
import tensorflow as tf

from diststrat import _tf_internal
from diststrat._cluster_runtime.multi_worker import _collective_watchdog

PEERS = ("/job:worker/replica:0/task:1", "/job:worker/replica:0/task:2")


@pytest.fixture
def aborts(monkeypatch):
  made = []
  monkeypatch.setattr(_tf_internal, "abort_collectives",
                      lambda message, deadline_exceeded=False: made.append(
                          (message, deadline_exceeded)))
  return made


def _probe(behaviour):
  """A probe where `behaviour[task]` is "answers", "dead" or "frozen"."""
  def probe(task, timeout):
    kind = behaviour.get(task, "answers")
    if kind == "dead":
      raise tf.errors.UnavailableError(None, None, "failed to connect to all addresses")
    if kind == "frozen":
      time.sleep(min(timeout, 0.2))
      raise tf.errors.DeadlineExceededError(None, None, "Deadline Exceeded")
    if kind == "frozen, waited out":  # As TensorFlow's health check: the whole deadline.
      time.sleep(timeout)
      raise tf.errors.DeadlineExceededError(None, None, "Deadline Exceeded")
  return probe


@tf.function
def _with_a_collective(x):
  with tf.device("/CPU:0"):
    return _tf_internal.all_reduce_v1(x, 1, 77, 77, "Add", "Id", timeout=0)


@tf.function
def _without_collectives(x):
  return x + 1.0


def _name(function):
  return function.get_concrete_function(tf.constant(1.0)).function_def.signature.name


def _watch(behaviour, call_name, seconds, timeout=1.0, probe_after=0.2):
  """Runs a watchdog while one call named `call_name` is 'running' for `seconds`."""
  dog = _collective_watchdog.CollectiveWatchdog(PEERS, timeout, _probe(behaviour), "test",
                                                probe_after=probe_after)
  dog.start()
  token = dog.started(call_name)
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and dog.running:
    time.sleep(0.05)
  dog.finished(token)
  dog.stop()
  return dog


def test_a_dead_peer_ends_the_wait_before_the_timeout(aborts):
  dog = _watch({PEERS[1]: "dead"}, _name(_with_a_collective), seconds=8, timeout=30)
  assert dog.verdict is not None and dog.verdict.task == PEERS[1]
  assert dog.verdict.status.startswith("cannot be reached")
  assert dog.verdict.waited < 5
  assert len(aborts) == 1 and PEERS[1] in aborts[0][0] and not aborts[0][1]
  assert aborts[0][0].startswith(_collective_watchdog.ABORT_MARK)


@pytest.mark.parametrize("frozen, timeout", [("frozen", 1.0), ("frozen, waited out", 2.6)])
def test_a_frozen_peer_is_named_at_the_timeout(aborts, frozen, timeout):
  # At the timeout, not a round of health checks later: the last round starts early
  # enough to end by it (a check of a frozen peer takes its whole second). It came up
  # to a second late (0.9 s measured on real processes).
  dog = _watch({PEERS[0]: frozen}, _name(_with_a_collective), seconds=8, timeout=timeout)
  assert dog.verdict.task == PEERS[0] and dog.verdict.status == "does not answer"
  late = dog.verdict.waited - timeout
  assert 0 <= late < 2 * _collective_watchdog._TICK, late
  assert aborts and aborts[0][1]  # As a deadline, not as an unreachable task.


def test_dead_peers_are_named_before_a_short_timeout(aborts):
  # With two peers and a 3 s timeout, the last round before the deadline is due at
  # 0.75 s, before the first round (probe_after 1 s): the rounds that confirm a refusing
  # peer must go on after it. (A version that slept until the deadline after that round
  # blamed no one: "answers", as a CI run on a loaded machine showed.)
  dog = _watch({PEERS[0]: "dead", PEERS[1]: "dead"}, _name(_with_a_collective), seconds=8,
               timeout=3, probe_after=1.0)
  assert dog.verdict.status.startswith("cannot be reached"), dog.verdict
  assert dog.verdict.waited < 3


def test_peers_that_answer_but_do_not_join_are_blamed_at_the_timeout(aborts):
  dog = _watch({}, _name(_with_a_collective), seconds=8, timeout=1)
  assert dog.verdict.status == "answers" and dog.verdict.task is None  # Two peers.
  assert all(p in aborts[0][0] for p in PEERS)


def test_a_long_call_without_collectives_is_left_alone(aborts):
  dog = _watch({}, _name(_without_collectives), seconds=2.5, timeout=0.5)  # 5 timeouts.
  assert dog.verdict is None and not aborts


def test_a_healthy_cluster_is_never_probed_or_aborted(aborts):
  probed = []
  dog = _collective_watchdog.CollectiveWatchdog(
      PEERS, 1.0, lambda task, timeout: probed.append(task), "test", probe_after=0.5)
  dog.start()
  for _ in range(100):  # Short calls, one after another, for twice probe_after.
    dog.finished(dog.started(_name(_with_a_collective)))
    time.sleep(0.01)
  dog.stop()
  assert not probed and not aborts and dog.verdict is None
  assert not any(t.name == "diststrat-collective-watchdog" and t.is_alive()
                 for t in threading.enumerate())
