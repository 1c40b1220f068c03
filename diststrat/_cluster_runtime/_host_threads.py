"""Tasks of one cluster on one machine share its cores (`share_cores`).

TensorFlow sizes a process's intra-op thread pool (the threads one op, such as a matrix
product, splits its work over) to every core of the machine. Several worker processes
of a cluster on one machine then each run that many threads on the same cores, and
their ops slow each other down. When the cluster spec puts more than one task on this
machine, a `MultiWorkerMirroredStrategy` worker, or a `ParameterServerStrategy` worker,
takes its share of the cores for its intra-op pool, as `torchrun` sets
`OMP_NUM_THREADS=1` for the processes it starts on one node (PS tasks keep TensorFlow's
pool). Measured in docs/benchmarks.md (2 workers on 2 cores) and
docs/parameter_server.md, "Threads" (1 PS and 2 workers).

It changes nothing that the program chose: with `TF_NUM_INTRAOP_THREADS` set, or
`tf.config.threading.set_intra_op_parallelism_threads` called before the strategy is
created, TensorFlow's setting stands; nor for a process pinned to some of the cores
(its CPU affinity narrower than the machine), whose cores someone chose already. The
inter-op pool (how many ops run at once) is left to TensorFlow.
"""

import logging
import os
import socket
from typing import Mapping, Optional, Sequence

from diststrat._tf import tf
from diststrat._cluster_runtime import _exposure

logger = logging.getLogger("diststrat")

THREADS_VARIABLE = "TF_NUM_INTRAOP_THREADS"


def usable_cores() -> int:
  """The cores this process may run on (its CPU affinity, which containers and
  `taskset` narrow), else every core of the machine."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # pragma: no cover - not Linux
    return os.cpu_count() or 1


def machine_cores() -> int:
  return os.cpu_count() or 1


def tasks_on_this_machine(cluster_spec: Mapping[str, Sequence[str]]) -> int:
  """How many tasks of `cluster_spec` (every job) have an address of this machine.

  An address is this machine's when its host is `localhost`, this machine's host name,
  a loopback address, or an address this machine can bind. Other names are not looked
  up (no DNS wait here): they count as other machines.
  """
  return sum(_is_this_machine(address) for addresses in cluster_spec.values()
             for address in addresses)


def _is_this_machine(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  return host in ("localhost", socket.gethostname()) or \
      _exposure.is_this_machines_address(host)


def share_cores(cluster_spec: Mapping[str, Sequence[str]], name: str) -> Optional[int]:
  """Sets this process's intra-op threads to its share of the cores, if its cluster
  has other tasks on this machine and the program chose no thread count.

  Must run before TensorFlow initializes in this process. Returns the count it set, or
  None when it set nothing.
  """
  if os.environ.get(THREADS_VARIABLE) or \
      tf.config.threading.get_intra_op_parallelism_threads() != 0:
    return None  # The program's choice.
  cores = usable_cores()
  if cores < machine_cores():
    # Pinned to some cores (taskset, numactl, Slurm's --cpu-bind, a cpuset): whoever
    # pinned it chose its share already, and TensorFlow sizes its pool to those cores.
    return None
  local = tasks_on_this_machine(cluster_spec)
  if local <= 1:
    return None
  share = max(1, cores // local)
  if share >= cores:
    return None  # One core: nothing to divide.
  try:
    tf.config.threading.set_intra_op_parallelism_threads(share)
  except RuntimeError:  # TensorFlow already runs: its pools are made.
    logger.info(
        "%s: %d tasks of the cluster run on this machine, but TensorFlow already ran in "
        "this process, so its intra-op pool keeps a thread per core (%d). Create the "
        "strategy before any TensorFlow op, or set %s, to give this process its share "
        "(%d).", name, local, cores, THREADS_VARIABLE, share)
    return None
  logger.info(
      "%s: %d tasks of the cluster run on this machine, which has %d cores for this "
      "process: TensorFlow's intra-op threads set to %d in this process (set %s, or call "
      "tf.config.threading.set_intra_op_parallelism_threads before creating the "
      "strategy, to choose another count).", name, local, cores, share, THREADS_VARIABLE)
  return share
