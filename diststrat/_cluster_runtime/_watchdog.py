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
  right after a failure TensorFlow may refuse one op to a healthy task; a task whose
  address refuses the connection twice in a row has no process listening, and is
  known dead at once); the message, which may name a healthy task that failed to reach
  the dead one, is the fallback.
- `fn` is still running after half the timeout: every task is probed at once, each
  with a tiny op in its own daemon thread. At the timeout, the step is abandoned: the
  helper thread is left blocked (it ends on its own if the task comes back or dies), a
  warning names the step and the tasks that did not answer, and `ClusterError` is raised.
  The next call starts a new helper thread.

The helper thread holds its guard weakly: a guard that nothing else holds (a dropped
strategy's) is freed, and its idle helper thread ends within a second.

Calls made from inside a guarded call (the strategy creating a variable during a step)
run directly: the outer call already bounds them.

Faults outside guarded calls: a cluster connection installs `translate_error` into
TensorFlow (`_tf_internal.install_error_translator`), so that an error raised by any
eager op or `tf.function` call of this process (a variable's `assign_add`, a step
called directly, a checkpoint save) that means a task died or restarted reaches the
caller as `ClusterError` naming the task, like a guarded call's. A killed task is
reported within a fraction of a second; an error that names no task of a live connection, and whose
probes blame none, is left as TensorFlow raised it.
"""

import contextlib
import functools
import logging
import queue
import threading
import time
import weakref

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import _tf_internal
from diststrat import errors
from diststrat._cluster_runtime import _faults

logger = logging.getLogger("diststrat")

_PROBE_FRACTION = 0.5  # Probe the tasks once a step has used this share of its timeout.
_MIN_PROBE_TIME = 1.0  # Seconds a probe gets to answer before its task counts as silent.
_BLAME_TIME = 2.0  # Seconds spent asking the tasks which one failed, after an error.
_PROBE_RETRY = 0.25  # Seconds between two probes of a task that did not answer.


_PS_ADVICE = "Restart the task, call strategy.reconnect(), then restore the last checkpoint."
_PS_RESTARTED_ADVICE = "Call strategy.reconnect(), then restore the last checkpoint."

# The StepGuards of this process's cluster connections.
_live_guards: "weakref.WeakSet[StepGuard]" = weakref.WeakSet()
_thread_state = threading.local()  # .raw: leave errors alone; .what: the guarded call.


@contextlib.contextmanager
def raw_errors():
  """In this thread, errors are not translated (probes, and translating itself)."""
  saved = getattr(_thread_state, "raw", False)
  _thread_state.raw = True
  try:
    yield
  finally:
    _thread_state.raw = saved


def translate_error(error):
  """`error` (raised by TensorFlow in this process) as `ClusterError` if it is a fault.

  Installed into TensorFlow by the first cluster connection; see the module docstring.
  """
  if getattr(_thread_state, "raw", False) or not isinstance(error, tf.errors.OpError):
    return error
  if not (_faults.is_cluster_fault(error) or _faults.may_follow_a_fault(error)):
    return error
  guards = list(_live_guards)
  if not guards:
    return error
  named = [g for g in guards if _faults.tasks_named_in_error(error, g.tasks)]
  guard = (named or guards)[-1]
  with raw_errors():
    return guard.translate(error, getattr(_thread_state, "what", None) or "an operation",
                           require_task=True)


def probe_with_an_op(task):
  """Probes `task` (a PS task) by running a tiny op on its CPU."""
  _probe_function(f"{task}/device:CPU:0")().numpy()


@functools.lru_cache(maxsize=None)
def _probe_function(device):
  """A tiny op on `device`, as a function: eager remote ops from a new thread (each
  probe's) can block forever, holding the GIL, once another thread saw a task fail."""

  @tf.function(autograph=False)
  def probe():
    with tf.device(device):
      return tf.raw_ops.Identity(input=tf.constant(0))

  return probe


class _Job:

  def __init__(self, fn, epoch):
    self.fn = fn
    self.epoch = epoch  # The guard's connection when the call started.
    self.done = threading.Event()
    self.result = None
    self.error = None


class _HelperThread:
  """A daemon thread that runs guarded calls one at a time until abandoned, or until its
  guard is gone."""

  def __init__(self, guard, name, jobs=None):
    self.jobs = queue.Queue()
    self.abandoned = False
    self.busy = False  # Set by the caller that queues a job, cleared when it is done.
    self._left = jobs  # Jobs to run before ending; None: until abandoned.
    # The guard weakly: the thread would keep it (and the connection its jobs hold)
    # alive, and itself running, after the strategy that made them was dropped.
    self.thread = threading.Thread(target=self._main, args=(weakref.ref(guard), guard._local),
                                   name=name, daemon=True)
    self.thread.start()

  def _main(self, guard, local):
    local.inside = True
    try:
      self._run_jobs(guard, local)
    finally:
      _tf_internal.release_thread_state()

  def _run_jobs(self, guard, local):
    while not self.abandoned and self._left != 0:
      try:
        job = self.jobs.get(timeout=1.0)
      except queue.Empty:
        if guard() is None:  # No call can come: only the guard queues them.
          return
        continue
      local.epoch = job.epoch
      try:
        job.result = job.fn()
      except BaseException as e:  # pylint: disable=broad-except
        job.error = e
      finally:
        if self._left is not None:
          self._left -= 1
        self.busy = False
        job.done.set()
        job = None  # Idle, the thread holds nothing of the call (its closure).


class StepGuard:
  """Runs cluster-touching calls with a time limit; see the module docstring.

  Args:
    tasks: the task names to blame and probe, such as "/job:ps/replica:0/task:0".
    probe: `probe(task)` returns if the task answers, raises if not (see
      `probe_with_an_op`); it runs in its own daemon thread.
    timeout: seconds a call may take, or None for no limit (faults still become
      `ClusterError`).
    name: how log lines and errors name the owner (a strategy's repr).
    role: how messages name a task, such as "Parameter server task".
    advice, restarted_advice: what a fault's message tells the user to do (a task died
      or froze; a task restarted).
    blame_silent_peers: when a call times out (`DeadlineExceededError`) although every
      task answers, name them all as not having joined (collectives across workers).
    known_fault: `known_fault(error)` returns (task or None, status) when the fault
      behind `error` is already known (a watchdog aborted the call), else None; status
      as a probe's: "cannot be reached ...", "restarted", "does not answer", "answers".
  """

  def __init__(self, tasks, probe, timeout, name, role="Parameter server task",
               advice=_PS_ADVICE, restarted_advice=_PS_RESTARTED_ADVICE,
               blame_silent_peers=False, known_fault=None):
    self.tasks = tuple(tasks)
    self._probe = probe
    self._advice = advice
    self._restarted_advice = restarted_advice
    self._blame_silent_peers = blame_silent_peers
    self._known_fault = known_fault
    self.timeout = timeout
    self._name = name
    self._role = role
    self._local = threading.local()
    self._helper = None
    self._lock = threading.Lock()
    self._failure = None  # The first cluster fault seen since connecting (a TF error).
    self._failure_blame = None  # (task, probe status) found for it, when one was.
    # Which connection: `clear_failure` (connecting again) starts a new one. A call that
    # started before it (abandoned at its timeout, still running in a helper thread)
    # may fail after it; that fault is the old connection's, and is not recorded.
    self._epoch = 0
    _live_guards.add(self)

  def check_healthy(self, what):
    """Raises `ClusterError` if a task failed since the last `clear_failure()`."""
    failure = self._failure
    if failure is not None:
      # A task blamed as frozen is not asked again (asking one waits out the whole probe
      # time): later calls raise at once. Any other is asked (quickly: refused, or back
      # after a restart, which the message must say).
      blame = self._failure_blame
      if blame is not None and blame[1] != "does not answer":
        blame = None
      with raw_errors():
        translated = self.translate(failure, what, record=False, blame=blame)
      raise translated

  def clear_failure(self):
    """Forgets the fault seen: called when connecting again."""
    self._epoch += 1
    self._failure = None
    self._failure_blame = None

  def wait_for(self, wait, what="waiting for the operations sent to the cluster"):
    """`wait()` (TensorFlow's wait for pending eager work) bounded, faults as `ClusterError`.

    Installed as the process's sync hook (`_tf_internal.install_sync_hook`): checkpoint
    saves and `context.async_wait()` wait through it. Once a task failed, TensorFlow's
    wait can block forever, so it raises `ClusterError` at once until `clear_failure()`.
    """
    if tf.executing_eagerly() and not self.inside():
      self.check_healthy(what)
    return self.run(wait, what)

  @property
  def timeout(self):
    return self._timeout

  @timeout.setter
  def timeout(self, value):
    self._timeout = _arguments.seconds("step_timeout", value)

  def inside(self):
    """Whether the calling thread is running a guarded call."""
    return getattr(self._local, "inside", False)

  def run(self, fn, what, probe=True):
    """Returns `fn()`, run with the time limit; raises `ClusterError` on a cluster fault.

    Args:
      fn: a callable without arguments.
      what: a short description for messages, such as "step 12".
      probe: ask the tasks which one is at fault (not while connecting: a probe would
        wait for the same connection).
    """
    if self.inside() or not tf.executing_eagerly():
      return self._call_translating(fn, what, probe)
    if self.timeout is None:
      self._local.inside = True
      self._local.epoch = self._epoch
      try:
        return self._call_translating(fn, what, probe)
      finally:
        self._local.inside = False
        del self._local.epoch
    job = _Job(fn, self._epoch)
    with self._lock:
      if self._helper is None:
        self._helper = _HelperThread(self, name=f"diststrat-step-{id(self):x}")
      helper = self._helper
      if helper.busy:
        # Another thread's call holds the helper (a step, while this thread reads a
        # variable): this call gets a thread of its own, which ends after it.
        helper = _HelperThread(self, name=f"diststrat-call-{id(self):x}", jobs=1)
      helper.busy = True
    helper.jobs.put(job)
    start = time.monotonic()
    probes = None
    if not job.done.wait(self.timeout * _PROBE_FRACTION):
      probes = self._start_probes() if probe else None
      job.done.wait(max(0.0, self.timeout - (time.monotonic() - start)))
    if job.done.is_set():
      if job.error is not None:
        self._raise(job.error, what, probe)
      return job.result
    # Give the probes at least _MIN_PROBE_TIME to answer, even with a tiny timeout.
    elapsed = time.monotonic() - start
    statuses = self._collect_probes(probes, _MIN_PROBE_TIME - elapsed * (1 - _PROBE_FRACTION))
    return self._abandon(helper, what, time.monotonic() - start, statuses)

  # --- faults ---

  def _call_translating(self, fn, what, probe=True):
    saved = getattr(_thread_state, "what", None)
    _thread_state.what = what
    try:
      return fn()
    except tf.errors.OpError as e:
      self._raise(e, what, probe)
    finally:
      _thread_state.what = saved

  def _raise(self, error, what, probe=True):
    """Raises `error`, as `ClusterError` when it is a cluster fault."""
    translated = self.translate(error, what, probe=probe)
    if translated is error:
      raise error.with_traceback(error.__traceback__)
    raise translated from error

  def translate(self, error, what, require_task=False, record=True, probe=True,
                blame=None):
    """`error` as a `ClusterError` naming the task at fault, if it is a cluster fault.

    Args:
      error: an exception raised by TensorFlow.
      what: what failed, for the message ("step 12").
      require_task: leave `error` alone when no task of this guard can be blamed.
      record: remember the fault (see `check_healthy`).
      probe: ask the tasks which one is at fault; else the error's text decides.
      blame: (task, status) already found for `error` (a recorded fault): no asking.
    """
    if not isinstance(error, tf.errors.OpError):
      return error
    # A cancelled component of a function whose other part failed on a task: a fault
    # only if a task is found faulty (not merely named), else the error stays as it is.
    cancelled = not _faults.is_cluster_fault(error) and _faults.may_follow_a_fault(error)
    if not cancelled and not _faults.is_cluster_fault(error):
      return error
    known = self._known_fault(error) if self._known_fault is not None else None
    if known is None and blame is None:
      blame = self._blame(error, probe)
    task, status = known if known is not None else blame
    if cancelled and (task is None or status in (None, "answers")):
      return error
    summary = _faults.error_summary(error)
    if status == "answers" or (
        task is None and status is None and self._blame_silent_peers and isinstance(
            error, tf.errors.DeadlineExceededError)):
      # Every peer answers, yet the collective timed out: they did not join it.
      if record:
        self._record(error, (task, status))
      task = self.tasks[0] if len(self.tasks) == 1 else None
      message = (f"{self._role}{'s' if len(self.tasks) > 1 else ''} "
                 f"{', '.join(self.tasks)} answer{'' if len(self.tasks) > 1 else 's'} but "
                 f"did not join the collective within its timeout: stopped calling it, or "
                 f"slower than the timeout ({what} failed: {summary}). {self._advice}")
      return errors.ClusterError(message, task=task)
    if task is None and require_task:
      return error
    if record:
      self._record(error, (task, status))
    who = f"{self._role} {task}" if task else f"A {self._role.lower()}"
    if status == "restarted" or (status is None and
                                 _faults.error_means_task_restarted(error)):
      message = (f"{who} restarted since {self._name} connected to it, so the state it "
                 f"held is gone ({what} failed: {summary}). {self._restarted_advice}")
    elif status == "does not answer":
      message = (f"{who} does not answer: it is frozen or cut off ({what} failed: "
                 f"{summary}). {self._advice}")
    else:
      message = (f"{who} cannot be reached: it died or its network is down ({what} "
                 f"failed: {summary}). {self._advice}")
    return errors.ClusterError(message, task=task)

  def _record(self, error, blame=None):
    """Remembers the first fault of this connection and whom it blamed (see
    `check_healthy`)."""
    if self._failure is None and getattr(self._local, "epoch", self._epoch) == self._epoch:
      self._failure, self._failure_blame = error, blame

  def _blame(self, error, probe=True):
    """(the task most likely at fault for `error` or None, that task's probe status).

    The message may name a healthy task that failed to reach the dead one, and right
    after a failure a healthy task may refuse one probe or answer slowly, so neither
    signal alone is enough: tasks that refuse connections come before tasks that are
    merely silent, and within each group the tasks the message names come first. With
    every task answering, the message decides.
    """
    statuses = self._probe_all(_BLAME_TIME) if probe else {}
    named = _faults.tasks_named_in_error(error, self.tasks)
    order = list(self.tasks)

    def ranked(tasks):
      return sorted(tasks, key=lambda t: (t not in named, order.index(t)))

    restarted = [t for t, s in statuses.items() if s == "restarted"]
    unreachable = [t for t, s in statuses.items() if s.startswith("cannot be reached")]
    silent = [t for t, s in statuses.items() if s == "does not answer"]
    blamed = ranked(restarted) or ranked(unreachable) or ranked(silent) or named
    if not blamed:
      return None, None
    return blamed[0], statuses.get(blamed[0])

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
    if blamed and self._failure is None:  # Later eager ops must not block on it too.
      self._failure = tf.errors.DeadlineExceededError(
          None, None, f"{what} did not finish within step_timeout; {blamed[0]} "
          f"{statuses[blamed[0]]}")
      self._failure_blame = (blamed[0], statuses[blamed[0]])
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
      cause = f"although every {self._role.lower()} answers"
      advice = ("If the step is just slow, raise step_timeout (strategy.step_timeout = "
                "seconds).")
    raise errors.ClusterError(
        f"{what} of {self._name} did not finish within step_timeout={self.timeout:g} s, "
        f"{cause}. It was abandoned: its thread stays blocked in TensorFlow and "
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
    _thread_state.raw = True
    try:
      self._probe(task)
      result["status"] = "answers"
    except Exception as e:  # pylint: disable=broad-except
      if _faults.error_means_task_restarted(e):
        result["status"] = "restarted"
      else:
        result["refused"] = _faults.error_means_nothing_listens(e)
        result["status"] = (f"cannot be reached ({type(e).__name__}: "
                            f"{_faults.error_summary(e)})")
    finally:
      _tf_internal.release_thread_state()

  def _collect_probes(self, probes, timeout=0.0, refused=None):
    """{task: status} of `probes`, waited for `timeout` s in all; adds to the set
    `refused` (if given) the tasks whose address refused the connection."""
    deadline = time.monotonic() + timeout
    statuses = {}
    for task, (thread, result) in (probes or {}).items():
      thread.join(max(0.0, deadline - time.monotonic()))
      statuses[task] = result.get("status", "does not answer")
      if refused is not None and result.get("refused"):
        refused.add(task)
    return statuses

  def _probe_all(self, timeout):
    """{task: status} within `timeout` s; a task that fails is asked again until then.

    Right after a failed step, TensorFlow may refuse an op to a healthy task once
    ("Socket closed") while it re-opens its stream, so a task that fails counts as
    unreachable only if it never answers, or if its address refuses the connection
    twice in a row (nothing listens there: no need to wait out the time).
    """
    deadline = time.monotonic() + timeout
    statuses, pending, refused_before = {}, list(self.tasks), set()
    while True:
      refused = set()
      results = self._collect_probes(self._start_probes(pending),
                                     max(0.1, deadline - time.monotonic()), refused)
      statuses.update(results)
      pending = [t for t, s in results.items() if s.startswith("cannot be reached") and
                 not (t in refused and t in refused_before)]
      refused_before = refused
      if not pending or time.monotonic() + _PROBE_RETRY > deadline:
        return statuses
      time.sleep(_PROBE_RETRY)
