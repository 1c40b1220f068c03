"""Keras training semantics under towers (diststrat/_keras/_training.py): the summed
gradients update each copy of a variable from the sum on its own device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _devices
from diststrat._keras import _replay
from diststrat._keras import _training
from conftest import CPUS
from keras_cases import STRATEGIES


def _cross_device_edges(graphs, min_elements=0):
  """Edges of the step's graphs whose ends sit on different devices: the copies.

  Every op of the traced step (and of each function it calls) whose device differs from
  the device of one of its inputs counts once per such input (of at least
  `min_elements` elements, when known). An op with no device assigned runs where
  TensorFlow's placer puts it: with the variable whose handle it takes, else on the
  first device (the default device). An input of a function's op (cond, call) counts
  in the function, where it is used.
  """
  count = 0
  graphs = list(graphs)
  seen = set()
  while graphs:
    graph = graphs.pop()
    if id(graph) in seen:
      continue
    seen.add(id(graph))
    for op in graph.get_operations():
      for inner in op.node_def.attr.values():  # Functions called by this op (cond, ...).
        if inner.HasField("func") and graph._get_function(inner.func.name) is not None:  # pylint: disable=protected-access
          graphs.append(graph._get_function(inner.func.name).graph)  # pylint: disable=protected-access
      if op.type in _CALLS:
        continue
      for tensor in op.inputs:
        if min_elements and (tensor.shape.num_elements() or 0) < min_elements:
          continue
        if tensor.dtype == tf.resource:  # A handle: the op runs where the variable is.
          continue
        if _device_of(tensor) != _device_of(op.outputs[0] if op.outputs else op):
          count += 1
  return count


_CALLS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "PartitionedCall",
                    "StatefulPartitionedCall"})


def _device_of(tensor_or_op):
  """Where a tensor is made (a function's input: where its caller's tensor is)."""
  if isinstance(tensor_or_op, tf.Tensor) and not hasattr(tensor_or_op, "op"):
    return _devices.canonicalize(tensor_or_op.device)  # Eager: a captured handle.
  op = getattr(tensor_or_op, "op", tensor_or_op)
  if op.type == "Placeholder" and not op.device:
    for external, internal in getattr(op.graph, "captures", ()):
      if internal.graph is op.graph and internal.name == tensor_or_op.name:
        return _device_of(external)
  if not op.device:
    for tensor in op.inputs:
      if tensor.dtype == tf.resource:
        return _device_of(tensor)
  return _devices.canonicalize(op.device or CPUS[0])


def _fit_copies(monkeypatch, keep_copies, optimizer, min_elements=0, steps_per_execution=1,
                width=8):
  graphs = []  # The graph each step's summed gradients are applied in (the step's).
  apply_summed = _training.apply_summed

  def recording(*args):
    graphs.append(tf.compat.v1.get_default_graph())
    return apply_summed(*args)

  monkeypatch.setattr(_training, "apply_summed", recording)
  if not keep_copies:  # The old way: every copy updated from the first device's sum.
    monkeypatch.setattr(_training, "summed_copies", lambda value, devices=(): None)
  strategy = ds.MirroredStrategy(
      CPUS, cross_tower_ops=ds.cross_tower_ops.AllReduceCrossTowerOps("naive"))
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=optimizer(), loss="mse", steps_per_execution=steps_per_execution)
  initial = [v.numpy() for v in model.trainable_variables]
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 6)).astype(np.float32)
  y = rng.normal(size=(16, 2)).astype(np.float32)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
  copies = [[c.numpy() for c in strategy.unwrap(v.value)] for v in model.trainable_variables]
  assert graphs and graphs[0].get_operations()  # Applied while the step was traced.
  return _cross_device_edges(graphs[:1], min_elements), copies, model, initial


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                       lambda: keras.optimizers.Adam(0.01)],
                         ids=["sgd_momentum", "adam"])
def test_each_copy_is_updated_from_the_sum_on_its_device(monkeypatch, optimizer):
  before, old_copies, _, _ = _fit_copies(monkeypatch, keep_copies=False, optimizer=optimizer)
  monkeypatch.undo()
  after, new_copies, model, _ = _fit_copies(monkeypatch, keep_copies=True, optimizer=optimizer)
  num_variables = len(model.trainable_variables)
  # One copy from the first device to each other device, per variable, is gone.
  assert before - after >= (len(CPUS) - 1) * num_variables, (before, after)
  for old, new in zip(old_copies, new_copies, strict=True):
    for copy in new:  # Every copy equal, and equal to the old way's result.
      np.testing.assert_allclose(copy, new[0], rtol=0, atol=0)
    np.testing.assert_allclose(new[0], old[0], rtol=1e-6, atol=1e-7)


def test_summed_copies_knows_only_the_sums_it_was_given():
  assert _training.summed_copies(tf.constant(1.0)) is None
  assert _training.summed_copies("not a tensor") is None


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
    lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipvalue=0.01),
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, clipnorm=0.05))],
    ids=["clipnorm", "global_clipnorm", "clipvalue", "loss_scale", "loss_scale_clipnorm"])
def test_a_gradient_transformed_after_the_sum_is_computed_on_each_device(monkeypatch,
                                                                         optimizer):
  # On CPUs a copy shares the buffer, so diststrat copies there; replayed here as on GPUs.
  monkeypatch.setattr(_replay, "REPLAY_ON_CPUS", True)
  # Copies of more than one element: a norm or a loss scale (a scalar) is still copied.
  before, old_copies, _, _ = _fit_copies(monkeypatch, keep_copies=False,
                                         optimizer=optimizer, min_elements=2)
  monkeypatch.undo()
  monkeypatch.setattr(_replay, "REPLAY_ON_CPUS", True)
  after, new_copies, model, initial = _fit_copies(monkeypatch, keep_copies=True,
                                                  optimizer=optimizer, min_elements=2)
  num_variables = len(model.trainable_variables)
  assert before - after >= (len(CPUS) - 1) * num_variables, (before, after)
  for old, new, start in zip(old_copies, new_copies, initial, strict=True):
    for copy in new:
      np.testing.assert_allclose(copy, new[0], rtol=0, atol=0)
    np.testing.assert_allclose(new[0], old[0], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(new[0], start), "the steps changed nothing"


def test_on_cpus_a_transformed_gradient_is_copied_not_computed_again(monkeypatch):
  # A copy between CPU devices shares the buffer: cheaper than computing N times.
  copied, _, _, _ = _fit_copies(monkeypatch, keep_copies=True, min_elements=2,
                                  optimizer=lambda: keras.optimizers.SGD(0.1, clipnorm=0.05))
  monkeypatch.undo()
  monkeypatch.setattr(_replay, "REPLAY_ON_CPUS", True)
  forced, _, model, _ = _fit_copies(monkeypatch, keep_copies=True, min_elements=2,
                                    optimizer=lambda: keras.optimizers.SGD(0.1, clipnorm=0.05))
  assert copied - forced >= (len(CPUS) - 1) * len(model.trainable_variables)


def test_a_replayer_gives_up_where_it_cannot_compute_again():
  devices = ["/device:GPU:0", "/device:GPU:1"]  # Only built, never run.
  with tf.Graph().as_default():
    total = tf.constant([1.0, 2.0])
    other = tf.identity(total)
    replayer = _replay.Replayer({total.ref(): {devices[0]: total, devices[1]: other}},
                                devices)
    scaled = total * 2.0
    on_each = replayer.per_device(scaled)
    assert on_each[devices[0]] is scaled
    assert on_each[devices[1]].op.type == "Mul" and on_each[devices[1]].device == devices[1]
    assert other in list(on_each[devices[1]].op.inputs)
    variable_like = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2], shared_name="v")
    stateful = tf.raw_ops.ReadVariableOp(resource=variable_like, dtype=tf.float32) + total
    assert replayer.per_device(stateful) is None  # A read of state: copied instead.
    assert replayer.per_device(tf.constant([3.0, 4.0])) is None  # Depends on no sum.
  assert replayer.per_device(tf.constant([1.0])) is None  # Eager.


def test_a_transformed_gradient_in_a_multi_step_execution_trains_as_before(monkeypatch):
  # steps_per_execution > 1: Keras runs the steps in one traced function (a loop).
  clipped = lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05)  # noqa: E731
  before, old_copies, _, _ = _fit_copies(monkeypatch, keep_copies=False, optimizer=clipped,
                                         steps_per_execution=2, min_elements=2)
  monkeypatch.undo()
  monkeypatch.setattr(_replay, "REPLAY_ON_CPUS", True)
  after, new_copies, model, initial = _fit_copies(
      monkeypatch, keep_copies=True, optimizer=clipped, steps_per_execution=2,
      min_elements=2)
  assert before - after >= (len(CPUS) - 1) * len(model.trainable_variables), (before, after)
  for old, new, start in zip(old_copies, new_copies, initial, strict=True):
    for copy in new:
      np.testing.assert_allclose(copy, new[0], rtol=0, atol=0)
    np.testing.assert_allclose(new[0], old[0], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(new[0], start)


class HalvingSGD(keras.optimizers.SGD):
  """SGD on half the gradient, halved by eager tensors the traced step captures (a
  function captures an eager tensor of more than 128 elements as an input)."""

  halves = None

  def apply(self, grads, trainable_variables=None):
    grads = list(grads)
    if HalvingSGD.halves is None:
      with tf.init_scope():
        HalvingSGD.halves = [tf.fill(g.shape, 0.5) for g in grads]
    return super().apply([g * h for g, h in zip(grads, HalvingSGD.halves, strict=True)],
                         trainable_variables)


def test_a_gradient_changed_by_a_captured_eager_tensor_trains_as_before(monkeypatch):
  """The step captures the halves (eager tensors) as inputs; the replay once raised
  AttributeError on them (an eager tensor has no op). Each device's product then reads
  the halves from the first device: as many copies as before, of the halves instead of
  the gradients."""
  monkeypatch.setattr(HalvingSGD, "halves", None)
  before, old_copies, _, _ = _fit_copies(monkeypatch, keep_copies=False, min_elements=2,
                                         optimizer=lambda: HalvingSGD(0.1), width=64)
  monkeypatch.undo()
  monkeypatch.setattr(HalvingSGD, "halves", None)
  monkeypatch.setattr(_replay, "REPLAY_ON_CPUS", True)
  after, new_copies, model, _ = _fit_copies(monkeypatch, keep_copies=True, min_elements=2,
                                            optimizer=lambda: HalvingSGD(0.1), width=64)
  assert model.trainable_variables[0].shape.num_elements() > 128  # Captured, not a Const.
  assert after <= before, (before, after)
  for old, new in zip(old_copies, new_copies, strict=True):
    for copy in new:
      np.testing.assert_allclose(copy, new[0], rtol=0, atol=0)
    np.testing.assert_allclose(new[0], old[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("replay_on_cpus", [False, True])
@pytest.mark.parametrize("strategy_name", ["mirrored4", "ps4"])
def test_fit_with_an_embedding_sparse_gradient_equals_one_device(monkeypatch, replay_on_cpus,
                                                                 strategy_name):
  """An embedding's gradient is IndexedSlices: once, fit raised AttributeError ('ref')."""
  monkeypatch.setattr(_replay, "REPLAY_ON_CPUS", replay_on_cpus)
  rng = np.random.default_rng(1)
  x = rng.integers(0, 10, (16, 3)).astype(np.int32)
  y = rng.normal(size=(16, 2)).astype(np.float32)

  def train(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
      model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                                keras.layers.Dense(2)])
      model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.5), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return model

  reference = train(ds.get_distribution_strategy())
  model = train(STRATEGIES[strategy_name]())
  for v, ref in zip(model.trainable_variables, reference.trainable_variables, strict=True):
    strategy = model.distribute_strategy.diststrat_strategy
    for copy in [c.numpy() for c in strategy.unwrap(v.value)]:
      np.testing.assert_allclose(copy, ref.numpy(), rtol=1e-5, atol=1e-6)
