"""GPipe's schedule: micro-batches through stages, forward then backward.

With S stages and M micro-batches, cell (k, s) is "micro-batch k on stage s". The forward
pass visits the cells in clock order (clock t holds the cells with k + s = t); each cell
runs on its stage's device after (k, s - 1), which produced its input, and after
(k - 1, s), the previous cell on the same device (a control dependency). For S = 3, M = 4::

    clock        0    1    2    3    4    5
    device 0    F0   F1   F2   F3
    device 1         F0   F1   F2   F3
    device 2              F0   F1   F2   F3

The backward pass starts when the whole output's gradient is known (so after every
forward cell), and visits the cells in the mirror order: the last stage first, the last
micro-batch first, each cell after (k, s + 1), which produced its output gradient, and
after (k + 1, s). Each stage's variable gradients are summed over the micro-batches on
the stage's device and handed to the tape once.

Inside `tf.function`, these dependencies are the whole schedule: TensorFlow's executor
runs cells of different devices at the same time as soon as their inputs are ready. In
eager mode the cells run one after the other in clock order (same results, no overlap).

Without re-materialization each forward cell is recorded on its own tape, which keeps
the cell's activations for the backward pass. With it, the forward pass records nothing
and keeps only each cell's input; the backward pass runs the cell's forward again, on
its device, once the output gradient has arrived, and differentiates that.
"""

import contextlib

from diststrat._tf import tf
from diststrat import _tf_internal
from diststrat.values import _wrapped


class Stage:
  """One stage as the schedule sees it: a device, a function, and its variables.

  Args:
    index: the stage's position.
    device: where its ops and variables are.
    fn: `fn(x) -> y`, the stage's layers applied in order.
    variables: the TensorFlow variables to differentiate (what the layers declare).
    state: the layers' other variables (random seeds, moving statistics): a recomputed
      cell starts from the values they had before the cell's forward pass, and leaves
      them as it found them.
    context: a function returning a context manager to enter around the stage's ops
      (besides its device), e.g. one that makes mirrored variables read the stage's copy.
  """

  def __init__(self, index, device, fn, variables, state=(), context=None):
    self.index = index
    self.device = device
    self.fn = fn
    self.variables = list(variables)
    self.state = list(state)
    self._context = context or contextlib.nullcontext

  @contextlib.contextmanager
  def scope(self, name):
    with tf.device(self.device), tf.name_scope(name), self._context():
      yield


def forward_order(num_micro_batches, num_stages):
  """The cells (k, s) in forward clock order."""
  for clock in range(num_micro_batches + num_stages - 1):
    for s in range(num_stages):
      k = clock - s
      if 0 <= k < num_micro_batches:
        yield k, s


def backward_order(num_micro_batches, num_stages):
  """The cells (k, s) in backward clock order: the mirror image of `forward_order`."""
  cells = list(forward_order(num_micro_batches, num_stages))
  clocks = {}
  for k, s in cells:
    clocks.setdefault(k + s, []).append((k, s))
  for clock in sorted(clocks, reverse=True):
    yield from sorted(clocks[clock], reverse=True)


