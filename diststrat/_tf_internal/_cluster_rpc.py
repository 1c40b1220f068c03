"""TensorFlow's gRPC runtime seen from a client: probing a server, copying a handle,
and the error path of eager ops.

- Connecting to a cluster blocks, with no timeout, while a task is down or frozen
  (TensorFlow's remote device discovery waits for the task): a task is asked first
  whether it answers, with the same RPC and a deadline (`probe_tf_server`).
- No public op brings a remote resource handle to this process (`copy_to_device`).
- Cluster faults reach the user from inside TensorFlow's own calls (an op, a
  `tf.function` step), where only a hook in TensorFlow's error path can give them
  diststrat's type (`install_error_translator`). Which errors are faults is decided by
  the caller (diststrat/_cluster_runtime/_faults.py).
- Eager remote ops and function calls may return before they ran on the remote task.
  The one wait for them (`context.async_wait`) is not public (`wait_for_pending_ops`);
  a checkpoint write calls it after it registered the checkpoint as the latest, it
  blocks forever on a frozen task, and its errors bypass the error path above: a hook
  routes it through the caller's bounded, translating wait, and runs that wait before
  the write registers the checkpoint (`install_sync_hook`).
"""

import threading

import grpc  # TensorFlow's own dependency: its gRPC runtime.

from tensorflow.python.checkpoint import checkpoint as _checkpoint  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import context as _eager_context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import core as _eager_core  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import execute as _execute  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf
from diststrat._tf_internal import _base

_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def probe_tf_server(addresses, timeout):
  """Asks each TensorFlow server at `addresses` for its devices, all at once.

  The RPC TensorFlow's remote device discovery sends, with a deadline: a server that is
  down refuses at once, a frozen one does not answer in time (its kernel still accepts
  TCP connections, so only an RPC tells). Touches no TensorFlow state.

  Args:
    addresses: "host:port" strings.
    timeout: seconds the servers have to answer.

  Returns:
    One entry per address: None if it answered, else a short description of the failure
    ("cannot be reached (UNAVAILABLE: ...)" or "did not answer within N s").
  """
  channels, calls = [], []
  try:
    for address in addresses:
      channel = grpc.insecure_channel(address)
      channels.append(channel)
      stub = channel.unary_unary(_GET_STATUS, request_serializer=lambda _: b"",
                                 response_deserializer=lambda raw: raw)
      calls.append(stub.future(None, timeout=timeout))
    outcomes = []
    for call in calls:
      try:
        call.result()
        outcomes.append(None)
      except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
          outcomes.append(f"did not answer within {timeout:g} s (frozen, overloaded or cut "
                          "off)")
        else:
          outcomes.append(f"cannot be reached ({e.code().name}: {e.details()})")
    return outcomes
  finally:
    for channel in channels:
      channel.close()


def copy_to_device(tensor, device):
  """Copies an eager tensor to `device`, whatever its dtype (resource handles included).

  `tf.identity` of a resource handle runs where the resource lives, so it cannot bring a
  parameter server's handle to the worker; the eager tensor's own copy can. A failed
  remote copy raises a bare `RuntimeError` (TensorFlow's), not an op error.
  """
  return tensor._copy_to_device(device)  # pylint: disable=protected-access


_TRANSLATOR_MARK = "_diststrat_translator"
# Where TensorFlow 2.21 raises errors of eager ops and function calls: ops on the fast
# path build them in core._status_to_exception; the others, and every tf.function call,
# come out of execute.quick_execute (also named execute.execute, and used by
# execute_with_cancellation's callers).
_EXECUTE_NAMES = ("quick_execute", "execute", "execute_with_cancellation")


_call_tracker = None  # See set_call_tracker.


def _wrap_raising(function, translate):
  def wrapper(*args, **kwargs):
    tracker = _call_tracker
    token = (tracker.started(args[0] if args else kwargs.get("op_name"))
             if tracker is not None else None)
    try:
      return function(*args, **kwargs)
    except tf.errors.OpError as e:
      translated = _translate_safely(translate, e)
      if translated is e:
        raise
      raise translated from e
    finally:
      if tracker is not None:
        tracker.finished(token)
  setattr(wrapper, _TRANSLATOR_MARK, function)
  return wrapper


def _translate_safely(translate, error):
  try:
    return translate(error)
  except Exception:  # pylint: disable=broad-except
    return error  # A translator that fails leaves the error as TensorFlow made it.


