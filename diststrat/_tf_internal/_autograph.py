"""AutoGraph: letting diststrat's errors through as themselves; its generated files.

Inside `tf.function`, AutoGraph rebuilds errors raised in converted code from their
message, as another type (`StagingError`) and without their notes, unless they are
marked to pass through.

AutoGraph writes each function it converts to a file in the temporary directory
(`__autograph_generated_file*.py`), loads it as a module and removes it at interpreter
exit (an `atexit` hook). A process that ends with `os._exit` skips that hook and leaves
the files behind; `remove_autograph_generated_files` removes this process's own.
"""

import os
import sys

_AUTOGRAPH_PASS_THROUGH = "ag_pass_through"
_AUTOGRAPH_METADATA = "ag_error_metadata"


def pass_through_autograph(error):
  """Makes AutoGraph re-raise `error` itself: same type, message and notes.

  AutoGraph leaves alone an error that has `ag_pass_through`; one that already carries
  its `ag_error_metadata` (attached in converted code deeper down, such as a tower
  function) would be rebuilt at the top, so that is removed.
  """
  setattr(error, _AUTOGRAPH_PASS_THROUGH, True)
  if _AUTOGRAPH_METADATA in getattr(error, "__dict__", {}):
    delattr(error, _AUTOGRAPH_METADATA)
  return error


def pass_through_autograph_class(cls):
  """Class decorator: every error of `cls` passes through AutoGraph as itself."""
  setattr(cls, _AUTOGRAPH_PASS_THROUGH, True)
  return cls


_GENERATED_PREFIX = "__autograph_generated_file"


def remove_autograph_generated_files(modules=None):
  """Removes the files AutoGraph generated in this process (for a process about to end
  with `os._exit`). Returns their paths. `modules` (tests) replaces `sys.modules`.

  AutoGraph loads each generated file as a module named after it, so this process's files
  are the `__file__`s of the modules in `sys.modules` with that prefix: another
  process's files are not touched.
  """
  removed = []
  for name, module in list((sys.modules if modules is None else modules).items()):
    path = getattr(module, "__file__", None)
    if name.startswith(_GENERATED_PREFIX) and path:
      try:
        os.remove(path)
        removed.append(path)
      except OSError:
        pass  # Already gone.
  return removed


def register_for_loop(cls, for_stmt):
  """Makes AutoGraph call `for_stmt(iter_, extra_test, body, get_state, set_state,
  symbol_names, opts)` for a `for` loop over a `cls` in a converted function, instead of
  running the loop in Python (which, over an iterator whose `next` never ends in a
  graph, would trace forever). Returns False where TensorFlow has no such registry."""
  try:
    from tensorflow.python.autograph.operators import control_flow  # pylint: disable=g-import-not-at-top
    control_flow.for_loop_registry.register(cls, for_stmt)
  except (ImportError, AttributeError):  # pragma: no cover - another TensorFlow
    return False
  return True
