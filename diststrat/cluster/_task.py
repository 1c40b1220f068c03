"""What a task process of `diststrat-run` runs: a prologue, then the program or `serve()`.

The launcher starts every task as `python -c PROLOGUE MODE [script args...]`, where
PROLOGUE (`prologue()`) runs before anything is imported:

1. joins the launcher's private network namespace, if it has one (`_isolation`; joining
   needs a process that has started no thread yet);
2. asks Linux to SIGKILL the process when the launcher dies (`prctl(PR_SET_PDEATHSIG)`),
   and exits at once if the launcher is already gone: so even a launcher killed with
   SIGKILL leaves no task behind;
3. calls `main()`, which splits the CPU into the logical devices of
   `--cpus-per-worker` (before the program can initialize TensorFlow), then runs the
   program as `__main__` (MODE "script", as `python script.py args` would: `sys.argv`
   and `sys.path[0]` are the script's), or `serve()` (MODE "serve", a PS task).
"""

import os
import runpy
import sys

from diststrat._tf import tf
from diststrat.cluster import _isolation
from diststrat.cluster import _serve

LAUNCHER_PID_ENV = "DISTSTRAT_LAUNCHER_PID"
"""The launcher's process id, which a task checks is still its parent."""
CPUS_ENV = "DISTSTRAT_CPUS_PER_WORKER"
"""Logical CPU devices of a worker process (`--cpus-per-worker`)."""
SCRIPT, SERVE = "script", "serve"
_PR_SET_PDEATHSIG = 1
_ORPHANED_EXIT = 3

_DEATH_SIGNAL = (
    "import ctypes as _c, os as _o, signal as _s\n"
    f"if _c.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, int(_s.SIGKILL)) != 0:\n"
    "  raise OSError(_c.get_errno(), 'diststrat-run: prctl(PR_SET_PDEATHSIG) failed')\n"
    f"if _o.getppid() != int(_o.environ['{LAUNCHER_PID_ENV}']):\n"
    f"  _o._exit({_ORPHANED_EXIT})  # The launcher died before this line: do not run.\n"
    "del _c, _o, _s\n")


def prologue(namespace_holder_pid: int | None = None) -> str:
  """The Python code a task runs first (see the module docstring)."""
  join = "" if namespace_holder_pid is None else _isolation.join_code(namespace_holder_pid)
  return join + _DEATH_SIGNAL + "from diststrat.cluster import _task\n_task.main()\n"


def split_cpu(count: int | None) -> None:
  """Splits the CPU into `count` logical devices (before TensorFlow initializes).

  Nothing happens with GPUs (the towers are the GPUs) or when `count` is None or 0.
  """
  if count and not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * count)


def run_script(path: str, args: list) -> None:
  """Runs the program at `path` as `__main__`, as `python path args...` does."""
  sys.argv[:] = [path] + list(args)
  sys.path[0] = os.path.dirname(os.path.abspath(path))
  runpy.run_path(path, run_name="__main__")


def main() -> None:
  """Entry point after the prologue: `sys.argv` is ["-c", MODE, script, args...]."""
  mode = sys.argv[1]
  split_cpu(int(os.environ.pop(CPUS_ENV, "0")))
  if mode == SERVE:
    _serve.serve()
  else:
    run_script(sys.argv[2], sys.argv[3:])
