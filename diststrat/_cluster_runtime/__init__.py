"""The cluster runtime: what every cluster strategy uses to work across processes.

Below the strategies (they import it; it imports none of them). Starting processes is
another layer, above the strategies: `diststrat.cluster` (`LocalCluster`, the child
process entry point).

One file per concept:

- `_connection.py`: a parameter-server worker's link to its cluster (spec checks,
  connecting, devices, shared variables) and `ClusterTaskMixin`.
- `_worker_group.py`: a worker's place in a synchronous cluster (collectives across
  processes, `MultiWorkerMirroredStrategy`).
- `_watchdog.py`: bounded cluster calls; TensorFlow faults become `ClusterError`.
- `_faults.py`: which TensorFlow errors are cluster faults, read from their text.
- `_shared_variables.py`: variables that live on a PS task, shared by name.
- `_read_cache.py`: reading each PS variable once per step.
"""
