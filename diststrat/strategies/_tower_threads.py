"""Runs a function once per tower, each in its own thread, stepped one at a time.

Why threads: model code calls `merge_call` in the middle of a tower function and expects
to continue from there with the merged result, so each tower needs its own stack. The
towers do not run Python in parallel: the calling thread lets tower 0 run until it
pauses (at `merge_call` or on return), then tower 1, and so on, so graphs, names and
variables come out the same on every run. Parallelism comes from TensorFlow's runtime.

Each tower thread starts from the calling thread's TensorFlow state: its graph (so towers
can build a `tf.function`), name scope, variable creator stack, control dependencies and
op callbacks, plus the tower's device scope and `TowerContext`.

Tower threads are pooled: a call takes idle threads from a process-wide pool, lowest
numbered first (so tower i runs in the same thread call after call when one thread
calls; which thread a tower gets does not change Keras's per-thread state in it, which
follows the calling thread: _keras/_thread_globals.py), and each tower gives its thread
back before the calling thread sees it finish. TensorFlow keeps some
state of every thread that runs an op and never frees it (part of it outside Python's
reach), so starting threads on every call would grow an eager loop's memory without
bound; a pooled thread releases what it can when it ends. The pool holds as many threads
as the most towers that ever ran at once; they wait, idle, as daemons.

A tower that returned or raised has given its thread back before `run()` returns or
raises, and the calling thread's waits are bounded by `timeout`, with one exception: a
tower that is still running its own code when the call fails (it timed out, or another
tower failed while it ran) cannot be stopped by Python. Its error is raised at once; the
thread is left to finish in the background (it unwinds at its next `merge_call` or
return, then ends instead of going back to the pool), logged as a warning, and listed by
`abandoned_tower_threads()` until it ends (then it holds nothing of its call). A paused
tower waits for its turn for as long as the call goes on (a `merge_fn` or the other
towers may take longer than `timeout`): the calling thread releases it when the call
returns or fails, and it gives up by itself only if that thread is gone.
"""

import contextlib
import functools
import inspect
import logging
import os
import threading
import types
from typing import Any

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat import errors
from diststrat.values import _wrapped

DEFAULT_TOWER_TIMEOUT = 600.0
"""Seconds a tower may run between two pauses before the call fails (not a hang)."""

_JOIN_TIMEOUT = 30.0
"""Seconds to wait for a paused tower to unwind after the call failed."""

logger = logging.getLogger("diststrat")
# Towers still running their code when their call failed (`_Tower`s).
_abandoned: list = []
_abandoned_lock = threading.Lock()  # Also orders a tower's end against its abandonment.


def abandoned_tower_threads():
  """Tower threads whose call failed while they ran their own code, still running it.

  Each one ends by itself when its code reaches a `merge_call` or returns (it then
  unwinds without running further, and the thread ends). Useful in tests and to check
  that a long-lived process is not accumulating stuck threads.
  """
  with _abandoned_lock:
    _abandoned[:] = [t for t in _abandoned if not t.finished.is_set()]
    return [t.thread for t in _abandoned]


def idle_tower_threads():
  """The pooled tower threads waiting for a call (see the module docstring)."""
  return _pool.idle_threads()


class _Worker:
  """A pooled thread: runs one tower at a time, then waits for the next one."""

  def __init__(self, number):
    self.number = number
    self._job = None
    self._given = threading.Event()
    self.thread = threading.Thread(target=self._loop, daemon=True,
                                   name=f"diststrat-tower-pool-{number}")
    self.thread.start()

  def give(self, job, name):
    """Runs `job()` in this thread; it returns whether the thread may serve again."""
    self.thread.name = name
    self._job = job
    self._given.set()

  def _loop(self):
    try:
      while True:
        self._given.wait()
        self._given.clear()
        job, self._job = self._job, None
        reuse = job()
        job = None  # Idle, this thread holds nothing of the call (its strategy, results).
        if not reuse:
          return
    finally:
      # What TensorFlow keeps of this thread must not outlive it.
      _tf_internal.release_thread_state()


