"""`diststrat-run`: start a training program as a cluster job of processes.

    diststrat-run --workers N [--ps P] [--cpus-per-worker M] [--max-restarts R] \\
        script.py [script args...]

starts P parameter-server tasks (`diststrat.cluster.serve()`, no user code) and N
worker processes of `script.py` on this machine, each with `TF_CONFIG` set for its task,
so `ds.MultiWorkerMirroredStrategy()` or `ds.ParameterServerStrategy()` with no cluster
arguments joins the job. It streams every task's output prefixed with its name
(`[worker:0] ...`), and ends when every worker has exited: with status 0 if all
succeeded, else with the first failing task's status (128 + N for a signal N), after
stopping the others. `--max-restarts R` starts the whole job again, up to R times, after a
failure: a program that checkpoints (`keras.callbacks.BackupAndRestore`,
`tf.train.CheckpointManager`) resumes. See docs/launch.md.

Nothing outlives the launcher: each task runs in its own process group, which the
launcher kills when the job ends, on Ctrl-C (SIGINT) and on SIGTERM; and each task asks
Linux to kill it when the launcher dies, so a launcher killed with SIGKILL takes its
tasks with it (`cluster/_task.py`).

Security (docs/security.md): TensorFlow's servers listen on every interface and run any
graph any client sends. On one machine the job's processes run in a private network
namespace by default, where Linux allows it without privileges (`--no-isolate` turns
it off); a job across machines (`--hosts`) cannot be isolated, and says so.

Also `python -m diststrat.run ...`.
"""

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from diststrat._cluster_runtime import _exposure
from diststrat.cluster import _isolation
from diststrat.cluster import _local_cluster
from diststrat.cluster import _serve
from diststrat.cluster import _task

DEFAULT_START_TIMEOUT = 120.0
DEFAULT_PORT_BASE = 8888
RESTART_COUNT_ENV = "DISTSTRAT_RESTART_COUNT"
"""How many times the job was restarted before this attempt (0 on the first)."""
_GRACE = 5.0  # Seconds between SIGTERM and SIGKILL when the launcher stops a task.
_POLL = 0.05
_USAGE_ERROR = 2
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class LaunchError(Exception):
  """A job that cannot start or run; `status` is the launcher's exit status."""

  def __init__(self, message, status=1):
    super().__init__(message)
    self.status = status


class _Interrupted(BaseException):
  """The launcher received SIGINT or SIGTERM."""

  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


# --- the cluster spec: a pure function of the command line, the same on every host ---


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


# --- the command line ---


def _positive(least):
  def parse(text):
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < least:
      raise argparse.ArgumentTypeError(
          f"must be an integer >= {least}. Received: {text!r}")
    return value
  return parse


def _seconds(text):
  try:
    value = float(text)
  except ValueError:
    value = None
  if value is None or not value > 0:
    raise argparse.ArgumentTypeError(f"must be a positive number of seconds. Received: "
                                     f"{text!r}")
  return value


def _parser():
  parser = argparse.ArgumentParser(
      prog="diststrat-run",
      description="Start a TensorFlow program as a cluster job: P parameter servers and "
      "N worker processes, each with TF_CONFIG set for its task. See docs/launch.md.",
      epilog="Example: diststrat-run --workers 2 train.py --epochs=3")
  parser.add_argument("--workers", type=_positive(1), required=True,
                      help="worker processes of the script (per host with --hosts)")
  parser.add_argument("--ps", type=_positive(0), default=0,
                      help="parameter-server tasks (per host with --hosts); default 0")
  parser.add_argument("--cpus-per-worker", type=_positive(1), default=None,
                      help="split each worker's CPU into this many logical devices "
                      "(its towers, without GPUs)")
  parser.add_argument("--max-restarts", type=_positive(0), default=0,
                      help="start the whole job again after a failure, up to this many "
                      "times; default 0")
  parser.add_argument("--no-isolate", action="store_true",
                      help="do not run the job in a private network namespace (needed "
                      "when the script must reach the network)")
  parser.add_argument("--hosts", default=None,
                      help="comma-separated hosts of a job across machines; run the same "
                      "command on each, with its --task-index")
  parser.add_argument("--task-index", "--node-rank", dest="task_index", type=_positive(0),
                      default=None, help="this host's index in --hosts")
  parser.add_argument("--port-base", type=_positive(1), default=None,
                      help="first port of this host's tasks (default: free ports on one "
                      f"host, {DEFAULT_PORT_BASE} with --hosts)")
  parser.add_argument("--start-timeout", type=_seconds, default=DEFAULT_START_TIMEOUT,
                      help="seconds a parameter server may take to start")
  parser.add_argument("script", help="the Python program each worker runs")
  parser.add_argument("script_args", nargs=argparse.REMAINDER,
                      help="arguments of the script")
  return parser


