"""GPipe pipeline parallelism (docs/pipeline.md): the oracle is the layers run in sequence.

Every result is compared with the same layers applied one after the other on one device
(or with numpy / a brute-force search): outputs, gradients, training, data x pipeline.
"""

import contextlib
import functools
import itertools
import json
import os
import pathlib
import random
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _devices
from diststrat.pipeline import GPipe, estimate_costs, partition
from conftest import CPUS


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


def _frozen(tensors):
  """Read-only numpy copies of `tensors`, as a tuple (a cached reference no test changes)."""
  arrays = tuple(np.array(t) for t in tensors)
  for array in arrays:
    array.setflags(write=False)
  return arrays


@functools.lru_cache(maxsize=None)
def _sequential_loss_and_grads(num_stages, num_micro_batches):
  """The layers of `_shared(num_stages)` in sequence on the input of this case: output and
  gradients, computed once for both recompute settings and both modes."""
  layers, _ = _shared(num_stages)
  x = _input(seed=num_stages * 10 + num_micro_batches)
  y, grads = _loss_and_grads(functools.partial(_sequential, layers), _variables(layers), x)
  return _frozen([y])[0], _frozen(grads)


def test_import_diststrat_makes_the_pipeline_available():
  assert ds.pipeline.GPipe is GPipe and ds.pipeline.partition is partition
  assert "pipeline" in ds.__all__
  assert sorted(ds.pipeline.__all__) == ["GPipe", "estimate_costs", "partition"]


# --- partition -----------------------------------------------------------------------


def _max_stage(costs, sizes):
  bounds = [0] + list(itertools.accumulate(sizes))
  return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


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


def test_partition_breaks_ties_as_documented():
  """Among optimal cuts: the last stage as short as possible, then the one before it...
  The cut chose the last stage's start for the best cut of the rest alone, so e.g.
  [1.7, 1.9, 1.2, 8.2] in 3 stages gave [1, 2, 1], not [2, 1, 1]."""
  assert partition([1.7, 1.9, 1.2, 8.2], 3) == [2, 1, 1]
  assert partition([1e308, 1e308, 1e308], 2) == [2, 1]  # Sums beyond float range.
  rng = random.Random(17)
  for _ in range(300):
    n = rng.randint(1, 8)
    num_stages = rng.randint(1, n)
    costs = [rng.choice([0, 1, 2, 3, 5]) for _ in range(n)]
    best = _brute_force(costs, num_stages)
    cuts = [np.diff((0,) + cut + (n,)).tolist()
            for cut in itertools.combinations(range(1, n), num_stages - 1)]
    want = min((c for c in cuts if _max_stage(costs, c) == best), key=lambda c: c[::-1])
    assert partition(costs, num_stages) == want, (costs, num_stages)