class _Pool:
  """The process's idle tower threads (`_Worker`s), handed out lowest number first."""

  def __init__(self):
    self._lock = threading.Lock()
    self._idle = []
    self._started = 0

  def take(self, count):
    """`count` workers: idle ones, lowest numbers first, then new ones."""
    with self._lock:
      self._idle.sort(key=lambda w: w.number)
      taken, self._idle = self._idle[:count], self._idle[count:]
      try:
        while len(taken) < count:
          taken.append(_Worker(self._started))
          self._started += 1
      except RuntimeError as e:  # Threading's "can't start new thread" (a thread limit).
        self._idle.extend(taken)  # Still idle and reusable: the call never gave them work.
        raise RuntimeError(
            f"diststrat could not start a tower thread ({len(taken)} of the {count} "
            f"needed were available; the process runs {threading.active_count()} "
            f"threads): {e}. The system's limit on threads (ulimit -u, or a container's "
            "pids limit) is reached; raise it, or end threads the program no longer "
            "needs.") from e
      return taken

  def put_back(self, worker):
    with self._lock:
      self._idle.append(worker)

  def idle_threads(self):
    with self._lock:
      return [w.thread for w in self._idle]

  def forget(self):
    """In a forked child: the parent's threads do not exist here."""
    self._lock = threading.Lock()
    self._idle = []


_pool = _Pool()


def _forget_threads_in_child():
  """In a forked child: only the forking thread exists, so neither the pool's idle
  threads nor the abandoned towers of the parent are this process's."""
  global _abandoned_lock
  _pool.forget()
  _abandoned_lock = threading.Lock()
  _abandoned.clear()


os.register_at_fork(after_in_child=_forget_threads_in_child)


class _Aborted(BaseException):
  """Raised inside a paused tower to unwind it when the call fails elsewhere."""


class ThreadedTowerContext(_context.TowerContext):
  """The `TowerContext` of a tower run in its own thread: `merge_call` pauses it."""

  def __init__(self, tower, strategy, tower_id, num_towers, device, batch_share=None):
    super().__init__(strategy, tower_id, num_towers, device, batch_share)
    self._tower = tower

  @property
  def step_cache(self):
    """The `step_cache` of this tower's `TowerRunner` (None when it has none)."""
    return self._tower.runner.step_cache

  def _merge_call(self, merge_fn, args, kwargs):
    if self._tower.tracing_its_own_graph():
      raise errors.ContextError(
          f"merge_call() was called in tower {self.tower_id} of {self.distribution_strategy!r} "
          "while the tower was tracing a tf.function (or a tf.cond/tf.while_loop branch) "
          "of its own, which cannot merge with the other towers: they would wait for that "
          "trace to finish, and it waits for them. Received: a merge_call inside a graph "
          "the tower started building. Put the tf.function around call_for_each_tower "
          "(trace the whole step), or keep merge_call, apply_gradients and synchronized "
          "layers out of tf.functions and control flow inside the tower function.")
    return self._tower.pause_for_merge(merge_fn, args, kwargs)


