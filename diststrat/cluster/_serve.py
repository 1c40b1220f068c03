"""`serve()`: run this process as a parameter server of a cluster, until it is stopped.

A parameter-server cluster's PS tasks run no model code: each is a TensorFlow gRPC
server holding the variables the workers create on it. `LocalCluster` and
`diststrat-run` start them with this module; under Kubernetes or Slurm, the program
calls `diststrat.cluster.serve()` in its PS tasks (see docs/launch.md).
"""

import os
import socket
import sys
import time
import typing

from diststrat._tf import tf
from diststrat import _arguments
from diststrat import errors
from diststrat._cluster_runtime import _cluster_spec
from diststrat._cluster_runtime import _exposure
from diststrat.cluster._task import READY_FD_ENV
from diststrat.cluster._task import WORKERS_GONE_FOR

_WARM_UP_JOB = "diststrat_warm_up"
_SLEEP = 3600.0
_WATCH_EVERY = 0.25  # Seconds between two looks at the workers' addresses.
_CONNECT_TIMEOUT = 1.0  # A worker address that neither accepts nor refuses is not gone.


def task_name(task_type: str, task_id: int) -> str:
  return f"/job:{task_type}/replica:0/task:{task_id}"


def _free_port(host):
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    try:
      sock.bind((host, 0))
    except OSError:
      sock.bind(("", 0))
    return sock.getsockname()[1]


def warm_up(cluster_spec: dict, task_id: int, port: int) -> None:
  """Makes this process the first client of its own PS server, and runs one op there.

  TensorFlow 2.21's eager service can crash (SIGSEGV, in GetOrCreateKernelAndDevice) when
  the first contexts on a fresh server are created by several clients at once, and not
  once one context exists on it (docs/parameter_server.md, "Start-up", with the soak
  test's figures). So the PS creates the first one itself, from `port`, before it says
  it is ready; workers then never create the first.
  """
  address = cluster_spec["ps"][task_id]
  host = address.rsplit(":", 1)[0]
  view = tf.train.ClusterSpec({"ps": {task_id: address}, _WARM_UP_JOB: [f"{host}:{port}"]})
  tf.config.experimental_connect_to_cluster(view, job_name=_WARM_UP_JOB, task_index=0)
  tf.config.list_logical_devices()
  with tf.device(f"{task_name('ps', task_id)}/device:CPU:0"):
    tf.raw_ops.Identity(input=tf.constant(0)).numpy()


def start_server(cluster_spec: dict, task_type: str, task_id: int,
                 warm_up_port: int | None = None) -> tf.distribute.Server:
  """Starts the TensorFlow server of a task (warmed up if a PS) and says who can reach it.

  Raises:
    ClusterError: the task's port is taken.
  """
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster_spec), job_name=task_type,
                                  task_index=task_id, protocol="grpc", start=True)
  except tf.errors.OpError as e:  # "Could not start gRPC server": say which and why.
    _raise_if_port_taken(task_name(task_type, task_id), cluster_spec[task_type][task_id], e)
    raise
  if task_type != "ps":
    _exposure.server_started(task_name(task_type, task_id),
                             cluster_spec[task_type][task_id])
    return server
  host = cluster_spec["ps"][task_id].rsplit(":", 1)[0].strip("[]")
  port = warm_up_port or _free_port(host)
  _exposure.server_started(task_name(task_type, task_id), cluster_spec[task_type][task_id],
                           warm_up_port=port)
  warm_up(cluster_spec, task_id, port)
  return server


def _raise_if_port_taken(task, address, error):
  """Raises `ClusterError` from `error` if something listens on the port of `address`
  (TensorFlow's servers bind it on every interface)."""
  port = int(address.rsplit(":", 1)[1])
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As a server binds.
    try:
      sock.bind(("", port))
      return
    except OSError as e:
      why = e.strerror
  raise errors.ClusterError(
      f"Cannot start the TensorFlow server of {task} at {address}: port {port} is taken "
      f"({why}). Stop what listens there, or give the task another port "
      "(cluster_spec; DISTSTRAT_SLURM_PORT_BASE under Slurm; --port-base with "
      "diststrat-run).", task=task) from error


