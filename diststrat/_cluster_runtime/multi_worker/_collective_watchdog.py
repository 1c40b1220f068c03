"""The watchdog of a synchronous cluster: a failed peer stops this worker's collectives.

A collective across worker processes waits for every member. If a peer died, froze or
stopped calling the collectives, it waits forever, unless TensorFlow's own timeout is
attached to it; but TensorFlow runs each such timeout on a native thread that sleeps
until the timeout expires, finished or not, so at hundreds of steps a second a worker
holds thousands of threads and dies of it (docs/design/tensorflow_facts.md). So the
collectives have no timeout, and one thread per process watches instead:

- It learns which calls into TensorFlow are running (`tf.function` calls, through the
  hook of TensorFlow's execute path that the error translator uses), with no work on
  the hot path beyond a dictionary entry.
- While a call has run longer than `probe_after` (a fraction of a second, far above a
  step of a healthy cluster), it asks every peer whether it is alive, once a second
  (TensorFlow's collective peer health check, with a deadline). A peer that refuses
  twice (dead, or restarted: a different task now) ends the wait at once.
- A call that runs collectives and has waited `timeout` seconds ends too: the peers
  that do not answer are frozen or cut off; if every peer answers, they are alive but
  did not join (stopped calling the collectives, or slower than the timeout).

Ending the wait means aborting this process's collectives (TensorFlow's abort, which
also fails every later collective of the process: the worker processes must be
restarted). The blocked call then raises, and the error translator turns it into
`ClusterError` naming the task from the verdict recorded here. Idle (no call running),
the watchdog does nothing but wake up every `_TICK` seconds.
"""

import itertools
import logging
import threading
import time

from diststrat._tf import tf
from diststrat import _tf_internal
from diststrat._cluster_runtime import _faults

logger = logging.getLogger("diststrat")

_TICK = 0.25  # Seconds between two looks at the running calls.
_PROBE_EVERY = 1.0  # Seconds between two rounds of health checks while a call waits.
_PROBE_TIMEOUT = 1.0  # Seconds a peer has to answer one health check.
ABORT_MARK = "diststrat collective watchdog:"  # Starts the message of the abort it makes.


class Verdict:
  """Why the watchdog aborted the collectives: `task` (or None: several peers),
  `status` ("cannot be reached ...", "restarted", "does not answer", "answers") and
  `waited` (seconds the call had waited)."""

  def __init__(self, task, status, waited, details):
    self.task = task
    self.status = status
    self.waited = waited
    self.details = details

  def __repr__(self):
    return f"Verdict(task={self.task!r}, status={self.status!r}, waited={self.waited:.1f})"


