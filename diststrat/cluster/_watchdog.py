"""The watchdog of cluster mode: bounded steps, and cluster faults as `ClusterError`.

TensorFlow's eager runtime waits forever for a parameter-server task that stopped
answering (a frozen process, a cut network): the calling thread blocks inside
TensorFlow, and `context.check_alive()` blocks too, holding the GIL. A killed task is
easier: its next op fails within ~0.1 s with `UnavailableError`.

`StepGuard.run(fn, what)` therefore runs `fn` in a helper thread (a daemon) and waits
for it at most `timeout` seconds in the calling thread:

- `fn` returns: its result is returned.
- `fn` raises a TensorFlow error that says a task died or restarted: `ClusterError`
  naming the task. Every task is asked (probed, again and again for up to 2 s, since
  right after a failure TensorFlow may refuse one op to a healthy task); the message,
  which may name a healthy task that failed to reach the dead one, is the fallback.
- `fn` is still running after half the timeout: every task is probed at once, each
  with a tiny op in its own daemon thread. At the timeout, the step is abandoned: the
  helper thread is left blocked (it ends on its own if the task comes back or dies), a
  warning names the step and the tasks that did not answer, and `ClusterError` is raised.
  The next call starts a new helper thread.

Calls made from inside a guarded call (the strategy creating a variable during a step)
run directly: the outer call already bounds them.
"""

import logging
import queue
import threading
import time

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _tf_internal
from diststrat import errors

logger = logging.getLogger("diststrat")

_PROBE_FRACTION = 0.5  # Probe the tasks once a step has used this share of its timeout.
_MIN_PROBE_TIME = 1.0  # Seconds a probe gets to answer before its task counts as silent.
_BLAME_TIME = 2.0  # Seconds spent asking the tasks which one failed, after an error.
_PROBE_RETRY = 0.25  # Seconds between two probes of a task that did not answer.


def is_cluster_fault(error):
  """Whether a TensorFlow error means a task died, restarted or could not be reached."""
  if isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
    return True
  return _tf_internal.error_means_task_restarted(error)


class _Job:

  def __init__(self, fn):
    self.fn = fn
    self.done = threading.Event()
    self.result = None
    self.error = None


class _HelperThread:
  """A daemon thread that runs guarded calls one at a time until abandoned."""

  def __init__(self, guard, name):
    self.jobs = queue.Queue()
    self.abandoned = False
    self.thread = threading.Thread(target=self._main, args=(guard,), name=name, daemon=True)
    self.thread.start()

  def _main(self, guard):
    guard._local.inside = True  # pylint: disable=protected-access
    while not self.abandoned:
      try:
        job = self.jobs.get(timeout=1.0)
      except queue.Empty:
        continue
      try:
        job.result = job.fn()
      except BaseException as e:  # pylint: disable=broad-except
        job.error = e
      finally:
        job.done.set()


