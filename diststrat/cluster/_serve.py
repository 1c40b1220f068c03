"""`serve()`: run this process as a parameter server of a cluster, until it is stopped.

A parameter-server cluster's PS tasks run no model code: each is a TensorFlow gRPC
server holding the variables the workers create on it. `LocalCluster` and
`diststrat-run` start them with this module; under Kubernetes or Slurm, the program
calls `diststrat.cluster.serve()` in its PS tasks (see docs/launch.md).
"""

import os
import socket
import time

from diststrat._tf import tf
from diststrat._cluster_runtime import _cluster_spec
from diststrat._cluster_runtime import _exposure
from diststrat.cluster._task import READY_FD_ENV

_WARM_UP_JOB = "diststrat_warm_up"
_SLEEP = 3600.0


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
  """Starts the TensorFlow server of a task (warmed up if a PS) and says who can reach it."""
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster_spec), job_name=task_type,
                                task_index=task_id, protocol="grpc", start=True)
  _exposure.server_started(task_name(task_type, task_id), cluster_spec[task_type][task_id])
  if task_type == "ps":
    host = cluster_spec["ps"][task_id].rsplit(":", 1)[0].strip("[]")
    warm_up(cluster_spec, task_id, warm_up_port or _free_port(host))
  return server


def serve(cluster_spec: dict | None = None, task_type: str | None = None,
          task_id: int | None = None) -> None:
  """Runs this process's task of a cluster as a TensorFlow server, and never returns.

  The task is the one given, else the one `TF_CONFIG` names, else the one of a Slurm
  step (`cluster_from_slurm`). A parameter server first makes itself the first client
  of its own server (a TensorFlow 2.21 start-up crash is avoided that way), then serves
  the workers until the process is stopped (a signal, or Ctrl-C).

  Security: the server listens on every interface and runs any graph any client sends,
  without authentication (docs/security.md); this logs a warning saying so.

  Example, at the top of a program that Kubernetes or Slurm starts in every task::

      config = diststrat.cluster.cluster_from_environment()
      if config is not None and config.task_type == "ps":
        diststrat.cluster.serve()             # never returns
      strategy = diststrat.ParameterServerStrategy()

  Raises:
    ValueError: no task is given and the environment names none, or the task is not in
      the cluster spec.
  """
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
  while server is not None:  # The server stops when its object is deleted: keep it.
    time.sleep(_SLEEP)