@pytest.mark.parametrize("costs,num_stages,match", [
    ([1, 2], 3, r"between 1 and len\(costs\) stages.*Received: num_stages=3 for 2 costs"),
    ([1, 2], 0, r"Received: num_stages=0 for 2 costs"),
    ([1, 2], 1.5, r"Received: num_stages=1.5"),
    ([], 1, r"at least one cost. Received: costs=\[\]"),
    ([1, -2], 1, r"finite number >= 0. Received: costs\[1\]=-2.0"),
    ([float("nan")], 1, r"Received: costs\[0\]=nan"),
    (["a"], 1, r"sequence of numbers.*Received: costs=\['a'\]"),
    # Strings that parse as numbers were taken: "123" as the costs [1, 2, 3].
    ("123", 2, r"sequence of numbers.*Received: costs='123'"),
    (["1", "2"], 1, r"sequence of numbers.*Received: costs=\['1', '2'\]"),
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
  expected_y, expected_grads = _sequential_loss_and_grads(num_stages, num_micro_batches)
  step = functools.partial(_loss_and_grads, lambda t: pipe(t, training=True),
                           pipe.trainable_variables)
  if mode == "function":
    step = tf.function(step)
  y, grads = step(x)
  np.testing.assert_allclose(y, expected_y, **TOL)
  assert len(grads) == len(expected_grads)
  for g, e in zip(grads, expected_grads, strict=True):
    np.testing.assert_allclose(g, e, **TOL)


def test_variables_live_on_their_stage_devices():
  layers, sizes = _shared(4)
  pipe = GPipe(layers, devices=CPUS, partition=sizes)
  assert [len(s) for s in pipe.stages] == sizes
  for device, stage in zip(CPUS, pipe.stages, strict=True):
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
  for g, e in zip(got, expected, strict=True):
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
  for g, e in zip(got, want, strict=True):
    np.testing.assert_allclose(g, e, **TOL)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("partition", [[2, 2], [1, 3]])
def test_recompute_replays_dropout_and_updates_moving_statistics_once(mode, partition):
  """[1, 3] puts the Dropout on stage 1: Keras made its seed state in the layer's
  constructor, on the default device, and GPipe refused it as "built before"."""
  keras.utils.set_random_seed(10)
  layers = [keras.layers.Dense(12), keras.layers.Dropout(0.5, seed=4),
            keras.layers.BatchNormalization(), keras.layers.Dense(3)]
  keep = GPipe(layers, devices=CPUS[:2], num_micro_batches=4, partition=partition)
  again = GPipe(layers, devices=CPUS[:2], num_micro_batches=4, partition=partition,
                recompute=True)
  keep.build((BATCH, FEATURES))
  dropout_stage = 0 if partition[0] == 2 else 1
  assert [_devices.canonicalize(v.value.device) for v in layers[1].non_trainable_variables] \
      == [CPUS[dropout_stage]]
  state = [v for layer in layers for v in layer.non_trainable_variables]
  initial = [v.numpy() for v in state]
  x = _input(seed=5)
  results = []
  for pipe in (keep, again):
    for v, value in zip(state, initial, strict=True):
      v.assign(value)
    step = functools.partial(_loss_and_grads, lambda t, p=pipe: p(t, training=True),
                             pipe.trainable_variables)
    if mode == "function":
      step = tf.function(step)
    y, grads = step(x)
    results.append((y, grads, [v.numpy() for v in state]))
  (y1, g1, s1), (y2, g2, s2) = results
  np.testing.assert_allclose(y2, y1, **TOL)
  # Same masks; moving statistics updated once per cell.
  for a, b in zip(g2 + s2, g1 + s1, strict=True):
    np.testing.assert_allclose(a, b, **TOL)
  assert not np.allclose(s1[1], initial[1])  # The moving mean did move.


@pytest.mark.parametrize("strategy", [False, True], ids=["no_strategy", "mirrored"])
def test_seed_states_of_nested_layers_are_placed_on_their_stage(strategy):
  """An LSTM's seed state is its cell's, a Dropout's in a Sequential the Sequential's
  sublayer's: GPipe moved only a layer's own, and refused these as "built before"."""
  keras.utils.set_random_seed(11)
  layers = [keras.layers.Dense(4),
            keras.Sequential([keras.layers.Dense(6), keras.layers.Dropout(0.5, seed=2)]),
            keras.layers.Reshape((3, 2)), keras.layers.LSTM(3), keras.layers.Dense(2)]
  if strategy:
    scope = ds.MirroredStrategy(CPUS[:2]).scope()
    devices = {CPUS[0]: CPUS[:1], CPUS[1]: CPUS[1:2]}
    partition = [5]
  else:
    scope = contextlib.nullcontext()
    devices, partition = CPUS[:2], [1, 4]
  with scope:
    pipe = GPipe(layers, devices=devices, partition=partition)
    pipe.build((BATCH, FEATURES))
  stage = 0 if strategy else 1
  for layer in pipe.stages[stage]:
    for v in layer.non_trainable_variables:
      assert _devices.canonicalize(v.value.device) == CPUS[stage], v.path
  if not strategy:
    x = _input()
    np.testing.assert_allclose(pipe(x, training=False), _sequential(layers, x, training=False),
                               **TOL)


class _UnseededNoise(keras.layers.Layer):
  """Draws from Keras's global seed generator (no seed of its own)."""

  def call(self, x):
    return x * keras.random.uniform(tf.shape(x))


def test_a_layer_drawing_from_keras_global_seed_generator():
  """Tracing the layers' costs made Keras's global seed generator (on the layer's first
  unseeded draw) inside the scratch graph: the pipeline's call, and every later
  unseeded draw of the thread, failed with TypeError "... is out of scope"."""
  keras.utils.set_random_seed(14)  # No global generator yet: the trace would make it.
  layers = [keras.layers.Dense(4), _UnseededNoise(name="unseeded_noise"),
            keras.layers.Dense(2)]
  pipe = GPipe(layers, devices=CPUS[:2], partition=[2, 1])
  pipe.build((None, FEATURES))
  keras.random.uniform((2,))  # An unseeded draw outside the pipeline works.
  x = _input(seed=8)
  keras.utils.set_random_seed(15)
  got = pipe(x)
  keras.utils.set_random_seed(15)
  np.testing.assert_allclose(got, _sequential(layers, x), **TOL)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_layers_frozen_after_they_are_built(recompute):
  """layer.trainable = False after building (fine-tuning): the variables stay trainable
  for TensorFlow, and GPipe refused them as read by a stage that does not declare them."""
  keras.utils.set_random_seed(12)
  layers = [keras.layers.Dense(12, activation="tanh"), keras.layers.BatchNormalization(),
            keras.layers.Dense(10, activation="relu"), keras.layers.Dense(3)]
  pipe = GPipe(layers, devices=CPUS[:2], num_micro_batches=2, recompute=recompute,
               partition=[2, 2])
  pipe.build((BATCH, FEATURES))
  layers[1].trainable = False  # A frozen BatchNormalization also runs in inference mode.
  layers[2].trainable = False
  frozen = [v.numpy() for v in layers[1].weights + layers[2].weights]
  x = _input(seed=6)
  got = _loss_and_grads(lambda t: pipe(t, training=True), pipe.trainable_variables, x)
  want = _loss_and_grads(functools.partial(_sequential, layers), pipe.trainable_variables, x)
  assert len(pipe.trainable_variables) == 4
  for g, e in zip([got[0]] + got[1], [want[0]] + want[1], strict=True):
    np.testing.assert_allclose(g, e, **TOL)
  for v, value in zip(layers[1].weights + layers[2].weights, frozen, strict=True):
    np.testing.assert_array_equal(v.numpy(), value)


def test_persistent_tape_and_tape_outside_the_function():
  layers, sizes = _shared(2)
  pipe = GPipe(layers, devices=CPUS[:2], num_micro_batches=2, partition=sizes)
  x = _input(seed=3)
  _, expected = _loss_and_grads(functools.partial(_sequential, layers), _variables(layers), x)
  with tf.GradientTape(persistent=True) as tape:  # Two backward passes: the second recomputes.
    loss = tf.reduce_sum(tf.sin(pipe(x)) * pipe(x))
  # strict=False: `expected` ends with the input's gradient, which is not compared.
  for _ in range(2):
    for g, e in zip(tape.gradient(loss, pipe.trainable_variables), expected, strict=False):
      np.testing.assert_allclose(g, e, **TOL)
  del tape
  forward = tf.function(lambda t: pipe(t, training=True))
  with tf.GradientTape() as tape:  # TensorFlow differentiates the traced function itself.
    y = forward(x)
    loss = tf.reduce_sum(tf.sin(y) * y)
  for g, e in zip(tape.gradient(loss, pipe.trainable_variables), expected, strict=False):
    np.testing.assert_allclose(g, e, **TOL)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_gradient_of_a_gradient(recompute, mode):
  """A gradient penalty: the gradient of |d loss / d x|^2. With recompute=True the
  backward pass recomputed each stage from an input the outer tape had not seen: every
  stage but the last lost the terms through later stages' inputs (wrong, no error)."""
  layers, sizes = _shared(3)
  pipe = GPipe(layers, devices=CPUS[:3], num_micro_batches=2, recompute=recompute,
               partition=sizes)
  x = _input(seed=4)

  def penalty(fn):
    with tf.GradientTape(persistent=True) as outer:
      outer.watch(x)
      with tf.GradientTape() as inner:
        inner.watch(x)
        y = fn(x)
        loss = tf.reduce_sum(tf.sin(y) * y)
      d_x = inner.gradient(loss, x)
      penalty = tf.reduce_sum(tf.square(d_x))
    return [d_x] + outer.gradient(penalty, pipe.trainable_variables + [x])

  step = functools.partial(penalty, lambda t: pipe(t, training=True))
  if mode == "function":
    step = tf.function(step)
  expected = penalty(functools.partial(_sequential, layers))
  got = step()
  for g, e in zip(got, expected, strict=True):
    np.testing.assert_allclose(g, e, **TOL)


def test_checkpoint_restores_into_another_stage_count(tmp_path):
  two = GPipe(_make_layers(seed=1), devices=CPUS[:2], num_micro_batches=2)
  two.build((BATCH, FEATURES))
  path = tf.train.Checkpoint(model=two).save(str(tmp_path / "ckpt"))
  three = GPipe(_make_layers(seed=2), devices=CPUS[1:4])
  three.build((BATCH, FEATURES))
  tf.train.Checkpoint(model=three).restore(path).assert_consumed()
  x = _input()
  np.testing.assert_allclose(three(x), two(x), **TOL)
  for a, b in zip(three.trainable_variables, two.trainable_variables, strict=True):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


# --- training equals one device ------------------------------------------------------

# Five steps: every optimizer's state (momentum, Adam's moments and powers) carries over four
# times; each test compares every variable after the last one.
STEPS, LR = 5, 0.05
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
  for a, b in zip(source, target, strict=True):
    if isinstance(a, keras.layers.Layer):
      b.set_weights(a.get_weights())


def _train(forward, variables, opt, mode, xs, ys):
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(forward(x) - y))
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    return loss
  if mode == "function":
    step = tf.function(step)
  for x, y in zip(xs, ys, strict=True):
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
  expected = _expected_one_device(opt_name)
  layers = _make_layers(seed=9)
  pipe = GPipe(layers, devices=CPUS[:3], num_micro_batches=4, recompute=True)
  pipe.build((BATCH, FEATURES))
  _copy_weights(_initial_weights(), layers)
  got = _train(lambda t: pipe(t, training=True), pipe.trainable_variables,
               OPTIMIZERS[opt_name](), mode, xs, ys)
  assert not np.allclose(got[0], _initial_weights()[0].kernel.numpy())  # It trained.
  for g, e in zip(got, expected, strict=True):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


# --- data x pipeline: MirroredStrategy towers, each pipelining over its own devices ----

TOWERS = [CPUS[0], CPUS[2]]
TOWER_PIPELINES = {CPUS[0]: CPUS[0:2], CPUS[2]: CPUS[2:4]}


def _sgd_merge(strategy, grads_and_vars):
  """Plain SGD in cross-tower context: sum the towers' gradients, update every copy."""
  variables = [v for _, v in grads_and_vars]
  reduced = strategy.batch_reduce("sum", [(g, v) for g, v in grads_and_vars])
  for v, g in zip(variables, reduced, strict=True):
    strategy.update(v, lambda copy, grad: copy.assign_sub(LR * grad), g)


def _train_towers(opt_name, mode, xs, ys, apply_with):
  strategy = ds.MirroredStrategy(TOWERS)
  with strategy.scope():
    layers = _make_layers(seed=9)
    pipe = GPipe(layers, devices=TOWER_PIPELINES, num_micro_batches=2, recompute=True)
    pipe.build((None, FEATURES))
    _copy_weights(_initial_weights(), layers)
    opt = OPTIMIZERS[opt_name]()

  def tower(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(pipe(x, training=True) - y))
      scaled = loss / strategy.num_towers  # A Keras optimizer sums the towers' gradients.
    if apply_with == "keras":
      grads = tape.gradient(scaled, pipe.trainable_variables)
      return opt.apply_gradients(zip(grads, pipe.trainable_variables, strict=True))
    # Scales the loss by 1/num_towers: the towers' gradients sum to the global mean's.
    grads_and_vars = opt.compute_gradients(loss, pipe.trainable_variables, tape=tape)
    if apply_with == "optimizer":
      return opt.apply_gradients(grads_and_vars)
    return ds.get_tower_context().merge_call(_sgd_merge, grads_and_vars)

  def step(x, y):
    def split(t):
      return ds.values.PerDevice(dict(zip(strategy.worker_devices, tf.split(t, 2), strict=True)))
    strategy.call_for_each_tower(tower, split(x), split(y))

  if mode == "function":
    step = tf.function(step)
  with strategy.scope():
    for x, y in zip(xs, ys, strict=True):
      step(tf.constant(x), tf.constant(y))
  return pipe


@functools.lru_cache(maxsize=None)
def _expected_one_device(opt_name):
  """The layers trained in sequence on one device, eagerly, on `_training_data()`: the
  reference of every pipeline and tower test with this optimizer, computed once."""
  xs, ys = _training_data()
  reference = _make_layers(seed=8)
  _sequential(reference, xs[0])
  _copy_weights(_initial_weights(), reference)
  return _frozen(_train(lambda t: _sequential(reference, t), _variables(reference),
                        OPTIMIZERS[opt_name](), "eager", xs, ys))


def _check_towers_trained(pipe, expected):
  columns = [tuple(TOWER_PIPELINES[t][s] for t in TOWERS) for s in range(2)]
  for stage, layers in enumerate(pipe.stages):
    for layer in layers:
      for v in getattr(layer, "trainable_variables", []):
        assert isinstance(v.value, ds.values.MirroredVariable)
        assert v.value.devices == columns[stage]  # One copy per tower, on its stage device.
  for v, e in zip(pipe.trainable_variables, expected, strict=True):
    for copy in v.value.values:
      np.testing.assert_allclose(copy.numpy(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("opt_name", ["ds_sgd", "ds_momentum", "ds_adam"])
def test_two_towers_of_two_stages_train_like_one_device(opt_name, no_thread_leak):
  xs, ys = _training_data()
  pipe = _train_towers(opt_name, "eager", xs, ys, apply_with="optimizer")
  _check_towers_trained(pipe, _expected_one_device(opt_name))


def test_two_towers_of_two_stages_in_a_tf_function(no_thread_leak):
  xs, ys = _training_data()
  pipe = _train_towers("ds_sgd", "function", xs, ys, apply_with="merge_call")
  _check_towers_trained(pipe, _expected_one_device("ds_sgd"))


def test_two_towers_diststrat_optimizer_in_a_tf_function():
  xs, ys = _training_data()
  pipe = _train_towers("ds_momentum", "function", xs, ys, apply_with="optimizer")
  _check_towers_trained(pipe, _expected_one_device("ds_momentum"))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_two_towers_of_two_stages_with_a_keras_optimizer(mode, no_thread_leak):
  xs, ys = _training_data()
  pipe = _train_towers("keras_sgd", mode, xs, ys, apply_with="keras")
  _check_towers_trained(pipe, _expected_one_device("keras_sgd"))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_each_tower_reads_its_own_copy(mode):
  strategy = ds.MirroredStrategy(TOWERS)
  with strategy.scope():
    keras.utils.set_random_seed(3)
    layers = [keras.layers.Dense(4), keras.layers.Dense(3)]
    pipe = GPipe(layers, devices=TOWER_PIPELINES, partition=[1, 1])
    pipe.build((None, FEATURES))
  kernel = layers[1].kernel.value
  assert kernel.devices == (CPUS[1], CPUS[3])
  # Make tower 1's stage-1 copy differ on purpose: its output shows which copy it read.
  kernel.get(CPUS[3]).assign(kernel.get(CPUS[3]) * 2.0)
  x = _input(batch=4)
  run = (lambda: strategy.call_for_each_tower(pipe, x))
  if mode == "function":
    run = tf.function(run)
  with strategy.scope():
    out = run()
  h = x.numpy() @ layers[0].kernel.numpy() + layers[0].bias.numpy()
  bias = layers[1].bias.numpy()
  np.testing.assert_allclose(out.values[0], h @ kernel.get(CPUS[1]).numpy() + bias, **TOL)
  np.testing.assert_allclose(out.values[1], h @ kernel.get(CPUS[3]).numpy() + bias, **TOL)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_stateful_layers_on_a_later_stage_in_towers_in_a_tf_function(recompute):
  """BatchNormalization's and Dropout's state writes merge the towers' values in a
  merge_call. From stage 1 inside a tf.function, the merge's result (one op per copy, on
  the stage-1 devices) was handed to each tower by its own device, where it has no part:
  ValueError "returned a wrapped value with no component on tower 0's device"."""
  def run(mode):
    strategy = ds.MirroredStrategy(TOWERS)
    with strategy.scope():
      keras.utils.set_random_seed(13)
      layers = [keras.layers.Dense(8), keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.5, seed=5), keras.layers.Dense(3)]
      pipe = GPipe(layers, devices=TOWER_PIPELINES, num_micro_batches=2,
                   recompute=recompute, partition=[1, 3])
      pipe.build((None, FEATURES))

    def tower(x):
      with tf.GradientTape() as tape:
        y = pipe(x, training=True)
        loss = tf.reduce_sum(tf.sin(y) * y)
      return [y] + tape.gradient(loss, pipe.trainable_variables)

    step = lambda x: strategy.call_for_each_tower(tower, x)  # noqa: E731
    if mode == "function":
      step = tf.function(step)
    with strategy.scope():
      out = step(_input(seed=7, batch=4))
    state = [c.numpy() for v in pipe.non_trainable_variables for c in v.value.values]
    return [t.numpy() for result in out for t in result.values], state

  eager, function = run("eager"), run("function")
  for a, b in zip(eager[0] + eager[1], function[0] + function[1], strict=True):
    np.testing.assert_allclose(b, a, **TOL)


@pytest.mark.parametrize("merge_fn_of", ["method", "keras_bridge"])
def test_different_merge_fns_in_a_stage_are_refused_as_outside_one(merge_fn_of):
  """A merge_call in a stage is wrapped to hand each tower its part on its stage device.
  The wrapper (a functools.partial binding each tower's merge_fn) hid the towers'
  merge_fns from the check that they are the same: bound methods of objects made per
  tower, or tf.distribute merge_fns through the Keras bridge that differ, passed, and
  tower 0's merge_fn ran for every tower."""
  strategy = ds.MirroredStrategy(TOWERS)
  ran = []

  class Merger:
    def merge(self, unused_strategy, x):
      ran.append(self)
      return x

  mergers = [Merger(), Merger()]

  def first(unused_strategy, x):
    ran.append("first")
    return x

  def second(unused_strategy, x):
    ran.append("second")
    return x

  def layer(x):
    tower = ds.get_tower_context()
    if tower is None:  # GPipe's trace at build.
      return x
    if merge_fn_of == "method":
      return tower.merge_call(mergers[tower.tower_id].merge, x)
    context = tf.distribute.get_replica_context()
    return context.merge_call(first if tower.tower_id == 0 else second, args=(x,))

  with strategy.scope():
    pipe = GPipe([tf.nn.relu, layer], devices=TOWER_PIPELINES, partition=[1, 1])
    pipe.build((None, FEATURES))
    expected = (r"towers \[0\] passed Merger.merge of one object; towers \[1\] passed it of "
                r"another object" if merge_fn_of == "method" else
                r"towers \[0\] passed first; towers \[1\] passed second")
    with pytest.raises(ds.errors.MergeCallMismatchError, match=expected):
      strategy.call_for_each_tower(pipe, _input(batch=4))
  assert not ran


def test_moving_statistics_in_a_stage_weigh_each_towers_share_of_the_batch():
  """A batch of 5 split 3 + 2: the towers' moving means merge weighted by their shares,
  as one device's mean. Inside a stage the tower context had no batch share, so the
  towers weighed 1/2 each (moving mean -1.39 where one device gives -1.41)."""
  strategy = ds.MirroredStrategy(TOWERS)
  x = np.random.default_rng(0).normal(size=(5, FEATURES)).astype(np.float32) + 3
  with strategy.scope():
    keras.utils.set_random_seed(14)
    layers = [keras.layers.Dense(3), keras.layers.BatchNormalization(momentum=0.5)]
    pipe = GPipe(layers, devices=TOWER_PIPELINES, partition=[1, 1])
    pipe.build((None, FEATURES))
    data = strategy.distribute_dataset(lambda: tf.data.Dataset.from_tensors(x))
    for batch in data:
      strategy.call_for_each_tower(lambda t: pipe(t, training=True), batch)
  reference = keras.layers.BatchNormalization(momentum=0.5)
  reference(layers[0](x), training=True)
  for copy in layers[1].moving_mean.value.values:
    np.testing.assert_allclose(copy.numpy(), reference.moving_mean.numpy(), **TOL)


# --- errors: every message names the rule, what was received, and the fix -------------


class _NoConfig(keras.layers.Layer):
  """A layer that cannot be cloned: its argument is not serializable."""

  def __init__(self, fn, **kwargs):
    super().__init__(**kwargs)
    self.fn = fn

  def call(self, x):
    return self.fn(x)


class _NoConfigWithShape(_NoConfig):

  def compute_output_shape(self, input_shape):
    return input_shape


def _built_dense(units, inputs, device=CPUS[0]):
  layer = keras.layers.Dense(units)
  with tf.device(device):
    layer.build((None, inputs))
  return layer


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(layers=[tf.nn.relu, tf.nn.relu], devices=CPUS[:3]), ValueError,
     r"at least one layer on each device .*Received: 2 layers for 3 devices"),
    (dict(layers=tf.nn.relu), TypeError, r"takes a list of layers.*Received: layers of type"),
    (dict(layers=[]), ValueError, r"at least one layer. Received: layers=\[\]"),
    (dict(layers=[tf.nn.relu, 3]), TypeError, r"Received: layer 1 = 3"),
    (dict(layers=[tf.nn.relu], devices={}), ValueError, r"names no tower"),
    (dict(layers=[tf.nn.relu] * 2, devices={CPUS[0]: CPUS[:2], CPUS[2]: CPUS[2:3]}),
     ValueError, r"same number of stages"),
    (dict(layers=[tf.nn.relu] * 2, devices={CPUS[0]: CPUS[:2], CPUS[2]: CPUS[1:3]}),
     ValueError, r"one stage of one tower's pipeline.*uses a device twice"),
    (dict(layers=[tf.nn.relu], devices="/cpu:0"), ValueError,
     r"list of device strings, one per stage. Received: devices='/cpu:0'"),
    (dict(layers=[tf.nn.relu], devices=[]), ValueError, r"at least one device"),
    (dict(layers=[tf.nn.relu], devices=CPUS[:1], num_micro_batches=0), ValueError,
     r"positive int. Received: num_micro_batches=0"),
    (dict(layers=[tf.nn.relu], devices=CPUS[:1], recompute="False"), ValueError,
     r"recompute must be True or False. Received: recompute='False' of type str"),
    (dict(layers=[tf.nn.relu], devices=CPUS[:1], recompute=None), ValueError,
     r"recompute must be True or False. Received: recompute=None"),
    (dict(layers=[tf.nn.relu], devices=CPUS[:1], partition="greedy"), ValueError,
     r"'cost' or a list of layer counts.*Received: partition='greedy'"),
    (dict(layers=[tf.nn.relu] * 3, devices=CPUS[:2], partition=[1, 1]), ValueError,
     r"adding up to the number of layers. Received: partition=\[1, 1\] for 3 layers and "
     r"2 stages"),
])
def test_constructor_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    GPipe(**kwargs)


