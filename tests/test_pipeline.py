"""GPipe pipeline parallelism (SPEC section 13): the oracle is the layers run in sequence.

Every result is compared with the same layers applied one after the other on one device
(or with numpy / a brute-force search): outputs, gradients, training, data x pipeline.
"""

import functools
import importlib.util
import itertools
import os
import pathlib
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat.pipeline import GPipe, estimate_costs, partition
from conftest import CPUS

keras = pytest.importorskip("keras")

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH, FEATURES = 8, 6
TOL = {"rtol": 2e-4, "atol": 2e-5}


def _gelu(x):
  return tf.nn.gelu(x)


def _make_layers(seed=0):
  """Five layers of four kinds: Keras layers with variables, one without, a plain callable."""
  keras.utils.set_random_seed(seed)
  return [keras.layers.Dense(12, activation="tanh"), keras.layers.LayerNormalization(),
          _gelu, keras.layers.Dense(10, activation="relu"), keras.layers.Dense(3)]


def _make_keras_layers(seed=0):
  """The same, all Keras layers (for keras.Sequential)."""
  return [layer if isinstance(layer, keras.layers.Layer) else keras.layers.Activation("gelu")
          for layer in _make_layers(seed)]


def _sequential(layers, x, training=True):
  for layer in layers:
    x = layer(x, training=training) if isinstance(layer, keras.layers.Layer) else layer(x)
  return x


def _input(seed=0, batch=BATCH):
  return tf.constant(np.random.default_rng(seed).normal(size=(batch, FEATURES)), tf.float32)


def _variables(layers):
  return [v for layer in layers if isinstance(layer, keras.layers.Layer)
          for v in layer.trainable_variables]


def _loss_and_grads(fn, variables, x):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = fn(x)
    loss = tf.reduce_sum(tf.sin(y) * y)  # Gradients that differ per element.
  return y, tape.gradient(loss, list(variables) + [x])


@functools.lru_cache(maxsize=None)
def _shared(num_stages):
  """Layers built once per stage count (placement is per stage), with their partition."""
  layers = _make_layers()
  pipe = GPipe(layers, devices=CPUS[:num_stages])
  pipe.build((BATCH, FEATURES))
  return layers, pipe.stage_sizes


# --- partition -----------------------------------------------------------------------


def _max_stage(costs, sizes):
  bounds = [0] + list(itertools.accumulate(sizes))
  return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def _brute_force(costs, num_stages):
  n = len(costs)
  return min(_max_stage(costs, np.diff((0,) + cut + (n,)).tolist())
             for cut in itertools.combinations(range(1, n), num_stages - 1))


def test_partition_is_optimal_on_200_random_cost_lists():
  rng = random.Random(13)
  for trial in range(200):
    n = rng.randint(1, 10)
    num_stages = rng.randint(1, n)
    if trial % 4 == 0:
      costs = [rng.randint(0, 5) for _ in range(n)]  # Integers, zeros and ties.
    else:
      costs = [rng.expovariate(1.0) * 10 ** rng.randint(0, 3) for _ in range(n)]
    sizes = partition(costs, num_stages)
    assert len(sizes) == num_stages and sum(sizes) == n and min(sizes) >= 1, (costs, sizes)
    assert all(isinstance(s, int) for s in sizes)
    got, best = _max_stage(costs, sizes), _brute_force(costs, num_stages)
    assert got == pytest.approx(best, rel=1e-9, abs=1e-12), (costs, num_stages, sizes)


def test_partition_beats_a_greedy_cut():
  # Filling stages up to total/num_stages (a histogram cut) gives [1, 1, 1] | [6] | [1, 1]
  # or worse; the optimum is 6 with the small layers spread around the big one.
  costs = [1, 1, 1, 6, 1, 1]
  sizes = partition(costs, 3)
  assert _max_stage(costs, sizes) == 6 == _brute_force(costs, 3)


def test_partition_is_deterministic():
  costs = [0, 0, 0, 0, 1, 1]
  assert partition(costs, 3) == partition(list(costs), 3)


@pytest.mark.parametrize("costs,num_stages,match", [
    ([1, 2], 3, r"between 1 and len\(costs\) stages.*Received: num_stages=3 for 2 costs"),
    ([1, 2], 0, r"Received: num_stages=0 for 2 costs"),
    ([1, 2], 1.5, r"Received: num_stages=1.5"),
    ([], 1, r"at least one cost. Received: costs=\[\]"),
    ([1, -2], 1, r"finite number >= 0. Received: costs\[1\]=-2.0"),
    ([float("nan")], 1, r"Received: costs\[0\]=nan"),
    (["a"], 1, r"sequence of numbers.*Received: costs=\['a'\]"),
])
def test_partition_errors(costs, num_stages, match):
  with pytest.raises(ValueError, match=match):
    partition(costs, num_stages)


# --- cost estimates --------------------------------------------------------------------


