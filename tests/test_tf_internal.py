"""One test per reach past TensorFlow's and Keras's public API (diststrat/_tf_internal/).

After a TensorFlow or Keras upgrade, the test named after the wrapper that broke fails
here, with a message naming it, instead of deep inside a user's training step.
"""

import gc
import os
import sys
import threading
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _tf_internal
from diststrat._tf_internal import _distribute_stack
from diststrat._tf_internal import _functions
from diststrat._tf_internal import _variables
from conftest import CPUS
from fault_control import bounded


def _broke(wrapper, detail):
  return f"diststrat/_tf_internal: {wrapper} broke with TensorFlow {tf.__version__}: {detail}"


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


def _members(op, *args, ordering=False):
  """`op` built once per device of CPUS[:2] in one tf.function; its outputs."""
  tokens = []
  if ordering:
    for device in CPUS[:2]:
      with tf.device(device):
        tokens.append(tf.Variable(0.0))

  @tf.function
  def run():
    outputs = []
    for k, device in enumerate(CPUS[:2]):
      with tf.device(device):
        extra = {"ordering_token": [tokens[k].handle]} if ordering else {}
        outputs.append(op(tf.constant([float(k + 1), 10.0]), 2, *args, timeout=30, **extra))
    return outputs

  return [o.numpy() for o in run()]


def test_all_reduce_v1():
  for output in _members(_tf_internal.all_reduce_v1, 900_001, 900_000_001, "Add", "Id"):
    np.testing.assert_allclose(output, [3.0, 20.0], err_msg=_broke("all_reduce_v1", "sum"))


def test_all_reduce_v2():
  for output in _members(_tf_internal.all_reduce_v2, 900_002, 900_000_002, "Add", "Div",
                         ordering=True):
    np.testing.assert_allclose(output, [1.5, 10.0], err_msg=_broke("all_reduce_v2", "mean"))


def test_all_gather_v1():
  for output in _members(_tf_internal.all_gather_v1, 900_003, 900_000_003):
    np.testing.assert_allclose(output, [1.0, 10.0, 2.0, 10.0],
                               err_msg=_broke("all_gather_v1", "gather"))


def test_all_gather_v2():
  for output in _members(_tf_internal.all_gather_v2, 900_004, 900_000_004, ordering=True):
    np.testing.assert_allclose(output, [1.0, 10.0, 2.0, 10.0],
                               err_msg=_broke("all_gather_v2", "gather"))


def test_in_while_loop():
  seen = {}

  @tf.function
  def inner(i):
    seen["nested"] = _tf_internal.in_while_loop()
    return i

  @tf.function
  def loop():
    seen["function"] = _tf_internal.in_while_loop()

    def body(i):
      seen["body"] = _tf_internal.in_while_loop()
      return (inner(i) + 1,)

    return tf.while_loop(lambda i: i < 3, body, (0,))

  loop()
  assert seen == {"function": False, "body": True, "nested": True}, _broke(
      "in_while_loop", f"saw {seen}")
  assert _tf_internal.in_while_loop() is False


def _in_a_thread(fn):
  """fn() run in a new thread (`fault_control.bounded`, at most 60 s): its result, or its
  error raised here."""
  kind, value, _ = bounded(fn, 60)
  if kind == "raised":
    raise value
  assert kind == "returned", "the thread did not finish within 60 s"
  return value


def test_op_callbacks_and_set_op_callbacks_share_them_with_another_thread():
  def enable_and_share():
    tf.debugging.enable_check_numerics()
    try:
      return _tf_internal.op_callbacks(), list(_tf_internal.op_callbacks())
    finally:
      tf.debugging.disable_check_numerics()

  shared, enabled = _in_a_thread(enable_and_share)
  assert enabled, _broke("op_callbacks", "enable_check_numerics() added no callback")

  def checked_in_another_thread():
    _tf_internal.set_op_callbacks(enabled)
    try:
      tf.math.log(tf.constant(-1.0))
    finally:
      _tf_internal.set_op_callbacks([])

  with pytest.raises(tf.errors.InvalidArgumentError, match="NaN"):
    _in_a_thread(checked_in_another_thread)
  assert shared == [] and _in_a_thread(_tf_internal.op_callbacks) == [], _broke(
      "op_callbacks", "a thread's callbacks are not its own list")


def test_release_thread_state_frees_what_tensorflow_keeps_of_a_thread():
  double = tf.function(lambda x: 2 * x)

  def step(release):
    with tf.device("/cpu:1"):
      double(tf.constant(1.0))
    if release:
      _tf_internal.release_thread_state()

  def kept():
    # TensorFlow keeps, for every thread that called a function, one FunctionCallOptions
    # object (in a per-thread record it never frees). Counting only those, not every
    # object, keeps the measure blind to the rest of the process: counting all objects
    # once read -27 in the full suite, where a collection here can also free an earlier
    # test's garbage that the first collection's finalizers left behind.
    gc.collect()
    return sum(type(o).__name__ == "FunctionCallOptions" for o in gc.get_objects())

  def growth(release, threads=300):
    for _ in range(5):
      _in_a_thread(lambda: step(release))
    before = kept()
    for _ in range(threads):
      _in_a_thread(lambda: step(release))
    return kept() - before

  # Without it, each thread leaves one behind (the measure can see the leak; a few may
  # be an earlier test's threads letting theirs go meanwhile); with it, next to none.
  assert growth(release=False) >= 270, (
      f"TensorFlow {tf.__version__} no longer keeps objects of finished threads: "
      "release_thread_state may be unneeded, and this test needs another measure")
  assert growth(release=True) < 30, _broke(
      "release_thread_state", "finished threads still leave objects behind")


def test_call_flat():
  function = tf.function(lambda a, b: [a + b, a * b]).get_concrete_function(
      tf.constant(2.0), tf.constant(3.0))
  assert _functions._has_fast_call(type(function)), _broke(  # pylint: disable=protected-access
      "call_flat", "ConcreteFunction._call_flat has a new signature: the slow path runs")
  outputs = _tf_internal.call_flat(function, [tf.constant(2.0), tf.constant(5.0)])
  assert [float(o) for o in outputs] == [7.0, 10.0], _broke("call_flat", f"gave {outputs}")