def test_recompute_takes_numpy_bools():
  assert GPipe([tf.nn.relu], devices=CPUS[:1], recompute=np.bool_(True)).recompute is True


class _Residual(keras.Model):
  """A model whose output is not its layers applied in a chain. (Named explicitly: a
  layer name starting with "_" is not a valid name scope in a tf.function.)"""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.a = keras.layers.Dense(4)
    self.b = keras.layers.Dense(4)

  def call(self, x):
    return self.a(x) + self.b(x)


class _Reversed(keras.Sequential):
  def call(self, x, training=None):
    for layer in reversed(self.layers):
      x = layer(x)
    return x


def _functional_chain():
  inputs = keras.Input((4,))
  return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(4)(inputs)))


@pytest.mark.parametrize("make_model", [
    lambda: _Residual(name="residual"), _functional_chain,
    lambda: _Reversed([keras.layers.Dense(4), keras.layers.Dense(4)], name="reversed")],
                         ids=["subclassed", "functional", "sequential_overriding_call"])
def test_a_keras_model_other_than_a_sequential_is_refused(make_model):
  """GPipe took any Keras model as a keras.Sequential and chained its layers: the
  residual model silently computed b(a(x)), not a(x) + b(x), and the functional one
  failed on its InputLayer as a layer that "cannot take the pipeline's input"."""
  keras.utils.set_random_seed(13)
  model = make_model()
  with pytest.raises(TypeError, match=r"a list of layers, applied in order, or a "
                     r"keras.Sequential.*Received: the \w+ '\w+', which is neither. Pass "
                     r"\[\w+\] to run it whole"):
    GPipe(model, devices=CPUS[:2])
  whole = GPipe([model], devices=CPUS[:1])  # What the message suggests: same results.
  x = _input(seed=7)[:, :4]
  np.testing.assert_allclose(whole(x), model(x), **TOL)