class _Tower:
  """One tower's thread and the hand-over state between it and the calling thread."""

  def __init__(self, runner, index, device, fn, args, kwargs, batch_share=None):
    self.runner = runner
    self.index = index  # Among this runner's towers.
    self.tower_id = runner.first_tower_id + index  # Among all towers of the strategy.
    self.device = device
    self.batch_share = batch_share
    self._fn, self._args, self._kwargs = fn, args, kwargs
    self.go = threading.Event()      # caller -> tower: run until the next pause
    self.paused = threading.Event()  # tower -> caller: at merge_call, or finished
    self.aborted = False
    self.running = False  # Between "go" and its next pause: running its own code.
    self.done = False
    self.result = None
    self.error = None
    self.merge_fn = None
    self.merge_args = None
    self.merge_kwargs = None
    self.merge_name_scope = ""
    self.merge_result = None
    self.variables_created = 0
    self.worker = None  # The pooled thread running it, once started.
    self.thread = None
    self.finished = threading.Event()  # Set when it returned, raised or was aborted.
    self.left_behind = False  # Abandoned by its failed call while running its code.

  def start(self, worker):
    self.worker, self.thread = worker, worker.thread
    worker.give(self._main, f"diststrat-tower-{self.tower_id}")

  def _wait_for_go(self):
    # Not bounded while the call goes on: merge_fn and the towers before this one may
    # take longer than the tower timeout, which bounds each tower's own code. The caller
    # sends "go" or aborts on every way out of run(); the check is for a caller gone.
    while not self.go.wait(self.runner.timeout + _JOIN_TIMEOUT):
      if not self.runner.caller.is_alive():
        self.aborted = True  # The caller is gone; do not run.
        break
    self.go.clear()
    if self.aborted:
      raise _Aborted()

  def _main(self):
    """The tower, in its pooled thread; returns whether the thread may serve again."""
    try:
      self._wait_for_go()
      context = ThreadedTowerContext(self, self.runner.strategy, self.tower_id,
                                     self.runner.num_towers, self.device,
                                     self.batch_share)
      with self.runner.captured.enter(device=self.device, slot=self.index), \
          self.runner.strategy._tower_scope(context):
        self.result = self._fn(*self._args, **self._kwargs)
    except _Aborted:
      pass
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
    finally:
      self.done = True
      self.running = False
      with _abandoned_lock:
        reuse = not self.left_behind
        if reuse:  # Before the caller can see this tower end, so its next call finds it.
          _pool.put_back(self.worker)
        elif self in _abandoned:  # Listed no longer: it would keep its call's strategy,
          _abandoned.remove(self)  # arguments and results for as long as the process.
        self.finished.set()
      self.paused.set()
    return reuse

  def tracing_its_own_graph(self):
    """True while this tower builds a graph other than the one it started in.

    Inside a `tf.init_scope` (eager again) is not: nothing is being traced there.
    """
    if tf.executing_eagerly():
      return False
    return self.runner.captured.eager or (
        tf.compat.v1.get_default_graph() is not self.runner.captured.graph)

  def shared_variable(self, kwargs, create):
    """Tower 0 creates each variable (with `create()`); tower i's n-th gets tower 0's n-th.

    Raises:
      ValueError: the names differ, or this tower creates more variables than tower 0.
    """
    store = self.runner.shared_variables
    index = self.variables_created
    self.variables_created += 1
    name = kwargs.get("name")
    if self.index == 0:
      variable = create()
      store.append((name, variable))
      return variable
    if index >= len(store):
      raise ValueError(
          f"Tower {self.tower_id} created more variables than tower "
          f"{self.runner.first_tower_id} (variable number "
          f"{index}, name={name!r}). Every tower must create the same variables in the "
          "same order; create them in scope() before call_for_each_tower to be sure.")
    expected, variable = store[index]
    if expected != name:
      raise ValueError(
          f"Tower {self.tower_id}'s variable number {index} is named {name!r}, but tower "
          f"{self.runner.first_tower_id}'s is named {expected!r}. Every tower must create "
          "the same variables in the "
          "same order.")
    return variable

  def pause_for_merge(self, merge_fn, args, kwargs):
    """Called in the tower thread by merge_call: hand over, wait, return our part."""
    if self.aborted:
      # Unwinding from its failed call (a merge_call in a `finally`): no "go" comes
      # again, so it stops here, as at any merge_call after the failure.
      raise _Aborted()
    self.merge_fn, self.merge_args, self.merge_kwargs = merge_fn, args, kwargs
    self.merge_name_scope = tf.get_current_name_scope()
    self.running = False
    self.paused.set()
    self._wait_for_go()
    result, self.merge_result = self.merge_result, None
    self.merge_args = self.merge_kwargs = None
    return result


