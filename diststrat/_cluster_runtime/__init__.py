"""The cluster runtime: what the cluster strategies use to work across processes.

Below the strategies (they import it; it imports none of them). Starting processes is
another layer, above the strategies: `diststrat.cluster`. The folders say which strategy
a part serves:

- `parameter_server/`: `ParameterServerStrategy`'s cluster mode (its link to the PS tasks,
  shared variables, read caching).
- `multi_worker/`: `MultiWorkerMirroredStrategy` (the worker group, the collective
  watchdog).
- here, what both use (and `serve()` too):
  - `_cluster_spec.py`: checking a cluster spec, finding this process's cluster from its
    arguments or environment (`resolve_cluster`), waiting for the cluster's servers,
    `ClusterTaskMixin`;
  - `_environment.py`: reading `TF_CONFIG` and Slurm's variables;
  - `_watchdog.py`: bounded cluster calls, TensorFlow faults as `ClusterError`;
  - `_faults.py`: which TensorFlow errors are cluster faults, read from their text;
  - `_exposure.py`: saying who can reach a TensorFlow server diststrat starts.
"""
