"""A job of task processes on this host, as `diststrat-run` runs it: start, watch, stop.

`run_job(plan)` starts this host's tasks of the job `plan` describes (parameter servers
first, then the workers, each a `python -c` process with `TF_CONFIG` for its task),
copies their output to this process's, prefixed with the task's name, and waits for the
workers. It stops every task when a worker fails, when a parameter server dies, and on
SIGINT/SIGTERM/SIGHUP, and starts the job again after a failure, up to `plan.max_restarts`
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
import time
import uuid

from diststrat._cluster_runtime import _exposure
from diststrat.cluster import _output
from diststrat.cluster import _processes
from diststrat.cluster import _task

RESTART_COUNT_ENV = "DISTSTRAT_RESTART_COUNT"
"""How many times the job was restarted before this attempt (0 on the first)."""
JOB_MARK_ENV = "DISTSTRAT_JOB_MARK"
"""A mark unique to an attempt, in the environment of its tasks and of every process they
start: when the attempt ends, the launcher stops the processes that still carry it."""
_GRACE = 5.0  # Seconds between SIGTERM and SIGKILL when a task is stopped.
_POLL = 0.05
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop the job (SIGHUP: the terminal or ssh session closed)."""
USAGE_ERROR = 2
TIMEOUT_STATUS = 124
"""The exit status of a job stopped by --job-timeout or --heartbeat-timeout (as timeout(1))."""


class LaunchError(Exception):
  """A job that cannot start or run; `status` is the launcher's exit status."""

  def __init__(self, message, status=1):
    super().__init__(message)
    self.status = status


