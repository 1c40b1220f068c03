"""Keras training semantics under towers (diststrat/_keras/_training.py): the summed
gradients update each copy of a variable from the sum on its own device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _devices
from diststrat._keras import _training
from conftest import CPUS


def _cross_device_edges(graphs):
  """Edges of the step's graphs whose ends sit on different devices: the copies.

  Every op of the traced step (and of each function it calls) whose device differs from
  the device of one of its inputs counts once per such input. Ops with no device
  assigned are not counted.
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
      if not op.device:
        continue
      for tensor in op.inputs:
        if tensor.op.device and (_devices.canonicalize(tensor.op.device) !=
                                 _devices.canonicalize(op.device)):
          count += 1
  return count


def _fit_copies(monkeypatch, keep_copies, optimizer):
  graphs = []  # The graph each step's summed gradients are applied in (the step's).
  apply_summed = _training.apply_summed

  def recording(*args):
    graphs.append(tf.compat.v1.get_default_graph())
    return apply_summed(*args)

  monkeypatch.setattr(_training, "apply_summed", recording)
  if not keep_copies:  # The old way: every copy updated from the first device's sum.
    monkeypatch.setattr(_training, "summed_copies", lambda value: None)
  strategy = ds.MirroredStrategy(
      CPUS, cross_tower_ops=ds.cross_tower_ops.AllReduceCrossTowerOps("naive"))
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=optimizer(), loss="mse")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 6)).astype(np.float32)
  y = rng.normal(size=(16, 2)).astype(np.float32)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
  copies = [[c.numpy() for c in strategy.unwrap(v.value)] for v in model.trainable_variables]
  assert graphs and graphs[0].get_operations()  # Applied while the step was traced.
  return _cross_device_edges(graphs[:1]), copies, model


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                       lambda: keras.optimizers.Adam(0.01)],
                         ids=["sgd_momentum", "adam"])
def test_each_copy_is_updated_from_the_sum_on_its_device(monkeypatch, optimizer):
  before, old_copies, _ = _fit_copies(monkeypatch, keep_copies=False, optimizer=optimizer)
  monkeypatch.undo()
  after, new_copies, model = _fit_copies(monkeypatch, keep_copies=True, optimizer=optimizer)
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
