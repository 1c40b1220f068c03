"""`LocalCluster`: a parameter-server cluster of child processes on this machine.

Each PS task is a child process running a `tf.distribute.Server` on a free loopback
port. Worker tasks have fixed ports in the spec too (a worker that reconnects after a PS
restart must come back at the same address), but their processes exist only while
`run_on_workers` runs: one fresh process per worker task, each running the caller's
function with a `ParameterServerStrategy` for its task.

Every task process is a fork of the cluster's fork server (`_forkserver.py`), a process
that imports TensorFlow, Keras and diststrat once when the cluster starts: a task starts
in milliseconds instead of paying TensorFlow's import (seconds) each time, and is still a
fresh process that has run nothing else. Children talk to the parent over a socket pair
(`_child.py`). Nothing outlives the cluster:

- `stop()` (also on leaving the `with` block, whatever the body raised) kills every
  child with SIGKILL, which works on frozen (SIGSTOPped) processes too, then the fork
  server, which reaps them;
- an `atexit` hook stops every cluster still running when the interpreter exits;
- if this process dies, the fork server sees its connection close and kills its
  children, and each child is killed by Linux when the fork server dies.

Every wait is bounded: `start_timeout` for a server to come up, `result_timeout` for
the workers' results, and a few seconds for each kill.

Network: TensorFlow's servers listen on every interface and run any graph any client
sends (docs/security.md). Where Linux allows it without privileges, every process of
the cluster runs in a private network namespace (`_isolation.py`): the tasks reach each
other on loopback, and nothing outside the cluster reaches them.
"""

from typing import Any, Callable, Optional

import atexit
import inspect
import ipaddress
import logging
import numbers
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import connection

from diststrat import _arguments
from diststrat import errors
from diststrat import strategies
from diststrat._cluster_runtime import _exposure
from diststrat.cluster import _forkserver
from diststrat.cluster import _processes
from diststrat.cluster._processes import free_ports
from diststrat.cluster._processes import task_name

DEFAULT_START_TIMEOUT = 120.0
DEFAULT_RESULT_TIMEOUT = 600.0
_KILL_WAIT = 10.0
_POLL = 0.05
_CHILD_MAIN = "from diststrat.cluster import _child; _child.main()"
_CHILD_FD = 3  # The child's end of its socket pair, in the child.
# What every task process needs: the fork server imports it once (`_forkserver`).
_PRELOAD = ("diststrat.cluster._child", "keras", "numpy")
_JOBS = ("ps", "worker")
STRATEGIES = ("parameter_server", "multi_worker")

_running_clusters: "weakref.WeakSet[LocalCluster]" = weakref.WeakSet()
_logger = logging.getLogger("diststrat")
_network_warned: list[bool] = []


@atexit.register
def _stop_running_clusters():
  for cluster in list(_running_clusters):
    cluster.stop()
  share_fork_server(False)


class _Shared:
  """The fork server the clusters of this process share, when they do."""
  enabled = False
  server: Optional[_forkserver.ForkServer] = None
  lock = threading.Lock()


def share_fork_server(share: bool) -> None:
  """Whether the clusters of this process share one fork server (not public).

  By default each `LocalCluster` starts its own fork server and stops it on exit, so
  nothing outlives the cluster. A process that starts many clusters one after another
  (a test suite) can share one instead, and save TensorFlow's import (seconds) on each
  cluster: it starts with the first cluster and stops at interpreter exit, or on
  `share_fork_server(False)`. Tasks are forks as before: fresh processes, each in its
  own cluster's network namespace.
  """
  with _Shared.lock:
    _Shared.enabled = share
    server = None if share else _Shared.server
    if server is not None:
      _Shared.server = None
  if server is not None:
    server.close()


def shared_fork_server_pid() -> Optional[int]:
  """The process id of the shared fork server while one runs (tests leave it alone)."""
  return None if _Shared.server is None else _Shared.server.pid


def _fork_server(env, timeout):
  """The fork server of a cluster that starts: the shared one, or one of its own."""
  with _Shared.lock:
    if not _Shared.enabled:
      return _forkserver.ForkServer(_PRELOAD, env).start(timeout)
    if _Shared.server is None or not _Shared.server.alive():
      _Shared.server = _forkserver.ForkServer(_PRELOAD, env).start(timeout)
    return _Shared.server