def test_batch_not_divisible_by_micro_batches():
  pipe = GPipe([tf.nn.relu, tf.nn.tanh], devices=CPUS[:2], num_micro_batches=4)
  with pytest.raises(ValueError, match=r"divisible by num_micro_batches. Received: batch "
                     r"size 6 and num_micro_batches=4. Use a batch size that is a multiple"):
    pipe(tf.ones([6, 3]))
  unknown_batch = tf.function(pipe, input_signature=[tf.TensorSpec([None, 3])])
  # The message named neither the batch size nor a fix (it showed the remainder, as
  # "x (mod:0) = 2").
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"divisible by num_micro_batches. Received: batch size\] \[6\] "
                     r"\[and num_micro_batches=4. Use batches whose size is a multiple of 4: "
                     r"with tf.data, batch\(n, drop_remainder=True\)"):
    unknown_batch(tf.ones([6, 3]))
  np.testing.assert_allclose(unknown_batch(tf.ones([8, 3])), np.tanh(np.ones([8, 3])))


def test_layers_that_do_not_fit():
  with pytest.raises(ValueError, match=r"layer 1 \('conv2d.*'\) cannot take the output of "
                     r"layer 0 \('dense.*'\). Received: input shape \(None, 4\)"):
    GPipe([keras.layers.Dense(4), keras.layers.Conv2D(2, 3)], devices=CPUS[:2]).build(
        (None, FEATURES))
  with pytest.raises(ValueError, match=r"layer 0 \('dense.*'\) cannot take the pipeline's "
                     r"input. Received: input shape \(2, 6\).*Fix the layer sizes"):
    GPipe([_built_dense(3, 5), tf.nn.relu], devices=CPUS[:1])(tf.ones([2, FEATURES]))
  with pytest.raises(ValueError, match=r"must return one tensor.*Received: layer 0 "
                     r"\('<lambda>'\) returned tuple"):
    GPipe([lambda x: (x, x)], devices=CPUS[:1])(tf.ones([2, 3]))