def test_tf_function_jit_compile():
  assert _tf_internal.tf_function_jit_compile(tf.function(lambda x: x, jit_compile=True)), \
      _broke("tf_function_jit_compile", "a jit_compile=True function reads as not compiled")
  for function in (tf.function(lambda x: x), tf.function(lambda x: x, jit_compile=False)):
    assert not _tf_internal.tf_function_jit_compile(function), _broke(
        "tf_function_jit_compile", "a function without jit_compile reads as compiled")


def test_building_xla_function():
  seen = []

  def probe(x):
    seen.append(_tf_internal.building_xla_function())
    return x

  tf.function(probe, jit_compile=True)(tf.constant(1.0))
  tf.function(lambda x: tf.function(probe)(x), jit_compile=True)(tf.constant(2.0))  # Nested.
  assert seen == [True, True], _broke("building_xla_function", f"XLA traces read as {seen}")
  seen.clear()
  tf.function(probe)(tf.constant(1.0))
  tf.function(probe, jit_compile=False)(tf.constant(1.0))
  probe(tf.constant(1.0))
  assert seen == [False, False, False], _broke("building_xla_function",
                                               f"other traces or eager read as {seen}")


def test_clone_tf_function():
  spec = [tf.TensorSpec([None], tf.float32)]
  function = tf.function(lambda x: x, input_signature=spec, reduce_retracing=True,
                         jit_compile=False)
  assert hasattr(function, "_clone"), _broke("clone_tf_function", "Function._clone is gone")
  clone = _tf_internal.clone_tf_function(function, lambda x: x * 2.0)
  assert isinstance(clone, tf.types.experimental.PolymorphicFunction)
  assert clone.input_signature == function.input_signature, _broke(
      "clone_tf_function", f"input signature {clone.input_signature}")
  np.testing.assert_allclose(clone(tf.constant([1.0, 2.0])), [2.0, 4.0])
  with pytest.raises((TypeError, ValueError)):  # The input signature holds.
    clone(tf.constant([[1.0]]))
  compiled = _tf_internal.clone_tf_function(tf.function(lambda x: x, jit_compile=True),
                                            lambda x: x + 1.0)
  assert _tf_internal.tf_function_jit_compile(compiled), _broke(
      "clone_tf_function", "the clone lost jit_compile")


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
  monkeypatch.setattr(_variables, "RESOURCE_METHODS",
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


def test_keras_seed_generators():
  dropout = keras.layers.Dropout(0.5, seed=3)
  generators = _tf_internal.keras_seed_generators(dropout)
  assert len(generators) == 1 and isinstance(generators[0], keras.random.SeedGenerator), _broke(
      "keras_seed_generators", f"Keras {keras.__version__} layers track no _seed_generators")
  assert generators[0].state is dropout.non_trainable_variables[0]
  assert _tf_internal.keras_seed_generators(keras.layers.Dense(2)) == []
  nested = keras.Sequential([keras.layers.Dense(2), dropout, keras.layers.LSTM(2)])
  found = _tf_internal.keras_seed_generators(nested)
  assert found[0] is generators[0] and len(found) == 2, _broke(
      "keras_seed_generators", f"Keras {keras.__version__} layers have no _flatten_layers")
  assert _tf_internal.keras_seed_generators(tf.Module()) == []


def test_keras_thread_globals_and_keras_global_seed_generator_and_set_keras_global_seed_generator():
  import threading  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(5)
  mine = _tf_internal.keras_thread_globals()
  assert isinstance(mine, dict), _broke(
      "keras_thread_globals", f"Keras {keras.__version__} keeps no GLOBAL_STATE_TRACKER")
  assert _tf_internal.keras_global_seed_generator(mine) is None  # Dropped by the seed.
  keras.random.normal(())
  generator = _tf_internal.keras_global_seed_generator(mine)
  assert isinstance(generator, keras.random.SeedGenerator), _broke(
      "keras_global_seed_generator", f"Keras {keras.__version__} renamed its global seed "
      "generator")
  seen = {}

  def other_thread():  # Another thread's state is its own, and can take this one's.
    own = _tf_internal.keras_thread_globals()
    seen["own"] = own is not mine and _tf_internal.keras_global_seed_generator(own)
    _tf_internal.set_keras_global_seed_generator(own, generator)
    seen["draw"] = keras.random.normal(())

  thread = threading.Thread(target=other_thread)
  thread.start()
  thread.join(timeout=60)
  assert seen["own"] is None
  after = generator.state.numpy()
  _tf_internal.set_keras_global_seed_generator(mine, None)
  keras.utils.set_random_seed(5)
  keras.random.normal(())
  replay = _tf_internal.keras_global_seed_generator(mine)
  assert replay is not generator
  np.testing.assert_array_equal(keras.random.normal(()), seen["draw"])  # Same stream.
  np.testing.assert_array_equal(replay.state.numpy(), after)


def test_keras_name_counters_and_set_keras_name_counters():
  import collections  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  mine = _tf_internal.keras_thread_globals()
  saved = _tf_internal.keras_name_counters(mine)
  try:
    counters = collections.defaultdict(int)
    _tf_internal.set_keras_name_counters(mine, counters)
    assert keras.layers.Dense(1).name == "dense", _broke(
        "set_keras_name_counters", f"Keras {keras.__version__} keeps its name counters "
        "elsewhere")
    assert keras.layers.Dense(1).name == "dense_1" and counters["dense"] == 2
    assert _tf_internal.keras_name_counters(mine) is counters
    names = []

    def other_thread():  # Counting in this thread's counters from another thread.
      own = _tf_internal.keras_thread_globals()
      _tf_internal.set_keras_name_counters(own, counters)
      names.append(keras.layers.Dense(1).name)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=60)
    assert names == ["dense_2"] and keras.layers.Dense(1).name == "dense_3"
  finally:
    _tf_internal.set_keras_name_counters(mine, saved)


def test_keras_dtype_policy_and_set_keras_dtype_policy():
  import threading  # pylint: disable=g-import-not-at-top
  mine = _tf_internal.keras_thread_globals()
  before = _tf_internal.keras_dtype_policy(mine)
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    policy = _tf_internal.keras_dtype_policy(mine)
    assert getattr(policy, "name", None) == "mixed_bfloat16", _broke(
        "keras_dtype_policy", f"Keras {keras.__version__} keeps its dtype policy elsewhere")
    seen = []

    def other_thread():  # Its own policy is the default, until given this thread's.
      own = _tf_internal.keras_thread_globals()
      seen.append(keras.layers.Dense(1).dtype_policy.name)
      _tf_internal.set_keras_dtype_policy(own, policy)
      seen.append(keras.layers.Dense(1).dtype_policy.name)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=60)
    assert seen == ["float32", "mixed_bfloat16"], _broke("set_keras_dtype_policy", seen)
  finally:
    _tf_internal.set_keras_dtype_policy(mine, before)


