"""A cluster spec and this process's task in it: checked, and found (`resolve_cluster`).

Every process of a cluster (a `ParameterServerStrategy` worker, a
`MultiWorkerMirroredStrategy` worker, a PS task's `serve()`) finds its cluster the same
way, through `resolve_cluster`: the arguments it was given, else the environment
(`TF_CONFIG`, else Slurm: `_environment.py`), else none (one process). The spec is
checked here, once, with errors that name what was wrong and where it came from.
"""

import numbers
import time
from typing import Mapping, Optional

from diststrat._tf import tf
from diststrat import _tf_internal
from diststrat import errors
from diststrat._cluster_runtime import _environment
from diststrat._cluster_runtime import _exposure

PS_JOB = "ps"
WORKER_JOB = "worker"
ROLES = ("parameter_server", "multi_worker", "server")
"""Who asks `resolve_cluster`: a worker of each strategy, or a task's server (`serve()`)."""


def _check_addresses(job, addresses):
  if isinstance(addresses, dict):
    items = sorted(addresses.items())
    if [i for i, _ in items] != list(range(len(items))):
      raise ValueError(f"cluster_spec[{job!r}] as a dict must map task ids 0..n-1 to "
                       f"addresses. Received: {addresses!r}")
    addresses = [a for _, a in items]
  if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
    raise ValueError(f"cluster_spec[{job!r}] must be a list of 'host:port' addresses. "
                     f"Received: {addresses!r}")
  for address in addresses:
    _check_address(job, address)
  return list(addresses)


def _check_address(job, address):
  """Raises ValueError unless `address` is 'host:port' with a port from 1 to 65535."""
  if isinstance(address, str) and "://" in address:
    raise ValueError(
        f"cluster_spec[{job!r}] must hold plain 'host:port' addresses: TensorFlow's gRPC "
        f"runtime adds the scheme itself. Received: {address!r}. Write "
        f"{address.split('://', 1)[1]!r}.")
  host, port = "", ""
  if isinstance(address, str):
    host, _, port = address.rpartition(":")
  if host.startswith("[") and host.endswith("]"):  # An IPv6 address: "[::1]:2222".
    host = host[1:-1]
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
        f"cluster_spec[{job!r}] must hold 'host:port' addresses with a port from 1 to "
        f"65535, such as '127.0.0.1:2222' or '[::1]:2222'. Received: {address!r}"
        f"{'' if isinstance(address, str) else f' ({type(address).__name__})'}")


def _address_key(address):
  """A checked 'host:port' as (host, port) that compares equal for one address: host
  names are case-insensitive, and "02" is port 2."""
  host, _, port = address.rpartition(":")
  return host.lower(), int(port)


def _check_unique_addresses(spec):
  """Raises ValueError if two tasks of `spec` share an address (they would share a port)."""
  seen = {}
  for job, addresses in spec.items():
    for i, address in enumerate(addresses):
      task = f"/job:{job}/replica:0/task:{i}"
      key = _address_key(address)
      if key in seen:
        first, first_task = seen[key]
        received = (f"{address!r} for both {first_task} and {task}" if first == address else
                    f"{first!r} for {first_task} and {address!r} for {task}, one address "
                    "spelled twice")
        raise ValueError(
            f"Each task of cluster_spec needs its own address: two tasks cannot listen on "
            f"one port. Received: {received}. Give each task its own port.")
      seen[key] = (address, task)
  _check_resolved_addresses(spec)


_RESOLVE_TIMEOUT = 3.0
"""Seconds all host names of a cluster spec may take to resolve (a bad DNS can hang)."""


def _check_resolved_addresses(spec):
  """Raises ValueError if two tasks give one port on host names that resolve to a shared
  address ('localhost:2222' and '127.0.0.1:2222'). Only names that share a port are
  resolved; a name that does not resolve is left to the errors of connecting."""
  by_port = {}
  for job, addresses in spec.items():
    for i, address in enumerate(addresses):
      host, port = _address_key(address)
      by_port.setdefault(port, []).append((host.strip("[]"), address,
                                           f"/job:{job}/replica:0/task:{i}"))
  shared = [tasks for tasks in by_port.values() if len(tasks) > 1]
  if not shared:
    return
  found = _exposure.resolve_hosts(sorted({t[0] for tasks in shared for t in tasks}),
                                  _RESOLVE_TIMEOUT)
  resolved = {host: {str(sockaddr[0]) for _, sockaddr in infos}
              for host, infos in found.items() if isinstance(infos, list)}
  for tasks in shared:
    for i, (host_a, address_a, task_a) in enumerate(tasks):
      for host_b, address_b, task_b in tasks[i + 1:]:
        common = sorted(resolved.get(host_a, set()) & resolved.get(host_b, set()))
        if common:
          raise ValueError(
              "Each task of cluster_spec needs its own address: two tasks cannot listen "
              f"on one port. Received: {address_a!r} for {task_a} and {address_b!r} for "
              f"{task_b}, one address: both hosts resolve to {', '.join(common)}. Give "
              "each task its own port.")