def test_layers_that_cannot_be_traced():
  layers = [_NoConfigWithShape(tf.nn.relu), tf.nn.tanh]
  with pytest.raises(ValueError, match=r"partition='cost' needs every layer's cost.*"
                     r"Give GPipe partition=\[n0, n1, ...\] instead"):
    GPipe(layers, devices=CPUS[:2])(tf.ones([2, 3]))
  with pytest.raises(ValueError, match=r"traces a clone of it.*Received: layer 0 "
                     r"\('_*no_config_with_shape.*'\) whose get_config\(\) fails"):
    estimate_costs(layers, (2, 3))
  pipe = GPipe(layers, devices=CPUS[:2], partition=[1, 1])  # An explicit cut works.
  np.testing.assert_allclose(pipe(-tf.ones([2, 3])), np.zeros([2, 3]))
  assert pipe.stage_costs[0] is None and pipe.stage_costs[1] == 6.0
  with pytest.raises(ValueError, match=r"cannot be cloned.*does not define "
                     r"compute_output_shape\(\). Received: a layer of class _NoConfig"):
    GPipe([_NoConfig(tf.nn.relu)], devices=CPUS[:1], partition=[1])(tf.ones([2, 3]))


def test_layer_built_on_another_device():
  with pytest.raises(ValueError, match=r"places stage 1's variables on \['.*CPU:1'\].*"
                     r"layer 1 \('dense.*'\) was built before, with variable '.*kernel.*' on "
                     r"\['.*CPU:0'\]. Received: a layer built elsewhere. Pass layers that are "
                     r"not built yet"):
    GPipe([tf.nn.relu, _built_dense(2, 3)], devices=CPUS[:2]).build((4, 3))
  pipe = GPipe([tf.nn.relu, _built_dense(2, 3, CPUS[1])], devices=CPUS[:2])  # Built there.
  assert pipe(tf.ones([4, 3])).shape == (4, 2)


