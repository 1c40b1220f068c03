"""What runs in a `LocalCluster` child process: a PS server, or one worker's function.

The parent forks it from the cluster's fork server (`_forkserver`) as
`python -c "from diststrat.cluster import _child; _child.main()" FD` would start it,
where FD is its end of a socket pair, and sends one job (a dict) over it:

- {"kind": "ps", ...}: start a `tf.distribute.Server` for the task, warm it up (see
  `_serve.warm_up`), answer ("ready", pid), then serve until the parent closes the socket (or
  dies).
- {"kind": "worker", ...}: build the strategy the job names (`ParameterServerStrategy`
  or `MultiWorkerMirroredStrategy`) for the task, run
  `fn(strategy, **kwargs)`, answer ("ok", pickled result) or ("error", ...,
  when it failed), and exit.

Every child dies with the fork server, and the fork server with the cluster's process
(`_forkserver`), so no process outlives the cluster. A child ends with `os._exit` so
that a step thread still blocked in TensorFlow cannot hold the exit up; it removes the
files AutoGraph generated first, which TensorFlow's exit hook would have removed.

A worker job with "cpus" (`LocalCluster(cpus_per_worker=N)`) splits the process's CPU
into N logical devices before anything else can initialize TensorFlow, so tests and
benchmarks run several towers per worker process on a machine without GPUs.
"""

import faulthandler
import os
import pickle
import runpy
import sys
import time
import traceback
import types
from multiprocessing import connection

from diststrat import _integrations
from diststrat import _tf_internal
from diststrat.cluster import _serve
from diststrat.cluster import _task
from diststrat.strategies import MultiWorkerMirroredStrategy
from diststrat.strategies import ParameterServerStrategy

_STRATEGIES = {"parameter_server": ParameterServerStrategy,
               "multi_worker": MultiWorkerMirroredStrategy}

def _load_main(main_path):
  """Loads the parent's main script as `__mp_main__` (as multiprocessing does).

  Functions defined in a script run as `python script.py` pickle as `__main__.fn`;
  this makes that name resolve in the child without running the script's
  `if __name__ == "__main__":` block.
  """
  module = types.ModuleType("__mp_main__")
  module.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
  sys.modules["__main__"] = sys.modules["__mp_main__"] = module


_INHERITED_MODULES = frozenset(sys.modules)  # The fork server's: its files are its own.


def _remove_autograph_files():
  """Removes the files AutoGraph generated in this task: the task ends with `os._exit`,
  which skips TensorFlow's exit hook that would remove them."""
  _tf_internal.remove_autograph_generated_files(
      {n: m for n, m in list(sys.modules.items()) if n not in _INHERITED_MODULES})


def _serve_ps(conn, job):
  server = _serve.start_server(job["cluster_spec"], job["task_type"], job["task_id"],
                               warm_up_port=job["warm_up_port"])
  conn.send(("ready", os.getpid()))
  try:
    while True:
      conn.recv()
  except (EOFError, OSError):
    pass
  return server  # Referenced until here: deleting the Server object stops it.


def _error_payload(error):
  """("error", pickled or None, type name, message, traceback text, when): `when` is this
  machine's monotonic clock, so the cluster can tell which worker failed first."""
  when = time.monotonic()
  text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
  try:
    pickled = pickle.dumps(error)
    pickle.loads(pickled)
  except Exception:  # pylint: disable=broad-except
    pickled = None
  return ("error", pickled, type(error).__name__, str(error), text, when)


def _run_worker(conn, job):
  try:
    _task.split_cpu(job.get("cpus"))  # Before the user's modules load: they may use TensorFlow.
    if job.get("main_path"):
      _load_main(job["main_path"])
    fn = pickle.loads(job["fn"])
    kwargs = pickle.loads(job["kwargs"])
    strategy_kwargs = pickle.loads(job["strategy_kwargs"])
    strategy = _STRATEGIES[job.get("strategy", "parameter_server")](
        cluster_spec=job["cluster_spec"], task_type=job["task_type"],
        task_id=job["task_id"], **strategy_kwargs)
    result = fn(strategy, **kwargs)
    try:
      payload = ("ok", pickle.dumps(result))
    except Exception as e:  # pylint: disable=broad-except
      raise TypeError(f"the result of {getattr(fn, '__name__', fn)!r} cannot be pickled "
                      f"to send it back: {e}. Return plain Python values or numpy "
                      "arrays.") from e
  except BaseException as e:  # pylint: disable=broad-except
    payload = _error_payload(e)
  _remove_autograph_files()  # Before the answer: the cluster may stop the task after it.
  _integrations.run_exit_cleanups()
  conn.send(payload)


def main():
  """Entry point of a child process (see the module docstring)."""
  faulthandler.enable()  # A crash (SIGSEGV, SIGABRT) leaves a Python trace on stderr.
  conn = connection.Connection(int(sys.argv[1]))
  job = conn.recv()
  sys.path[:] = job["sys_path"]
  code = 0
  try:
    if job["kind"] == "ps":
      _serve_ps(conn, job)
    else:
      _run_worker(conn, job)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  finally:
    _remove_autograph_files()
    _integrations.run_exit_cleanups()  # What os._exit would skip (scratch directories).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