def test_costs_are_the_flops_of_the_traced_ops():
  b, d, u = 4, 6, 5
  h, w, c, f, k = 9, 9, 3, 7, 3
  dense = keras.layers.Dense(u, activation="tanh")
  costs = estimate_costs([dense, keras.layers.Dense(2)], (b, d))
  # MatMul 2*b*d*u, BiasAdd b*u, Tanh b*u; then MatMul 2*b*u*2 and BiasAdd b*2.
  assert costs == [2 * b * d * u + 2 * b * u, 2 * b * u * 2 + b * 2]
  conv = keras.layers.Conv2D(f, k, padding="valid")
  (cost,) = estimate_costs([conv], (b, h, w, c))
  out = b * (h - k + 1) * (w - k + 1) * f
  assert cost == 2 * out * k * k * c + out
  assert not dense.built and not conv.built  # Traced on clones: the layers are untouched.


def test_costs_of_a_built_layer_and_a_callable():
  dense = keras.layers.Dense(4)
  dense.build((None, 3))
  assert estimate_costs([dense, tf.nn.relu, lambda x: x * 2.0], (2, 3)) == [
      2 * 2 * 3 * 4 + 2 * 4, 2 * 4, 2 * 4]


def test_cost_partition_balances_uneven_layers():
  layers = [keras.layers.Dense(n) for n in (4, 64, 4, 4, 64, 4, 4)]
  costs = estimate_costs(layers, (BATCH // 2, FEATURES))
  pipe = GPipe(layers, devices=CPUS[:3], num_micro_batches=2)
  pipe.build((BATCH, FEATURES))
  assert pipe.stage_sizes == partition(costs, 3)
  assert max(pipe.stage_costs) == pytest.approx(_brute_force(costs, 3))
  assert sum(pipe.stage_costs) == pytest.approx(sum(costs))
  assert [len(s) for s in pipe.stages] == pipe.stage_sizes


# --- output and gradients equal the layers in sequence ---------------------------------


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4, 8])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_matches_sequential(num_stages, num_micro_batches, recompute, mode):
  layers, sizes = _shared(num_stages)
  pipe = GPipe(layers, devices=CPUS[:num_stages], num_micro_batches=num_micro_batches,
               recompute=recompute, partition=sizes)
  x = _input(seed=num_stages * 10 + num_micro_batches)
  expected_y, expected_grads = _loss_and_grads(
      functools.partial(_sequential, layers), _variables(layers), x)
  step = functools.partial(_loss_and_grads, lambda t: pipe(t, training=True),
                           pipe.trainable_variables)
  if mode == "function":
    step = tf.function(step)
  y, grads = step(x)
  np.testing.assert_allclose(y, expected_y, **TOL)
  assert len(grads) == len(expected_grads)
  for g, e in zip(grads, expected_grads):
    np.testing.assert_allclose(g, e, **TOL)


def test_variables_live_on_their_stage_devices():
  layers, sizes = _shared(4)
  pipe = GPipe(layers, devices=CPUS, partition=sizes)
  assert [len(s) for s in pipe.stages] == sizes
  for device, stage in zip(CPUS, pipe.stages):
    for layer in stage:
      for v in getattr(layer, "variables", []):
        assert v.value.device == device
  assert [id(v) for v in pipe.trainable_variables] == [id(v) for v in _variables(layers)]


def test_same_program_same_names_and_placements():
  def build():
    pipe = GPipe(keras.Sequential(_make_keras_layers(seed=4)), devices=CPUS[:3])
    pipe.build((BATCH, FEATURES))
    return pipe.stage_sizes, [(v.path, v.value.device) for v in pipe.trainable_variables]
  first, second = build(), build()
  assert first[0] == second[0]
  assert [d for _, d in first[1]] == [d for _, d in second[1]]
  assert [p.split("/")[-1] for p, _ in first[1]] == [p.split("/")[-1] for p, _ in second[1]]


def test_keras_sequential_and_backward_on_each_stage_device():
  model = keras.Sequential(_make_keras_layers(seed=2))
  pipe = GPipe(model, devices=CPUS[:2], num_micro_batches=2, recompute=True)
  x = _input()

  @tf.function
  def step(x):
    return _loss_and_grads(lambda t: pipe(t, training=True), pipe.trainable_variables, x)

  y, _ = step(x)
  np.testing.assert_allclose(y, _sequential(model.layers, x), **TOL)
  graph = step.get_concrete_function(x).graph
  seen = set()
  for op in graph.get_operations():
    for phase in ("forward", "backward"):
      for s in range(2):
        if f"{phase}/stage_{s}/" in op.name and op.type in ("MatMul", "TanhGrad", "Tanh"):
          assert op.device == CPUS[s], (op.name, op.device)
          seen.add((phase, s))
  assert seen == {(p, s) for p in ("forward", "backward") for s in range(2)}