def run(stages, x, num_micro_batches, recompute, name="gpipe"):
  """Runs `x` through `stages` in GPipe's schedule; records GPipe's backward on the tape.

  Args:
    stages: a list of `Stage`.
    x: the batch, a tensor whose first dimension is divisible by `num_micro_batches`.
    num_micro_batches: M.
    recompute: whether the backward pass recomputes each cell's forward.
    name: the name scope of the ops.

  Returns:
    The last stage's outputs for the micro-batches, concatenated: what the layers in
    sequence return for `x`.
  """
  num_stages = len(stages)
  with tf.name_scope(name):
    # One read of each variable, on its stage's device, made in the caller's context:
    # the tape sees the pipeline as an op of (x, these reads), and gives the gradient it
    # gets for a read to whoever asks for the variable's gradient.
    reads = []
    for stage in stages:
      with tf.device(stage.device):
        reads.extend(tf.convert_to_tensor(v) for v in stage.variables)
    recording = _tf_internal.should_record([x] + reads)

    with tf.device(stages[0].device):
      micro_batches = _split(x, num_micro_batches)
    cells = _Cells()
    pause = _tf_internal.stop_recording() if (recompute or not recording) else contextlib.nullcontext()
    with pause:
      _forward(stages, micro_batches, cells, keep_state=recording,
               keep_tapes=recording and not recompute)
      with tf.device(stages[-1].device):
        result = _concat([cells.outputs[k, num_stages - 1] for k in range(num_micro_batches)])
    if not recording:
      return result

    def backward(d_result):
      if recompute and _tf_internal.should_record([d_result, x] + reads):
        # The backward pass is itself recorded (a gradient of a gradient): the tapes
        # must see every cell's input come from x and the variables, which the paused
        # forward pass hid from them. Run the forward again, recorded, keeping tapes.
        with tf.name_scope(name + "_rematerialize"):
          _forward(stages, _split(x, num_micro_batches), cells, keep_state=False,
                   keep_tapes=True, replay=True)
      return _backward(stages, cells, d_result, x, num_micro_batches, name)

    _tf_internal.record_backward("GPipe", [result], [x] + reads, backward)
    return result


def _forward(stages, micro_batches, cells, keep_state, keep_tapes, replay=False):
  """Runs every cell forward in clock order, filling `cells`.

  Args:
    keep_state: keep each cell's stage state values from before the cell.
    keep_tapes: record each cell on its own tape (kept for the backward pass).
    replay: start each cell from the state kept for it, and leave the state as found.
  """
  for k, s in forward_order(len(micro_batches), len(stages)):
    stage = stages[s]
    inp = micro_batches[k] if s == 0 else cells.outputs[k, s - 1]
    after = [cells.outputs[k - 1, s]] if k > 0 else []
    with stage.scope(f"forward/stage_{s}/micro_batch_{k}"), _after(after):
      if keep_state and stage.state:
        cells.states[k, s] = [tf.identity(v) for v in stage.state]
      with _replayed_state(stage, cells.states.get((k, s)) if replay else None):
        if keep_tapes:
          tape = tf.GradientTape()
          with tape:
            if _differentiable(inp):
              tape.watch(inp)
            tape.watch(stage.variables)
            y = stage.fn(inp)
          _check_declared(stage, tape)
          cells.tapes[k, s] = tape
        else:
          y = stage.fn(inp)
    cells.inputs[k, s] = inp
    cells.outputs[k, s] = y


class _Cells:
  """What the forward pass keeps per cell (k, s): input, output, tape, state values."""

  def __init__(self):
    self.inputs = {}
    self.outputs = {}
    self.tapes = {}
    self.states = {}  # The stage's state variables' values before the cell.


