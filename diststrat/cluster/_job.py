"""A job of task processes on this host, as `diststrat-run` runs it: start, watch, stop.

`run_job(plan)` starts this host's tasks of the job `plan` describes (parameter servers
first, then the workers, each a `python -c` process with `TF_CONFIG` for its task),
copies their output to this process's, prefixed with the task's name, and waits for the
workers. It stops every task when a worker fails, when a parameter server dies, and on
SIGINT/SIGTERM, and starts the job again after a failure, up to `plan.max_restarts`
times. Processes are started, signalled and described by the process layer
(`_processes.py`): each task runs its prologue first (it dies with this process), in a
process group of its own that `stop` kills whole.

The cluster spec is a pure function of the plan, so every host of a job across machines
computes the same one (`build_cluster_spec`).
"""

from typing import List, Optional, Tuple

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from diststrat.cluster import _processes
from diststrat.cluster import _task

RESTART_COUNT_ENV = "DISTSTRAT_RESTART_COUNT"
"""How many times the job was restarted before this attempt (0 on the first)."""
_GRACE = 5.0  # Seconds between SIGTERM and SIGKILL when a task is stopped.
_POLL = 0.05
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
USAGE_ERROR = 2


class LaunchError(Exception):
  """A job that cannot start or run; `status` is the launcher's exit status."""

  def __init__(self, message, status=1):
    super().__init__(message)
    self.status = status


class Interrupted(BaseException):
  """The launcher received SIGINT or SIGTERM."""

  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


# --- the cluster spec: a pure function of the plan, the same on every host ---


def build_cluster_spec(hosts: list, num_ps: int, num_workers: int,
                       port_base: int) -> dict:
  """The cluster of a job that runs `num_ps` PS and `num_workers` worker tasks per host.

  Host i's tasks listen on consecutive ports from `port_base`, its PS tasks first:
  PS task i*num_ps + k on `port_base + k`, worker task i*num_workers + k on
  `port_base + num_ps + k`. Every host computes the same spec from the same arguments.

  >>> build_cluster_spec(["a", "b"], num_ps=1, num_workers=2, port_base=2222)
  {'ps': ['a:2222', 'b:2222'], 'worker': ['a:2223', 'a:2224', 'b:2223', 'b:2224']}

  Raises:
    ValueError: no host, a host named twice, or ports beyond 65535.
  """
  if not hosts or any(not h for h in hosts):
    raise ValueError(f"hosts must name at least one host. Received: hosts={hosts!r}")
  if len(set(hosts)) != len(hosts):
    raise ValueError("Each host runs its tasks on the same ports, so a host can be named "
                     f"once only. Received: hosts={hosts!r}")
  if not 0 < port_base <= 65536 - (num_ps + num_workers):
    raise ValueError(f"--port-base must leave {num_ps + num_workers} ports below 65536. "
                     f"Received: --port-base {port_base}")
  spec = {"ps": [f"{h}:{port_base + k}" for h in hosts for k in range(num_ps)],
          "worker": [f"{h}:{port_base + num_ps + k}" for h in hosts
                     for k in range(num_workers)]}
  if not num_ps:
    del spec["ps"]
  return spec


def tasks_of_host(host_index: int, num_ps: int, num_workers: int) -> list:
  """The (task_type, task_id) of the tasks host `host_index` runs, PS tasks first."""
  return ([("ps", host_index * num_ps + k) for k in range(num_ps)] +
          [("worker", host_index * num_workers + k) for k in range(num_workers)])


def tf_config(spec: dict, task_type: str, task_id: int) -> str:
  return json.dumps({"cluster": spec, "task": {"type": task_type, "index": task_id}})


@dataclasses.dataclass
class JobPlan:
  """What to run: a job of `num_ps` PS and `num_workers` worker tasks per host.

  `hosts` are the job's hosts (one: `["127.0.0.1"]`), `host_index` this one's; with
  `port_base` None (one host only), the tasks get free ports.
  """
  num_ps: int
  num_workers: int
  script: str
  script_args: List[str]
  cpus: Optional[int] = None
  max_restarts: int = 0
  hosts: List[str] = dataclasses.field(default_factory=lambda: ["127.0.0.1"])
  host_index: int = 0
  port_base: Optional[int] = None
  isolate: bool = True
  start_timeout: float = 120.0
  across_hosts: bool = False  # Given --hosts: a job across machines (never isolated).

  def cluster_spec(self) -> dict:
    if self.port_base is None:  # One host, free ports (any: the spec lists each one).
      ports = _processes.free_ports(self.num_ps + self.num_workers)
      return {**({"ps": [f"127.0.0.1:{p}" for p in ports[:self.num_ps]]}
                 if self.num_ps else {}),
              "worker": [f"127.0.0.1:{p}" for p in ports[self.num_ps:]]}
    return build_cluster_spec(self.hosts, self.num_ps, self.num_workers, self.port_base)