class TowerRunner:
  """Runs `fn` once per device in tower threads; see the module docstring.

  Args:
    strategy: the strategy whose towers these are.
    devices: one tower per device.
    timeout: seconds a tower may run between two pauses.
    first_tower_id, num_towers: the towers on `devices` have ids `first_tower_id`, ...
      out of `num_towers` (default: one per device): a strategy over several processes
      numbers its towers globally.
    step_cache: optional state that lives for this one call, such as a strategy's
      cache of values read in the towers: the towers reach it as their tower context's
      `step_cache`, and its `invalidate_all()` is called after every `merge_fn` (cross-
      tower code may have changed anything).
  """

  def __init__(self, strategy, devices, timeout=DEFAULT_TOWER_TIMEOUT, first_tower_id=0,
               num_towers=None, step_cache=None):
    self.strategy = strategy
    self.devices = tuple(devices)
    self.timeout = timeout
    self.first_tower_id = first_tower_id
    self.num_towers = len(self.devices) if num_towers is None else num_towers
    self.step_cache = step_cache
    self.captured = None
    self.caller = None  # The thread running run().
    self.shared_variables = []  # (requested name, variable) created by tower 0, in order.

  def run(self, fn, args, kwargs):
    """Returns the list of the towers' results, in tower order."""
    self.captured = _context.ThreadState()
    self.caller = threading.current_thread()
    if not self.captured.eager:
      fn = autograph_tower_fn(fn)
    elif _tf_internal.gradient_tape_recording():
      raise errors.ContextError(
          f"call_for_each_tower() of {self.strategy!r} was called while a tf.GradientTape "
          "(or a tf.autodiff.ForwardAccumulator) of the calling thread was recording. Each "
          "tower runs in a thread of its own, and a tape records only the ops of its own "
          "thread: tape.gradient() (or accumulator.jvp()) would be None for everything the "
          "towers computed. Enter the tape inside the tower function (the function given "
          "to call_for_each_tower or strategy.run): compute the loss and tape.gradient() "
          "there, as tf.distribute requires too. An optimizer's minimize(loss_fn) records "
          "loss_fn on a tape of its own: call minimize in the tower function, with a "
          "loss_fn that computes the tower's loss.")
    off = _wrapped.per_device_off((args, kwargs), self.devices)
    if off is not None:
      raise ValueError(
          f"An argument of call_for_each_tower() is a PerDevice over {list(off.devices)}, "
          f"but the towers of {self.strategy!r} are on {list(self.devices)}: each tower "
          "takes the component on its own device, so a component on another device would "
          "be ignored and a tower without one would have no argument. Pass a PerDevice "
          "with one component per tower device (the strategy's worker_devices; "
          "strategy.distribute_dataset() makes such values).")
    shares = _wrapped.batch_shares((args, kwargs)) or {}
    towers = [_Tower(self, i, d, fn, *self._tower_arguments(d, args, kwargs), shares.get(d))
              for i, d in enumerate(self.devices)]
    workers = _pool.take(len(towers))
    try:
      for tower, worker in zip(towers, workers, strict=True):
        tower.start(worker)
      while True:
        for tower in towers:
          self._step(tower)
        finished = [t for t in towers if t.done]
        if len(finished) == len(towers):
          return [t.result for t in towers]
        if finished:
          raise self._mismatch(towers)
        self._merge(towers)
    except BaseException:
      self._abort(towers)
      raise
    finally:
      self._join(towers)

  def _tower_arguments(self, device, args, kwargs):
    """(args, kwargs) for the tower on `device`: each wrapped value's component there."""
    try:
      return _wrapped.tower_part(device, args), _wrapped.tower_part(device, kwargs)
    except ValueError as e:  # A wrapped argument with no component on this device.
      raise _missing_component(
          f"An argument of call_for_each_tower() is a wrapped value with no component on "
          f"the tower device {device} of {self.strategy!r}: a PerDevice or Mirrored "
          "argument needs a component on every tower's device (the strategy's "
          "worker_devices; strategy.distribute_dataset() makes such values).", e) from e

  def _join(self, towers):
    """Waits for every tower to end; one still running its own code is left (see module
    doc)."""
    for tower in towers:
      if tower.running or tower.worker is None:  # Running its code, or not started.
        continue
      tower.finished.wait(_JOIN_TIMEOUT)
    with _abandoned_lock:
      stuck = [t for t in towers if t.worker is not None and not t.finished.is_set()]
      for tower in stuck:
        tower.left_behind = True
      _abandoned.extend(stuck)
    if stuck:
      # Formatted here: a record kept by a handler (pytest's, a list in a notebook) then
      # holds a string, not the strategy, which it would keep alive.
      logger.warning("%s", (
          f"diststrat: tower(s) {[t.tower_id for t in stuck]} of {self.strategy!r} were "
          "still running their code when the call failed; their threads finish in the "
          "background and stop at their next merge_call or return."))

  def _step(self, tower):
    tower.running = True
    tower.go.set()
    if not tower.paused.wait(self.timeout):
      raise errors.TowerTimeoutError(
          f"Tower {tower.tower_id} of {self.strategy!r} (device {tower.device}) neither "
          f"reached merge_call() nor returned within {self.timeout:g} s. Towers run one "
          "at a time, so a tower must not wait for another one (for example on an eager "
          "collective op); do such work inside merge_call() or a tf.function. Raise the "
          "limit with the strategy's tower_timeout argument if the work is just slow.")
    tower.paused.clear()
    if tower.error is not None:
      error = tower.error
      errors.add_note(error, f"(raised in tower {tower.tower_id} of {self.strategy!r}, "
                     f"on device {tower.device})")
      # It passes through AutoGraph as itself, notes included: `call_for_each_tower`
      # marks every error it raises (`_strategy._needs_cross_tower`).
      raise error.with_traceback(error.__traceback__)

  def _mismatch(self, towers):
    waiting = [t.tower_id for t in towers if not t.done]
    returned = [t.tower_id for t in towers if t.done]
    return errors.MergeCallMismatchError(
        f"Towers {waiting} called merge_call() but towers {returned} returned without "
        f"calling it, in {self.strategy!r}. Every tower must make the same merge_call()s "
        "in the same order (check for branches on tower_id around merge_call or an "
        "optimizer's apply_gradients).")

  def _merge(self, towers):
    first = towers[0]
    self._check_same_merge_fn(towers)
    merged_args = _wrapped.regroup([t.merge_args for t in towers], self.devices)
    merged_kwargs = _wrapped.regroup([t.merge_kwargs for t in towers], self.devices)
    with contextlib.ExitStack() as stack:
      stack.enter_context(_context.cross_tower_mode(self.strategy))
      if first.merge_name_scope:
        stack.enter_context(tf.name_scope(first.merge_name_scope + "/"))
      try:
        result = first.merge_fn(self.strategy, *merged_args, **merged_kwargs)
      except BaseException as e:
        if not isinstance(e, _Aborted):
          errors.add_note(e, f"(raised in merge_fn {_describe_fn(first.merge_fn)} "
                         f"called by {_tower_span(towers)} of {self.strategy!r})")
        raise
      finally:
        if self.step_cache is not None:
          self.step_cache.invalidate_all()
    for tower in towers:
      try:
        tower.merge_result = _wrapped.tower_part(tower.device, result)
      except ValueError as e:  # A wrapped value with no component for this tower.
        raise _missing_component(
            f"merge_fn {_describe_fn(first.merge_fn)} returned a wrapped value with no "
            f"component on tower {tower.tower_id}'s device {tower.device}, so merge_call "
            "cannot give that tower its part. Return a value with a component on every "
            "tower's device (strategy.reduce(...) or strategy.broadcast(...) without "
            "destinations), or a plain value (every tower gets it).", e) from e

  def _check_same_merge_fn(self, towers):
    groups = []  # [(merge_fn, [tower ids])], by sameness
    for tower in towers:
      for fn, ids in groups:
        if _context.same_merge_fn(fn, tower.merge_fn):
          ids.append(tower.tower_id)
          break
      else:
        groups.append((tower.merge_fn, [tower.tower_id]))
    if len(groups) == 1:
      return
    passed = [_passed_merge_fn(fn) for fn, _ in groups]
    if _methods_of_different_objects(passed):
      first = passed[0]
      name = f"{type(first.__self__).__name__}.{_describe_fn(first)}"
      described = "; ".join(
          f"towers {ids} passed {name if i == 0 else 'it'} of {'one' if i == 0 else 'another'}"
          " object" for i, (_, ids) in enumerate(groups))
      raise errors.MergeCallMismatchError(
          f"Towers passed different merge_fns to one merge_call() in {self.strategy!r}: "
          f"{described}. Each tower made its own object (such as an optimizer created "
          "inside the tower function): create it once, before call_for_each_tower, and "
          "use it in every tower.")
    described = "; ".join(f"towers {ids} passed {_describe_fn(fn)}" for fn, ids in groups)
    raise errors.MergeCallMismatchError(
        f"Towers passed different merge_fns to one merge_call() in {self.strategy!r}: "
        f"{described}. Every tower must call merge_call() with the same function at the "
        "same point (check for branches on tower_id around merge_call).")

  def _abort(self, towers):
    for tower in towers:
      tower.aborted = True
      tower.go.set()