def test_a_layer_used_on_two_stages():
  """The same layer twice in the list: fine on one stage; on two, the error said the
  layer "was built before" and to build it under its stage's device, which cannot help."""
  keras.utils.set_random_seed(3)
  shared = keras.layers.Dense(FEATURES, activation="tanh")
  layers = [shared, _gelu, shared, _gelu]  # A stateless callable may be on any stage.
  x = _input()
  one_stage = GPipe(layers, devices=CPUS[:2], num_micro_batches=2, partition=[3, 1])
  np.testing.assert_allclose(one_stage(x), _sequential(layers, x), **TOL)
  assert len(one_stage.trainable_variables) == 2
  split = GPipe(layers, devices=CPUS[:2], partition=[2, 2])
  with pytest.raises(ValueError, match=r"layer 2 \('dense.*'\) is the same layer as layer 0 "
                     r".*puts layer 0 on stage 0 and layer 2 on stage 1.*explicit partition"):
    split.build((BATCH, FEATURES))


class _LazyModule(tf.Module):
  """Makes its variable on its first call (as Sonnet modules do)."""

  def __init__(self, units, in_function):
    super().__init__(name="lazy")
    self.units, self.w = units, None
    if in_function:
      self.__call__ = tf.function(self.__call__)

  def __call__(self, x):
    if self.w is None:
      self.w = tf.Variable(tf.ones([x.shape[-1], self.units]), name="w")
    return tf.matmul(x, self.w)


@pytest.mark.parametrize("in_function", [False, True], ids=["call", "tf_function"])
def test_a_callable_that_makes_its_variables_when_called(in_function):
  """Tracing the costs called it in a scratch graph: it kept a variable of that graph,
  and GPipe said it "was built before, with variable 'w:0' on []"."""
  lazy = _LazyModule(2, in_function)
  pipe = GPipe([keras.layers.Dense(3), lazy], devices=CPUS[:2])
  with pytest.raises(ValueError, match=r"layer 1 \('lazy'\), not a Keras layer, creates a "
                     r"variable \('w'\) when it is called. .*Create them in its constructor"):
    pipe.build((None, 4))
  assert lazy.w is None  # Left as it was.
  lazy(tf.ones([1, 3]))  # Still usable.


def test_undeclared_variable():
  hidden = tf.Variable(2.0)
  match = (r"stage 0 reads the trainable variable 'Variable.*', which none of its layers "
           r"declares. Received: stage 0 declares \[\]. Make the callable that uses it a "
           r"tf.Module")
  with pytest.raises(ValueError, match=match):  # Found when the pipeline is built...
    GPipe([lambda x: x * hidden], devices=CPUS[:1])(tf.ones([2, 2]))
  sneaky = tf.Variable(3.0)

  def eager_reader(x):  # Reads its variable only when run eagerly, never when traced.
    return x * sneaky if tf.executing_eagerly() else x

  pipe = GPipe([eager_reader], devices=CPUS[:1])
  pipe.build((2, 2))
  x = tf.ones([2, 2])
  with pytest.raises(ValueError, match=match):
    with tf.GradientTape() as tape:  # ... or when a tape records it.
      tape.watch(x)
      loss = tf.reduce_sum(pipe(x))
    tape.gradient(loss, [sneaky])


