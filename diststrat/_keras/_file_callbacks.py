"""Keras callbacks that write files, in every worker process of a cluster.

Under `MultiWorkerMirroredStrategy` and `ParameterServerStrategy` every worker runs the
same program, so the same `model.fit` with the same callbacks. Those that write files
(`ModelCheckpoint`, `CSVLogger`, `BackupAndRestore`, `TensorBoard`) must still run in
every worker (under `MultiWorkerMirroredStrategy` a save reads the tower-local
variables, a collective across the workers), but two workers writing one path race:
HDF5 refuses the second writer's lock, or one reads the other's half-written file. So,
as tf.distribute's Keras did: the chief (worker 0, or a "chief" job's task) writes to
the user's path; every other worker writes to a scratch directory of its own, removed
when `fit` ends, and the callback's path is given back. User code does not branch on the task.

`redirect_fit_callbacks` is called by the tf.distribute facade
(`StrategyAdapter.experimental_distribute_dataset`) when Keras's `fit` asks for its
dataset (before it builds its callback list): the callbacks are found in `fit`'s
arguments (`_tf_internal.keras_fit_callbacks`).

Under `MultiWorkerMirroredStrategy`, `BackupAndRestore` reads the chief's backup at the
start of `fit` (every worker must restore the same state; the workers are in step, so
the chief writes nothing meanwhile) and writes to the scratch directory after that. Under
`ParameterServerStrategy` the workers are not in step and share their variables: the
chief restores them for all, and the other workers' backups are in scratch from the
start (a restarted worker other than the chief runs its epochs again).

To do this, diststrat replaces instance attributes of each such callback (only in a
worker other than the chief; Keras's classes are not changed), and gives every one back
when `fit` ends:

- the path attribute: `ModelCheckpoint.filepath`, `CSVLogger.filename`,
  `TensorBoard.log_dir`, set to a path in the worker's scratch directory;
- `BackupAndRestore.on_train_begin`, with a function that runs Keras's, then points the
  callback at the scratch directory: its `backup_dir` and the paths Keras derived from
  it (private attributes, through `_tf_internal.set_keras_backup_dir`);
- `on_train_end`, with a function that runs Keras's, then gives the callback back its
  paths and its methods and removes the scratch directory.
"""

import os
import shutil
import tempfile
import typing
import weakref
from typing import Any

from diststrat import _integrations
from diststrat import _tf_internal

# callback -> its scratch directory
_redirected: weakref.WeakKeyDictionary[typing.Any, str] = weakref.WeakKeyDictionary()


def _file_callback_kinds():
  import keras  # pylint: disable=import-outside-toplevel
  return {keras.callbacks.ModelCheckpoint: "filepath", keras.callbacks.CSVLogger: "filename",
          keras.callbacks.TensorBoard: "log_dir", keras.callbacks.BackupAndRestore: None}


def _other_worker(strategy):
  """Whether this process is a worker other than the chief, in a job of several: a
  "chief" job's task counts as one of the workers (it is the chief)."""
  spec = getattr(strategy, "cluster_spec", None) or {}
  training = len(spec.get("chief", ())) + len(spec.get("worker", ()))
  if training <= 1 or getattr(strategy, "task_type", None) != "worker":
    return False
  return not getattr(strategy, "is_chief", strategy.task_id == 0)


def redirect_fit_callbacks(strategy):
  """In a worker other than the chief of a cluster: points the file callbacks of the
  running `fit` at scratch directories (see the module doc)."""
  if not _other_worker(strategy):
    return
  callbacks = _tf_internal.keras_fit_callbacks()
  if callbacks is None:
    return
  callbacks = getattr(callbacks, "callbacks", callbacks)  # A CallbackList, or a list.
  if not isinstance(callbacks, (list, tuple)):
    callbacks = [callbacks]
  kinds = _file_callback_kinds()
  for callback in callbacks:
    kind = next((k for k in kinds if isinstance(callback, k)), None)
    if kind is not None and callback not in _redirected:
      _redirect(callback, kinds[kind], strategy)


# Removes every scratch directory still there: when `fit` raised (Keras then calls no
# `on_train_end`) in a process that ends with `os._exit` (a LocalCluster task), which
# skips the finalizers' exit hook.
_cleanups: "list[Any]" = []  # weakref.finalize objects (alive until they ran)


def _remove_scratch_directories():
  for cleanup in list(_cleanups):
    cleanup()  # A finalizer that ran already does nothing.
  _cleanups.clear()


_integrations.register_exit_cleanup(_remove_scratch_directories)


def _redirect(callback, attribute, strategy):
  scratch = tempfile.mkdtemp(prefix=f"diststrat_worker{strategy.task_id}_")
  _redirected[callback] = scratch
  cleanup = weakref.finalize(callback, shutil.rmtree, scratch, ignore_errors=True)
  _cleanups[:] = [c for c in _cleanups if c.alive] + [cleanup]
  restore = []

  if attribute is not None:
    user_path = getattr(callback, attribute)
    name = os.path.basename(os.path.normpath(str(user_path))) or "output"
    setattr(callback, attribute, os.path.join(scratch, name))
    restore.append(lambda: setattr(callback, attribute, user_path))
  elif strategy._num_processes() == 1:
    # BackupAndRestore of a ParameterServerStrategy worker: the workers train apart, on
    # variables the PS tasks share, so the chief's restore is everyone's; this worker
    # neither reads the chief's backup (the chief may be writing it: HDF5 refuses the
    # lock, or reads a half-written file) nor writes it.
    state = _tf_internal.set_keras_backup_dir(callback, os.path.join(scratch, "backup"))
    restore.append(lambda: _tf_internal.restore_keras_backup_dir(callback, state))
  else:  # BackupAndRestore: restore from the chief's backup, then write to scratch.
    on_train_begin = callback.on_train_begin

    def begin(logs=None):
      on_train_begin(logs)
      state = _tf_internal.set_keras_backup_dir(callback, os.path.join(scratch, "backup"))
      restore.append(lambda: _tf_internal.restore_keras_backup_dir(callback, state))
      del callback.on_train_begin  # Back to the class's method.

    callback.on_train_begin = begin

  on_train_end = callback.on_train_end

  def end(logs=None):
    try:
      on_train_end(logs)
    finally:
      for undo in restore:
        undo()
      del callback.on_train_end
      _redirected.pop(callback, None)
      cleanup()

  callback.on_train_end = end
