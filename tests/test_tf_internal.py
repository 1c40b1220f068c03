"""One test per reach past TensorFlow's and Keras's public API (diststrat/_tf_internal.py).

After a TensorFlow or Keras upgrade, the test named after the wrapper that broke fails
here, with a message naming it, instead of deep inside a user's training step.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _tf_internal
from conftest import CPUS


def _broke(wrapper, detail):
  return f"diststrat/_tf_internal.py: {wrapper} broke with TensorFlow {tf.__version__}: {detail}"


# --- tower thread state -------------------------------------------------------------------


def test_current_device():
  with tf.device("/cpu:1"):
    eager = _tf_internal.current_device()

  @tf.function
  def traced():
    with tf.device("/cpu:2"):
      return tf.constant(_tf_internal.current_device())

  assert eager.endswith("CPU:1"), _broke("current_device", f"eager gave {eager!r}")
  graph = traced().numpy().decode()
  assert graph.upper().endswith("CPU:2"), _broke("current_device", f"graph gave {graph!r}")
  assert _tf_internal.current_device() == "", _broke("current_device", "no scope is not ''")


def test_variable_creator_stack_round_trips_to_another_thread():
  seen = []

  def creator(next_creator, **kwargs):
    seen.append(kwargs.get("name"))
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    stack = _tf_internal.variable_creator_stack()
    assert creator in _tf_internal.variable_creators(), _broke(
        "variable_creators", "the creator in effect is not listed")

  def in_thread():
    _tf_internal.set_variable_creator_stack(stack)
    tf.Variable(1.0, name="made_in_thread")

  thread = threading.Thread(target=in_thread)
  thread.start()
  thread.join(30)
  assert seen == ["made_in_thread"], _broke(
      "variable_creator_stack/set_variable_creator_stack",
      f"a creator installed in another thread saw {seen}")


def test_current_control_dependencies():
  found = []

  @tf.function
  def traced(x):
    op = tf.print(x, output_stream="file:///dev/null")
    with tf.control_dependencies([op]):
      found.extend(_tf_internal.current_control_dependencies())
    return x

  traced(tf.constant(1.0))
  assert len(found) == 1 and "Print" in found[0].type, _broke(
      "current_control_dependencies", f"found {found}")
  assert _tf_internal.current_control_dependencies() == []


# --- collectives and fast calls -------------------------------------------------------------


def test_collective_all_reduce():
  @tf.function
  def total():
    outputs = []
    for i, device in enumerate(CPUS[:2]):
      with tf.device(device):
        outputs.append(_tf_internal.collective_all_reduce(
            tf.constant([float(i + 1), 10.0]), 2, 900_001, 900_000_001, mean=False,
            timeout=30))
    return outputs

  for output in total():
    np.testing.assert_allclose(output.numpy(), [3.0, 20.0],
                               err_msg=_broke("collective_all_reduce", "wrong sum"))


def test_in_while_loop_and_collectives_in_a_loop():
  seen = {}

  @tf.function
  def inner(i):
    seen["nested"] = _tf_internal.in_while_loop()
    outputs = []
    for k, device in enumerate(CPUS[:2]):
      with tf.device(device):
        outputs.append(_tf_internal.collective_all_reduce(
            tf.stack([tf.cast(i, tf.float32), float(k + 1)]), 2, 900_002, 900_000_002,
            mean=False, timeout=30))
    return outputs[0] + outputs[1]

  @tf.function
  def loop():
    seen["function"] = _tf_internal.in_while_loop()

    def body(i, total):
      seen["body"] = _tf_internal.in_while_loop()
      return i + 1, total + inner(i)

    return tf.while_loop(lambda i, _: i < 3, body, (0, tf.zeros([2])))[1]

  total = loop()
  assert seen == {"function": False, "body": True, "nested": True}, _broke(
      "in_while_loop", f"saw {seen}")
  # Each run: [2i, 3] on both devices, added: [4i, 6]; over i = 0, 1, 2: [12, 18].
  np.testing.assert_allclose(total.numpy(), [12.0, 18.0],
                             err_msg=_broke("collective_all_reduce", "wrong sum in a loop"))
  types = {op.type for f in inner._list_all_concrete_functions()  # pylint: disable=protected-access
           for op in f.graph.get_operations()}
  assert "CollectiveReduceV2" in types and "CollectiveReduce" not in types, _broke(
      "collective_all_reduce", f"op types in a loop: {sorted(types)}")


def test_call_flat():
  function = tf.function(lambda a, b: [a + b, a * b]).get_concrete_function(
      tf.constant(2.0), tf.constant(3.0))
  assert _tf_internal._has_fast_call(type(function)), _broke(  # pylint: disable=protected-access
      "call_flat", "ConcreteFunction._call_flat has a new signature: the slow path runs")
  outputs = _tf_internal.call_flat(function, [tf.constant(2.0), tf.constant(5.0)])
  assert [float(o) for o in outputs] == [7.0, 10.0], _broke("call_flat", f"gave {outputs}")


# --- variables around a handle ---------------------------------------------------------------


def test_resource_variable_from_handle():
  handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2], shared_name="test_from_handle",
                                  container="")
  tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant([1.0, 2.0]))
  variable = _tf_internal.ResourceVariableFromHandle(
      handle=handle, shape=tf.TensorShape([2]), dtype=tf.float32, name="test_from_handle",
      unique_id="test_from_handle_0")
  variable.assign_add([1.0, 1.0])
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(variable * variable)
  grad = tape.gradient(loss, variable)
  assert isinstance(variable, tf.Variable)
  np.testing.assert_allclose(variable.numpy(), [2.0, 3.0],
                             err_msg=_broke("ResourceVariableFromHandle", "assign/read"))
  np.testing.assert_allclose(grad.numpy(), [4.0, 6.0],
                             err_msg=_broke("ResourceVariableFromHandle", "gradient"))


def test_wrap_resource_methods():
  calls = []

  def wrap(name, method):
    def wrapper(self, *args, **kwargs):
      calls.append(name)
      return method(self, *args, **kwargs)
    return wrapper

  class Recording(_tf_internal.ResourceVariableFromHandle):
    pass

  _tf_internal.wrap_resource_methods(Recording, wrap)
  handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="test_wrap",
                                  container="")
  variable = Recording(handle=handle, shape=tf.TensorShape([]), dtype=tf.float32,
                       name="test_wrap", unique_id="test_wrap_0")
  variable.assign(2.0)
  variable.assign_add(1.0)
  value = variable.read_value()
  assert float(value) == 3.0
  assert {"assign", "assign_add", "read_value"} <= set(calls), _broke(
      "wrap_resource_methods", f"wrapped methods not called: {calls}")


def test_wrap_resource_methods_fails_on_a_missing_method(monkeypatch):
  monkeypatch.setattr(_tf_internal, "RESOURCE_METHODS",
                      _tf_internal.RESOURCE_METHODS + ("no_such_method",))

  class Target(_tf_internal.ResourceVariableFromHandle):
    pass

  with pytest.raises(_tf_internal.TensorFlowInternalsError,
                     match=r"BaseResourceVariable's methods .*missing no_such_method"):
    _tf_internal.wrap_resource_methods(Target, lambda name, method: method)


def test_copy_to_device():
  with tf.device("/cpu:1"):
    handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="test_copy",
                                    container="")
    tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(4.0))
  copy = _tf_internal.copy_to_device(handle, CPUS[0])
  assert copy.dtype == tf.resource, _broke("copy_to_device", f"dtype {copy.dtype}")
  value = tf.raw_ops.ReadVariableOp(resource=copy, dtype=tf.float32)
  assert float(value) == 4.0, _broke("copy_to_device", "the copied handle reads another value")


def test_copy_to_device_reports_a_lost_connection_as_unavailable():
  class LostTensor:
    def _copy_to_device(self, device):
      raise RuntimeError("Failed copying input tensor: Socket closed")

  with pytest.raises(tf.errors.UnavailableError, match="Socket closed"):
    _tf_internal.copy_to_device(LostTensor(), CPUS[0])


# --- TensorFlow's error text ---------------------------------------------------------------
# The cluster tests (tests/test_cluster.py) feed these real errors from killed and restarted
# tasks; here, the formats those errors had in TensorFlow 2.21.


def test_error_summary():
  error = tf.errors.UnavailableError(
      None, None, "Graph execution error:\n\nDetected at node x\n(0) UNAVAILABLE: Socket "
      "closed\nAdditional GRPC error information from remote target /job:ps/replica:0/task:0")
  assert _tf_internal.error_summary(error) == "UNAVAILABLE: Socket closed", _broke(
      "error_summary", repr(_tf_internal.error_summary(error)))
  assert len(_tf_internal.error_summary(RuntimeError("x" * 500))) == 200


def test_tasks_named_in_error():
  tasks = ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"]
  error = tf.errors.UnavailableError(
      None, None, "Failed to connect to /job:ps/replica:0/task:1 (Connection refused)")
  assert _tf_internal.tasks_named_in_error(error, tasks) == tasks[1:], _broke(
      "tasks_named_in_error", "the task in the message was not found")


@pytest.mark.parametrize("error_type, text, restarted", [
    (tf.errors.AbortedError, "Unable to find a context_id matching the specified one", True),
    (tf.errors.InvalidArgumentError, "Unable to find the relevant tensor remote_handle", True),
    (tf.errors.NotFoundError, "The remote task was probably restarted", True),
    (tf.errors.InvalidArgumentError, "Incompatible shapes: [2] vs. [3]", False),
    (tf.errors.UnavailableError, "context_id", False),
])
def test_error_means_task_restarted(error_type, text, restarted):
  assert _tf_internal.error_means_task_restarted(error_type(None, None, text)) is restarted, \
      _broke("error_means_task_restarted", text)


# --- Keras -------------------------------------------------------------------------------


def test_keras_backing_variable():
  variable = keras.Variable(np.ones([2], np.float32))
  inner = _tf_internal.keras_backing_variable(variable)
  assert isinstance(inner, tf.Variable), _broke(
      "keras_backing_variable", f"Keras {keras.__version__} variables hold no tf.Variable "
      "in _value")
  inner.assign([3.0, 4.0])
  np.testing.assert_allclose(np.asarray(variable.numpy()), [3.0, 4.0])
  assert _tf_internal.keras_backing_variable(inner) is None
  assert _tf_internal.keras_backing_variable(tf.constant(1.0)) is None


def test_keras_optimizer_strategy():
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    inside = keras.optimizers.SGD(0.1)
  outside = keras.optimizers.SGD(0.1)
  captured = _tf_internal.keras_optimizer_strategy(inside)
  assert getattr(captured, "diststrat_strategy", None) is strategy, _broke(
      "keras_optimizer_strategy", f"Keras {keras.__version__} optimizers captured {captured!r}")
  assert _tf_internal.keras_optimizer_strategy(outside) is tf.distribute.get_strategy()


# --- protocols TensorFlow calls on diststrat's objects ---------------------------------------


def _mirrored_variable(value=1.0):
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    return strategy, tf.Variable(value)


def test_protocol_distributed_variables_act_as_resource_variables():
  strategy, v = _mirrored_variable(3.0)
  with tf.GradientTape() as tape:
    loss = v * v
  assert float(tape.gradient(loss, v)) == 6.0, _broke(
      "protocol _should_act_as_resource_variable", "the tape did not watch the variable")
  assert float(tf.convert_to_tensor(v)) == 3.0, _broke(
      "protocol _dense_var_to_tensor", "conversion failed")
  module = tf.Module()
  module.v = v
  assert list(module.variables) == [v], _broke(
      "protocols _shared_name/_unique_id", "tf.Module does not see the variable")
  del strategy


def test_protocol_checkpoints_save_one_value(tmp_path):
  strategy, v = _mirrored_variable(5.0)
  checkpoint = tf.train.Checkpoint(v=v)
  path = checkpoint.write(f"{tmp_path}/ckpt")
  keys = [name for name, _ in tf.train.list_variables(path)]
  assert "v/.ATTRIBUTES/VARIABLE_VALUE" in keys, _broke(
      "protocol _serialize_to_tensors", f"saved keys {keys}")
  plain = tf.Variable(0.0)
  tf.train.Checkpoint(v=plain).read(path).assert_consumed()
  assert float(plain) == 5.0, _broke("protocol _restore_from_tensors", "wrong value")
  options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
  async_path = checkpoint.write(f"{tmp_path}/async", options=options)
  checkpoint.sync()
  tf.train.Checkpoint(v=plain).read(async_path)
  assert float(plain) == 5.0, _broke("protocol _copy_trackable_to_cpu", "async save")
  del strategy


def test_protocol_slot_restore_calls_create_or_restore_slot_variable(tmp_path):
  v = tf.Variable([1.0, 2.0])
  optimizer = ds.optimizers.Momentum(0.1, momentum=0.9)
  optimizer.apply_gradients([(tf.constant([1.0, 1.0]), v)])
  path = tf.train.Checkpoint(v=v, optimizer=optimizer).write(f"{tmp_path}/slots")

  fresh_v = tf.Variable([0.0, 0.0])
  fresh = ds.optimizers.Momentum(0.1, momentum=0.9)
  calls = []
  original = type(fresh)._create_or_restore_slot_variable

  def recording(self, *args, **kwargs):
    calls.append(args[1] if len(args) > 1 else kwargs.get("slot_name"))
    return original(self, *args, **kwargs)

  type(fresh)._create_or_restore_slot_variable = recording
  try:
    tf.train.Checkpoint(v=fresh_v, optimizer=fresh).read(path)
  finally:
    type(fresh)._create_or_restore_slot_variable = original
  assert calls == ["momentum"], _broke("protocol _create_or_restore_slot_variable",
                                       f"calls {calls}")
  np.testing.assert_allclose(fresh.get_slot(fresh_v, "momentum").numpy(), [1.0, 1.0])


# --- AutoGraph ---------------------------------------------------------------------------


class _Custom(Exception):

  def __init__(self, code, detail):  # Not a one-string constructor: AutoGraph can't rebuild it.
    super().__init__(f"{code}: {detail}")


def _raise_in_converted_code(error):
  def inner():
    raise error

  @tf.function
  def traced():
    inner()  # AutoGraph converts this call.
    return 0

  with pytest.raises(BaseException) as info:
    traced()
  return info.value


def test_pass_through_autograph():
  plain = _raise_in_converted_code(_Custom(1, "no"))
  assert type(plain).__name__ == "StagingError", _broke(
      "pass_through_autograph", "AutoGraph no longer rebuilds errors: the wrapper may go")
  error = _Custom(2, "yes")
  error.add_note("a note")
  _tf_internal.pass_through_autograph(error)
  raised = _raise_in_converted_code(error)
  assert raised is error and raised.__notes__ == ["a note"], _broke(
      "pass_through_autograph", f"AutoGraph raised {type(raised).__name__}: {raised}")


def test_pass_through_autograph_class():
  @_tf_internal.pass_through_autograph_class
  class Marked(RuntimeError):
    pass

  raised = _raise_in_converted_code(Marked("kept"))
  assert type(raised) is Marked and str(raised) == "kept", _broke(
      "pass_through_autograph_class", f"AutoGraph raised {type(raised).__name__}")


def test_install_error_translator():
  seen = []

  def translate(error):
    seen.append(type(error).__name__)
    return KeyError("translated")

  @tf.function
  def traced(x):
    tf.debugging.assert_equal(x, 0.0, message="must be zero")
    return x

  paths = {
      "fast-path eager op": lambda: tf.reshape(tf.zeros([6]), [4]),
      "fallback eager op": lambda: tf.raw_ops.Reshape(tensor=tf.zeros([6]), shape=[4]),
      "tf.function call": lambda: traced(tf.constant(1.0)),
  }
  _tf_internal.install_error_translator(translate)
  try:
    for path, call in paths.items():
      with pytest.raises(KeyError, match="translated"):
        call()
      assert len(seen) == list(paths).index(path) + 1, _broke(
          "install_error_translator", f"the {path}'s error was not translated")
  finally:
    _tf_internal.uninstall_error_translator()
  with pytest.raises(tf.errors.InvalidArgumentError):
    tf.reshape(tf.zeros([6]), [4])
  with pytest.raises(tf.errors.InvalidArgumentError):
    traced(tf.constant(1.0))


@pytest.mark.parametrize("error_type, text, lost", [
    (tf.errors.InternalError, "This should never happen. Additional GRPC error information "
     "from remote target /job:ps/replica:0/task:1 while calling /tensorflow.WorkerService/"
     "RecvTensor: {grpc_status:14, grpc_message:\"failed to connect to all addresses\"}", True),
    (tf.errors.UnavailableError, "Socket closed", True),
    (tf.errors.InternalError, "Blas GEMM launch failed", False),
])
def test_error_means_connection_lost(error_type, text, lost):
  assert _tf_internal.error_means_connection_lost(error_type(None, None, text)) is lost, \
      _broke("error_means_connection_lost", text)


# --- tapes ---------------------------------------------------------------------------------


def test_record_backward_and_should_record():
  x = tf.constant(3.0)
  with tf.GradientTape() as tape:
    tape.watch(x)
    assert _tf_internal.should_record([x]), _broke("should_record", "a watched tensor")
    with _tf_internal.stop_recording():
      y = x * x  # Not recorded: the custom entry below stands for it.
    _tf_internal.record_backward("Square", [y], [x], lambda dy: [dy * 10.0])
  assert float(tape.gradient(y, x)) == 10.0, _broke("record_backward", "wrong gradient")
  assert not _tf_internal.should_record([tf.constant(1.0)])


def test_stop_recording():
  x = tf.constant(2.0)
  with tf.GradientTape() as tape:
    tape.watch(x)
    with _tf_internal.stop_recording():
      y = x * x
  assert tape.gradient(y, x) is None, _broke("stop_recording", "the tape still recorded")


def test_variable_accessed():
  v = tf.Variable([1.0, 2.0])
  with tf.GradientTape() as tape:
    _tf_internal.variable_accessed(v)  # No op runs; the tape watches v all the same.
  assert [u is v for u in tape.watched_variables()] == [True], _broke(
      "variable_accessed", "the tape does not watch the variable")


def test_record_variable_read():
  v = tf.Variable([1.0, 2.0])
  value = tf.constant([1.0, 2.0])  # Stands for a value of v read earlier.
  with tf.GradientTape() as tape:
    tape.watch(v)
    use = tf.identity(value)
    _tf_internal.record_variable_read(v, use)
    loss = tf.reduce_sum(use * use)
  grad = tape.gradient(loss, v)
  assert grad is not None and np.allclose(grad, [2.0, 4.0]), _broke(
      "record_variable_read", f"eager gradient {grad}")

  @tf.function
  def jvp():  # Forward accumulators in a graph watch the handle's capture.
    earlier = tf.identity(v.read_value())
    with tf.autodiff.ForwardAccumulator(v, tf.ones([2])) as acc:
      use = tf.identity(earlier)
      _tf_internal.record_variable_read(v, use)
      y = tf.reduce_sum(use * use)
    return acc.jvp(y)

  tangent = jvp()
  assert tangent is not None and np.allclose(tangent, 6.0), _broke(
      "record_variable_read", f"forward-mode tangent in a graph {tangent}")


# --- TensorFlow's distribution-mode stack, Keras variable origins --------------------------


class _Stand:
  """Stands for a strategy (and its replica context) in TensorFlow's mode stack."""

  class extended:  # pylint: disable=invalid-name
    _retrace_functions_for_each_device = False