def _passed_merge_fn(fn):
  """The merge_fn a tower passed: `fn`, or the one that wrappers put around it on its way
  (the tf.distribute bridge's, a GPipe stage's) hold."""
  while isinstance(fn, _context.WrappedMergeFn):
    fn = fn.tower_merge_fn
  return fn


def _methods_of_different_objects(fns):
  """Whether `fns` are the same method bound to different objects."""
  if not all(inspect.ismethod(fn) for fn in fns):
    return False
  return len({getattr(fn.__func__, "__code__", None) for fn in fns}) == 1


def _tower_span(towers):
  """"tower i", or "towers i-j": the ids of a call's towers (a strategy over several
  processes numbers them from its `first_tower_id`)."""
  first, last = towers[0].tower_id, towers[-1].tower_id
  return f"tower {first}" if first == last else f"towers {first}-{last}"


def _missing_component(message, error):
  """`message` as a ValueError, with `select_device`'s own `error` after it."""
  return ValueError(f"{message} ({error})")


def _describe_fn(fn):
  """A function's name, the same whether or not AutoGraph converted it."""
  if isinstance(fn, functools.partial):
    bound = [_describe_fn(a) for a in fn.args if isinstance(a, types.FunctionType)]
    return f"partial({', '.join([_describe_fn(fn.func)] + bound)})"
  name = getattr(fn, "__name__", None) or type(fn).__name__
  return name[len("tf__"):] if name.startswith("tf__") else name


