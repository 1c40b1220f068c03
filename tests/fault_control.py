"""Faults of a `LocalCluster`'s PS task, asked for by its worker, and calls waited for with a bound.

A worker process asks for a fault through files (`Control`), so that it knows exactly
when it happened; the process that owns the cluster does it (`serve_faults`): freeze
(SIGSTOP), thaw (SIGCONT), kill, restart, or "kill_after SECONDS". Every call the worker
makes on a faulty PS runs in a thread waited for with a bound (`bounded`): a call that
blocks is reported as "blocked" instead of hanging. `describe` makes an outcome picklable;
`reconnect` retries `strategy.reconnect()` while gRPC backs off.

Used by tests/test_ps_faults.py, which asserts what each path raises, and by
benchmarks/ps_faults.py, which times the same paths for docs/parameter_server.md. It
lives in tests/, beside sync_files.py (whose files it signals through), and the benchmark
puts tests/ on its sys.path, rather than the other way round: the tests run on every
change and should depend on nothing outside their folder, while the benchmark is a script
run from a checkout, where tests/ is always there. Not in diststrat/: it is no API of the
package.
"""

import os
import signal
import threading
import time

from diststrat.errors import ClusterError
import sync_files


class Control:
  """In a worker: asks the cluster's owner for a fault and waits until it happened
  (`timeout` seconds at most)."""

  def __init__(self, sync_dir, timeout=90.0):
    self._dir = sync_dir
    self._timeout = timeout
    self._count = 0

  def __call__(self, action):
    self._count += 1
    sync_files.write(os.path.join(self._dir, f"request_{self._count}"), action)
    sync_files.wait_for_file(os.path.join(self._dir, f"done_{self._count}"),
                             timeout=self._timeout)


def serve_faults(cluster, sync_dir):
  """In the cluster's owner: does what the worker's `Control` asks, in a thread, until
  the returned join() is called; join() re-raises what went wrong there."""
  failures, stop = [], threading.Event()

  def serve():
    count = 0
    try:
      while not stop.is_set():
        count += 1
        path = os.path.join(sync_dir, f"request_{count}")
        while not os.path.exists(path):
          if stop.wait(0.02):
            return
        with open(path) as f:
          action = f.read().split()
        done = os.path.join(sync_dir, f"done_{count}")
        if action[0] == "freeze":
          cluster.kill("ps", 0, signal.SIGSTOP)
        elif action[0] == "thaw":
          cluster.kill("ps", 0, signal.SIGCONT)
        elif action[0] == "kill":
          cluster.kill("ps", 0)
        elif action[0] == "restart":
          cluster.restart("ps", 0)
        elif action[0] == "kill_after":  # Answers at once, kills after the delay.
          sync_files.write(done)
          time.sleep(float(action[1]))
          cluster.kill("ps", 0)
          continue
        sync_files.write(done)
    except BaseException as e:  # pylint: disable=broad-except
      failures.append(e)

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()

  def join():
    stop.set()
    thread.join(30)
    if failures:
      raise failures[0]

  return join


def bounded(fn, timeout):
  """("returned", result) | ("raised", error) | ("blocked", None): `fn()` in a thread,
  waited for at most `timeout` s; plus the seconds it took."""
  outcome = {}

  def target():
    try:
      outcome["returned"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      outcome["raised"] = e

  start = time.monotonic()
  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(timeout)
  elapsed = time.monotonic() - start
  for kind in ("returned", "raised"):
    if kind in outcome:
      return kind, outcome[kind], elapsed
  return "blocked", None, elapsed


def describe(kind, value, elapsed):
  """A picklable summary of a `bounded` outcome."""
  if kind == "raised":
    return {"kind": kind, "type": type(value).__name__, "task": getattr(value, "task", None),
            "message": str(value)[:400], "elapsed": elapsed}
  return {"kind": kind, "type": None, "task": None, "message": "", "elapsed": elapsed}


def reconnect(strategy, timeout=60.0):
  """`strategy.reconnect()`, again while gRPC backs off from the failed connections."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      return strategy.reconnect()
    except ClusterError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.5)