def test_keras_optimizer_step_count():
  variable = keras.Variable(np.ones([2], np.float32))
  plain = keras.optimizers.SGD(0.1)
  plain.build([variable])
  count = _tf_internal.keras_optimizer_step_count(plain)
  assert count is plain.iterations, _broke(
      "keras_optimizer_step_count", f"Keras {keras.__version__} optimizers keep no "
      "_iterations variable")
  accumulating = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
  accumulating.build([variable])
  count = _tf_internal.keras_optimizer_step_count(accumulating)
  assert _tf_internal.keras_backing_variable(count) is not None  # Not the tensor.
  accumulating.apply_gradients([(tf.ones([2]), variable)])
  assert int(count.numpy()) == 1 and int(accumulating.iterations.numpy()) == 0


def test_keras_in_stateless_scope():
  from keras.src.backend.common import stateless_scope  # pylint: disable=g-import-not-at-top
  assert not _tf_internal.keras_in_stateless_scope()
  with stateless_scope.StatelessScope():
    assert _tf_internal.keras_in_stateless_scope(), _broke(
        "keras_in_stateless_scope", f"Keras {keras.__version__} moved its stateless scope")


def test_keras_optimizer_strategy():
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    inside = keras.optimizers.SGD(0.1)
  outside = keras.optimizers.SGD(0.1)
  captured = _tf_internal.keras_optimizer_strategy(inside)
  assert getattr(captured, "diststrat_strategy", None) is strategy, _broke(
      "keras_optimizer_strategy", f"Keras {keras.__version__} optimizers captured {captured!r}")
  assert _tf_internal.keras_optimizer_strategy(outside) is tf.distribute.get_strategy()


def test_keras_model_strategy():
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    inside = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  outside = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  captured = _tf_internal.keras_model_strategy(inside)
  assert getattr(captured, "diststrat_strategy", None) is strategy, _broke(
      "keras_model_strategy", f"Keras {keras.__version__} models captured {captured!r}")
  assert _tf_internal.keras_model_strategy(outside) is None


def test_keras_model_on_stack():
  seen = []

  class Probe(keras.layers.Layer):
    def call(self, x):  # Inside the model's __call__ and call: the model is on the stack.
      seen.append(_tf_internal.keras_model_on_stack(max_frames=60, skip=0))
      return x

  inputs = keras.Input((3,))
  model = keras.Model(inputs, Probe()(keras.layers.Dense(1)(inputs)), name="on_stack")
  seen.clear()  # Building the graph above ran Probe outside any model.
  model(np.zeros((1, 3), np.float32))
  assert seen and seen[-1] is model, _broke(
      "keras_model_on_stack", f"Keras {keras.__version__}: no model among the frames of a "
      f"layer's call ({seen!r})")
  assert _tf_internal.keras_model_on_stack(max_frames=60) is None  # No model here.


def test_wrap_keras_symbolic_build_and_keras_epoch_iterator_dataset():
  calls = []

  def wrapper(own, iterator=None, data_batch=None):
    dataset = _tf_internal.keras_epoch_iterator_dataset(iterator)
    calls.append(getattr(dataset, "element_spec", None))
    return own(iterator=iterator, data_batch=data_batch)

  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  assert _tf_internal.wrap_keras_symbolic_build(model, wrapper)
  assert _tf_internal.keras_epoch_iterator_dataset(object()) is None
  model.fit(np.zeros((4, 3), np.float32), np.zeros((4, 1), np.float32), verbose=0)
  model.evaluate(np.zeros((4, 3), np.float32), np.zeros((4, 1), np.float32), verbose=0)
  expected = (tf.TensorSpec((None, 3), tf.float32), tf.TensorSpec((None, 1), tf.float32))
  assert calls == [expected, expected], _broke(
      "wrap_keras_symbolic_build or keras_epoch_iterator_dataset",
      f"Keras {keras.__version__}: fit and evaluate called the wrapper with {calls!r}")


def test_keras_optimizer_being_created():
  found = []

  def creator(next_creator, **kwargs):
    found.append(_tf_internal.keras_optimizer_being_created())
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    optimizer = keras.optimizers.SGD(0.1)
    keras.Variable(1.0)
  assert found and found[0] is optimizer, _broke(
      "keras_optimizer_being_created", f"Keras {keras.__version__}: the optimizer's "
      f"constructor made no variable, or is not BaseOptimizer.__init__ ({found!r})")
  assert found[-1] is None  # A variable made by anything else.


def test_keras_output_loss_trackers():
  inputs = keras.Input((3,))
  model = keras.Model(inputs, {"a": keras.layers.Dense(1)(inputs),
                               "b": keras.layers.Dense(2)(inputs)})
  assert _tf_internal.keras_output_loss_trackers(model) == []  # Not compiled.
  model.compile(optimizer="sgd", loss={"a": "mse", "b": "mae"})
  model.fit(np.zeros((4, 3), np.float32),
            {"a": np.zeros((4, 1), np.float32), "b": np.zeros((4, 2), np.float32)},
            verbose=0)
  trackers = _tf_internal.keras_output_loss_trackers(model)
  names = sorted(t.name for t in trackers)
  assert names == ["a_loss", "b_loss"], _broke(
      "keras_output_loss_trackers", f"Keras {keras.__version__} per-output trackers: {names}")
  assert all(isinstance(t, keras.metrics.Mean) for t in trackers)


def test_keras_compile_loss():
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
  assert _tf_internal.keras_compile_loss(model) is None  # Not compiled.
  model.compile(optimizer="sgd", loss="mse")
  compile_loss = _tf_internal.keras_compile_loss(model)
  y_true = np.zeros((2, 1), np.float32)
  y_pred = np.ones((2, 1), np.float32)
  called = []

  def call(*args, **kwargs):
    called.append(args)
    return type(compile_loss).call(compile_loss, *args, **kwargs)

  object.__setattr__(compile_loss, "call", call)  # What diststrat's routing sets.
  loss = model.compute_loss(y=y_true, y_pred=y_pred)
  assert called and float(loss) == 1.0, _broke(
      "keras_compile_loss", f"Keras {keras.__version__}: compute_loss did not call the "
      f"model's _compile_loss through its instance's call ({called!r}, {loss!r})")