def autograph_tower_fn(fn: Any) -> Any:
  """`fn` converted by AutoGraph (Python control flow on tensors) while tracing.

  AutoGraph converts the functions a `tf.function` calls, but not the ones a library
  calls for it; the tower function is one of those, so convert it here, as TensorFlow
  does for its own strategies (the threaded towers and the default strategy's one
  tower alike). Functions AutoGraph cannot convert run as they are.
  """
  if getattr(fn, "autograph_info__", None) is not None or not callable(fn):
    return fn
  if inspect.ismethod(fn):  # AutoGraph converts the function; bind it again.
    converted = autograph_tower_fn(fn.__func__)
    return fn if converted is fn.__func__ else types.MethodType(converted, fn.__self__)
  if isinstance(fn, functools.partial):  # As a tf.function does: convert its function.
    converted = autograph_tower_fn(fn.func)
    return fn if converted is fn.func else functools.partial(converted, *fn.args,
                                                             **fn.keywords)
  if _is_callable_object(fn):
    return _autograph_callable_object(fn)
  try:
    return tf.autograph.to_graph(fn)
  except Exception:  # pylint: disable=broad-except
    return fn


def _is_callable_object(fn):
  """Whether `fn` is an instance of a class with a `__call__` written in Python (not a
  function, method, class, builtin, partial or `tf.function`)."""
  if (inspect.isroutine(fn) or inspect.isclass(fn) or isinstance(fn, functools.partial)
      or isinstance(fn, tf.types.experimental.GenericFunction)):
    return False
  return inspect.isfunction(inspect.getattr_static(type(fn), "__call__", None))


def _autograph_callable_object(fn):
  """A callable object converted as a `tf.function` converts one it calls.

  `tf.autograph.to_graph` takes functions only. A function calling `fn`, converted, calls
  it through AutoGraph, which converts the `__call__` of the object's class with the rules
  it applies in a `tf.function`: code of the libraries it leaves alone (Keras's
  `Layer.__call__`, so a Keras model runs as when a `tf.function` calls it) is not
  converted.
  """
  def call(*args, **kwargs):
    return fn(*args, **kwargs)

  call.__name__ = call.__qualname__ = type(fn).__name__  # What errors name.
  try:
    return tf.autograph.to_graph(call)
  except Exception:  # pylint: disable=broad-except
    return fn


def current_tower(strategy):
  """The `_Tower` of the calling thread if it is a tower thread of `strategy`, else None."""
  context = _context.get_tower_context()
  if isinstance(context, ThreadedTowerContext) and context.distribution_strategy is strategy:
    return context._tower
  return None


