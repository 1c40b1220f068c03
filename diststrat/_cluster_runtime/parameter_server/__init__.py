"""What `ParameterServerStrategy` uses in cluster mode, in each worker process.

- `_connection.py`: this worker's link to the PS tasks (connecting, devices, variables).
- `_shared_variables.py`: variables that live on a PS task, shared by name.
- `_read_cache.py`: reading each PS variable once per step.
"""
