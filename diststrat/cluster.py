"""Run a parameter-server cluster on this machine: `LocalCluster`.

`LocalCluster(num_ps, num_workers)` starts the parameter servers as child processes on
free loopback ports and runs functions on the worker tasks, each with a
`ParameterServerStrategy` connected to the cluster. See docs/parameter_server.md.

Example::

    import diststrat as ds

    def train(strategy, steps):                 # module-level, so it can be pickled
      ...
      return final_loss

    with ds.cluster.LocalCluster(num_ps=1, num_workers=2) as cluster:
      losses = cluster.run_on_workers(train, steps=100)
"""

from diststrat._cluster import LocalCluster as LocalCluster

__all__ = ["LocalCluster"]