def test_keras_fit_callbacks():
  assert _tf_internal.keras_fit_callbacks() is None  # Outside fit.
  # The bridge asks while fit distributes its dataset: check from there.
  found = []

  class _Strategyless(keras.callbacks.Callback):
    pass

  def distribute_hook(dataset):
    found.append(_tf_internal.keras_fit_callbacks())
    return dataset

  strategy = ds.MirroredStrategy(CPUS[:1])
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  adapter = model.distribute_strategy
  original = adapter.experimental_distribute_dataset
  adapter.experimental_distribute_dataset = lambda dataset, options=None: original(
      distribute_hook(dataset), options)
  try:
    fit_callbacks = [_Strategyless()]
    model.fit(np.zeros((4, 3), np.float32), np.zeros((4, 1), np.float32), verbose=0,
              callbacks=fit_callbacks)
  finally:
    del adapter.experimental_distribute_dataset
  assert found and found[0] is fit_callbacks, _broke(
      "keras_fit_callbacks", f"Keras {keras.__version__} fit's callbacks not found: {found}")


def test_set_keras_backup_dir(tmp_path):
  callback = keras.callbacks.BackupAndRestore(str(tmp_path / "user"))
  before = {k: v for k, v in vars(callback).items() if isinstance(v, str)}
  state = _tf_internal.set_keras_backup_dir(callback, str(tmp_path / "scratch"))
  moved = {k: v for k, v in vars(callback).items() if isinstance(v, str)}
  assert any(k != "backup_dir" for k in state)
  for key, value in moved.items():
    if str(tmp_path / "user") in before[key]:
      assert value.startswith(str(tmp_path / "scratch")), _broke(
          "set_keras_backup_dir", f"Keras {keras.__version__} keeps {key}={value}")
  # The callback writes where it was pointed.
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  callback.delete_checkpoint = False
  model.fit(np.zeros((4, 3), np.float32), np.zeros((4, 1), np.float32), verbose=0,
            callbacks=[callback])
  assert os.listdir(tmp_path / "scratch") and not os.path.exists(tmp_path / "user")
  _tf_internal.restore_keras_backup_dir(callback, state)
  assert {k: v for k, v in vars(callback).items() if isinstance(v, str)} == before


def test_restore_keras_backup_dir(tmp_path):
  callback = keras.callbacks.BackupAndRestore(str(tmp_path / "a"))
  before = dict(vars(callback))
  _tf_internal.restore_keras_backup_dir(
      callback, _tf_internal.set_keras_backup_dir(callback, str(tmp_path / "b")))
  assert dict(vars(callback)) == before, _broke("restore_keras_backup_dir", "not restored")


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


def test_remove_autograph_generated_files(tmp_path):
  @tf.function
  def converted(x):
    if x > 0:  # AutoGraph converts this function and writes it to a file.
      x += 1
    return x

  before = {n for n in sys.modules if n.startswith("__autograph_generated_file")}
  converted(tf.constant(1))
  new = {n: sys.modules[n] for n in sys.modules
         if n.startswith("__autograph_generated_file") and n not in before}
  assert new and all(os.path.exists(m.__file__) for m in new.values()), _broke(
      "remove_autograph_generated_files",
      "AutoGraph no longer loads its generated files as modules named after them")
  other = tmp_path / "__autograph_generated_file_of_another_process.py"
  other.write_text("")
  removed = _tf_internal.remove_autograph_generated_files(
      dict(new, unrelated=types.ModuleType("unrelated")))
  assert sorted(removed) == sorted(m.__file__ for m in new.values())
  assert not any(os.path.exists(path) for path in removed)
  assert other.exists()  # Only this process's files (the modules it loaded) go.


def test_pass_through_autograph_class():
  @_tf_internal.pass_through_autograph_class
  class Marked(RuntimeError):
    pass

  raised = _raise_in_converted_code(Marked("kept"))
  assert type(raised) is Marked and str(raised) == "kept", _broke(
      "pass_through_autograph_class", f"AutoGraph raised {type(raised).__name__}")


@pytest.fixture
def own_process_hooks(monkeypatch):
  """Runs a test with TensorFlow's own error path and waits, and gives back afterwards
  whatever hooks the process had: a ParameterServerStrategy made earlier in this worker
  installs them for the process's lifetime."""
  from diststrat._tf_internal import _cluster_rpc  # pylint: disable=g-import-not-at-top
  targets = [(_cluster_rpc._eager_context, "async_wait"),
             (_cluster_rpc._checkpoint, "_execute_callbacks"),
             (_cluster_rpc._eager_core, "_status_to_exception"),
             (_cluster_rpc, "_call_tracker")]
  targets += [(_cluster_rpc._execute, name) for name in _cluster_rpc._EXECUTE_NAMES]
  for module, name in targets:
    monkeypatch.setattr(module, name, getattr(module, name))
  _tf_internal.uninstall_sync_hook()
  _tf_internal.uninstall_error_translator()
  _tf_internal.set_call_tracker(None)


def test_install_error_translator(own_process_hooks):
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


def test_creating_checkpoint_save_counter(tmp_path):
  seen = []

  def creator(next_creator, **kwargs):
    seen.append((kwargs.get("name"), _tf_internal.creating_checkpoint_save_counter()))
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0, name="save_counter"))
    checkpoint.save(str(tmp_path / "ckpt"))
  assert seen == [("save_counter", False), ("save_counter", True)], _broke(
      "creating_checkpoint_save_counter", f"creations seen: {seen}")


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

  monkeypatch.setattr(_distribute_stack, "_ops", _Graphless)
  with pytest.raises(_tf_internal.TensorFlowInternalsError,
                     match=r"Graph._distribution_strategy_stack.*Keras would train on one "
                           r"device under diststrat"):
    with _tf_internal.tf_distribution_mode(_Stand()):
      pass


# --- the rest of the boundary, one test each ----------------------------------------------


def test_variable_creators():
  def creator(next_creator, **kwargs):
    return next_creator(**kwargs)

  before = _tf_internal.variable_creators()
  with tf.variable_creator_scope(creator):
    inside = _tf_internal.variable_creators()
  assert inside[-1] is creator and inside[:-1] == before, _broke(
      "variable_creators", f"innermost is not the creator just entered: {inside}")


