"""What a task process of `diststrat-run` runs, after its prologue: the program or `serve()`.

The launcher starts every task as `python -c PROLOGUE+CODE [script args...]`: the
prologue (`_processes.prologue`) joins the job's private network and makes the task die
with the launcher; then

- a worker (`WORKER_CODE`) splits the CPU into the logical devices of
  `--cpus-per-worker` (before the program can initialize TensorFlow; TensorFlow is
  imported only then) and runs the program as `__main__`, as `python script.py args`
  would (`sys.argv`, `sys.path[0]`, a traceback that starts at the script); diststrat
  itself is not imported, so a program that does not use it runs as it would alone;
- a PS task runs `diststrat.cluster.serve()`: in a job across hosts (`SERVE_CODE`), it
  ends once every worker of the job has ended; on one host (`SERVE_UNTIL_STOPPED_CODE`),
  it serves until the launcher stops it, once this host's workers (all of the job's)
  are done. Its own watch would end it while a worker still starting has not yet
  connected, 10 s after the others left.
"""

READY_FD_ENV = "DISTSTRAT_READY_FD"
"""A file descriptor `serve()` writes one line to once the server is ready (the launcher's)."""

WORKERS_GONE_FOR = 10.0
"""Seconds a PS started by `serve()` waits, once no worker of its job answers any more,
before it takes the job for ended (the launcher names it too)."""

CPUS_ENV = "DISTSTRAT_CPUS_PER_WORKER"
"""Logical CPU devices of a worker process (`--cpus-per-worker`)."""

# sys.argv is ["-c", script, args...]; the program sees [script, args...] (runpy makes
# the script's path absolute), an absolute __file__ and, first on sys.path, the directory
# of the script's real path (symlinks resolved), as under `python script.py`; with
# PYTHONSAFEPATH, neither `python -c` nor `python script.py` puts a directory first, so
# sys.path is left as it is (replacing its first entry dropped one of PYTHONPATH's). An
# exception the program does not catch is
# reported as `python script.py` would: its traceback starts at the script's frame (not
# this code's, nor runpy's; a SyntaxError has none, so only its place in the script is
# shown; an error with no frame of the script, such as one in a zipapp, keeps them all),
# and the task exits with 1, or, for KeyboardInterrupt, is killed by SIGINT.
WORKER_CODE = (
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
    "if not getattr(_s.flags, 'safe_path', False):\n"
    "  _s.path[0] = _o.path.dirname(_o.path.realpath(_s.argv[0]))\n"
    "_p = _o.path.abspath(_s.argv[0])\n"
    "del _n\n"
    "try:\n"
    "  _r.run_path(_p, run_name='__main__')\n"
    "except SystemExit:\n"
    "  raise\n"
    "except BaseException as _e:\n"
    "  _b = _e.__traceback__\n"
    "  while _b is not None and _o.path.abspath(_b.tb_frame.f_code.co_filename) != _p:\n"
    "    _b = _b.tb_next\n"
    "  _e = _e.with_traceback(_b if _b is not None or isinstance(_e, SyntaxError)\n"
    "                         else _e.__traceback__)\n"
    "  _s.excepthook(type(_e), _e, _e.__traceback__)\n"
    "  if isinstance(_e, KeyboardInterrupt):\n"
    "    import signal as _g\n"
    "    _s.stdout.flush()\n"
    "    _s.stderr.flush()\n"
    "    _g.signal(_g.SIGINT, _g.SIG_DFL)\n"
    "    _o.kill(_o.getpid(), _g.SIGINT)\n"
    "  _s.exit(1)\n")

SERVE_CODE = "from diststrat.cluster import _serve\n_serve.serve()\n"
SERVE_UNTIL_STOPPED_CODE = (
    "from diststrat.cluster import _serve\n_serve.serve(workers_gone_for=None)\n")


def split_cpu(count: int | None) -> None:
  """Splits the CPU into `count` logical devices (before TensorFlow initializes).

  Nothing happens with GPUs (the towers are the GPUs) or when `count` is None or 0.
  (`LocalCluster`'s worker processes; a launched worker does the same in `WORKER_CODE`.)
  """
  if not count:
    return
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  if not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * count)