def test_stages_before_build():
  pipe = GPipe([tf.nn.relu, tf.nn.tanh], devices=CPUS[:2])
  with pytest.raises(ds.errors.ContextError, match=r"GPipe.stages is known once the layers "
                     r"are partitioned.*Call pipe.build\(input_shape\)"):
    _ = pipe.stages
  pipe = GPipe([tf.nn.relu, tf.nn.tanh], devices=CPUS[:2], partition=[1, 1])
  assert pipe.stage_sizes == [1, 1]
  with pytest.raises(ds.errors.ContextError, match=r"GPipe.stage_costs is known once the "
                     r"pipeline is built"):
    _ = pipe.stage_costs


def test_strategy_errors():
  mirrored = ds.MirroredStrategy(TOWERS)
  with mirrored.scope():
    with pytest.raises(ValueError, match=r"Inside a MirroredStrategy with 2 towers, each "
                       r"tower needs its own stage devices. Received: devices=\[.*\]. Give "
                       r"devices=\{tower_device: \[stage devices\], ...\}"):
      GPipe([tf.nn.relu, tf.nn.tanh], devices=CPUS[:2]).build((4, 3))
    with pytest.raises(ValueError, match=r"exactly the towers of the strategy. Received: "
                       r"towers \[.*CPU:0', '.*CPU:1'\]"):
      GPipe([tf.nn.relu], devices={CPUS[0]: [CPUS[2]], CPUS[1]: [CPUS[3]]}).build((4, 3))
    pipe = GPipe([tf.nn.relu], devices={CPUS[0]: [CPUS[1]], CPUS[2]: [CPUS[3]]})
    pipe.build((4, 3))
    with pytest.raises(ds.errors.ContextError, match=r"a GPipe runs in a tower.*called in the "
                       r"cross-tower context.*call_for_each_tower"):
      pipe(tf.ones([4, 3]))
  with pytest.raises(ValueError, match=r"need a MirroredStrategy whose towers are those "
                     r"devices. Received: devices=\{"):
    GPipe([tf.nn.relu], devices={CPUS[0]: [CPUS[1]]})(tf.ones([4, 3]))
  plain = GPipe([tf.nn.relu], devices=CPUS[:1])
  plain.build((4, 3))
  with mirrored.scope():
    with pytest.raises(ds.errors.ContextError, match=r"built under DefaultStrategy\(\) and is "
                       r"called under MirroredStrategy"):
      mirrored.call_for_each_tower(plain, tf.ones([4, 3]))
  ps = ds.ParameterServerStrategy(worker_devices=CPUS[:2], ps_devices=CPUS[2:])
  with ps.scope():
    with pytest.raises(ValueError, match=r"no strategy or inside MirroredStrategy.*Received: "
                       r"ParameterServerStrategy"):
      GPipe([tf.nn.relu], devices=CPUS[:1]).build((4, 3))


# --- the benchmark's trace and memory figures: stages overlap, recompute saves memory --


