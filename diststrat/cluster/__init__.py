"""Starting clusters of processes: `LocalCluster`.

`LocalCluster(num_ps, num_workers)` starts a cluster's server processes on free loopback
ports and runs functions on its worker tasks, each with a strategy connected to the
cluster. See docs/parameter_server.md and docs/multi_worker.md. The runtime the cluster
strategies use inside each process is `diststrat/_cluster_runtime/`.

One file per concept:

- `_processes.py`: the process layer. Every process diststrat starts is started,
  signalled and described there (with `_forkserver.py`, fresh processes forked without
  TensorFlow's import, and `_isolation.py`, private network namespaces), under one
  orphan policy: a task dies with its parent.
- `_local_cluster.py`: `LocalCluster` (its tasks, ports, faults); `_child.py`: what one
  of its tasks runs (a server, or one worker's function).
- `_job.py`: a job of a script's tasks on this host, as `diststrat-run` (its command
  line: `diststrat/run.py`) runs it; `_task.py`: what such a task runs after its
  prologue.
- `_serve.py`: `serve()`, a parameter server's process (and `LocalCluster`'s PS tasks).

`cluster_from_environment()` and `cluster_from_slurm()` read the cluster the strategies
use when given no cluster arguments (`TF_CONFIG`, else Slurm's variables); they live in
`diststrat/_cluster_runtime/_environment.py` and are re-exported here.

Example::

    import diststrat as ds

    def train(strategy, steps):                 # module-level, so it can be pickled
      ...
      return final_loss

    with ds.cluster.LocalCluster(num_ps=1, num_workers=2) as cluster:
      losses = cluster.run_on_workers(train, steps=100)
"""

import importlib
import typing

__all__ = ["LocalCluster", "serve", "ClusterConfig", "cluster_from_environment",
           "cluster_from_slurm"]

# Loaded on first use (PEP 562): `diststrat-run` imports this package's `_job` without
# TensorFlow, which `LocalCluster` and `serve` import.
_NAMES = {
    "ClusterConfig": "diststrat._cluster_runtime._environment",
    "cluster_from_environment": "diststrat._cluster_runtime._environment",
    "cluster_from_slurm": "diststrat._cluster_runtime._environment",
    "LocalCluster": "diststrat.cluster._local_cluster",
    "serve": "diststrat.cluster._serve",
}

if typing.TYPE_CHECKING:
  from diststrat._cluster_runtime._environment import ClusterConfig as ClusterConfig
  from diststrat._cluster_runtime._environment import (
      cluster_from_environment as cluster_from_environment)
  from diststrat._cluster_runtime._environment import cluster_from_slurm as cluster_from_slurm
  from diststrat.cluster._local_cluster import LocalCluster as LocalCluster
  from diststrat.cluster._serve import serve as serve


def __getattr__(name: str) -> typing.Any:
  if name in _NAMES:
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'diststrat.cluster' has no attribute {name!r}")


def __dir__() -> typing.List[str]:
  return sorted(set(globals()) | set(_NAMES))