class StepGuard:
  """Runs cluster-touching calls with a time limit; see the module docstring.

  Args:
    tasks: the task names to blame and probe, such as "/job:ps/replica:0/task:0".
    probe_device: `task -> device` on which a probe op runs.
    timeout: seconds a call may take, or None for no limit (faults still become
      `ClusterError`).
    name: how log lines and errors name the owner (a strategy's repr).
  """

  def __init__(self, tasks, probe_device, timeout, name):
    self.tasks = tuple(tasks)
    self._probe_device = probe_device
    self.timeout = timeout
    self._name = name
    self._local = threading.local()
    self._helper = None
    self._lock = threading.Lock()

  @property
  def timeout(self):
    return self._timeout

  @timeout.setter
  def timeout(self, value):
    self._timeout = _arguments.seconds("step_timeout", value)

  def inside(self):
    """Whether the calling thread is running a guarded call."""
    return getattr(self._local, "inside", False)

  def run(self, fn, what):
    """Returns `fn()`, run with the time limit; raises `ClusterError` on a cluster fault.

    Args:
      fn: a callable without arguments.
      what: a short description for messages, such as "step 12".
    """
    if self.inside() or not tf.executing_eagerly():
      return self._call_translating(fn, what)
    if self.timeout is None:
      self._local.inside = True
      try:
        return self._call_translating(fn, what)
      finally:
        self._local.inside = False
    job = _Job(fn)
    with self._lock:
      if self._helper is None:
        self._helper = _HelperThread(self, name=f"diststrat-step-{id(self):x}")
      helper = self._helper
    helper.jobs.put(job)
    start = time.monotonic()
    probes = None
    if not job.done.wait(self.timeout * _PROBE_FRACTION):
      probes = self._start_probes()
      job.done.wait(max(0.0, self.timeout - (time.monotonic() - start)))
    if job.done.is_set():
      if job.error is not None:
        self._raise(job.error, what)
      return job.result
    # Give the probes at least _MIN_PROBE_TIME to answer, even with a tiny timeout.
    elapsed = time.monotonic() - start
    statuses = self._collect_probes(probes, _MIN_PROBE_TIME - elapsed * (1 - _PROBE_FRACTION))
    return self._abandon(helper, what, time.monotonic() - start, statuses)

  # --- faults ---

  def _call_translating(self, fn, what):
    try:
      return fn()
    except tf.errors.OpError as e:
      self._raise(e, what)

  def _raise(self, error, what):
    """Raises `error`, as `ClusterError` when it is a cluster fault."""
    translated = self._translate(error, what)
    if translated is error:
      raise error.with_traceback(error.__traceback__)
    raise translated from error

  def _translate(self, error, what):
    if not isinstance(error, tf.errors.OpError) or not is_cluster_fault(error):
      return error
    task = self._blame(error)
    who = f"Parameter server task {task}" if task else "A parameter server task"
    if _tf_internal.error_means_task_restarted(error):
      message = (f"{who} restarted since {self._name} connected to it, so the variables "
                 f"it held are gone ({what} failed: {_tf_internal.error_summary(error)}). Call "
                 "strategy.reconnect(), then restore the last checkpoint.")
    else:
      message = (f"{who} cannot be reached: it died or its network is down ({what} "
                 f"failed: {_tf_internal.error_summary(error)}). Restart the task, call "
                 "strategy.reconnect(), then restore the last checkpoint.")
    return errors.ClusterError(message, task=task)

  def _blame(self, error):
    """The task most likely at fault for `error`, or None.

    The message may name a healthy task that failed to reach the dead one, and right
    after a failure a healthy task may refuse one probe or answer slowly, so neither
    signal alone is enough: tasks that refuse connections come before tasks that are
    merely silent, and within each group the tasks the message names come first. With
    every task answering, the message decides.
    """
    statuses = self._probe_all(_BLAME_TIME)
    named = _tf_internal.tasks_named_in_error(error, self.tasks)
    order = list(self.tasks)

    def ranked(tasks):
      return sorted(tasks, key=lambda t: (t not in named, order.index(t)))

    unreachable = [t for t, s in statuses.items() if s.startswith("cannot be reached")]
    silent = [t for t, s in statuses.items() if s == "does not answer"]
    blamed = ranked(unreachable) or ranked(silent) or named
    return blamed[0] if blamed else None

  def _abandon(self, helper, what, elapsed, statuses):
    helper.abandoned = True
    with self._lock:
      if self._helper is helper:
        self._helper = None
    silent = [t for t, s in statuses.items() if s == "does not answer"]
    dead = [t for t, s in statuses.items() if s not in ("answers", "does not answer")]
    blamed = silent or dead
    task = blamed[0] if blamed else None
    details = "; ".join(f"{t} {s}" for t, s in statuses.items())
    logger.warning("diststrat watchdog: %s of %s has been stuck for %.1f s (step_timeout "
                   "%.1f s), waiting on %s. Tasks: %s.", what, self._name, elapsed,
                   self.timeout, ", ".join(blamed) if blamed else "no task in particular",
                   details)
    if blamed:
      cause = (f"waiting on {', '.join(blamed)}, which "
               f"{'does' if len(blamed) == 1 else 'do'} not answer (frozen, or cut off)"
               if silent else f"waiting on {', '.join(blamed)}, which cannot be reached")
      advice = ("Restart the task (or resume it), call strategy.reconnect(), then restore "
                "the last checkpoint.")
    else:
      cause = "although every parameter server task answers"
      advice = ("If the step is just slow, raise step_timeout (strategy.step_timeout = "
                "seconds).")
    raise errors.ClusterError(
        f"{what} of {self._name} did not finish within step_timeout={self.timeout:g} s, "
        f"{cause}. The step was abandoned: its thread stays blocked in TensorFlow and "
        f"may still apply its updates if the task comes back. {advice}", task=task)

  # --- probes ---

  def _start_probes(self, tasks=None):
    """Starts one probe thread per task; returns {task: (thread, result dict)}."""
    probes = {}
    for task in self.tasks if tasks is None else tasks:
      result = {}
      thread = threading.Thread(target=self._probe_one, args=(task, result), daemon=True,
                                name=f"diststrat-probe-{task}")
      thread.start()
      probes[task] = (thread, result)
    return probes

  def _probe_one(self, task, result):
    self._local.inside = True
    try:
      with tf.device(self._probe_device(task)):
        value = tf.raw_ops.Identity(input=tf.constant(0))
      value.numpy()
      result["status"] = "answers"
    except Exception as e:  # pylint: disable=broad-except
      result["status"] = f"cannot be reached ({type(e).__name__}: {_tf_internal.error_summary(e)})"

  def _collect_probes(self, probes, timeout=0.0):
    deadline = time.monotonic() + timeout
    statuses = {}
    for task, (thread, result) in (probes or {}).items():
      thread.join(max(0.0, deadline - time.monotonic()))
      statuses[task] = result.get("status", "does not answer")
    return statuses

  def _probe_all(self, timeout):
    """{task: status} within `timeout` s; a task that fails is asked again until then.

    Right after a failed step, TensorFlow may refuse an op to a healthy task once
    ("Socket closed") while it re-opens its stream; a task only counts as unreachable
    if it never answers.
    """
    deadline = time.monotonic() + timeout
    statuses, pending = {}, list(self.tasks)
    while True:
      results = self._collect_probes(self._start_probes(pending),
                                     max(0.1, deadline - time.monotonic()))
      statuses.update(results)
      pending = [t for t, s in results.items() if s.startswith("cannot be reached")]
      if not pending or time.monotonic() + _PROBE_RETRY > deadline:
        return statuses
      time.sleep(_PROBE_RETRY)
