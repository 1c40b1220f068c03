"""Models and tower functions that read parameter-server variables in every way there is.

Shared by tests/test_read_cache.py (one process) and tests/test_cluster.py, whose worker
processes import this module too: it must not import conftest, which would split the
worker's CPU into 4 devices at import. `train` and `run_case` run on 2 towers: the
strategy's worker devices.
"""

import keras
import numpy as np
import tensorflow as tf

import diststrat as ds


def ps_reads(step, args, ps_device):
  """ReadVariableOps on `ps_device` in the graph of `step(*args)` whose value leaves it.

  Follows each one through Identity ops on the PS (as `read_value()` makes); each that
  reaches an op elsewhere is a transfer from the PS per execution of the step.
  """
  ps = ds.canonicalize_device(ps_device)
  on_ps = lambda op: bool(op.device) and ds.canonicalize_device(op.device) == ps
  count = 0
  for op in step.get_concrete_function(*args).graph.get_operations():
    if op.type != "ReadVariableOp" or not on_ps(op):
      continue
    frontier, crosses = [op], False
    while frontier and not crosses:
      for consumer in (c for out in frontier.pop().outputs for c in out.consumers()):
        if on_ps(consumer) and consumer.type == "Identity":
          frontier.append(consumer)
        elif not on_ps(consumer):
          crosses = True
    count += crosses
  return count


def as_numpy(nest, strategy):
  """Every tensor of a nest of results, per tower, as numpy arrays."""
  flat = []
  for value in tf.nest.flatten(nest):
    parts = strategy.unwrap(value) if isinstance(value, ds.values.DistributedValues) else [value]
    flat += [np.asarray(tf.convert_to_tensor(p)) for p in parts]
  return flat


# --- training ---------------------------------------------------------------------------


class MLP(tf.Module):
  """w2 is used twice per tower (as tied weights are): 2 reads per tower uncached."""

  def __init__(self):
    super().__init__()
    rng = np.random.default_rng(1)
    self.w1 = tf.Variable(rng.normal(size=(6, 8)).astype(np.float32) * 0.3, name="w1")
    self.b1 = tf.Variable(np.zeros(8, np.float32), name="b1")
    self.w2 = tf.Variable(rng.normal(size=(8, 3)).astype(np.float32) * 0.3, name="w2")
    self.b2 = tf.Variable(np.zeros(3, np.float32), name="b2")
    self.weights = [self.w1, self.b1, self.w2, self.b2]

  def __call__(self, x):
    h = tf.nn.relu(x @ self.w1 + self.b1)
    return h @ self.w2 + self.b2 + 0.1 * tf.reduce_mean(self.w2)


class KerasDense(tf.Module):

  def __init__(self):
    super().__init__()
    keras.utils.set_random_seed(3)
    self.hidden, self.out = keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(3)
    self.hidden.build((None, 6))
    self.out.build((None, 3))
    self.weights = self.hidden.trainable_variables + self.out.trainable_variables

  def __call__(self, x):
    return self.out(self.hidden(x))


STEPS = 4
OPTIMIZERS = {"sgd": lambda: ds.optimizers.GradientDescent(0.1),
              "adam": lambda: ds.optimizers.Adam(0.05)}


def train(strategy, model_class, optimizer, mode):
  """Trains STEPS steps on 2 towers; returns the weights and the step (for counting)."""
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(STEPS, 2, 4, 6)).astype(np.float32)
  ys = rng.normal(size=(STEPS, 2, 4, 3)).astype(np.float32)
  with strategy.scope():
    model, opt = model_class(), OPTIMIZERS[optimizer]()

  def tower(x, y):
    opt.minimize(lambda: tf.reduce_mean(tf.square(model(x) - y)), var_list=model.weights)

  def step(x, y):
    strategy.call_for_each_tower(
        tower, ds.values.PerDevice(dict(zip(strategy.worker_devices, tf.unstack(x), strict=True))),
        ds.values.PerDevice(dict(zip(strategy.worker_devices, tf.unstack(y), strict=True))))

  if mode == "function":
    step = tf.function(step)
  with strategy.scope():
    for i in range(STEPS):
      strategy.run_step(step, tf.constant(xs[i]), tf.constant(ys[i]))
  return [v.numpy() for v in model.weights], step, (tf.constant(xs[0]), tf.constant(ys[0]))


# --- tower functions: every way a tape or a graph sees a read ----------------------------


def _tower_input():
  tower_id = ds.get_tower_context().tower_id
  return tf.constant(np.arange(8, dtype=np.float32).reshape(2, 4) * (0.1 + tower_id))


def _loss(w, b, x):
  h = tf.tanh(x @ w + b)
  return tf.reduce_sum(h * h) + tf.reduce_sum(w) * tf.reduce_mean(b)  # w, b used twice