def test_tf_distribution_mode():
  strategy, replica = _Stand(), _Stand()
  with _tf_internal.tf_distribution_mode(strategy):
    cross = (tf.distribute.get_strategy() is strategy, tf.distribute.has_strategy(),
             tf.distribute.in_cross_replica_context())
    with _tf_internal.tf_distribution_mode(strategy, replica):
      inner = tf.distribute.get_replica_context() is replica
    traced = []
    tf.function(lambda: traced.append(tf.distribute.get_strategy() is strategy))()
  assert cross == (True, True, True), _broke("tf_distribution_mode",
                                             f"cross-replica entry not reported: {cross}")
  assert inner, _broke("tf_distribution_mode", "the replica context is not reported")
  assert traced == [True], _broke("tf_distribution_mode", "a traced function lost the entry")
  assert not tf.distribute.has_strategy(), _broke("tf_distribution_mode", "entry left behind")


def test_keras_variable_origin():
  origins = []

  def creator(next_creator, **kwargs):
    origins.append(_tf_internal.keras_variable_origin())
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    keras.Variable(np.ones([2], np.float32))
    keras.random.SeedGenerator(1)
    tf.Variable(1.0)
  assert origins == ["keras", "seed", None], _broke(
      "keras_variable_origin", f"Keras {keras.__version__}: origins {origins}")


