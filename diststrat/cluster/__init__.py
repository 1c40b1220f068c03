"""Starting clusters of processes: `LocalCluster`.

`LocalCluster(num_ps, num_workers)` starts a cluster's server processes on free loopback
ports and runs functions on its worker tasks, each with a strategy connected to the
cluster. See docs/parameter_server.md and docs/multi_worker.md. The runtime the cluster
strategies use inside each process is `diststrat/_cluster_runtime/`.

One file per concept:

- `_local_cluster.py`: `LocalCluster`, the launcher (child processes, ports, faults).
- `_child.py`: what a child process runs (a server, or one worker's function).
- `_serve.py`: `serve()`, a parameter server's process (and `LocalCluster`'s PS tasks).
- `_task.py`: what a task of `diststrat-run` runs before the user's program.

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

from diststrat._cluster_runtime._environment import ClusterConfig as ClusterConfig
from diststrat._cluster_runtime._environment import (
    cluster_from_environment as cluster_from_environment)
from diststrat._cluster_runtime._environment import cluster_from_slurm as cluster_from_slurm
from diststrat.cluster._local_cluster import LocalCluster as LocalCluster
from diststrat.cluster._serve import serve as serve

__all__ = ["LocalCluster", "serve", "ClusterConfig", "cluster_from_environment",
           "cluster_from_slurm"]