def install_error_translator(translate):
  """Passes every error raised by an eager op or a `tf.function` call to `translate`.

  `translate(error)` returns the exception to raise: the same one, or another (raised
  from it). Installing again replaces the translator; `uninstall_error_translator`
  restores TensorFlow's own functions.

  Raises:
    TensorFlowInternalsError: TensorFlow no longer has the functions it wraps.
  """
  uninstall_error_translator()
  missing = [n for n in _EXECUTE_NAMES if not callable(getattr(_execute, n, None))]
  if not callable(getattr(_eager_core, "_status_to_exception", None)):
    missing.append("core._status_to_exception")
  if missing:
    raise _base.missing("TensorFlow's eager error path", f"missing {', '.join(missing)}, "
                        "so cluster faults would keep TensorFlow's error types")
  for name in _EXECUTE_NAMES:
    setattr(_execute, name, _wrap_raising(getattr(_execute, name), translate))
  original = _eager_core._status_to_exception  # pylint: disable=protected-access

  def status_to_exception(status):
    return _translate_safely(translate, original(status))

  setattr(status_to_exception, _TRANSLATOR_MARK, original)
  _eager_core._status_to_exception = status_to_exception  # pylint: disable=protected-access


def set_call_tracker(tracker):
  """Tells `tracker` when each `tf.function` call (and slow-path eager op) starts and ends.

  `tracker.started(name)` (the function's or op's name, as TensorFlow runs it) returns a
  token, `tracker.finished(token)` is called when that call
  returns or raises, in the calling thread: a watchdog learns that a call is blocked in
  TensorFlow without a timeout on every op. Works while an error translator is
  installed (`install_error_translator`: the same hook); None stops tracking.
  """
  global _call_tracker
  _call_tracker = tracker


def uninstall_error_translator():
  """Restores TensorFlow's own error path (undoes `install_error_translator`)."""
  for module, names in ((_execute, _EXECUTE_NAMES), (_eager_core, ("_status_to_exception",))):
    for name in names:
      original = getattr(getattr(module, name, None), _TRANSLATOR_MARK, None)
      if original is not None:
        setattr(module, name, original)


# --- waiting for pending eager work --------------------------------------------------

_SYNC_MARK = "_diststrat_sync_hook"
_sync_state = threading.local()  # .skip_next: the write's own wait follows one just made.


def _unhooked(module, name):
  function = getattr(module, name)
  return getattr(function, _SYNC_MARK, function)


def wait_for_pending_ops():
  """Returns once every op and function call this process sent to other tasks ran.

  TensorFlow's `context.async_wait()` (its own, never the hook): it syncs this
  process's executors and every remote task's, and raises the first error one of them
  holds (such as `UnavailableError` for a task that died), as a TensorFlow error that
  the error translator does not see. It blocks, without a limit, on a frozen task.
  """
  _unhooked(_eager_context, "async_wait")()


def install_sync_hook(sync):
  """Routes TensorFlow's waits for pending eager work through `sync(wait)`.

  `sync` gets TensorFlow's wait (`wait_for_pending_ops`) and calls it, bounded and
  translating errors as it likes. Hooked: `context.async_wait()`, which
  `tf.train.Checkpoint.write`/`save` and `CheckpointManager.save` call at their end,
  after the callbacks that register the checkpoint as the latest (its state file); and
  a wait added before those callbacks, so that a save whose wait fails raises before
  its checkpoint is registered. The write's own wait that follows is then skipped
  (the callbacks write files only). Installing again replaces the hook;
  `uninstall_sync_hook` restores TensorFlow's functions.

  Raises:
    TensorFlowInternalsError: TensorFlow no longer has the functions it wraps.
  """
  uninstall_sync_hook()
  missing = [f"{module.__name__}.{name}" for module, name in
             ((_eager_context, "async_wait"), (_checkpoint, "_execute_callbacks"))
             if not callable(getattr(module, name, None))]
  if missing:
    raise _base.missing("TensorFlow's wait for pending eager work",
                        f"missing {', '.join(missing)}, so checkpoint saves could block "
                        "on a frozen task and raise TensorFlow's error types")
  wait = _eager_context.async_wait
  execute_callbacks = _checkpoint._execute_callbacks  # pylint: disable=protected-access

  def async_wait():
    if getattr(_sync_state, "skip_next", False):
      _sync_state.skip_next = False
      return None
    return sync(wait)

  def execute_callbacks_after_waiting(callbacks, save_path):
    eager = tf.executing_eagerly()
    if eager:
      sync(wait)
    result = execute_callbacks(callbacks, save_path)
    # Checkpoint._write waits right after its callbacks, eagerly: that wait is done.
    _sync_state.skip_next = eager
    return result

  setattr(async_wait, _SYNC_MARK, wait)
  setattr(execute_callbacks_after_waiting, _SYNC_MARK, execute_callbacks)
  _eager_context.async_wait = async_wait
  _checkpoint._execute_callbacks = execute_callbacks_after_waiting  # pylint: disable=protected-access


def uninstall_sync_hook():
  """Restores TensorFlow's own waits (undoes `install_sync_hook`)."""
  _sync_state.skip_next = False
  for module, name in ((_eager_context, "async_wait"), (_checkpoint, "_execute_callbacks")):
    original = getattr(getattr(module, name, None), _SYNC_MARK, None)
    if original is not None:
      setattr(module, name, original)