def _check_host(host):
  """`host` if this machine can resolve it, else `ValueError` naming it."""
  if not isinstance(host, str) or not host:
    raise ValueError(f"host must be a host name or address such as '127.0.0.1'. Received: "
                     f"host={host!r}")
  try:
    socket.getaddrinfo(host, None)
  except (socket.gaierror, UnicodeError) as e:
    raise ValueError(f"host must be a name or address this machine resolves, such as "
                     f"'127.0.0.1'. Received: host={host!r} ({e}).") from e
  return host


# Set by LocalCluster for each worker's strategy: not the caller's to give.
_CLUSTER_SET_KWARGS = ("cluster_spec", "task_type", "task_id")


def _check_strategy_kwargs(strategy_kwargs, num_ps):
  """A copy of `strategy_kwargs` (a dict of keyword arguments, or None), else raises.

  The keywords must be arguments of the workers' strategy, which `num_ps` decides
  (`run_on_workers` runs `ParameterServerStrategy` with PS tasks only,
  `MultiWorkerMirroredStrategy` without them only): else each worker would raise
  `TypeError` once its process started.
  """
  if strategy_kwargs is None:
    return {}
  if not isinstance(strategy_kwargs, dict) or not all(
      isinstance(key, str) for key in strategy_kwargs):
    raise ValueError(
        "strategy_kwargs must be a dict of keyword arguments for each worker's strategy, "
        "such as {'step_timeout': 10}, or None. Received: "
        f"strategy_kwargs={strategy_kwargs!r} ({type(strategy_kwargs).__name__}).")
  taken = [key for key in _CLUSTER_SET_KWARGS if key in strategy_kwargs]
  if taken:
    raise ValueError(
        f"strategy_kwargs cannot set {', '.join(taken)}: LocalCluster gives each worker's "
        "strategy the cluster's spec and the worker's own task. Received: "
        f"strategy_kwargs={strategy_kwargs!r}. Leave them out.")
  strategy = (strategies.ParameterServerStrategy if num_ps else
              strategies.MultiWorkerMirroredStrategy)
  takes = [name for name in inspect.signature(strategy).parameters
           if name not in _CLUSTER_SET_KWARGS]
  unknown = [key for key in strategy_kwargs if key not in takes]
  if unknown:
    which = "with" if num_ps else "without"
    raise TypeError(
        f"strategy_kwargs has {', '.join(unknown)}, which {strategy.__name__} does not "
        f"take (the strategy of a cluster {which} PS tasks). It takes {', '.join(takes)}. "
        f"Received: strategy_kwargs={strategy_kwargs!r}.")
  return dict(strategy_kwargs)


def _is_int(value):
  """Whether `value` is an integer (a numpy one too), not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_loopback(host):
  try:
    return all(ipaddress.ip_address(info[4][0]).is_loopback
               for info in socket.getaddrinfo(host, None))
  except (socket.gaierror, ValueError):
    return False


class _Child:
  """One task's process (a fork of the cluster's fork server) and the socket pair to it."""

  def __init__(self, server, job, env, name, prologue):
    self.name = name
    parent_end, child_end = socket.socketpair()
    try:
      self.process = server.spawn(_CHILD_MAIN, [str(_CHILD_FD)], env=env,
                                  fds={_CHILD_FD: child_end.fileno()}, prologue=prologue)
    except BaseException:
      parent_end.close()
      raise
    finally:
      child_end.close()
    self.conn = connection.Connection(parent_end.detach())
    try:
      self.conn.send(job)
    except OSError:
      pass  # The child died at once; poll() reports how.

  @property
  def pid(self):
    return self.process.pid

  def exited(self):
    return self.process.poll() is not None

  def receive(self, timeout):
    """The child's next message, or None if none came within `timeout` (or it is gone)."""
    try:
      if self.conn.poll(timeout):
        return self.conn.recv()
    except (EOFError, OSError):
      if timeout:
        time.sleep(min(timeout, _POLL))
    return None

  def signal(self, sig):
    self.process.send_signal(sig)  # A no-op once it exited; never another process.

  def stop(self) -> None:
    """Kills the process (SIGKILL works on a stopped one too) and reaps it."""
    try:
      self.signal(signal.SIGKILL)
      self.process.wait(_KILL_WAIT)
    except (subprocess.TimeoutExpired, errors.ClusterError):  # pragma: no cover
      pass  # The kernel did not kill it in time, or the fork server (and so it) is gone.
    self.conn.close()