def _worker_answers(address: str) -> bool:
  """False once `address` refuses connections (nothing listens: the worker ended); True
  when it accepts them, and when it cannot tell (no answer within a second, a host that
  does not resolve): a worker is not taken for gone on a doubt.

  A connection to a port of this machine where nothing listens can connect to itself:
  the kernel may pick that very port as the connection's own (both ends then open at
  once). That can happen when the workers' ports are in the range the kernel picks
  from (a port base chosen there, such as a free port the system gave), and this asks
  four times a second. Such a connection is nothing listening, not a worker that answers.
  """
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host.strip("[]"), int(port)), _CONNECT_TIMEOUT) as sock:
      return sock.getsockname() != sock.getpeername()
  except ConnectionRefusedError:
    return False
  except OSError:
    return True


def wait_until_workers_done(workers: list, gone_for: float) -> None:
  """Returns once the job's workers have ended: after one of them has answered at its
  address (a `ParameterServerStrategy` worker serves there while it runs), none has
  answered for `gone_for` seconds in a row."""
  started = False
  silent_since = None
  while True:
    if any(_worker_answers(address) for address in workers):
      started, silent_since = True, None
    elif started:
      silent_since = silent_since or time.monotonic()
      if time.monotonic() - silent_since >= gone_for:
        return
    time.sleep(_WATCH_EVERY)


def serve(cluster_spec: dict | None = None, task_type: str | None = None,
          task_id: int | None = None, *,
          workers_gone_for: float | None = WORKERS_GONE_FOR) -> typing.NoReturn:
  """Runs this process's task of a cluster as a TensorFlow server; never returns.

  The task is the one given, else the one `TF_CONFIG` names, else the one of a Slurm
  step (`cluster_from_slurm`). A parameter server first makes itself the first client
  of its own server (a TensorFlow 2.21 start-up crash is avoided that way), then serves
  the workers until the job ends, and then ends the process with status 0
  (`SystemExit(0)`), so a Slurm step or a job across hosts ends on every task.

  How a parameter server learns that the job ended: a `ParameterServerStrategy` worker
  listens at its address in the cluster spec while it runs. The PS looks at the
  workers' addresses four times a second; once one worker has answered, the job is
  over when none has answered for `workers_gone_for` seconds in a row (every worker
  refusing connections: their processes ended). An address that neither accepts nor
  refuses (a frozen host) counts as a worker still running. With `workers_gone_for`
  None, or for a task that is not a PS, it serves until the process is stopped (a
  signal, or Ctrl-C).

  Security: the server listens on every interface and runs any graph any client sends,
  without authentication (docs/security.md); this logs a warning saying so.

  Example, at the top of a program that Kubernetes or Slurm starts in every task::

      config = diststrat.cluster.cluster_from_environment()
      if config is not None and config.task_type == "ps":
        diststrat.cluster.serve()             # never returns
      strategy = diststrat.ParameterServerStrategy()

  Raises:
    ValueError: no task is given and the environment names none, the task is not in
      the cluster spec, or `workers_gone_for` is not a positive number of seconds.
    ClusterError: the task's port is taken (naming the task and port).
  """
  if workers_gone_for is not None:
    workers_gone_for = _arguments.seconds("workers_gone_for", workers_gone_for)
  config = _cluster_spec.resolve_cluster(cluster_spec, task_type, task_id, role="server")
  if config is None:
    raise ValueError(
        "diststrat.cluster.serve() needs a cluster: set TF_CONFIG (diststrat-run and "
        "Kubernetes operators do), run it in a Slurm step of two tasks or more, or pass "
        "cluster_spec, task_type and task_id. Received: neither TF_CONFIG nor Slurm "
        "variables.")
  cluster_spec, task_type, task_id = config.cluster_spec, config.task_type, config.task_id
  server = start_server(cluster_spec, task_type, task_id)
  ready_fd = os.environ.pop(READY_FD_ENV, None)
  if ready_fd:
    os.write(int(ready_fd), f"ready {os.getpid()}\n".encode())
    os.close(int(ready_fd))
  workers = cluster_spec.get("worker", [])
  if task_type == _cluster_spec.PS_JOB and workers and workers_gone_for is not None:
    wait_until_workers_done(workers, workers_gone_for)
    sys.stdout.flush()
    print(f"diststrat: parameter server {task_name(task_type, task_id)} stops: every "
          f"worker of its job has ended (none has answered at its address for "
          f"{workers_gone_for:g} s).", file=sys.stderr, flush=True)
    raise SystemExit(0)  # The server object lives until the process ends.
  _hold_forever(server)


def _hold_forever(server: typing.Any) -> typing.NoReturn:
  """Sleeps until the process is stopped, holding `server`: a TensorFlow server stops
  when its object is deleted."""
  while True:
    time.sleep(_SLEEP)