def normalize_cluster_spec(cluster_spec, task_type, task_id, role="parameter_server"):
  """Returns `cluster_spec` as {job: [address, ...]} after checking it and the task.

  Args:
    cluster_spec: a dict {job: [address, ...]} or a `tf.train.ClusterSpec`.
    task_type, task_id: this process's task; it must be in the spec.
    role: "parameter_server" (a worker of a parameter-server cluster: it needs a "ps"
      job, and the task is not one of its), "multi_worker" (a worker of a cluster of
      workers only: no "ps" job), "server" (any task of any cluster).

  Raises:
    ValueError: the spec is not a dict of address lists, has no PS task (or has one when
      the role allows none), or does not hold the task (`task_type`, `task_id`).
  """
  if isinstance(cluster_spec, tf.train.ClusterSpec):
    cluster_spec = cluster_spec.as_dict()
  if not isinstance(cluster_spec, dict):
    raise ValueError("cluster_spec must be a dict such as {'ps': ['host:port', ...], "
                     "'worker': ['host:port', ...]}. Received: "
                     f"cluster_spec={cluster_spec!r}")
  spec = {job: _check_addresses(job, addresses) for job, addresses in cluster_spec.items()}
  _check_unique_addresses(spec)
  if role == "multi_worker":
    if spec.get(PS_JOB):
      raise ValueError("MultiWorkerMirroredStrategy runs on worker tasks only, but "
                       f"cluster_spec has a 'ps' job. Received: cluster_spec={cluster_spec!r}."
                       " Use ParameterServerStrategy for a cluster with parameter servers.")
    spec.pop(PS_JOB, None)
    if not any(spec.values()):
      raise ValueError("cluster_spec needs at least one worker task, such as {'worker': "
                       f"['host:port', ...]}}. Received: cluster_spec={cluster_spec!r}")
  elif role == "parameter_server" and not spec.get(PS_JOB):
    raise ValueError("cluster_spec needs at least one parameter server: a 'ps' job with "
                     f"one address or more. Received: cluster_spec={cluster_spec!r}")
  if role == "server":
    if task_type not in spec:
      raise ValueError(f"task_type must name a job of cluster_spec, one of {sorted(spec)}. "
                       f"Received: task_type={task_type!r}")
  elif task_type == PS_JOB or task_type not in spec:
    jobs = sorted(j for j in spec if j != PS_JOB and spec[j])
    if not jobs:
      raise ValueError(
          "cluster_spec names no task for this worker process: it has no job besides "
          "'ps' with an address (parameter servers run no model code). Add a job for the "
          "workers, such as {'ps': [...], 'worker': ['host:port', ...]}. Received: "
          f"cluster_spec={cluster_spec!r}")
    raise ValueError(
        f"task_type must name the job of this worker process, one of {jobs} (parameter "
        f"servers run no model code). Received: task_type={task_type!r}")
  if not spec[task_type]:
    raise ValueError(
        f"cluster_spec[{task_type!r}] lists no address, so this process cannot be task "
        f"{task_id!r} of it. Add this task's address to that job, or pass the task_type "
        f"of the job that lists it. Received: cluster_spec={cluster_spec!r}")
  if (isinstance(task_id, bool) or not isinstance(task_id, numbers.Integral)
      or not 0 <= task_id < len(spec[task_type])):
    kind = "" if isinstance(task_id, numbers.Integral) and not isinstance(task_id, bool) \
        else f" ({type(task_id).__name__}, not an integer)"
    raise ValueError(f"task_id must be an index into cluster_spec[{task_type!r}], from 0 "
                     f"to {len(spec[task_type]) - 1}. Received: task_id={task_id!r}{kind}")
  return spec


def wait_for_servers(addresses, timeout, poll=0.5):
  """Waits until the TensorFlow server at each of `addresses` answers, at most `timeout` s.

  For tasks started independently (`diststrat-run`, Slurm, Kubernetes, several
  machines), where this process may come up before the others: a server that refuses
  connections is asked again. Returns when all answer or the time is up (then the
  first use of the cluster names the task that does not).
  """
  addresses = list(addresses)
  deadline = time.monotonic() + timeout
  while addresses:
    outcomes = _tf_internal.probe_tf_server(addresses, min(poll * 4, timeout))
    addresses = [a for a, why in zip(addresses, outcomes, strict=True) if why]
    if not addresses or time.monotonic() + poll > deadline:
      return
    time.sleep(poll)


def is_chief_task(cluster_spec, task_type, task_id):
  """Whether this task is the cluster's chief: the one that writes checkpoints.

  No cluster (`cluster_spec` None): True, the process is alone. In a cluster: task 0 of
  a "chief" job if the spec has one (tf.distribute's convention), else worker task 0.

  Example:
    >>> spec = {"ps": ["a:1"], "worker": ["b:1", "b:2"]}
    >>> [is_chief_task(spec, "worker", i) for i in (0, 1)], is_chief_task(None, None, None)
    ([True, False], True)
  """
  if cluster_spec is None:
    return True
  chief_job = "chief" if cluster_spec.get("chief") else WORKER_JOB
  return task_type == chief_job and task_id == 0