def test_protocol_saved_model_exports_one_plain_variable(tmp_path):
  strategy, v = _mirrored_variable(4.0)
  module = tf.Module()
  module.v = v
  module.read = tf.function(lambda: v * 1.0, input_signature=[])
  with strategy.scope():
    strategy.call_for_each_tower(lambda: module.read())  # Traced in towers: both copies.
  tf.saved_model.save(module, str(tmp_path / "saved"))
  loaded = tf.saved_model.load(str(tmp_path / "saved"))
  assert float(loaded.read()) == 4.0 and type(loaded.v).__name__ != "MirroredVariable", _broke(
      "protocols _export_to_saved_model_graph/_write_object_proto", f"loaded {loaded.v!r}")


def test_protocol_distributed_container_keys_keras_slots():
  strategy, v = _mirrored_variable(1.0)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build([v])
    keys = strategy.update(v, lambda component: optimizer._var_key(component))  # pylint: disable=protected-access
  # One key for every copy (regroup keeps one equal object), the variable's own.
  assert keys == optimizer._var_key(v), _broke(  # pylint: disable=protected-access
      "protocol _distributed_container", f"a Keras optimizer keys the copies apart: {keys}")


def test_protocol_tf_distribute_bridge_extended():
  strategy = ds.MirroredStrategy(CPUS[:2])
  traces = []
  traced = tf.function(lambda x: traces.append(1) or x + 1.0)

  def tower_fn():
    merged = tf.__internal__.distribute.interim.maybe_merge_call(
        lambda s: ds.get_cross_tower_context() is strategy, tf.distribute.get_strategy())
    traced(tf.constant(1.0))
    return merged

  with strategy.scope():
    merged = strategy.call_for_each_tower(tower_fn)
  assert merged is True, _broke("protocol _use_merge_call", "maybe_merge_call did not merge")
  assert len(traces) == 2, _broke("protocol _retrace_functions_for_each_device",
                                  f"{len(traces)} traces for 2 tower devices")


def test_tf_distribution_mode_fails_loudly_without_the_stack(monkeypatch):
  class _Graphless:  # A TensorFlow whose graphs lost the per-thread distribution stack.
    @staticmethod
    def get_default_graph():
      return object()

  monkeypatch.setattr(_tf_internal, "_ops", _Graphless)
  with pytest.raises(_tf_internal.TensorFlowInternalsError,
                     match=r"Graph._distribution_strategy_stack.*Keras would train on one "
                           r"device under diststrat"):
    with _tf_internal.tf_distribution_mode(_Stand()):
      pass