def _backward(stages, cells, d_result, x, num_micro_batches, name):
  """GPipe's backward pass: returns the gradients of x and of every variable read."""
  num_stages = len(stages)
  with tf.name_scope(name + "_backward"):
    with tf.device(stages[-1].device):
      d_outputs = _split(d_result, num_micro_batches)
    d_inputs = {}
    grads = [[None] * len(stage.variables) for stage in stages]
    previous = [[] for _ in stages]  # The last backward cell's results, per stage.
    for k, s in backward_order(num_micro_batches, num_stages):
      stage = stages[s]
      dy = d_outputs[k] if s == num_stages - 1 else d_inputs[k, s + 1]
      if dy is None:  # Nothing flows back through this micro-batch.
        d_inputs[k, s] = None
        continue
      with stage.scope(f"backward/stage_{s}/micro_batch_{k}"), _after(previous[s]):
        inp = cells.inputs[k, s]
        # A forward tape is used once and dropped, so the cell's activations go as soon
        # as its gradients exist. A second backward pass (a persistent outer tape)
        # finds no tape and recomputes.
        tape = cells.tapes.pop((k, s), None)
        if tape is None:
          with _after([dy]):  # Recompute when the gradient arrives, not earlier.
            inp = tf.identity(inp)
          with _replayed_state(stage, cells.states.get((k, s))):
            with tf.GradientTape() as tape:
              if _differentiable(inp):
                tape.watch(inp)
              tape.watch(stage.variables)
              y = stage.fn(inp)
          _check_declared(stage, tape)
        else:
          y = cells.outputs[k, s]
        sources = ([inp] if _differentiable(inp) else []) + stage.variables
        result = tape.gradient(y, sources, output_gradients=dy)
        if not _differentiable(inp):
          result = [None] + list(result)
        d_inputs[k, s] = result[0]
        for i, g in enumerate(result[1:]):
          grads[s][i] = _accumulate(grads[s][i], g)
      # The stage's next cell waits for these sums, not only for this cell's gradients:
      # then one cell's gradients are alive at a time per stage. (Otherwise TensorFlow's
      # graph optimizer may turn the chain of sums into one AddN that keeps all M.)
      previous[s] = [_as_tensor_for_deps(g) for g in [result[0]] + grads[s] if g is not None]
    with tf.device(stages[0].device):
      d_parts = [d_inputs[k, 0] for k in range(num_micro_batches)]
      if all(d is None for d in d_parts) or not _differentiable(x):
        d_x = None
      else:
        d_x = _concat([tf.zeros_like(cells.inputs[k, 0]) if d is None else d
                       for k, d in enumerate(d_parts)])
  return [d_x] + [g for stage_grads in grads for g in stage_grads]


@contextlib.contextmanager
def _replayed_state(stage, before):
  """Sets the stage's state to `before` for a recomputation, then restores it.

  So a recomputed Dropout draws the mask it drew in the forward pass, and moving
  statistics are updated once per cell, not twice.
  """
  if not before:
    yield
    return
  now = [tf.identity(v) for v in stage.state]
  for v, value in zip(stage.state, before, strict=True):
    v.assign(value)
  yield
  for v, value in zip(stage.state, now, strict=True):
    v.assign(value)


def _split(x, num_micro_batches):
  if num_micro_batches == 1:
    return [x]
  return tf.split(x, num_micro_batches, axis=0)


def _concat(parts):
  if len(parts) == 1:
    return tf.identity(parts[0])
  return tf.concat(parts, axis=0)


def _differentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


def _after(tensors):
  """Control dependencies on `tensors` in a graph; nothing in eager mode."""
  tensors = [t for t in tensors if t is not None]
  if not tensors or tf.executing_eagerly():
    return contextlib.nullcontext()
  return tf.control_dependencies(tensors)


def _as_tensor_for_deps(g):
  return g.values if isinstance(g, tf.IndexedSlices) else g


def _accumulate(total, g):
  """total + g; IndexedSlices stay sparse (values and indices concatenated)."""
  if g is None:
    return total
  if total is None:
    return g
  if isinstance(total, tf.IndexedSlices) and isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(tf.concat([total.values, g.values], 0),
                            tf.concat([total.indices, g.indices], 0), total.dense_shape)
  return tf.convert_to_tensor(total) + tf.convert_to_tensor(g)


def _check_declared(stage, tape):
  """Raises if the stage read a trainable variable that its layers do not declare.

  A variable the layers declare non-trainable (a Keras layer frozen after it was built:
  its variables stay trainable for TensorFlow) is declared too, and not differentiated.
  """
  check_declared(stage.index, stage.variables + stage.state, tape.watched_variables())


def check_declared(stage_index, declared, used):
  """Raises ValueError if a variable of `used` is none of `declared` (nor a copy of one)."""
  known = {id(v) for v in declared}
  for v in used:
    if id(v) in known or id(_wrapped.container_of(v)) in known:
      continue
    raise ValueError(
        "GPipe differentiates the variables that its layers declare (their "
        f"trainable_variables), but stage {stage_index} reads the trainable variable "
        f"{v.name!r}, which none of its layers declares. Received: stage {stage_index} "
        f"declares {[getattr(d, 'name', '?') for d in declared]}. Make the callable that "
        "uses it a tf.Module or a Keras layer that owns the variable.")