def test_set_variable_creator_stack():
  names = []

  def creator(next_creator, **kwargs):
    names.append(kwargs.get("name"))
    return next_creator(**kwargs)

  saved = _tf_internal.variable_creator_stack()
  with tf.variable_creator_scope(creator):
    stack = _tf_internal.variable_creator_stack()
  _tf_internal.set_variable_creator_stack(stack)
  try:
    tf.Variable(1.0, name="through_the_installed_stack")
  finally:
    _tf_internal.set_variable_creator_stack(saved)
  tf.Variable(1.0, name="after_restoring")
  assert names == ["through_the_installed_stack"], _broke("set_variable_creator_stack",
                                                          f"the creator saw {names}")


_ONE_TASK_COLLECTIVE = """
import socket, sys
import tensorflow as tf
from diststrat import _tf_internal
with socket.socket() as s:
  s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}"]})
_tf_internal.enable_cross_process_collectives(spec, "worker", 0,
                                              leader="/job:worker/replica:0/task:0")
@tf.function
def total():
  with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
    return _tf_internal.all_reduce_v1(tf.constant([2.0]), 1, 7, 7, "Add", "Id", timeout=30)
print("SUM", float(total()[0]))
_tf_internal.check_peer_health("/job:worker/replica:0/task:0", timeout=10)
print("HEALTHY")
"""

_AFTER_AN_OP = """
import tensorflow as tf
from diststrat import _tf_internal
tf.constant(1.0) + 1.0  # TensorFlow is initialized now.
try:
  _tf_internal.enable_cross_process_collectives(
      tf.train.ClusterSpec({"worker": ["127.0.0.1:1"]}), "worker", 0,
      leader="/job:worker/replica:0/task:0")
except RuntimeError as e:
  print("REFUSED", e)
"""


def _run_python(code, timeout=120):
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-import
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=timeout).stdout


@pytest.mark.processes
def test_enable_cross_process_collectives_and_check_peer_health():
  out = _run_python(_ONE_TASK_COLLECTIVE)
  assert "SUM 2.0" in out, _broke("enable_cross_process_collectives", out)
  assert "HEALTHY" in out, _broke("check_peer_health", out)
  out = _run_python(_AFTER_AN_OP)
  assert "REFUSED" in out, _broke("enable_cross_process_collectives",
                                  f"a set-up after TensorFlow initialized did not raise: {out}")



def test_wait_for_pending_ops(monkeypatch, own_process_hooks):
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  tf.add(1.0, 1.0)  # The context exists (the wait does nothing before).
  synced = []
  sync_executors = context.context().sync_executors
  monkeypatch.setattr(context.context(), "sync_executors",
                      lambda: synced.append(1) or sync_executors())
  # It is TensorFlow's own wait (which syncs every executor), not the hook's.
  _tf_internal.install_sync_hook(lambda wait: (_ for _ in ()).throw(KeyError("hooked")))
  try:
    _tf_internal.wait_for_pending_ops()
  finally:
    _tf_internal.uninstall_sync_hook()
  assert synced == [1], _broke("wait_for_pending_ops", "context.async_wait() no longer "
                               "syncs the executors")


def test_install_sync_hook_and_uninstall_sync_hook(tmp_path, own_process_hooks):
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  original_wait = context.async_wait
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)),
                                       str(tmp_path), max_to_keep=3)
  calls = []

  def sync(wait):
    calls.append(tf.train.latest_checkpoint(str(tmp_path)))
    wait()

  _tf_internal.install_sync_hook(sync)
  try:
    first = manager.save()
    # One wait, made before the save registered its checkpoint; the save's own wait
    # after its callbacks is skipped.
    assert calls == [None], _broke("install_sync_hook", f"the hook saw {calls}")
    assert tf.train.latest_checkpoint(str(tmp_path)) == first
    context.async_wait()
    assert len(calls) == 2, _broke("install_sync_hook", "context.async_wait() is not hooked")

    def failing(wait):
      raise KeyError("the task died")

    _tf_internal.install_sync_hook(failing)
    with pytest.raises(KeyError, match="the task died"):
      manager.save()
    # The failed save is not the latest checkpoint.
    assert tf.train.latest_checkpoint(str(tmp_path)) == first
    assert manager.latest_checkpoint == first
  finally:
    _tf_internal.uninstall_sync_hook()
  assert context.async_wait is original_wait
  second = manager.save()
  assert tf.train.latest_checkpoint(str(tmp_path)) == second != first


def test_deferred_checkpoint_value(tmp_path):
  reads = []

  class Saved(tf.Module):

    def __init__(self):
      super().__init__()
      self.variable = tf.Variable(3.0)

    def _serialize_to_tensors(self):
      def read():
        reads.append(1)
        return tf.identity(self.variable)
      return {"value": _tf_internal.deferred_checkpoint_value(read, tf.float32, CPUS[0])}

    def _restore_from_tensors(self, restored_tensors):
      self.variable.assign(restored_tensors["value"])

  saved = Saved()
  path = tf.train.Checkpoint(saved=saved).write(str(tmp_path / "ckpt"))
  assert reads == [1], _broke("deferred_checkpoint_value", f"a save read it {len(reads)} times")
  saved.variable.assign(0.0)
  tf.train.Checkpoint(saved=saved).read(path).assert_consumed()
  assert reads == [1], _broke("deferred_checkpoint_value", "a restore read it")
  assert float(saved.variable) == 3.0


def test_serialize_to_tensors(tmp_path):
  class Saved(tf.Module):  # Saves its variable's value as the variable saves itself.

    def __init__(self):
      super().__init__()
      self.variable = tf.Variable(3.0)

    def _serialize_to_tensors(self):
      return _tf_internal.serialize_to_tensors(self.variable)

    def _restore_from_tensors(self, restored_tensors):
      [value] = restored_tensors.values()
      self.variable.assign(value)

  saved = Saved()
  keys = list(_tf_internal.serialize_to_tensors(saved.variable))
  assert keys == ["VARIABLE_VALUE"], _broke("serialize_to_tensors", f"keys {keys}")
  path = tf.train.Checkpoint(saved=saved).write(str(tmp_path / "ckpt"))
  saved.variable.assign(0.0)
  tf.train.Checkpoint(saved=saved).read(path).assert_consumed()
  assert float(saved.variable) == 3.0, _broke("serialize_to_tensors", "the saved value")
  plain = tf.Variable(0.0)  # The key of a plain variable: the checkpoints are exchangeable.
  tf.train.Checkpoint(saved=plain).read(path).expect_partial()
  assert float(plain) == 3.0