def case_auto_watch(v):
  with tf.GradientTape() as tape:
    loss = _loss(v["w"], v["b"], _tower_input())
  watched = sorted(u.name for u in tape.watched_variables())
  return tape.gradient(loss, [v["w"], v["b"]]), tf.constant(watched == sorted(
      [v["w"].name, v["b"].name]))


def case_explicit_watch(v):
  with tf.GradientTape(watch_accessed_variables=False) as tape:
    tape.watch(v["w"])
    loss = _loss(v["w"], v["b"], _tower_input())
  return tape.gradient(loss, [v["w"], v["b"]], unconnected_gradients="zero")


def case_persistent_and_second_order(v):
  with tf.GradientTape() as outer:
    with tf.GradientTape(persistent=True) as inner:
      loss = _loss(v["w"], v["b"], _tower_input())
    gw, gb = inner.gradient(loss, v["w"]), inner.gradient(loss, v["b"])
    norm = tf.reduce_sum(gw * gw)
  return gw, gb, outer.gradient(norm, [v["w"], v["b"]])


def case_keras_layer(v):
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.square(v["layer"](_tower_input())))
  return tape.gradient(loss, v["layer"].trainable_variables)


def case_symbolic_gradients(v):
  if tf.executing_eagerly():
    return tf.constant(0.0)  # tf.gradients is for graphs only.
  return tf.gradients(_loss(v["w"], v["b"], _tower_input()), [v["w"], v["b"]])


def case_sparse_and_dense(v):
  ids = tf.constant([1, 3, 3, 7 + ds.get_tower_context().tower_id])
  with tf.GradientTape() as tape:
    rows = tf.gather(v["emb"], ids)  # A sparse read: not cached.
    loss = tf.reduce_sum(rows @ v["w"]) + tf.reduce_sum(v["emb"][0])  # emb[0]: dense.
  grad_w, grad_emb = tape.gradient(loss, [v["w"], v["emb"]])
  return grad_w, tf.convert_to_tensor(grad_emb)


def case_write_then_read(v):
  before = v["w"] * 1.0
  v["b"].assign_add(tf.ones([3]))  # Every tower adds 1 to the shared b.
  after = v["b"] * 1.0
  v["w"].assign(v["w"] * 2.0)
  v["emb"][0:2].assign(tf.fill([2, 4], 5.0))  # Slice assignment.
  return before, after, tf.identity(v["w"]), v["emb"] + 0.0


def case_read_after_merge_call(v):
  x = _tower_input()
  before = tf.identity(v["w"])
  v["opt"].minimize(lambda: _loss(v["w"], v["b"], x), var_list=[v["w"], v["b"]])
  return before, tf.identity(v["w"]), v["b"] + 0.0


def case_cond(v):
  x = _tower_input()
  with tf.GradientTape() as tape:
    y = tf.cond(tf.reduce_sum(x) > 0.0, lambda: tf.reduce_sum(v["w"] * 2.0),
                lambda: tf.reduce_sum(v["w"]))
    loss = y * tf.reduce_sum(v["w"]) + _loss(v["w"], v["b"], x)
  return tape.gradient(loss, [v["w"], v["b"]])


@tf.function
def _inner_loss(w, b, x):
  return _loss(w, b, x)


def case_inner_function(v):
  with tf.GradientTape() as tape:
    loss = _inner_loss(v["w"], v["b"], _tower_input()) + tf.reduce_sum(v["w"] * v["w"])
  return tape.gradient(loss, [v["w"], v["b"]])


def case_forward_accumulator(v):
  with tf.autodiff.ForwardAccumulator(v["w"], tf.ones_like(v["w"])) as acc:
    loss = _loss(v["w"], v["b"], _tower_input())
  return acc.jvp(loss)


CASES = [case_auto_watch, case_explicit_watch, case_persistent_and_second_order,
         case_keras_layer, case_symbolic_gradients, case_sparse_and_dense,
         case_write_then_read, case_read_after_merge_call, case_cond, case_inner_function,
         case_forward_accumulator]


def run_case(strategy, case, mode):
  rng = np.random.default_rng(7)
  with strategy.scope():
    v = {"w": tf.Variable(rng.normal(size=(4, 3)).astype(np.float32), name="w"),
         "b": tf.Variable(rng.normal(size=(3,)).astype(np.float32), name="b"),
         "emb": tf.Variable(rng.normal(size=(10, 4)).astype(np.float32), name="emb"),
         "opt": ds.optimizers.GradientDescent(0.1)}
    keras.utils.set_random_seed(3)
    v["layer"] = keras.layers.Dense(3, activation="tanh")
    v["layer"].build((None, 4))

  def step():
    return strategy.call_for_each_tower(case, v)

  if mode == "function":
    step = tf.function(step)
  with strategy.scope():
    out = strategy.run_step(step)
  return as_numpy(out, strategy) + [u.numpy() for u in (v["w"], v["b"], v["emb"])]