# --- tasks ---


def _name(task_type, task_id):
  return f"{task_type}:{task_id}"


class _Output:
  """Copies a task's output to the launcher's, each line prefixed with the task's name."""

  _lock = threading.Lock()

  def __init__(self, name, pipe, sink):
    self._prefix = f"[{name}] ".encode()
    self._pipe, self._sink = pipe, sink
    self.thread = threading.Thread(target=self._copy, daemon=True,
                                   name=f"diststrat-run-output-{name}")
    self.thread.start()

  def _copy(self):
    for line in iter(self._pipe.readline, b""):
      if not line.endswith(b"\n"):
        line += b"\n"
      with self._lock:
        try:
          self._sink.write(self._prefix + line)
          self._sink.flush()
        except (OSError, ValueError):
          pass
    self._pipe.close()


class _Task:
  """One task's process (in its own process group) and the threads copying its output."""

  def __init__(self, task_type, task_id, env, code, argv_tail):
    self.task_type, self.task_id = task_type, task_id
    self.name = _name(task_type, task_id)
    self.ready_read = None
    pass_fds: Tuple[int, ...] = ()
    if task_type == "ps":
      self.ready_read, ready_write = os.pipe()
      env = dict(env, **{_task.READY_FD_ENV: str(ready_write)})
      pass_fds = (ready_write,)
    try:
      self.process = _processes.start_python(code, argv_tail, env, new_session=True,
                                             pass_fds=pass_fds, capture=True)
    finally:
      if pass_fds:
        os.close(ready_write)
    assert self.process.stdout is not None and self.process.stderr is not None
    self.outputs = [_Output(self.name, self.process.stdout, sys.stdout.buffer),
                    _Output(self.name, self.process.stderr, sys.stderr.buffer)]

  def poll(self):
    return self.process.poll()

  def signal_group(self, sig):
    _processes.signal_group(self.process, sig)

  def wait_ready(self, deadline, timeout):
    """Waits for a PS task's "ready" line; raises `LaunchError` if it exits or is late."""
    line = b""
    try:
      while time.monotonic() < deadline:
        if select.select([self.ready_read], [], [], _POLL)[0]:
          chunk = os.read(self.ready_read, 64)
          line += chunk
          if b"\n" in line:
            return
          if not chunk and self.poll() is None:
            time.sleep(_POLL)
        if self.poll() is not None:
          raise LaunchError(
              f"Parameter server {self.name} {_processes.describe_exit(self.poll())} "
              "while starting (its output, if any, is above).",
              _processes.exit_status(self.poll()) or 1)
      raise LaunchError(f"Parameter server {self.name} did not start within "
                        f"--start-timeout {timeout:g} s.", 1)
    finally:
      os.close(self.ready_read)
      self.ready_read = None