@pytest.mark.processes
def test_probe_tf_server():
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:  # A port nothing listens on (closed again at once).
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  [outcome] = _tf_internal.probe_tf_server([f"127.0.0.1:{port}"], timeout=5)
  assert outcome is not None and outcome.startswith("cannot be reached"), _broke(
      "probe_tf_server", f"a closed port gave {outcome!r}")
  server = _run_python_server()
  try:
    assert _tf_internal.probe_tf_server([server.address], timeout=30) == [None], _broke(
        "probe_tf_server", "a live TensorFlow server did not answer GetStatus")
  finally:
    server.stop()


class _ServerProcess:
  def __init__(self):
    import socket, subprocess, sys, time  # pylint: disable=g-import-not-at-top,multiple-import
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    self.address = f"127.0.0.1:{port}"
    code = ("import tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec("
            f"{{'ps': ['{self.address}']}}), job_name='ps', task_index=0).join()")
    self.process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      with socket.socket() as s:  # Not a connection to itself (see _serve._worker_answers).
        if s.connect_ex(("127.0.0.1", port)) == 0 and s.getsockname() != s.getpeername():
          return
      time.sleep(0.2)
    self.stop()
    raise RuntimeError("the test's TensorFlow server did not start within 60 s")

  def stop(self):
    self.process.kill()
    self.process.wait(30)


def _run_python_server():
  return _ServerProcess()


def test_uninstall_error_translator(own_process_hooks):
  _tf_internal.install_error_translator(lambda error: KeyError("translated"))
  _tf_internal.uninstall_error_translator()
  _tf_internal.uninstall_error_translator()  # Twice: nothing left to undo.
  with pytest.raises(tf.errors.InvalidArgumentError):
    tf.reshape(tf.zeros([6]), [4])


def test_resource_methods_and_read_methods():
  variable = tf.Variable([1.0, 2.0])
  missing = [m for m in _tf_internal.RESOURCE_METHODS if not callable(getattr(variable, m, None))]
  assert not missing, _broke("RESOURCE_METHODS", f"tf.Variable lacks {missing}")
  assert set(_tf_internal.READ_METHODS) <= set(_tf_internal.RESOURCE_METHODS)
  for name in _tf_internal.READ_METHODS:
    np.testing.assert_allclose(getattr(variable, name)().numpy(), [1.0, 2.0],
                               err_msg=_broke("READ_METHODS", name))



def test_base_resource_method():
  variable = tf.Variable(3.0)
  read = _tf_internal.base_resource_method("read_value")
  assert float(read(variable)) == 3.0, _broke("base_resource_method", "read_value")


def test_shared_name_unique_id_and_in_graph_mode():
  variable = tf.Variable(1.0, name="named_here")
  assert "named_here" in _tf_internal.shared_name(variable), _broke(
      "shared_name", repr(_tf_internal.shared_name(variable)))
  other = tf.Variable(1.0)
  assert _tf_internal.unique_id(variable) != _tf_internal.unique_id(other), _broke(
      "unique_id", "two variables share an id")
  assert _tf_internal.in_graph_mode(variable) is False, _broke("in_graph_mode", "eager")




def test_dense_var_to_tensor():
  variable = tf.Variable([1, 2], dtype=tf.int32)
  tensor = _tf_internal.dense_var_to_tensor(variable, dtype=tf.int32)
  assert isinstance(tensor, tf.Tensor) and tensor.numpy().tolist() == [1, 2], _broke(
      "dense_var_to_tensor", repr(tensor))


class _ByIdentity(dict):
  """A dict keyed by object identity, as TensorFlow's object maps are."""

  def __setitem__(self, key, value):
    super().__setitem__(id(key), value)

  def __getitem__(self, key):
    return super().__getitem__(id(key))

  def __contains__(self, key):
    return super().__contains__(id(key))


def test_copy_trackable_to_cpu():
  variable = tf.Variable(2.0)
  object_map = _ByIdentity()
  _tf_internal.copy_trackable_to_cpu(variable, object_map)
  assert float(object_map[variable]) == 2.0, _broke("copy_trackable_to_cpu", "the host copy")


def _saved_model_calls(tmp_path, monkeypatch):
  calls = []
  for name in ("export_to_saved_model_graph", "write_object_proto"):
    original = getattr(_tf_internal, name)

    def recording(*args, _original=original, _name=name, **kwargs):
      calls.append(_name)
      return _original(*args, **kwargs)

    monkeypatch.setattr(_tf_internal, name, recording)
  strategy, v = _mirrored_variable(7.0)
  module = tf.Module()
  module.v = v
  module.read = tf.function(lambda: module.v + 0.0, input_signature=[])
  tf.saved_model.save(module, str(tmp_path / "saved"))
  loaded = tf.saved_model.load(str(tmp_path / "saved"))
  del strategy
  return calls, float(loaded.read())


def test_export_to_saved_model_graph(tmp_path, monkeypatch):
  calls, value = _saved_model_calls(tmp_path, monkeypatch)
  assert "export_to_saved_model_graph" in calls and value == 7.0, _broke(
      "export_to_saved_model_graph", f"calls {calls}, loaded {value}")


def test_write_object_proto(tmp_path, monkeypatch):
  calls, value = _saved_model_calls(tmp_path, monkeypatch)
  assert "write_object_proto" in calls and value == 7.0, _broke(
      "write_object_proto", f"calls {calls}, loaded {value}")


def test_set_distributed_container_and_distributed_container():
  component = tf.Variable(1.0)
  owner = tf.Module()
  assert _tf_internal.distributed_container(component) is None
  import weakref  # pylint: disable=g-import-not-at-top
  _tf_internal.set_distributed_container(component, weakref.ref(owner))
  assert _tf_internal.distributed_container(component) is owner, _broke(
      "set_distributed_container/distributed_container", "the owner was not found")



def test_should_record():
  x = tf.constant(1.0)
  assert not _tf_internal.should_record([x])
  with tf.GradientTape() as tape:
    tape.watch(x)
    assert _tf_internal.should_record([x]), _broke("should_record", "a watched tensor")


def test_tensor_flow_internals_error():
  error = _tf_internal.TensorFlowInternalsError("x")
  assert isinstance(error, ImportError)  # `import diststrat` fails with it, as it should.


