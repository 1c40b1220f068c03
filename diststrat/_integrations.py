"""Integrations connected on first use: how code the core cannot import gets installed.

`import diststrat` imports no TensorFlow (so that `diststrat-run --help` answers at once),
so it cannot install the Keras support when it is imported. It registers the installer
here instead (this module imports nothing), and the core runs every pending installer
the first time a diststrat context is entered (`_context.enter_mode`) or a variable of
another library is unwrapped (`_arguments.as_tf_variable`), as well as on the first use
of a `diststrat` name. So the Keras support is connected before it can matter, however a
program imported diststrat: `import diststrat as ds`, or only
`from diststrat.strategies import MirroredStrategy`.
"""

import threading
import typing

_lock = threading.RLock()
_pending: list[typing.Callable[[], typing.Any]] = []
_default_strategy_loader: list[typing.Callable[[], typing.Any]] = []
_exit_cleanups: list[typing.Callable[[], typing.Any]] = []


def register(installer: typing.Callable[[], typing.Any]) -> None:
  """Adds `installer` (no arguments, idempotent) to run on first use."""
  with _lock:
    _pending.append(installer)


def install_pending() -> None:
  """Runs the installers not run yet, once each (cheap once none is pending)."""
  if not _pending:
    return
  with _lock:
    while _pending:
      installer = _pending[0]
      installer()  # Left pending if it raises: the next use tries again.
      _pending.pop(0)


def register_default_strategy_loader(loader: typing.Callable[[], typing.Any]) -> None:
  """Sets what registers diststrat's default strategy (`import diststrat` sets it: the
  import of the strategies' layer). The contexts call it the first time they need the
  default strategy, which a program that imported only some submodules has not loaded."""
  _default_strategy_loader[:] = [loader]


def load_default_strategy() -> None:
  """Runs the loader set by `register_default_strategy_loader`, if any."""
  with _lock:
    for loader in _default_strategy_loader:
      loader()


def register_exit_cleanup(cleanup: typing.Callable[[], typing.Any]) -> None:
  """Adds `cleanup` (no arguments, idempotent) to what `run_exit_cleanups` runs."""
  with _lock:
    _exit_cleanups.append(cleanup)


def run_exit_cleanups() -> None:
  """Runs the registered cleanups: a process about to end with `os._exit` (a
  `LocalCluster` task), which skips the interpreter's exit hooks, calls it first."""
  with _lock:
    cleanups = list(_exit_cleanups)
  for cleanup in cleanups:
    try:
      cleanup()
    except Exception:  # pylint: disable=broad-except
      pass  # Best effort: the process is ending.
