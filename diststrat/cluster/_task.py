"""What a task process of `diststrat-run` runs: a prologue, then the program or `serve()`.

The launcher starts every task as `python -c CODE [script args...]`, where CODE
(`worker_code()`, `ps_code()`) is self-contained Python that runs before anything is
imported:

1. it joins the launcher's private network namespace, if it has one (`_isolation`;
   joining needs a process that has started no thread yet);
2. it asks Linux to SIGKILL the process when the launcher dies
   (`prctl(PR_SET_PDEATHSIG)`), and exits at once if the launcher is already gone: so
   even a launcher killed with SIGKILL leaves no task behind;
3. a worker then splits the CPU into the logical devices of `--cpus-per-worker` (before
   the program can initialize TensorFlow; TensorFlow is imported only then) and runs
   the program as `__main__`, as `python script.py args` would (`sys.argv`,
   `sys.path[0]`); diststrat itself is not imported, so a program that does not use it
   runs as it would alone. A PS task runs `diststrat.cluster.serve()`.
"""

from diststrat._tf import tf
from diststrat.cluster import _isolation

LAUNCHER_PID_ENV = "DISTSTRAT_LAUNCHER_PID"
"""The launcher's process id, which a task checks is still its parent."""
CPUS_ENV = "DISTSTRAT_CPUS_PER_WORKER"
"""Logical CPU devices of a worker process (`--cpus-per-worker`)."""
_PR_SET_PDEATHSIG = 1
_ORPHANED_EXIT = 3

_DEATH_SIGNAL = (
    "import ctypes as _c, os as _o, signal as _s\n"
    f"if _c.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, int(_s.SIGKILL)) != 0:\n"
    "  raise OSError(_c.get_errno(), 'diststrat-run: prctl(PR_SET_PDEATHSIG) failed')\n"
    f"if _o.getppid() != int(_o.environ['{LAUNCHER_PID_ENV}']):\n"
    f"  _o._exit({_ORPHANED_EXIT})  # The launcher died before this line: do not run.\n"
    "del _c, _o, _s\n")

# sys.argv is ["-c", script, args...]; the program sees [script, args...].
_RUN_SCRIPT = (
    "import os as _o, runpy as _r, sys as _s\n"
    f"_n = int(_o.environ.pop('{CPUS_ENV}', '0') or 0)\n"
    "if _n:\n"
    "  import tensorflow as _t\n"
    "  if not _t.config.list_physical_devices('GPU'):\n"
    "    _t.config.set_logical_device_configuration(\n"
    "        _t.config.list_physical_devices('CPU')[0],\n"
    "        [_t.config.LogicalDeviceConfiguration()] * _n)\n"
    "  del _t\n"
    "_s.argv[:] = _s.argv[1:]\n"
    "_s.path[0] = _o.path.dirname(_o.path.abspath(_s.argv[0]))\n"
    "del _o, _s, _n\n"
    "_r.run_path(__import__('sys').argv[0], run_name='__main__')\n")

_SERVE = "from diststrat.cluster import _serve\n_serve.serve()\n"


def _prologue(namespace_holder_pid):
  if namespace_holder_pid is None:
    return _DEATH_SIGNAL
  return _isolation.join_code(namespace_holder_pid) + _DEATH_SIGNAL


def worker_code(namespace_holder_pid: int | None = None) -> str:
  """The `python -c` code of a worker task: prologue, CPU split, the program."""
  return _prologue(namespace_holder_pid) + _RUN_SCRIPT


def ps_code(namespace_holder_pid: int | None = None) -> str:
  """The `python -c` code of a PS task: prologue, then `serve()`."""
  return _prologue(namespace_holder_pid) + _SERVE


def split_cpu(count: int | None) -> None:
  """Splits the CPU into `count` logical devices (before TensorFlow initializes).

  Nothing happens with GPUs (the towers are the GPUs) or when `count` is None or 0.
  (`LocalCluster`'s worker processes; a launched worker does the same in `worker_code`.)
  """
  if count and not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * count)