class _WorkerRun:
  """One `run_on_workers` call: a process per worker task, and their results."""

  def __init__(self, cluster, job):
    self._cluster = cluster
    self._job = job
    self.children = [None] * cluster.num_workers
    self._payloads = [None] * cluster.num_workers

  def start(self) -> None:
    for task_id in range(len(self.children)):
      self.children[task_id] = self._start(task_id)

  def _start(self, task_id):
    job = dict(self._job, task_id=task_id)
    return self._cluster._start_child(job, task_name("worker", task_id))

  def restart(self, task_id):
    """Replaces worker `task_id`'s process with a fresh one (call with the cluster's lock)."""
    self.children[task_id].stop()
    self._payloads[task_id] = None
    self.children[task_id] = self._start(task_id)

  def stop(self) -> None:
    for child in self.children:
      if child is not None:
        child.stop()

  def wait(self, timeout):
    """Returns the results in task order, or raises the error of the worker that
    failed first (in time), with the others' named in a note."""
    deadline = time.monotonic() + timeout
    lock = self._cluster._processes_lock
    while True:
      with lock:
        pending = [i for i, p in enumerate(self._payloads) if p is None]
      if not pending:
        break
      if time.monotonic() > deadline:
        names = ", ".join(task_name("worker", i) for i in pending)
        raise errors.ClusterError(
            f"Worker task(s) {names} returned no result within result_timeout="
            f"{timeout:g} s; they were stopped. Raise LocalCluster(result_timeout=...) if "
            "the work is just long.", task=task_name("worker", pending[0]))
      for task_id in pending:
        with lock:
          child = self.children[task_id]
        exited = child.exited()
        message = child.receive(_POLL / len(pending))
        with lock:
          if self.children[task_id] is not child:
            continue  # Restarted meanwhile: wait for the new process.
          if message is not None:
            self._payloads[task_id] = message
          elif exited:
            # When this process noticed (within a poll of _POLL s of the exit): a failure
            # it caused in another worker may sort before it in that window, rarely.
            self._payloads[task_id] = ("died", child.process.returncode, time.monotonic())
    return self._results()

  def _results(self):
    results, failures = [], []
    for task_id, payload in enumerate(self._payloads):
      name = task_name("worker", task_id)
      if payload[0] == "ok":
        results.append(pickle.loads(payload[1]))
        continue
      when = payload[-1]  # Monotonic, this machine's: when the task failed.
      if payload[0] == "died":
        error = errors.ClusterError(
            f"Worker task {name} {_processes.describe_exit(payload[1])} before returning a result "
            "(its output, if any, is above).", task=name)
      else:
        _, pickled, type_name, message, text, _ = payload
        error = None
        if pickled is not None:
          try:
            error = pickle.loads(pickled)
          except Exception:  # pylint: disable=broad-except
            error = None
        if not isinstance(error, BaseException):
          error = errors.ClusterError(f"{type_name} in worker task {name}: {message}",
                                      task=name)
        errors.add_note(error, f"(raised in worker task {name}; its traceback:\n{text.rstrip()})")
      failures.append((when, name, error))
    if failures:
      # The first to fail is the likely cause: the others often fail because of it (a
      # collective whose peer is gone).
      failures.sort(key=lambda failure: failure[0])
      _, name, error = failures[0]
      if len(failures) > 1:
        others = "; ".join(f"{n}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                           for _, n, e in failures[1:])
        errors.add_note(error, f"(raised first, in {name}; later failures: {others})")
      raise error
    return results


class LocalCluster:
  """A cluster of processes on this machine, for tests and examples.

  Starts `num_ps` PS tasks (`tf.distribute.Server` processes) on free loopback ports,
  gives the `num_workers` worker tasks fixed ports, and runs functions on the workers
  with `run_on_workers`, each with a strategy for its task: a `ParameterServerStrategy`
  when the cluster has PS tasks, a `MultiWorkerMirroredStrategy` (synchronous training
  across the workers) when `num_ps=0`. Use it as a context manager: every process is
  stopped on exit, also when the body raises.

  Args:
    num_ps: number of PS tasks (0: workers only).
    num_workers: number of worker tasks.
    strategy_kwargs: extra arguments of each worker's strategy, such as
      {"step_timeout": 10, "variable_placement": "round_robin"} (not `cluster_spec`,
      `task_type` or `task_id`, which the cluster sets). The strategy is
      `ParameterServerStrategy` with PS tasks, else `MultiWorkerMirroredStrategy`; a
      keyword it does not take raises `TypeError` here.
    cpus_per_worker: on machines without GPUs, split each worker process's CPU into this
      many logical devices (its towers), a positive int; None leaves TensorFlow's
      default (one).
    start_timeout: seconds (a positive number) a PS server may take to start.
    result_timeout: seconds (a positive number) `run_on_workers` waits for the workers'
      results.
    host: the address the tasks use to reach each other (loopback by default). It is
      not where the servers listen: TensorFlow's servers listen on every interface.
    isolate: whether the cluster's processes run in a private network namespace that
      nothing outside the cluster can reach (Linux, no privileges needed where the
      kernel allows unprivileged user namespaces). None (the default): when `host` is a
      loopback address and the system allows it, else with a warning that the servers
      are reachable. True: required (`ClusterError` if the system does not allow it).
      False: never; needed when a worker's code must reach the network (isolated
      processes have only loopback). See docs/security.md.

  Every argument is checked when the cluster is created, before any process starts: a
  bad one raises `ValueError` naming it.

  Security: TensorFlow's gRPC servers run any graph any client sends, without
  authentication. Without isolation, any process that can reach this machine's ports
  can read and overwrite the cluster's variables and run code in its processes.

  Example::

      def count(strategy, n):                  # module-level: it is pickled
        with strategy.scope():
          c = tf.Variable(0)
        for _ in range(n):
          c.assign_add(1)
        return int(c.numpy())

      with diststrat.cluster.LocalCluster(num_ps=1, num_workers=2) as cluster:
        print(cluster.cluster_spec)            # {'ps': ['127.0.0.1:...'], 'worker': [...]}
        cluster.run_on_workers(count, n=100)   # e.g. [187, 200]: the counter is shared
  """

  def __init__(self, num_ps: int = 1, num_workers: int = 1, *,
               strategy_kwargs: Optional[dict] = None,
               cpus_per_worker: Optional[int] = None,
               start_timeout: float = DEFAULT_START_TIMEOUT,
               result_timeout: float = DEFAULT_RESULT_TIMEOUT, host: str = "127.0.0.1",
               isolate: Optional[bool] = None) -> None:
    # Every argument is checked here, before any process starts.
    for name, value, least in (("num_ps", num_ps, 0), ("num_workers", num_workers, 1)):
      if not _is_int(value) or value < least:
        kind = "a non-negative" if least == 0 else "a positive"
        raise ValueError(f"{name} must be {kind} integer. Received: {name}={value!r}")
    if cpus_per_worker is not None and (not _is_int(cpus_per_worker) or cpus_per_worker < 1):
      raise ValueError(
          "cpus_per_worker must be a positive integer (the logical CPU devices, so towers, "
          "of each worker process), or None for TensorFlow's default of one. Received: "
          f"cpus_per_worker={cpus_per_worker!r}")
    self.num_ps = int(num_ps)
    self._cpus_per_worker = None if cpus_per_worker is None else int(cpus_per_worker)
    self.num_workers = int(num_workers)
    self._strategy_kwargs = _check_strategy_kwargs(strategy_kwargs, self.num_ps)
    self._start_timeout = _arguments.seconds("start_timeout", start_timeout,
                                             allow_none=False)
    self._result_timeout = _arguments.seconds("result_timeout", result_timeout,
                                              allow_none=False)
    self._host = _check_host(host)
    if isolate not in (None, True, False):
      raise ValueError(f"isolate must be None (when possible), True or False. Received: "
                       f"isolate={isolate!r}")
    if isolate and not _is_loopback(self._host):
      raise ValueError(
          "isolate=True runs the cluster in a private network that has only loopback, so "
          f"host must be a loopback address such as '127.0.0.1'. Received: host={host!r}. "
          "Use host='127.0.0.1', or isolate=False to reach the tasks over the network.")
    self._isolate = isolate
    self._network = _processes.Network(None)
    self._forkserver: Optional[_forkserver.ForkServer] = None
    self._processes_lock = threading.RLock()
    self._spec: Optional[dict[str, list[str]]] = None  # Set by `start`.
    self._ps: list[Optional[_Child]] = []  # None while that PS task restarts.
    self._run: Optional[_WorkerRun] = None  # The `run_on_workers` call running.
    self._state = "new"

  def __repr__(self):
    return f"LocalCluster(num_ps={self.num_ps}, num_workers={self.num_workers}, {self._state})"

  def __enter__(self):
    self.start()
    return self

  def __exit__(self, exc_type, exc, tb):
    self.stop()
    return False

  def _addresses(self):
    assert self._spec is not None  # `start` set it.
    return [address for addresses in self._spec.values() for address in addresses]

  @property
  def isolated(self) -> bool:
    """Whether the cluster's processes run in a private network namespace (once started)."""
    return self._network.namespace is not None

  @property
  def cluster_spec(self) -> dict[str, list[str]]:
    """{"ps": ["127.0.0.1:port", ...], "worker": [...]} (no "ps" if num_ps=0): a copy."""
    self._check_running()
    assert self._spec is not None  # `start` set it.
    return {job: list(addresses) for job, addresses in self._spec.items()}

  def start(self) -> "LocalCluster":
    """Starts the PS servers and waits until each listens (at most `start_timeout`)."""
    with self._processes_lock:
      if self._state != "new":
        raise errors.ClusterError(f"{self!r} was started already; a LocalCluster starts once.")
      self._state = "running"
      _running_clusters.add(self)
      # A PS warms itself up as a client of its own server, from one more port (_child).
      ports = free_ports(self.num_ps + self.num_workers + self.num_ps, self._host)
      self._warm_up_ports = ports[self.num_ps + self.num_workers:]
      self._spec = {
          "ps": [f"{self._host}:{p}" for p in ports[:self.num_ps]],
          "worker": [f"{self._host}:{p}"
                     for p in ports[self.num_ps:self.num_ps + self.num_workers]],
      }
      if not self.num_ps:
        del self._spec["ps"]
    try:
      deadline = time.monotonic() + self._start_timeout
      self._network = self._private_network()
      if self.isolated:  # Connecting from outside then fails at once, with the fix.
        _exposure.register_isolated(self._addresses(), repr(self))
      self._forkserver = _fork_server(self._environment("server"), self._start_timeout)
      self._ps = [self._start_ps(i) for i in range(self.num_ps)]
      for task_id, child in enumerate(self._ps):
        self._wait_ready(child, task_id, deadline)
    except BaseException:
      self.stop()
      raise
    return self

  def stop(self) -> None:
    """Stops every process of the cluster (idempotent). Bounded: ~10 s per process."""
    with self._processes_lock:
      if self._state == "stopped":
        return
      self._state = "stopped"
      run, self._run = self._run, None
      children, self._ps = list(self._ps), []
    if run is not None:
      run.stop()
    for child in children:
      if child is not None:
        child.stop()
    if self._forkserver is not None and self._forkserver is not _Shared.server:
      self._forkserver.close()
    self._network.close()
    if self._spec is not None:
      _exposure.forget_isolated(self._addresses())
    _running_clusters.discard(self)

  def pid(self, task_type: str, task_id: int) -> Optional[int]:
    """The process id of a task (a worker's only while `run_on_workers` runs)."""
    return self._child(task_type, task_id).pid

  def kill(self, task_type: str, task_id: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to a task's process: SIGKILL (default) kills it, SIGSTOP freezes it.

    A killed PS task stays down until `restart`. A killed worker makes the running
    `run_on_workers` raise `ClusterError` naming it, unless it is restarted first.

    Raises:
      ValueError: no such task or signal, or a worker task while no `run_on_workers` runs.
    """
    if not _is_int(sig) or sig not in signal.valid_signals():
      raise ValueError(f"sig must be a signal of this system, such as signal.SIGKILL (the "
                       f"default) or signal.SIGSTOP. Received: sig={sig!r}")
    sig = int(sig)  # A numpy integer too, as task ids.
    child = self._child(task_type, task_id)
    child.signal(sig)
    if sig == signal.SIGKILL:
      try:
        child.process.wait(_KILL_WAIT)
      except subprocess.TimeoutExpired:  # pragma: no cover
        pass

  def restart(self, task_type: str, task_id: int) -> None:
    """Restarts a task on the same port, killing it first if it still runs.

    A PS task comes back empty (its variables are gone): workers call
    `strategy.reconnect()` and restore their last checkpoint. A worker task (only while
    `run_on_workers` runs) is replaced by a fresh process that runs the same function;
    `run_on_workers` returns the new process's result for it.
    """
    if task_type == "ps":
      with self._processes_lock:
        old = self._child(task_type, task_id)
        task_id = int(task_id)  # A numpy integer, say: checked by `_child`.
        old.stop()
        self._ps[task_id] = None
      child = self._start_ps(task_id)
      with self._processes_lock:
        if self._state != "running":
          child.stop()
          raise errors.ClusterError(f"{self!r} was stopped while {task_name('ps', task_id)} "
                             "restarted.")
        self._ps[task_id] = child
      self._wait_ready(child, task_id, time.monotonic() + self._start_timeout)
      return
    with self._processes_lock:
      self._child(task_type, task_id)  # Checks the task, and that a run is running.
      run = self._run
      assert run is not None  # `_child` raised otherwise.
      run.restart(int(task_id))

  def run_on_workers(self, fn: Callable[..., Any], strategy: Optional[str] = None,
                     **kwargs: Any) -> list:
    """Runs `fn(strategy, **kwargs)` in one fresh process per worker task, all at once.

    Each process gets a strategy for its own worker task of the cluster. Waits at most
    `result_timeout` seconds.

    Args:
      fn: a module-level function (it is pickled): `fn(strategy, **kwargs)`.
      strategy: "parameter_server" (`ParameterServerStrategy`, the default when the
        cluster has PS tasks) or "multi_worker" (`MultiWorkerMirroredStrategy`, the
        default without PS tasks; only there).
      **kwargs: picklable keyword arguments for `fn`.

    Returns:
      The list of the workers' results, in task order.

    Raises:
      TypeError: `fn`, `kwargs` or the `strategy_kwargs` cannot be pickled.
      ValueError: `strategy` does not fit the cluster ("parameter_server" without PS
        tasks, "multi_worker" with them), before any worker process starts.
      The exception of the worker that failed first, in time (same type when it can be
      pickled, else `ClusterError`), with notes naming the task, its traceback and the
      later failures of other workers (often caused by the first); `ClusterError`
      naming the task if a worker process died or did not finish in time.
    """
    try:
      fn_bytes = pickle.dumps(fn)
    except Exception as e:  # pylint: disable=broad-except
      raise TypeError(
          "run_on_workers() sends fn to the worker processes by pickling it, so fn must "
          "be a module-level function (not a lambda or a function defined inside "
          f"another one). Received: fn={fn!r} ({e})") from e
    try:
      kwargs_bytes = pickle.dumps(kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise TypeError("run_on_workers() sends its keyword arguments to the worker "
                      f"processes by pickling them; these cannot be: {e}") from e
    try:
      strategy_kwargs_bytes = pickle.dumps(self._strategy_kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise TypeError(
          "run_on_workers() sends strategy_kwargs to the worker processes by pickling "
          "them, so a function among them (such as variable_placement) must be a "
          f"module-level function, not a lambda or a nested function; these cannot be: "
          f"{e}") from e
    if strategy is None:
      strategy = "parameter_server" if self.num_ps else "multi_worker"
    if strategy not in STRATEGIES or (strategy == "parameter_server" and not self.num_ps):
      raise ValueError(
          f"strategy must be 'parameter_server' (a cluster with PS tasks) or 'multi_worker'. "
          f"Received: strategy={strategy!r} for {self!r}.")
    if strategy == "multi_worker" and self.num_ps:
      raise ValueError(
          "strategy='multi_worker' runs on a cluster without parameter servers, which "
          f"MultiWorkerMirroredStrategy does not use, but {self!r} has {self.num_ps} PS "
          "task(s). Use strategy='parameter_server' here, or a LocalCluster(num_ps=0, ...) "
          "for synchronous training.")
    main_path = None
    # What fn, kwargs or strategy_kwargs take from a script run as `__main__` (functions,
    # classes) pickles by that name: the workers load the script to find it.
    if any(b"__main__" in part for part in (fn_bytes, kwargs_bytes, strategy_kwargs_bytes)):
      main_path = getattr(sys.modules["__main__"], "__file__", None)
    job = {"kind": "worker", "fn": fn_bytes, "kwargs": kwargs_bytes, "main_path": main_path,
           "strategy": strategy, "strategy_kwargs": strategy_kwargs_bytes,
           "task_type": "worker", "cpus": self._cpus_per_worker}
    with self._processes_lock:
      self._check_running()
      if self._run is not None:
        raise errors.ClusterError(f"run_on_workers() is already running on {self!r}; wait for "
                           "it to return.")
      run = self._run = _WorkerRun(self, job)
      try:
        run.start()
      except BaseException:
        self._run = None
        run.stop()
        raise
    try:
      return run.wait(self._result_timeout)
    except BaseException as e:
      self._note_dead_ps(e)
      raise
    finally:
      with self._processes_lock:
        if self._run is run:
          self._run = None
      run.stop()

  def exit_status(self, task_type: str, task_id: int) -> Optional[int]:
    """A task's process exit status: None while it runs, negative for a signal (-11:
    SIGSEGV). A worker's only while `run_on_workers` runs."""
    return self._child(task_type, task_id).process.poll()

  def _note_dead_ps(self, error):
    """Adds to `error` how each PS task that died ended (its stderr is above)."""
    with self._processes_lock:
      children = list(enumerate(self._ps))
    for task_id, child in children:
      if child is not None and child.exited():
        errors.add_note(error, f"(parameter server task {task_name('ps', task_id)} "
                        f"{_processes.describe_exit(child.process.returncode)}; its error output, if "
                        "any, is above)")

  # --- processes ---

  def _check_running(self):
    if self._state != "running":
      raise errors.ClusterError(f"{self!r} is not running: use it as `with LocalCluster(...) as "
                         "cluster:` (or call start()).")

  def _child(self, task_type, task_id):
    with self._processes_lock:
      self._check_running()
      if task_type not in _JOBS:
        raise ValueError(f"task_type must be 'ps' or 'worker'. Received: "
                         f"task_type={task_type!r}")
      count = self.num_ps if task_type == "ps" else self.num_workers
      if not _is_int(task_id) or not 0 <= task_id < count:
        raise ValueError(f"task_id must be from 0 to {count - 1} for the {task_type!r} job "
                         f"of {self!r}. Received: task_id={task_id!r}")
      task_id = int(task_id)
      if task_type == "ps":
        child = self._ps[task_id]
        if child is None:
          raise errors.ClusterError(f"{task_name('ps', task_id)} is restarting.")
        return child
      if self._run is None:
        raise ValueError(
            f"Worker task {task_name('worker', task_id)} is not running: worker "
            "processes exist only while run_on_workers() runs (call kill() or restart() "
            "from another thread meanwhile).")
      return self._run.children[task_id]

  def _environment(self, kind):
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
      paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return _processes.task_environment(env, kind, self._network)

  def _private_network(self):
    """The network of the cluster's processes (see `isolate`), with a warning (once per
    process) when they have no private one and it was not asked for."""
    try:
      network = _processes.private_network(self._isolate, _is_loopback(self._host),
                                           "LocalCluster")
    except OSError as e:
      raise errors.ClusterError(
          "LocalCluster(isolate=True) runs its processes in a private network namespace, "
          f"which this system does not allow: {e}. Allow unprivileged user namespaces "
          "(sysctl kernel.unprivileged_userns_clone=1, or the container's seccomp "
          "profile), or use isolate=None to run without it (docs/security.md).") from e
    if network.warning is not None and self._isolate is None and not _network_warned:
      _network_warned.append(True)
      _logger.warning("LocalCluster: %s", network.warning)
    return network

  def _start_child(self, job, name):
    job = dict(job, cluster_spec=self._spec,
               sys_path=[p or os.getcwd() for p in sys.path])
    # Each task joins the cluster's network (and dies with the fork server, as each of
    # its children does).
    prologue = _processes.join_code(self._network.namespace)
    return _Child(self._forkserver, job, self._environment(job["kind"]), name, prologue)

  def _start_ps(self, task_id):
    job = {"kind": "ps", "task_type": "ps", "task_id": task_id,
           "warm_up_port": self._warm_up_ports[task_id]}
    return self._start_child(job, task_name("ps", task_id))

  def _wait_ready(self, child, task_id, deadline):
    name = task_name("ps", task_id)
    while time.monotonic() < deadline:
      exited = child.exited()
      message = child.receive(_POLL)
      if message is not None and message[0] == "ready":
        return
      if exited:
        raise errors.ClusterError(
            f"Parameter server {name} {_processes.describe_exit(child.process.returncode)} while "
            "starting (its error output is above).", task=name)
    raise errors.ClusterError(
        f"Parameter server {name} did not start within start_timeout="
        f"{self._start_timeout:g} s.", task=name)