def test_protocols_and_protocol_names():
  from diststrat._keras import _facade  # pylint: disable=g-import-not-at-top
  holders = [ds.values.MirroredVariable, ds.optimizers.Optimizer, _facade.ExtendedAdapter,
             _facade.StrategyAdapter]
  # `_distributed_container` is set on each component (set_distributed_container).
  undefined = [name for name in _tf_internal.PROTOCOL_NAMES - {"_distributed_container"}
               if not any(name in vars(c) or any(name in vars(b) for b in c.__mro__
                                                  if b.__module__.startswith("diststrat"))
                          for c in holders)]
  assert not undefined, f"PROTOCOLS lists names no diststrat class defines: {undefined}"
  assert _tf_internal.PROTOCOL_NAMES == {n for names in _tf_internal.PROTOCOLS.values()
                                         for n in names}



_ABORT_A_BLOCKED_COLLECTIVE = """
import socket, threading, time
import tensorflow as tf
from diststrat import _tf_internal
ports = []
for _ in range(2):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); ports.append(s.getsockname()[1])
# Two members, one process: the second never joins, so the first waits with no timeout.
spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
_tf_internal.enable_cross_process_collectives(spec, "worker", 0,
                                              leader="/job:worker/replica:0/task:0")
@tf.function
def alone():
  with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
    return _tf_internal.all_reduce_v1(tf.constant([2.0]), 2, 9, 9, "Add", "Id", timeout=0)
print("RUNS_COLLECTIVES", _tf_internal.function_runs_collectives(
    alone.get_concrete_function().function_def.signature.name))
threading.Timer(1.0, _tf_internal.abort_collectives, ("stop waiting",)).start()
start = time.monotonic()
try:
  alone()
except tf.errors.UnavailableError as e:
  print("ABORTED", "stop waiting" in str(e), round(time.monotonic() - start, 1))
"""


@pytest.mark.processes
def test_abort_collectives_and_function_runs_collectives():
  out = _run_python(_ABORT_A_BLOCKED_COLLECTIVE, timeout=60)
  assert "ABORTED True" in out, _broke("abort_collectives", out)
  assert "RUNS_COLLECTIVES True" in out, _broke("function_runs_collectives", out)


def test_function_runs_collectives():
  @tf.function
  def plain(x):
    return tf.while_loop(lambda i: i < x, lambda i: i + 1.0, [0.0])

  name = plain.get_concrete_function(tf.constant(1.0)).function_def.signature.name
  assert _tf_internal.function_runs_collectives(name) is False, _broke(
      "function_runs_collectives", "a function without collectives counted as one")
  assert _tf_internal.function_runs_collectives("Identity") is False


def test_set_call_tracker(own_process_hooks):
  calls = []

  class Tracker:
    def started(self, name=None):
      calls.append(("started", name))
      return len(calls)

    def finished(self, token):
      calls.append(("finished", token))

  @tf.function
  def traced(x):
    return x + 1.0

  traced(tf.constant(1.0))  # Traced before tracking.
  _tf_internal.install_error_translator(lambda error: error)
  _tf_internal.set_call_tracker(Tracker())
  try:
    traced(tf.constant(1.0))
  finally:
    _tf_internal.set_call_tracker(None)
    _tf_internal.uninstall_error_translator()
  started = [c for c in calls if c[0] == "started"]
  assert started and all("traced" in str(name) for _, name in started), _broke(
      "set_call_tracker", f"the function call was not reported: {calls}")
  assert ("finished", 1) in calls, _broke("set_call_tracker", f"no end reported: {calls}")
  traced(tf.constant(2.0))
  assert len(calls) == 2 * len(started), "tracking went on after set_call_tracker(None)"


def test_keras_loss_tracker():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  model.fit(np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32), verbose=0)
  tracker = _tf_internal.keras_loss_tracker(model)
  assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss", _broke(
      "keras_loss_tracker", f"Keras {keras.__version__}: {tracker!r}")


def test_strided_slice_assign():
  variable = tf.Variable([1.0, 2.0, 3.0])
  _tf_internal.strided_slice_assign(
      variable, begin=[1], end=[3], strides=[1], value=[5.0, 6.0], name=None,
      begin_mask=0, end_mask=0, ellipsis_mask=0, new_axis_mask=0, shrink_axis_mask=0)
  assert variable.numpy().tolist() == [1.0, 5.0, 6.0], _broke(
      "strided_slice_assign", repr(variable.numpy()))


def test_in_saved_model_trace_and_saved_model_trace_options(tmp_path):
  seen = []

  def body():
    seen.append((_tf_internal.in_saved_model_trace(),
                 _tf_internal.saved_model_trace_options()))
    return tf.constant(1.0)

  module = tf.Module()
  module.f = tf.function(body, input_signature=[])
  module.f()
  options = tf.saved_model.SaveOptions()
  tf.saved_model.save(module, str(tmp_path / "saved"), options=options)
  assert seen[0] == (False, None) and (True, options) in seen[1:], _broke(
      "in_saved_model_trace/saved_model_trace_options",
      f"a save did not trace its function again in its save context: {seen}")


def test_save_as_tuple_of_components(tmp_path):
  class Pair:  # A tf.nest structure of two tensors, unknown to TensorFlow's SavedModel.
    def __init__(self, a, b):
      self.a, self.b = a, b

    def __tf_flatten__(self):
      return None, (self.a, self.b)

    @classmethod
    def __tf_unflatten__(cls, metadata, components):
      del metadata
      return cls(*components)

  module = tf.Module()
  module.f = tf.function(lambda: Pair(tf.constant(1.0), tf.constant(2.0)), input_signature=[])
  module.f()
  _tf_internal.save_as_tuple_of_components(Pair, lambda p: p.__tf_flatten__()[1])
  _tf_internal.save_as_tuple_of_components(Pair, lambda p: p.__tf_flatten__()[1])  # no-op
  tf.saved_model.save(module, str(tmp_path / "saved"))
  got = tf.saved_model.load(str(tmp_path / "saved")).f()
  assert isinstance(got, tuple) and [float(t) for t in got] == [1.0, 2.0], _broke(
      "save_as_tuple_of_components", f"the loaded function returned {got!r}")