@pytest.mark.processes
def test_benchmark_trace_shows_stages_running_at_once_and_recompute_saves_memory(tmp_path):
  out = tmp_path / "pipeline.json"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
  proc = subprocess.run(
      # Batch 2048: the activations recompute drops (2 MiB each) dwarf the allocator's
      # run-to-run noise, which depends on the order ops finish (with batch 512 the
      # ratio below reached 0.87 in 1 of 4 runs on a loaded machine; 0.49-0.60 in 8 here).
      [sys.executable, str(ROOT / "benchmarks" / "pipeline_benchmark.py"), "--layers=12",
       "--width=256", "--batch=2048", "--micro_batches=1,4", "--rounds=1",
       "--steps_per_round=1", "--inter_op_threads=4", f"--out={out}"],
      env=env, capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
  one, four = rows["GPipe S=4 M=1"], rows["GPipe S=4 M=4"]
  # Traced: with 4 micro-batches, ops of different stages run at the same time; with one
  # there is nothing to overlap, and each device idles about (S - 1) / S of the step.
  assert four["max_concurrent_stages"] >= 2 and four["concurrent_fraction"] > 0.2, four
  assert one["bubble"] > 0.6 and one["bubble_gpipe"] == 0.75, one
  assert four["bubble"] < one["bubble"], (four, one)
  # Peak tensor memory of a training step (TensorFlow's allocator statistics).
  for m in (1, 4):
    keep, again = rows[f"GPipe S=4 M={m}"], rows[f"GPipe S=4 M={m} recompute"]
    assert again["peak_memory_mib"] < 0.85 * keep["peak_memory_mib"], (keep, again)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_built_lazily_by_the_towers(mode, no_thread_leak):
  strategy = ds.MirroredStrategy(TOWERS)
  with strategy.scope():
    layers = _make_layers(seed=12)
    pipe = GPipe(layers, devices=TOWER_PIPELINES, num_micro_batches=2)
  x = _input(batch=4)
  run = lambda: strategy.call_for_each_tower(lambda: pipe(x, training=True))  # pylint: disable=unnecessary-lambda
  if mode == "function":
    run = tf.function(run)
  with strategy.scope():
    out = run()  # The first call builds the layers once, in cross-tower context.
  columns = [tuple(TOWER_PIPELINES[t][s] for t in TOWERS) for s in range(2)]
  for stage, stage_layers in enumerate(pipe.stages):
    for layer in stage_layers:
      for v in getattr(layer, "variables", []):
        assert v.value.devices == columns[stage]
  expected = _sequential(layers, x)
  for value in out.values:
    np.testing.assert_allclose(value, expected, **TOL)


def test_stage_devices_that_do_not_exist_are_refused():
  # Once: the layers were built on the CPU by soft placement, then refused as "built
  # before, with variable ... on CPU:0" (a layer nobody had built).
  pipe = GPipe([keras.layers.Dense(3), keras.layers.Dense(3)], devices=["/gpu:0", "/gpu:1"])
  with pytest.raises(ValueError, match=r"devices must be devices that exist in this "
                     r"process. Received: '.*GPU:0', '.*GPU:1', which TensorFlow does not "
                     r"have; it has \['.*CPU:0'"):
    pipe(tf.ones([4, 3]))
  mirrored = ds.MirroredStrategy(TOWERS)
  towers = GPipe([tf.nn.relu], devices={TOWERS[0]: ["/cpu:7"], TOWERS[1]: ["/cpu:8"]})
  with mirrored.scope(), pytest.raises(ValueError, match=r"Received: '.*CPU:7', '.*CPU:8'"):
    towers.build((4, 3))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_errors_keep_type_and_message_in_a_tf_function(mode):
  # Once, inside tf.function: AutoGraph's StagingError for a layer error, and the
  # other errors' messages prefixed with "in user code:" and a traceback.
  def run(fn):
    return tf.function(fn)() if mode == "function" else fn()

  with pytest.raises(ValueError, match=r"^GPipe splits each batch"):
    pipe = GPipe([tf.nn.relu, tf.nn.tanh], devices=CPUS[:2], num_micro_batches=4)
    run(lambda: pipe(tf.ones([6, 3])))
  pipe = GPipe([_built_dense(3, 5), tf.nn.relu], devices=CPUS[:1])
  with pytest.raises(ValueError, match=r"^Each layer must accept the previous layer's "
                     r"output, but layer 0") as raised:
    run(lambda: pipe(tf.ones([2, FEATURES])))
  assert type(raised.value).__name__ == "LayerError"
  with pytest.raises(ValueError, match=r"^GPipe needs an input_shape"):
    run(lambda: GPipe([tf.nn.relu], devices=CPUS[:1]).build(None))
  with pytest.raises(ValueError, match=r"^estimate_costs\(\) needs an input_shape.*Received: "
                     r"input_shape=None. Pass e.g. \(None, 784\)"):
    estimate_costs([tf.nn.relu], None)


def test_fit_of_a_keras_model_holding_a_pipeline_under_mirrored_names_the_towers_rule():
  """Keras builds a model for `fit` by calling it in cross-tower context. An unbuilt
  GPipe built itself there first, and Keras reported "'Variable' object has no attribute
  'device'" (from the placement check, on the symbolic variables Keras gives a build)
  instead of the pipeline's rule: call it in a tower."""

  class Holder(keras.Model):

    def __init__(self):
      super().__init__()
      self.stack = [keras.layers.Dense(4), keras.layers.Dense(1)]
      self.pipe = GPipe(self.stack, devices={CPUS[0]: [CPUS[0]], CPUS[1]: [CPUS[1]]})

    def call(self, x, training=False):
      return self.pipe(x, training=training)

  with ds.MirroredStrategy(CPUS[:2]).scope():
    model = Holder()
    model.compile("sgd", "mse")
  with pytest.raises(RuntimeError, match=r"(?s)Unable to automatically build the model.*"
                                         r"a GPipe runs in a tower, on that tower's stage "
                                         r"devices.*call_for_each_tower"):
    model.fit(np.zeros((8, 3), np.float32), np.zeros((8, 1), np.float32), batch_size=4,
              verbose=0)
  assert not model.pipe.built


class _PipelineModel(keras.Model):
  """docs/pipeline.md's Keras model holding a pipeline, its layers kept on the model."""

  def __init__(self, layers, **gpipe_kwargs):
    super().__init__(name="pipeline_model")  # A name scope may not start with "_".
    self.stack = layers
    self.pipe = GPipe(layers, **gpipe_kwargs)

  def call(self, x, training=None):
    return self.pipe(x, training=training)


class _SequentialModel(keras.Model):
  def __init__(self, layers):
    super().__init__(name="sequential_model")
    self.stack = layers

  def call(self, x, training=None):
    return _sequential(self.stack, x, training=training)


def test_fit_of_a_keras_model_holding_a_pipeline_with_xla_requested():
  """XLA compiles a step for one device. Keras's compile(jit_compile=True) (and "auto" on
  a machine with GPUs) compiled the step of a model holding a pipeline with it, and fit
  failed with TensorFlow's InvalidArgumentError "Trying to access resource ... located in
  device CPU:1 from device CPU:0". The pipeline's layers now tell Keras they do not
  support XLA: Keras warns and fits without it, as one device does."""
  xs, ys = _training_data()
  x, y = xs.reshape(-1, FEATURES), ys.reshape(-1, 3)
  reference = _SequentialModel(_make_layers(seed=8))
  reference(x[:2])
  model = _PipelineModel(_make_layers(seed=9), devices=CPUS[:2], num_micro_batches=2)
  model.pipe.build((None, FEATURES))
  model.set_weights(reference.get_weights())
  reference.compile(keras.optimizers.SGD(LR, momentum=0.9), "mse", jit_compile=False)
  with pytest.warns(UserWarning, match="jit_compile"):
    model.compile(keras.optimizers.SGD(LR, momentum=0.9), "mse", jit_compile=True)
  assert model.jit_compile is False
  want = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
  np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
  for g, e in zip(model.get_weights(), reference.get_weights(), strict=True):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_a_pipeline_in_an_xla_compiled_function_is_refused():
  """tf.function(jit_compile=True) around a pipeline of several devices failed when it
  ran, with TensorFlow's InvalidArgumentError "Trying to access resource ... located in
  device CPU:1 from device CPU:0", which names no pipeline and no fix."""
  pipe = GPipe(_make_layers(seed=3), devices=CPUS[:2], num_micro_batches=2)
  with pytest.raises(ValueError, match=r"^GPipe runs its stages on 2 devices, but it is "
                     r"called in a function compiled with XLA.*Call the pipeline in a "
                     r"tf.function without jit_compile"):
    tf.function(lambda t: pipe(t, training=True), jit_compile=True)(_input())
  np.testing.assert_allclose(tf.function(lambda t: pipe(t))(_input()),  # Without XLA: runs.
                             _sequential(pipe.layers, _input()), **TOL)