class _Options:
  """The checked command line."""

  def __init__(self, args):
    self.num_ps, self.num_workers = args.ps, args.workers
    self.cpus = args.cpus_per_worker
    self.max_restarts = args.max_restarts
    self.script, self.script_args = args.script, list(args.script_args)
    self.start_timeout = args.start_timeout
    if not os.path.isfile(self.script):
      raise LaunchError(f"The script {self.script!r} does not exist (or is not a file); "
                        "no task was started. Give the path of a Python program, relative "
                        f"to {os.getcwd()!r} or absolute.", _USAGE_ERROR)
    self.port_base = args.port_base
    if args.hosts is None:
      if args.task_index not in (None, 0):
        raise LaunchError("--task-index applies to a job across machines: give --hosts "
                          f"too. Received: --task-index {args.task_index}", _USAGE_ERROR)
      self.hosts, self.host_index = ["127.0.0.1"], 0
      self.multi_host = False
    else:
      self.hosts = [h.strip() for h in args.hosts.split(",")]
      if args.task_index is None or args.task_index >= len(self.hosts):
        raise LaunchError(
            f"--hosts names {len(self.hosts)} host(s), so --task-index (this host's place "
            f"in it) must be from 0 to {len(self.hosts) - 1}. Received: --task-index "
            f"{args.task_index}", _USAGE_ERROR)
      self.host_index = args.task_index
      self.multi_host = True
      if self.port_base is None:
        self.port_base = DEFAULT_PORT_BASE
    self.isolate = not args.no_isolate and not self.multi_host
    if self.port_base is not None:
      try:
        build_cluster_spec(self.hosts, self.num_ps, self.num_workers, self.port_base)
      except ValueError as e:
        raise LaunchError(str(e), _USAGE_ERROR) from e

  def cluster_spec(self):
    port_base = self.port_base
    if port_base is None:  # One host, free ports (any: the spec lists each one).
      ports = _local_cluster.free_ports(self.num_ps + self.num_workers)
      return {**({"ps": [f"127.0.0.1:{p}" for p in ports[:self.num_ps]]}
                 if self.num_ps else {}),
              "worker": [f"127.0.0.1:{p}" for p in ports[self.num_ps:]]}
    return build_cluster_spec(self.hosts, self.num_ps, self.num_workers, port_base)


# --- tasks ---


def _exit_status(returncode):
  return 128 - returncode if returncode < 0 else returncode


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
    pass_fds = ()
    if task_type == "ps":
      self.ready_read, ready_write = os.pipe()
      env = dict(env, **{_serve.READY_FD_ENV: str(ready_write)})
      pass_fds = (ready_write,)
    try:
      self.process = subprocess.Popen(
          [sys.executable, "-c", code] + argv_tail, env=env, stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
          pass_fds=pass_fds)
    finally:
      if pass_fds:
        os.close(ready_write)
    self.outputs = [_Output(self.name, self.process.stdout, sys.stdout.buffer),
                    _Output(self.name, self.process.stderr, sys.stderr.buffer)]

  def poll(self):
    return self.process.poll()

  def signal_group(self, sig):
    try:
      os.killpg(self.process.pid, sig)  # The task's process group: its children too.
    except (ProcessLookupError, PermissionError):
      pass

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
          raise LaunchError(f"Parameter server {self.name} {_describe(self.poll())} while "
                            "starting (its output, if any, is above).",
                            _exit_status(self.poll()) or 1)
      raise LaunchError(f"Parameter server {self.name} did not start within "
                        f"--start-timeout {timeout:g} s.", 1)
    finally:
      os.close(self.ready_read)
      self.ready_read = None


def _describe(returncode):
  return _local_cluster._describe_exit(returncode)  # pylint: disable=protected-access