class ClusterTaskMixin:
  """The cluster properties of a strategy that runs as one task of a cluster.

  The strategy sets `_cluster_spec` (the normalized spec, or None outside a cluster),
  `_task_type` and `_task_id`.
  """

  _cluster_spec: Optional[dict[str, list[str]]] = None
  _task_type: Optional[str] = None
  _task_id: Optional[int] = None

  @property
  def cluster_spec(self) -> Optional[dict[str, list[str]]]:
    """The cluster spec as {job: [address, ...]}, or None outside a cluster."""
    if self._cluster_spec is None:
      return None
    return {job: list(addresses) for job, addresses in self._cluster_spec.items()}

  @property
  def task_type(self) -> Optional[str]:
    """This process's job in the cluster ("worker", ...)."""
    return self._task_type

  @property
  def task_id(self) -> Optional[int]:
    """This process's index in its job."""
    return self._task_id




def resolve_cluster(cluster_spec=None, task_type=None, task_id=None, *, role: str,
                    environ: Optional[Mapping[str, str]] = None
                    ) -> Optional[_environment.ClusterConfig]:
  """The cluster and task this process runs as, or None (a process of its own).

  The arguments if `cluster_spec` is given (then `source` is "arguments"), else the
  environment: `TF_CONFIG`, else a Slurm step (`_environment.cluster_from_environment`).
  The spec is checked for `role` (see `normalize_cluster_spec`); an error says where the
  cluster came from when it was the environment.

  Raises:
    ValueError: the spec or the task is not usable by `role`, naming the fix.
    ClusterError: the spec names tasks of an isolated `LocalCluster` of this process,
      which this process cannot reach (`check_reachable`).
  """
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}. Received: role={role!r}")
  source = "arguments"
  if cluster_spec is None:
    config = _environment.cluster_from_environment(environ)
    if config is None:
      return None
    cluster_spec, task_type, task_id, source = (config.cluster_spec, config.task_type,
                                                config.task_id, config.source)
    if role == "parameter_server":
      _check_parameter_server_worker(config)
  spec = _environment.checked(
      lambda: normalize_cluster_spec(cluster_spec, task_type, task_id, role),
      None if source == "arguments" else source)
  task_id = int(task_id)  # A numpy integer passes the check above: give on a plain int.
  check_reachable(spec, task_type, task_id)
  return _environment.ClusterConfig(spec, task_type, task_id, source)


def _check_parameter_server_worker(config):
  """The environment's cluster as a `ParameterServerStrategy` worker needs it, or a
  ValueError saying what to launch instead."""
  where = ("the TF_CONFIG environment variable" if config.source == _environment.TF_CONFIG
           else "Slurm's variables")
  if not config.cluster_spec.get(PS_JOB):
    hint = ("launch with diststrat-run --ps 1 (or more)"
            if config.source == _environment.TF_CONFIG
            else f"set {_environment.SLURM_NUM_PS_ENV} to the number of PS tasks")
    raise ValueError(
        f"ParameterServerStrategy() read its cluster from {where}, which names no "
        f"parameter server (a 'ps' job). Received: cluster={config.cluster_spec!r}. To "
        f"train with parameter servers, {hint}; for synchronous training on workers only, "
        "use MultiWorkerMirroredStrategy().")
  if config.task_type == PS_JOB:
    raise ValueError(
        f"This process is parameter server task {config.task_id} by {where}, and "
        "parameter servers run no model code. Run diststrat.cluster.serve() in PS tasks "
        "instead of the training program (diststrat-run does this itself): see "
        "docs/launch.md.")


def check_reachable(cluster_spec, task_type, task_id):
  """Raises `ClusterError` if `cluster_spec` names tasks of an isolated cluster of this
  process (a `LocalCluster` in a private network namespace), which this process, outside
  it, cannot reach: connecting would only fail, after a timeout.
  """
  if _exposure.in_private_network():
    return  # This process runs inside a private network: its job's tasks are reachable.
  for job, addresses in cluster_spec.items():
    for i, address in enumerate(addresses):
      owner = _exposure.isolated_owner(address)
      if owner is None:
        continue
      task = f"/job:{job}/replica:0/task:{i}"
      raise errors.ClusterError(
          f"The cluster_spec names {task} at {address}, a task of {owner}, which runs "
          "isolated in a private network namespace: no process outside it, this one "
          f"included ({task_type} task {task_id} would connect from here), can reach its "
          "tasks. Run the workers' code inside the cluster with cluster.run_on_workers(fn), "
          "or create it with LocalCluster(..., isolate=False) to connect from this process "
          "(its servers are then reachable by every local process: docs/security.md).",
          task=task)
