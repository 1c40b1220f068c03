"""What `MultiWorkerMirroredStrategy` uses, in each worker process.

- `_worker_group.py`: a worker's place in a synchronous cluster (collectives across
  processes).
- `_collective_watchdog.py`: ends a collective that waits on a dead, frozen or silent peer.
"""