class Interrupted(BaseException):
  """The launcher received SIGINT, SIGTERM or SIGHUP."""

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
    ValueError: no host, an empty host name, a host with a port, a host named twice, or
      ports beyond 65535.
  """
  if not hosts:
    raise ValueError(f"hosts must name at least one host. Received: hosts={hosts!r}")
  if any(not h for h in hosts):
    empty = [bool(h) for h in hosts].index(False) + 1
    raise ValueError(f"hosts has an empty name (entry {empty} of {len(hosts)}: two commas "
                     f"in a row, or one at an end?). Received: hosts={hosts!r}")
  for host in hosts:
    name, colon, port = host.rpartition(":")
    if colon and ":" not in name and port.isdigit():  # Not an IPv6 address.
      raise ValueError(
          f"--hosts takes host names without ports: {host!r} names port {port}. Give the "
          f"hosts alone (--hosts {name},...), and their first port with --port-base "
          f"{port}. Received: hosts={hosts!r}")
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


# --- the hosts of a job across machines ---

_RESOLVE_TIMEOUT = 10.0


def _addresses(host, timeout):
  """The addresses `host` resolves to, as [(family, sockaddr)]; raises `LaunchError`."""
  found = _exposure.resolve_hosts([host], timeout).get(host)
  if isinstance(found, list):
    return sorted(set(found))
  why = (f"({getattr(found, 'strerror', None) or found})" if found is not None
         else f"(no answer within {timeout:g} s)")
  raise LaunchError(
      f"--hosts names {host!r}, which does not resolve to an address {why}; no task was "
      "started. Give each host's name as every host of the job resolves it (DNS or "
      "/etc/hosts), or its IP address.", USAGE_ERROR)


def check_hosts(hosts: List[str], timeout: float = _RESOLVE_TIMEOUT) -> None:
  """Refuses `--hosts` that cannot run a job: a name that does not resolve, or two names
  of one machine (its tasks would share ports: each host's start at --port-base).

  Raises:
    LaunchError: naming the host(s) and the fix (exit status 2).
  """
  resolved = {host: _addresses(host, timeout) for host in hosts}
  local = [h for h in hosts if any(
      _exposure.is_this_machines_address(str(sockaddr[0]), tuple(sockaddr[2:]))
      for _, sockaddr in resolved[h])]
  for i, a in enumerate(hosts):
    for b in hosts[i + 1:]:
      shared = sorted({s[0] for _, s in resolved[a]} & {s[0] for _, s in resolved[b]})
      if shared or (a in local and b in local):
        why = (f"both resolve to {', '.join(map(str, shared))}" if shared else
               "both are addresses of this machine")
        raise LaunchError(
            f"--hosts names {a!r} and {b!r}, which are the same machine ({why}): their "
            "tasks would listen on the same ports. Name each machine once; to run more "
            "tasks on one machine, raise --workers or --ps (they count per host).",
            USAGE_ERROR)


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
  log_dir: Optional[str] = None  # One file per task and attempt: log_dir/attempt_0/ps_0.log.
  job_timeout: Optional[float] = None  # Seconds the whole job may run, restarts included.
  heartbeat_timeout: Optional[float] = None  # Seconds a worker may print nothing.

  @property
  def serves_other_hosts(self) -> bool:
    """Whether this host's PS tasks also serve other hosts' workers: then they end by
    themselves (`serve()`'s watch), not when this host's workers are done."""
    return self.across_hosts and len(self.hosts) > 1

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


class _Task:
  """One task's process (in its own process group) and the threads copying its output."""

  def __init__(self, task_type, task_id, env, code, argv_tail, log_path=None):
    self.task_type, self.task_id = task_type, task_id
    self.name = _name(task_type, task_id)
    self.ready_read: Optional[int] = None
    self._ready_line = b""
    self.serving = False  # A PS task that said it serves.
    self.output = _output.TaskOutput(self.name, log_path)
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
    # The copying threads inherit this thread's signal mask: with the stop signals blocked
    # in them, the kernel delivers those signals to the main thread only, which blocks
    # them while it stops the job. (Python runs a handler in the main thread wherever the
    # signal lands: one that landed in a copying thread interrupted the stop halfway.)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
      self.output.follow("stdout", self.process.stdout, sys.stdout.buffer)
      self.output.follow("stderr", self.process.stderr, sys.stderr.buffer)
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

  def poll(self):
    return self.process.poll()

  def signal_group(self, sig):
    _processes.signal_group(self.process, sig)

  def check_ready(self):
    """Whether a PS task serves yet, without waiting: True once it wrote its "ready"
    line, its `_Failure` if it exited first, else None."""
    while self.ready_read is not None and select.select([self.ready_read], [], [], 0)[0]:
      chunk = os.read(self.ready_read, 64)
      self._ready_line += chunk
      if b"\n" in self._ready_line:
        self._close_ready()
        self.serving = True
      if not chunk:  # It closed its end: only its exit can tell more.
        self._close_ready()
    if self.serving:
      return True
    code = self.poll()
    if code is None:
      return None
    self._close_ready()
    how = _processes.describe_exit(code)
    return _Failure(self, _processes.exit_status(code) or 1,
                    f"Parameter server {self.name} {how} while starting (its output, if "
                    "any, is above).", f"{how} while starting")

  def _close_ready(self):
    if self.ready_read is not None:
      os.close(self.ready_read)
      self.ready_read = None


@dataclasses.dataclass
class _Failure:
  """Why an attempt ended: the task that failed first (None: no task, such as a taken
  port), the launcher's exit status, and the message saying so."""
  task: Optional[_Task]
  status: int
  message: str
  how: str = ""  # How the task ended, for the summary: "exited with code 7".
  restart: bool = True  # Whether --max-restarts may start the job again.


def _job_timeout(plan):
  return _Failure(None, TIMEOUT_STATUS,
                  f"The job ran longer than --job-timeout {plan.job_timeout:g} s (restarts "
                  "included) and was stopped. If it needs longer, give a larger "
                  "--job-timeout.", restart=False)


class _Job:
  """One attempt of the job: this host's tasks, started, watched, stopped."""

  def __init__(self, plan, attempt, network, deadline=None):
    self._plan = plan
    self._attempt = attempt
    self._network = network
    self._deadline = deadline  # --job-timeout's, on the monotonic clock.
    self._mark = uuid.uuid4().hex
    self.tasks: List[_Task] = []

  def _environment(self, spec, task_type, task_id):
    extra = {
        "TF_CONFIG": tf_config(spec, task_type, task_id),
        "PYTHONUNBUFFERED": "1",
        RESTART_COUNT_ENV: str(self._attempt),
        JOB_MARK_ENV: self._mark,
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

  def _log_path(self, task_type, task_id):
    if self._plan.log_dir is None:
      return None
    directory = os.path.join(self._plan.log_dir, f"attempt_{self._attempt}")
    path = os.path.join(directory, f"{task_type}_{task_id}.log")
    try:
      os.makedirs(directory, exist_ok=True)
      open(path, "wb").close()  # noqa: SIM115 - the task's output opens it again.
    except OSError as e:
      raise LaunchError(f"--log-dir: cannot create {e.filename or directory!r} "
                        f"({e.strerror}).", 1) from e
    return path

  def start(self) -> Optional[_Failure]:
    """Starts this host's tasks: the PS tasks together, then, once every one serves, the
    workers; returns the failure that stopped the start, if any."""
    plan = self._plan
    spec = plan.cluster_spec()
    mine = tasks_of_host(plan.host_index, plan.num_ps, plan.num_workers)
    self._check_ports_free(spec, mine)
    prologue = _processes.prologue(os.getpid(), self._network.namespace)
    deadline = time.monotonic() + plan.start_timeout
    for task_type, task_id in mine:
      if task_type == "worker":
        failure = self._wait_servers(deadline)
        if failure is not None:
          return failure
      if task_type == "ps":
        serve = (_task.SERVE_CODE if plan.serves_other_hosts else
                 _task.SERVE_UNTIL_STOPPED_CODE)
        code, tail = prologue + serve, []
      else:
        code, tail = prologue + _task.WORKER_CODE, [plan.script] + plan.script_args
      self.tasks.append(_Task(task_type, task_id,
                              self._environment(spec, task_type, task_id), code, tail,
                              self._log_path(task_type, task_id)))
    return self._wait_servers(deadline)

  def _wait_servers(self, deadline):
    """Waits until every PS task started serves, or `deadline` (or --job-timeout's)
    passes; returns the failure, if any. Each PS task starts without waiting for the
    others, so `--start-timeout` is what one of them may take (TensorFlow's import)."""
    limit = min(deadline, self._deadline or deadline)
    waiting = [t for t in self.tasks if t.task_type == "ps" and not t.serving]
    while waiting:
      for task in list(waiting):
        ready = task.check_ready()
        if isinstance(ready, _Failure):
          return ready
        if ready:
          waiting.remove(task)
      if not waiting:
        break
      if time.monotonic() >= limit:
        if self._deadline is not None and time.monotonic() >= self._deadline:
          return _job_timeout(self._plan)
        task = waiting[0]
        how = f"did not start within --start-timeout {self._plan.start_timeout:g} s"
        return _Failure(task, 1, f"Parameter server {task.name} {how}.", how)
      pipes = [t.ready_read for t in waiting if t.ready_read is not None]
      if pipes:
        select.select(pipes, [], [], _POLL)
      else:
        time.sleep(_POLL)
    return None

  def wait(self) -> Optional[_Failure]:
    """Waits for the workers; returns None if all succeeded, else the first failure.

    In a job across two hosts or more, this host's PS tasks serve the other hosts' workers
    too: once this host's workers succeeded, it waits for its PS tasks to end by
    themselves (`serve()` ends when every worker of the job has ended), not stopping
    them."""
    heartbeat = self._plan.heartbeat_timeout
    said = False
    while True:
      workers_done = True
      now = time.monotonic()
      for task in self.tasks:
        code = task.poll()
        if task.task_type == "ps":
          if code == 0 and self._plan.serves_other_hosts:
            continue  # It saw every worker of the job end.
          if code is not None:
            how = _processes.describe_exit(code)
            return _Failure(task, _processes.exit_status(code) or 1,
                            f"Parameter server {task.name} {how} while the workers ran (its "
                            "output, if any, is above).", how)
        elif code is None:
          workers_done = False
          if heartbeat is not None and now - task.output.last_output > heartbeat:
            how = f"printed nothing for {heartbeat:g} s (--heartbeat-timeout {heartbeat:g})"
            return _Failure(task, TIMEOUT_STATUS,
                            f"Task {task.name} {how}, so it was taken to be hung.", how)
        elif code != 0:
          how = _processes.describe_exit(code)
          return _Failure(task, _processes.exit_status(code),
                          f"Task {task.name} {how} (its output is above).", how)
      if workers_done:
        serving = [t for t in self.tasks if t.task_type == "ps" and t.poll() is None]
        if not (self._plan.serves_other_hosts and serving):
          return None
        if not said:
          said = True
          say(f"this host's workers are done; its parameter server(s) "
              f"{', '.join(t.name for t in serving)} serve the job's other workers and "
              "end when every worker of the job has ended (diststrat.cluster.serve(): "
              f"{_task.WORKERS_GONE_FOR:g} s after the last one stops answering).")
      if self._deadline is not None and now >= self._deadline:
        return _job_timeout(self._plan)
      time.sleep(_POLL)

  def stop(self):
    """Stops every task's process group (SIGTERM, then SIGKILL after a grace period), then
    what the tasks started outside their groups and left running (`JOB_MARK_ENV`)."""
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
    left = _processes.stop_marked(JOB_MARK_ENV, self._mark, _GRACE,
                                  killed_groups=[task.process.pid for task in self.tasks])
    if left:
      say(f"stopped {len(left)} process(es) that the job's tasks started outside their "
          "process groups and left running: " +
          "; ".join(f"pid {pid} ({command[:80]})" for pid, command in sorted(left.items())))
    for task in self.tasks:
      task.output.close(_GRACE)


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


def _summary(failure: _Failure, restarts: int = 0) -> None:
  """Says which task caused a failed job, how it ended and the last lines it wrote; after
  `restarts`, that is the last attempt's first failure."""
  if failure.task is None:
    return
  task = failure.task
  lines = task.output.last_lines()
  first = (f"the first to fail in the last attempt (after {restarts} restart(s))" if restarts
           else "the first to fail")
  # `how` may give a killed task's returncode (-N); the launcher exits with 128 + N.
  say(f"the job failed. Root cause: task {task.name}, {first}, {failure.how}; "
      f"the launcher's exit status is {failure.status}. " +
      ("Its last lines:" if lines else "It wrote nothing."))
  if lines:
    sys.stderr.write("".join(f"  [{task.name}] {line}\n" for line in lines))
    sys.stderr.flush()


def _claim_ports(plan, network):
  """Claims this host's ports of `--port-base` for as long as the launcher runs: another
  launcher on this machine that names the same ports is refused at once, before the
  first one's tasks bind them (which takes them seconds, TensorFlow's import). A claim is
  an abstract Unix socket, which Linux removes when the process ends, however it ends.
  Returns the sockets; nothing to claim under a private network or with free ports."""
  if plan.port_base is None or network.namespace is not None or not sys.platform.startswith(
      "linux"):
    return []
  spec = plan.cluster_spec()
  claims = []
  try:
    for task_type, task_id in tasks_of_host(plan.host_index, plan.num_ps, plan.num_workers):
      address = spec[task_type][task_id]
      port = int(address.rsplit(":", 1)[1])
      sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      claims.append(sock)
      try:
        sock.bind(f"\0diststrat-run-port-{port}")
      except OSError as e:
        raise LaunchError(
            f"The port of task {_name(task_type, task_id)} ({address}) is taken by another "
            "diststrat-run job on this machine, which started from an overlapping "
            f"--port-base; no task was started. Choose another --port-base (this job's "
            f"{plan.port_base} needs ports {plan.port_base} to "
            f"{plan.port_base + plan.num_ps + plan.num_workers - 1}), or leave it out to "
            "use free ports.", 1) from e
    return claims
  except BaseException:
    for sock in claims:
      sock.close()
    raise


def run_job(plan: JobPlan) -> int:
  """Runs the job (restarts included) until its workers are done; returns the launcher's
  exit status. Raises `Interrupted` once every task is stopped after a signal of
  `STOP_SIGNALS` (the caller's signal handlers raise it)."""
  network = _network(plan)
  claims: List[socket.socket] = []
  deadline = (None if plan.job_timeout is None else
              time.monotonic() + plan.job_timeout)
  try:
    claims = _claim_ports(plan, network)
    attempt = 0
    while True:
      job = _Job(plan, attempt, network, deadline)
      try:
        failure = job.start() or job.wait()
      except LaunchError as e:  # A bad launch: starting again would fail the same way.
        failure = _Failure(None, e.status, str(e), restart=False)
      finally:
        # SIGINT/SIGTERM/SIGHUP wait until every task is stopped, then interrupt.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
          job.stop()
        finally:
          signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
      if failure is None:
        return 0
      others = [t for t in job.tasks if t is not failure.task]
      stopped = " The other tasks were stopped." if failure.task is not None else (
          " Its tasks were stopped." if others else "")
      say(failure.message + stopped)
      if attempt >= plan.max_restarts or not failure.restart:
        if plan.max_restarts and failure.restart:
          say(f"giving up after {attempt} restart(s) (--max-restarts "
              f"{plan.max_restarts}); exit status {failure.status}.")
        elif plan.max_restarts:
          say(f"not restarting: --max-restarts does not apply to this failure; exit "
              f"status {failure.status}.")
        _summary(failure, attempt)
        return failure.status
      attempt += 1
      say(f"restarting the job ({attempt} of --max-restarts {plan.max_restarts}).")
  except LaunchError as e:
    say(str(e))
    return e.status
  finally:
    for sock in claims:
      sock.close()
    network.close()