class _Job:
  """One attempt of the job: this host's tasks, started, watched, stopped."""

  def __init__(self, options, attempt, namespace):
    self._options = options
    self._attempt = attempt
    self._namespace = namespace
    self.tasks = []

  def _environment(self, spec, task_type, task_id):
    env = dict(os.environ)
    env.update({
        "TF_CONFIG": tf_config(spec, task_type, task_id),
        "PYTHONUNBUFFERED": "1",
        _task.LAUNCHER_PID_ENV: str(os.getpid()),
        RESTART_COUNT_ENV: str(self._attempt),
        _exposure.ISOLATED_ENV: "1" if self._namespace is not None else "0",
    })
    env.pop(_task.CPUS_ENV, None)
    if task_type == "ps":
      env["CUDA_VISIBLE_DEVICES"] = ""  # Variables live on the PS CPU; leave GPUs alone.
      # TensorFlow logs each worker's session options at INFO level on a PS: not by default.
      env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    elif self._options.cpus:
      env[_task.CPUS_ENV] = str(self._options.cpus)
    return env

  def _check_ports_free(self, spec, mine):
    """Raises `LaunchError` naming the task whose port another process holds."""
    if self._namespace is not None:
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
    options = self._options
    spec = options.cluster_spec()
    mine = tasks_of_host(options.host_index, options.num_ps, options.num_workers)
    self._check_ports_free(spec, mine)
    holder = None if self._namespace is None else self._namespace.holder_pid
    deadline = time.monotonic() + options.start_timeout
    for task_type, task_id in mine:
      if task_type == "ps":
        code, tail = _task.ps_code(holder), []
      else:
        code, tail = _task.worker_code(holder), [options.script] + options.script_args
      task = _Task(task_type, task_id, self._environment(spec, task_type, task_id),
                   code, tail)
      self.tasks.append(task)
      if task_type == "ps":  # Workers start once every PS of this host serves.
        task.wait_ready(deadline, options.start_timeout)

  def wait(self):
    """Waits for the workers; returns None if all succeeded, else the first failure
    as (task, exit status, message)."""
    while True:
      workers_done = True
      for task in self.tasks:
        code = task.poll()
        if task.task_type == "ps":
          if code is not None:
            return (task, _exit_status(code) or 1,
                    f"Parameter server {task.name} {_describe(code)} while the workers "
                    "ran (its output, if any, is above).")
        elif code is None:
          workers_done = False
        elif code != 0:
          return (task, _exit_status(code),
                  f"Task {task.name} {_describe(code)} (its output is above).")
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


# --- the launcher ---


def _say(message):
  sys.stderr.write(f"diststrat-run: {message}\n")
  sys.stderr.flush()


def _private_network(options):
  """The namespace of a one-host job, or None (with a warning saying why)."""
  if options.multi_host:
    _say("WARNING: a job across machines (--hosts) cannot run in a private network: the "
         "TensorFlow servers of its tasks listen on every interface of each host and run "
         "any graph any client sends, so whoever reaches their ports controls the job. "
         "Run it on a private network or behind a firewall that admits only the job's "
         "hosts; see docs/security.md.")
    return None
  if not options.isolate:
    _say("WARNING: --no-isolate: the TensorFlow servers of the job's tasks listen on "
         "every interface and run any graph any client sends; whoever reaches this "
         "machine's ports controls the job. See docs/security.md.")
    return None
  try:
    return _isolation.Namespace.create()
  except OSError as e:
    _say(f"WARNING: this system does not allow a private network namespace ({e}), so "
         "the job's TensorFlow servers are reachable by anyone who can reach this "
         "machine's ports, and run any graph they send. Allow unprivileged user "
         "namespaces, or run on a machine whose ports are closed to others; see "
         "docs/security.md.")
    return None


def _run(options):
  namespace = _private_network(options)
  try:
    attempt = 0
    while True:
      job = _Job(options, attempt, namespace)
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
      _say(message + (" The other tasks were stopped." if others else ""))
      if attempt >= options.max_restarts:
        if options.max_restarts:
          _say(f"giving up after {attempt} restart(s) (--max-restarts "
               f"{options.max_restarts}); exit status {status}.")
        return status
      attempt += 1
      _say(f"restarting the job ({attempt} of --max-restarts {options.max_restarts}).")
  finally:
    if namespace is not None:
      namespace.close()


def run(argv: list | None = None) -> int:
  """Runs the launcher with command-line arguments `argv`; returns its exit status."""
  args = _parser().parse_args(argv)
  try:
    options = _Options(args)
  except LaunchError as e:
    _say(str(e))
    return e.status
  stopping: list[int] = []

  def interrupt(signum, frame):
    del frame
    if not stopping:
      stopping.append(signum)
      raise _Interrupted(signum)

  previous = {sig: signal.signal(sig, interrupt) for sig in _STOP_SIGNALS}
  try:
    return _run(options)
  except _Interrupted as e:
    _say(f"stopped by {signal.Signals(e.signum).name}; every task was stopped.")
    return 128 + e.signum
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def main() -> None:
  """The `diststrat-run` console script."""
  sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
  main()