class _Job:
  """One attempt of the job: this host's tasks, started, watched, stopped."""

  def __init__(self, plan, attempt, network):
    self._plan = plan
    self._attempt = attempt
    self._network = network
    self.tasks: List[_Task] = []

  def _environment(self, spec, task_type, task_id):
    extra = {
        "TF_CONFIG": tf_config(spec, task_type, task_id),
        "PYTHONUNBUFFERED": "1",
        RESTART_COUNT_ENV: str(self._attempt),
    }
    if task_type == "ps":
      # TensorFlow logs each worker's session options at INFO level on a PS: not by default.
      extra["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1")
    elif self._plan.cpus:
      extra[_task.CPUS_ENV] = str(self._plan.cpus)
    base = {k: v for k, v in os.environ.items() if k != _task.CPUS_ENV}
    return _processes.task_environment(base, task_type, self._network, extra)

  def _check_ports_free(self, spec, mine):
    """Raises `LaunchError` naming the task whose port another process holds."""
    if self._network.namespace is not None:
      return  # The job's private network has no other process.
    for task_type, task_id in mine:
      address = spec[task_type][task_id]
      port = int(address.rsplit(":", 1)[1])
      with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As a server binds: connections of a previous attempt in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
          sock.bind(("", port))  # TensorFlow's servers bind every interface.
        except OSError as e:
          raise LaunchError(
              f"The port of task {_name(task_type, task_id)} ({address}) is taken by "
              f"another process ({e.strerror}); no task was started. Choose another "
              "--port-base, or leave it out to use free ports.", 1) from e

  def start(self):
    plan = self._plan
    spec = plan.cluster_spec()
    mine = tasks_of_host(plan.host_index, plan.num_ps, plan.num_workers)
    self._check_ports_free(spec, mine)
    prologue = _processes.prologue(os.getpid(), self._network.namespace)
    deadline = time.monotonic() + plan.start_timeout
    for task_type, task_id in mine:
      if task_type == "ps":
        code, tail = prologue + _task.SERVE_CODE, []
      else:
        code, tail = prologue + _task.WORKER_CODE, [plan.script] + plan.script_args
      task = _Task(task_type, task_id, self._environment(spec, task_type, task_id),
                   code, tail)
      self.tasks.append(task)
      if task_type == "ps":  # Workers start once every PS of this host serves.
        task.wait_ready(deadline, plan.start_timeout)

  def wait(self):
    """Waits for the workers; returns None if all succeeded, else the first failure
    as (task, exit status, message)."""
    while True:
      workers_done = True
      for task in self.tasks:
        code = task.poll()
        if task.task_type == "ps":
          if code is not None:
            return (task, _processes.exit_status(code) or 1,
                    f"Parameter server {task.name} {_processes.describe_exit(code)} while "
                    "the workers ran (its output, if any, is above).")
        elif code is None:
          workers_done = False
        elif code != 0:
          return (task, _processes.exit_status(code),
                  f"Task {task.name} {_processes.describe_exit(code)} (its output is "
                  "above).")
      if workers_done:
        return None
      time.sleep(_POLL)

  def stop(self):
    """Stops every task's process group: SIGTERM, then SIGKILL after a grace period."""
    running = [t for t in self.tasks if t.poll() is None]
    for task in running:
      task.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE
    for task in running:
      try:
        task.process.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    for task in self.tasks:
      task.signal_group(signal.SIGKILL)  # Also whatever the task started and left.
      try:
        task.process.wait(_GRACE)
      except subprocess.TimeoutExpired:  # pragma: no cover - the kernel did not kill it
        pass
      if task.ready_read is not None:
        os.close(task.ready_read)
        task.ready_read = None
    for task in self.tasks:
      for output in task.outputs:
        output.thread.join(_GRACE)


# --- the job ---


def say(message: str) -> None:
  """Writes a line of the launcher's own to its standard error."""
  sys.stderr.write(f"diststrat-run: {message}\n")
  sys.stderr.flush()


def _network(plan):
  """The job's private network (one host), or none, with a warning saying why."""
  network = _processes.private_network(None if plan.isolate else False, not plan.across_hosts,
                                       "diststrat-run", without="--no-isolate")
  if network.warning is not None:
    say(f"WARNING: {network.warning}")
  return network


def run_job(plan: JobPlan) -> int:
  """Runs the job (restarts included) until its workers are done; returns the launcher's
  exit status. Raises `Interrupted` once every task is stopped after SIGINT/SIGTERM
  (the caller's signal handlers raise it)."""
  network = _network(plan)
  try:
    attempt = 0
    while True:
      job = _Job(plan, attempt, network)
      try:
        job.start()
        failure = job.wait()
      except LaunchError as e:
        failure = (None, e.status, str(e))
      finally:
        # SIGINT/SIGTERM wait until every task is stopped, then interrupt.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
          job.stop()
        finally:
          signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
      if failure is None:
        return 0
      task, status, message = failure
      others = [t for t in job.tasks if t is not task]
      say(message + (" The other tasks were stopped." if others else ""))
      if attempt >= plan.max_restarts:
        if plan.max_restarts:
          say(f"giving up after {attempt} restart(s) (--max-restarts "
              f"{plan.max_restarts}); exit status {status}.")
        return status
      attempt += 1
      say(f"restarting the job ({attempt} of --max-restarts {plan.max_restarts}).")
  finally:
    network.close()