class CollectiveWatchdog:
  """Watches this process's calls into TensorFlow; see the module docstring.

  Args:
    peers: the other worker tasks, such as "/job:worker/replica:0/task:1".
    timeout: seconds a call that runs collectives may wait before the peers are blamed.
    probe: `probe(task, timeout)` returns if the task is alive, raises if not.
    name: the owner's description, for log lines.
    probe_after: seconds a call runs before the peers are asked (default: the smaller
      of 1 s and half the timeout).
  """

  def __init__(self, peers, timeout, probe, name, probe_after=None):
    self.peers = tuple(peers)
    self.timeout = float(timeout)
    self.probe_after = (min(1.0, self.timeout / 2) if probe_after is None
                        else float(probe_after))
    self._probe = probe
    self._name = name
    self._calls = {}  # token -> (start time, op or function name)
    self._tokens = itertools.count()
    self._collective_functions = {}  # name -> whether it runs collectives
    self.verdict = None
    self._stop = threading.Event()
    self._thread = None

  # --- the tracker TensorFlow's execute path calls (any thread) ---

  def started(self, name=None):
    token = next(self._tokens)
    self._calls[token] = (time.monotonic(), name)
    return token

  def finished(self, token):
    self._calls.pop(token, None)

  # --- the watching thread ---

  def start(self):
    if self._thread is None and self.peers:
      self._thread = threading.Thread(target=self._main, daemon=True,
                                      name="diststrat-collective-watchdog")
      self._thread.start()
    return self

  def stop(self):
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(_PROBE_TIMEOUT * len(self.peers) + 2 * _TICK)

  @property
  def running(self):
    return self._thread is not None and self._thread.is_alive()

  def _main(self):
    try:
      self._watch()
    finally:
      _tf_internal.release_thread_state()

  def _watch(self):
    last_probe, refused, statuses, final_for = 0.0, {}, {}, None
    round_time = _PROBE_TIMEOUT * len(self.peers)  # A round of checks, at worst.
    sleep = _TICK
    while not self._stop.wait(sleep):
      sleep = _TICK
      try:
        calls = list(self._calls.values())
      except RuntimeError:  # Changed while copied: look again at the next tick.
        continue
      now = time.monotonic()
      if not calls:
        refused.clear()
        continue
      start = min(t for t, _ in calls)
      deadline = start + self.timeout
      # The last round of checks before the deadline starts early enough to end by it,
      # so that a frozen peer is named at `timeout`, not a round later. After it, rounds
      # go on only where they end by the deadline, or to confirm a refusing peer.
      final_start = deadline - round_time - _TICK
      if now - start < self.probe_after:
        continue
      if final_for != start and now >= final_start:
        due, final_for = True, start
      else:
        due = now - last_probe >= _PROBE_EVERY and (
            final_for != start or refused or now + round_time <= deadline)
      if due:
        last_probe = now
        statuses = {task: self._status(task) for task in self.peers}
        if self._stop.is_set() or not self._calls:
          continue
        failed = [t for t, s in statuses.items() if s not in ("answers", "does not answer")]
        for task in list(refused):
          if task not in failed:
            del refused[task]
        for task in failed:
          refused[task] = refused.get(task, 0) + 1
        confirmed = [t for t in failed if refused[t] >= 2]
        if confirmed:
          waited = time.monotonic() - start
          self._abort(Verdict(confirmed[0], statuses[confirmed[0]], waited, statuses))
          return
      now = time.monotonic()
      if now < deadline or final_for != start:
        if final_for == start:  # Wake up at the deadline itself, or for the next round.
          sleep = max(0.0, min(_TICK, deadline - now))
        continue
      if not self._runs_collectives(calls):
        continue
      waited = now - start
      silent = [t for t, s in statuses.items() if s == "does not answer"]
      if silent:
        self._abort(Verdict(silent[0], "does not answer", waited, statuses))
      else:
        task = self.peers[0] if len(self.peers) == 1 else None
        self._abort(Verdict(task, "answers", waited, statuses))
      return

  def _status(self, task):
    try:
      self._probe(task, _PROBE_TIMEOUT)
      return "answers"
    except tf.errors.DeadlineExceededError:
      return "does not answer"
    except Exception as e:  # pylint: disable=broad-except
      if _faults.error_means_task_restarted(e):
        return "restarted"
      return f"cannot be reached ({type(e).__name__}: {_faults.error_summary(e)})"

  def _runs_collectives(self, calls):
    """Whether one of the running calls that waited `timeout` runs collectives."""
    now = time.monotonic()
    for start, name in calls:
      if name is None or now - start < self.timeout:
        continue
      known = self._collective_functions.get(name)
      if known is None:
        known = self._collective_functions[name] = (
            _tf_internal.function_runs_collectives(name))
      if known:
        return True
    return False

  def _abort(self, verdict):
    self.verdict = verdict
    details = "; ".join(f"{t} {s}" for t, s in verdict.details.items())
    logger.warning("diststrat watchdog: %s: a call waited %.1f s (collective_timeout "
                   "%.1f s); aborting this process's collectives. Peers: %s.", self._name,
                   verdict.waited, self.timeout, details)
    who = verdict.task or ", ".join(self.peers)
    _tf_internal.abort_collectives(
        f"{ABORT_MARK} {who} {verdict.status}, after {verdict.waited:.1f} s",
        deadline_exceeded=verdict.status in ("answers", "does not answer"))