def test_sparse_gradients_and_integer_inputs():
  keras.utils.set_random_seed(5)
  layers = [keras.layers.Embedding(20, 4), keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3)]
  pipe = GPipe(layers, devices=CPUS[:2], num_micro_batches=4, partition=[1, 2])
  ids = tf.constant(np.random.default_rng(1).integers(0, 20, size=(8, 5)), tf.int32)

  def grads(fn):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(fn(ids)))
    return tape.gradient(loss, pipe.trainable_variables)

  got = grads(lambda t: pipe(t, training=True))
  expected = grads(lambda t: _sequential(layers, t))
  assert isinstance(got[0], tf.IndexedSlices)  # Accumulated sparse, never densified.
  for g, e in zip(got, expected):
    np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(e), **TOL)


def test_tf_module_callable_with_its_own_variable():
  class Scale(tf.Module):

    def __init__(self):
      super().__init__()
      with tf.device(CPUS[1]):
        self.w = tf.Variable(tf.linspace(0.5, 1.5, 12), name="scale")

    def __call__(self, x):
      return x * self.w

  keras.utils.set_random_seed(6)
  layers = [keras.layers.Dense(12), Scale(), keras.layers.Dense(2)]
  pipe = GPipe(layers, devices=CPUS[:2], num_micro_batches=2, partition=[1, 2])
  x = _input()
  variables = pipe.trainable_variables
  assert any(v is layers[1].w for v in variables)
  got_y, got = _loss_and_grads(lambda t: pipe(t, training=True), variables, x)
  want_y, want = _loss_and_grads(functools.partial(_sequential, layers), variables, x)
  np.testing.assert_allclose(got_y, want_y, **TOL)
  for g, e in zip(got, want):
    np.testing.assert_allclose(g, e, **TOL)


def test_persistent_tape_and_tape_outside_the_function():
  layers, sizes = _shared(2)
  pipe = GPipe(layers, devices=CPUS[:2], num_micro_batches=2, partition=sizes)
  x = _input(seed=3)
  _, expected = _loss_and_grads(functools.partial(_sequential, layers), _variables(layers), x)
  with tf.GradientTape(persistent=True) as tape:  # Two backward passes: the second recomputes.
    loss = tf.reduce_sum(tf.sin(pipe(x)) * pipe(x))
  for _ in range(2):
    for g, e in zip(tape.gradient(loss, pipe.trainable_variables), expected):
      np.testing.assert_allclose(g, e, **TOL)
  del tape
  forward = tf.function(lambda t: pipe(t, training=True))
  with tf.GradientTape() as tape:  # TensorFlow differentiates the traced function itself.
    y = forward(x)
    loss = tf.reduce_sum(tf.sin(y) * y)
  for g, e in zip(tape.gradient(loss, pipe.trainable_variables), expected):
    np.testing.assert_allclose(g, e, **TOL)


# --- training equals one device ------------------------------------------------------

STEPS, LR = 10, 0.05
OPTIMIZERS = {
    "ds_sgd": lambda: ds.optimizers.GradientDescent(LR),
    "ds_momentum": lambda: ds.optimizers.Momentum(LR, 0.9),
    "ds_adam": lambda: ds.optimizers.Adam(0.01),
    "keras_sgd": lambda: keras.optimizers.SGD(LR, momentum=0.9),
    "keras_adam": lambda: keras.optimizers.Adam(0.01),
}


def _training_data(seed=11, batch=BATCH):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(STEPS, batch, FEATURES)).astype(np.float32),
          rng.normal(size=(STEPS, batch, 3)).astype(np.float32))


def _copy_weights(source, target):
  for a, b in zip(source, target):
    if isinstance(a, keras.layers.Layer):
      b.set_weights(a.get_weights())


def _train(forward, variables, opt, mode, xs, ys):
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(forward(x) - y))
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss
  if mode == "function":
    step = tf.function(step)
  for x, y in zip(xs, ys):
    step(tf.constant(x), tf.constant(y))
  return [np.array(tf.convert_to_tensor(v)) for v in variables]


@functools.lru_cache(maxsize=None)
def _initial_weights(seed=7):
  """Built layers whose weights every training test starts from (never trained)."""
  layers = _make_layers(seed=seed)
  _sequential(layers, _input())
  return layers


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_training_matches_one_device(opt_name, mode):
  xs, ys = _training_data()
  reference = _make_layers(seed=8)
  _sequential(reference, xs[0])
  _copy_weights(_initial_weights(), reference)
  expected = _train(lambda t: _sequential(reference, t), _variables(reference),
                    OPTIMIZERS[opt_name](), "eager", xs, ys)
  layers = _make_layers(seed=9)
  pipe = GPipe(layers, devices=CPUS[:3], num_micro_batches=4, recompute=True)
  pipe.build((BATCH, FEATURES))
  _copy_weights(_initial_weights(), layers)
  got = _train(lambda t: pipe(t, training=True), pipe.trainable_variables,
               OPTIMIZERS[opt_name](), mode, xs, ys)
  assert not np.allclose(got[0], _initial_weights()[0].kernel.numpy())  # It trained.
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