def test_saved_model_trace():
  options = tf.saved_model.SaveOptions()
  with _tf_internal.saved_model_trace(options):
    inside = (_tf_internal.in_saved_model_trace(), _tf_internal.saved_model_trace_options())
  assert inside == (True, options) and not _tf_internal.in_saved_model_trace(), _broke(
      "saved_model_trace", repr(inside))


def test_install_saved_model_device_rule(tmp_path, monkeypatch):
  # Undone after the test (the rule stays for a cluster process's life).
  monkeypatch.setattr(tf.Graph, "_apply_device_functions",
                      vars(tf.Graph)["_apply_device_functions"])
  _tf_internal.install_saved_model_device_rule()
  _tf_internal.install_saved_model_device_rule()  # Twice: a no-op.
  module = tf.Module()
  module.v = tf.Variable(1.0)

  @tf.function(input_signature=[])
  def f():
    with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
      total = module.v + 1.0
    with tf.device(CPUS[1]):
      return total * 2.0

  module.f = f
  # Traced outside the save (not run: this process has no /job:ps), it keeps them.
  assert any("/job:ps" in op.device
             for op in f.get_concrete_function().graph.get_operations())
  tf.saved_model.save(module, str(tmp_path / "saved"))
  loaded = tf.saved_model.load(str(tmp_path / "saved"))  # No /job:ps here.
  assert float(loaded.f()) == 4.0, _broke("install_saved_model_device_rule",
                                          "the saved function kept /job:ps")


def test_called_by_keras_trainer():
  assert not _tf_internal.called_by_keras_trainer()  # Called from a test.
  # The bridge asks from its `run`, which Keras's trainer calls for each predict step.
  seen = []
  strategy = ds.MirroredStrategy(CPUS[:1])
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  adapter = model.distribute_strategy
  original = adapter.run

  def run(fn, args=(), kwargs=None, options=None):
    seen.append(_tf_internal.called_by_keras_trainer())
    return original(fn, args, kwargs, options)

  adapter.run = run
  try:
    model.predict(np.zeros((2, 3), np.float32), verbose=0)
  finally:
    del adapter.run
  assert seen and all(seen), _broke(
      "called_by_keras_trainer", f"Keras {keras.__version__}: the caller of strategy.run in "
      f"predict is not in Keras's TensorFlow trainer module ({seen!r})")


def test_called_by_keras_loss():
  assert not _tf_internal.called_by_keras_loss()  # Called from a test.
  # The bridge asks from `num_replicas_in_sync`, which Keras's loss scaling reads.
  seen = []
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    adapter = tf.distribute.get_strategy()
  adapter_type = type(adapter)
  original = adapter_type.num_replicas_in_sync

  def probe(self):
    seen.append(_tf_internal.called_by_keras_loss())
    return original.fget(self)

  adapter_type.num_replicas_in_sync = property(probe)
  try:
    with strategy.scope():
      keras.losses.MeanSquaredError()(tf.ones([2, 1]), tf.zeros([2, 1]))
  finally:
    adapter_type.num_replicas_in_sync = original
  assert seen and all(seen), _broke(
      "called_by_keras_loss", f"Keras {keras.__version__}: a Keras loss does not read "
      f"num_replicas_in_sync from Keras's loss module ({seen!r})")



def test_keras_assign_increment(monkeypatch):
  v = keras.Variable(np.float32(1.0))
  backing = _tf_internal.keras_backing_variable(v)
  increments = []

  def assign(value, *args, **kwargs):  # Called by Keras for every write of `v`.
    increments.append(_tf_internal.keras_assign_increment(backing))
    return type(backing).assign(backing, value, *args, **kwargs)

  monkeypatch.setattr(backing, "assign", assign)
  v.assign_add(np.float32(2.0))
  v.assign_sub(np.float32(3.0))
  v.assign(np.float32(5.0))
  got = [None if i is None else (i[0], float(i[1])) for i in increments]
  assert got == [("assign_add", 2.0), ("assign_sub", 3.0), None] and float(v.numpy()) == 5.0, \
      _broke("keras_assign_increment", f"Keras {keras.__version__}: {got}")


def test_gradient_tape_recording():
  assert not _tf_internal.gradient_tape_recording()
  with tf.GradientTape():
    assert _tf_internal.gradient_tape_recording(), _broke(
        "gradient_tape_recording", "an entered tape is not seen")
    with _tf_internal.stop_recording():
      assert not _tf_internal.gradient_tape_recording(), _broke(
          "gradient_tape_recording", "a paused tape is seen as recording")
  assert not _tf_internal.gradient_tape_recording()


def test_forward_accumulator_watching():
  x, y = tf.constant(1.0), tf.constant(2.0)
  assert not _tf_internal.forward_accumulator_watching([x])
  with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)):
    z = x * 3.0
    assert _tf_internal.forward_accumulator_watching([y, z]), _broke(
        "forward_accumulator_watching", "a tensor with a tangent is not seen")
    assert not _tf_internal.forward_accumulator_watching([y]), _broke(
        "forward_accumulator_watching", "a tensor without a tangent is seen")
  with tf.GradientTape() as tape:
    tape.watch(x)
    assert not _tf_internal.forward_accumulator_watching([x]), _broke(
        "forward_accumulator_watching", "a tape's watched tensor is taken for a tangent")


def test_keras_rnn_dropout_mask_slots():
  lstm = keras.layers.LSTM(2, dropout=0.1, recurrent_dropout=0.1)
  model = keras.Sequential([keras.Input((3, 2)), keras.layers.Bidirectional(lstm),
                            keras.layers.Dense(1)])
  slots = _tf_internal.keras_rnn_dropout_mask_slots(model)
  assert slots, _broke("keras_rnn_dropout_mask_slots",
                       f"Keras {keras.__version__} recurrent cells have no get_dropout_mask")
  # The Bidirectional's two LSTMs' cells (not the unused original): two masks each.
  assert len(slots) == 4 and len({id(cell) for cell, *_ in slots}) == 2
  cell, attribute, get_method, reset_method = slots[0]
  mask = getattr(cell, get_method)(tf.ones((2, 2)))
  assert getattr(cell, attribute, None) is mask, _broke(
      "keras_rnn_dropout_mask_slots",
      f"Keras {keras.__version__} caches no dropout mask in {attribute}")
  getattr(cell, reset_method)()
  assert getattr(cell, attribute) is None
  assert _tf_internal.keras_rnn_dropout_mask_slots(keras.layers.Dense(2)) == []
