"""Layer costs: the FLOPs of the ops each layer adds to a traced graph.

Each layer is traced on its own, in a scratch graph, for a given input shape:

* a Keras layer is cloned (`from_config`, built like the original when the original is
  built) and called on a placeholder in a fresh TF1-style graph, so its variables are
  graph nodes that are never allocated and the user's layer is left untouched;
* any other callable is called on a placeholder the same way, or, when it reads eager
  variables (a `tf.Module`), traced with `tf.function` instead.

The layer is called twice and only the ops of the second call are counted, so variable
creation and initialization never count. FLOPs per op: `2 * M * N * K` for matrix
products (MatMul, BatchMatMul, Einsum), `2 * outputs * kernel elements per output` for
convolutions, and one per element of the largest floating-point input or output for
everything else (elementwise arithmetic, activations, reductions, softmax, ...); ops
that only move or describe data (Identity, Reshape, Shape, ReadVariableOp, ...) are free.
Counts are what the model asks for, not what a kernel library does; their use is to
compare layers.

Tracing also yields each layer's output shape, which is the next layer's input shape: a
layer that cannot take the previous layer's output fails here, before anything runs.
"""

import contextlib
import inspect
import re
from typing import Any

from diststrat._tf import tf
from diststrat import _tf_internal

_FREE_OPS = frozenset({
    "Assert", "AssignVariableOp", "BroadcastArgs", "BroadcastGradientArgs", "CheckNumerics",
    "Const", "ExpandDims", "Identity", "IdentityN", "NoOp", "Pack", "Placeholder",
    "PlaceholderWithDefault", "PreventGradient", "Rank", "ReadVariableOp", "Reshape", "Shape",
    "ShapeN", "Size", "Squeeze", "StopGradient", "VarHandleOp", "VarIsInitializedOp",
})
_MATMUL_OPS = {"MatMul": "transpose_a", "BatchMatMul": "adj_x", "BatchMatMulV2": "adj_x",
               "BatchMatMulV3": "adj_x"}
_CONV_OPS = frozenset({"Conv2D", "Conv3D", "Conv"})
_CONV_TRANSPOSE_OPS = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2"})


class LayerError(ValueError):
  """A layer cannot take its input (raised while tracing, with the layers named)."""


def keras_layer_class():
  """`keras.layers.Layer`, or None when Keras is not installed."""
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - Keras ships with TensorFlow >= 2.16
    return None
  return keras.layers.Layer


def is_keras_layer(layer):
  cls = keras_layer_class()
  return cls is not None and isinstance(layer, cls)


def describe(layer, index):
  """`layer 3 ('dense_2')`, for messages."""
  name = getattr(layer, "name", None) or getattr(layer, "__name__", None) or \
      type(layer).__name__
  return f"layer {index} ({name!r})"


def call_layer(layer, x, training):
  """Calls `layer` on `x`, passing `training` when the layer takes it."""
  if is_keras_layer(layer) or accepts_training(layer):
    return layer(x, training=training)
  return layer(x)


def accepts_training(fn):
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return "training" in parameters or any(
      p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def check_input_shape(who, input_shape):
  """`input_shape` as a tuple (None for unknown sizes), else `ValueError` with the fix."""
  try:
    shape = tf.TensorShape(input_shape)
  except (TypeError, ValueError):
    shape = None
  if shape is None or shape.rank is None or shape.rank == 0:
    raise ValueError(
        f"{who} needs an input_shape: the shape of a whole batch, batch dimension first "
        f"(which may be None). Received: input_shape={input_shape!r}. Pass e.g. "
        "(None, 784) or x.shape.")
  return tuple(shape.as_list())


def estimate_costs(layers: Any, input_shape: Any, dtype: Any = "float32") -> list[float]:
  """Estimates each layer's cost in FLOPs for one input of `input_shape`.

  Each layer is traced alone in a scratch graph (a clone for Keras layers, so nothing
  is built or allocated) and the FLOPs of its ops are added up: `2*M*N*K` for matrix
  products, `2 * outputs * kernel size` for convolutions, one per element for other
  arithmetic, zero for ops that only reshape or move data.

  Args:
    layers: a list of Keras 3 layers or callables (tensor in, tensor out), in order.
    input_shape: the shape of the first layer's input, batch dimension included (None
      counts as 1).
    dtype: the input's dtype.

  Returns:
    A list of floats, one per layer.

  Raises:
    ValueError: a layer cannot take the previous layer's output (names both layers
      and the shape), or a layer's cost cannot be traced.

  Example:
    >>> import keras
    >>> from diststrat.pipeline import estimate_costs
    >>> estimate_costs([keras.layers.Dense(3), keras.layers.ReLU()], (2, 4))
    [54.0, 6.0]
  """
  input_shape = check_input_shape("estimate_costs()", input_shape)
  costs = trace_layers(list(layers), input_shape, dtype).costs
  missing = [i for i, c in enumerate(costs) if c is None]
  if missing:
    raise ValueError(
        "Counting a layer's FLOPs traces a clone of it, made from its get_config(). "
        f"Received: {describe(layers[missing[0]], missing[0])} whose get_config() fails "
        f"({len(missing)} such layer(s), at positions {missing}). Implement get_config() "
        "in the layer, or give GPipe an explicit partition=[n0, n1, ...].")
  return costs


class Trace:
  """What tracing the layers found.

  Attributes:
    costs: FLOPs per layer (None where a layer could not be traced).
    specs: the (shape, dtype) of each layer's input, then of the last layer's output (a
      None batch dimension stays None).
    captured: per layer, the trainable variables a non-Keras callable reads (found when
      it is traced as a tf.function), else [].
  """

  def __init__(self):
    self.costs, self.specs, self.captured = [], [], []


def trace_layers(layers, input_shape, dtype="float32"):
  """Traces each layer on the previous one's output shape; returns a `Trace`.

  Raises:
    LayerError: a layer cannot take the previous layer's output.
  """
  dtype = tf.as_dtype(dtype)
  shape = tuple(tf.TensorShape(input_shape).as_list())
  trace = Trace()
  trace.specs.append((shape, dtype))
  for i in range(len(layers)):
    with _keras_global_seed_generator_kept():
      cost, out_shape, out_dtype, captured = _trace_one(layers, i, shape, dtype)
    trace.costs.append(cost)
    trace.captured.append(captured)
    if shape and out_shape and shape[0] is None:
      out_shape = (None,) + tuple(out_shape[1:])
    shape, dtype = tuple(out_shape), out_dtype
    trace.specs.append((shape, dtype))
  return trace


@contextlib.contextmanager
def _keras_global_seed_generator_kept():
  """Keeps this thread's Keras global seed generator as it was before a trace.

  A layer that draws without a seed (`keras.random.uniform(shape)`) makes Keras's global
  generator on its first draw: made in a scratch graph, its state would be a graph
  tensor that every later unseeded draw of the thread fails to use ("out of scope").
  """
  thread_globals = _tf_internal.keras_thread_globals()
  if thread_globals is None:
    yield
    return
  before = _tf_internal.keras_global_seed_generator(thread_globals)
  try:
    yield
  finally:
    _tf_internal.set_keras_global_seed_generator(thread_globals, before)


def _refusing_variables(layers, index, original):
  """While entered, creating a variable raises `LayerError` when `original`: a callable
  that makes its variables when first called would make them in the trace's graph, held
  by the user's object (and, out of GPipe's reach, on no stage's device)."""
  if not original:
    return contextlib.nullcontext()

  def refuse(next_creator, **kwargs):
    del next_creator  # Never created.
    raise LayerError(
        "GPipe places each layer's variables on its stage's device, which it does when it "
        f"builds Keras layers; but {describe(layers[index], index)}, not a Keras layer, "
        f"creates a variable ({kwargs.get('name')!r}) when it is called. Received: a "
        f"{type(layers[index]).__name__} that makes its variables on its first call. "
        "Create them in its constructor, under tf.device() of its stage's device, and "
        "give GPipe an explicit partition=[n0, n1, ...]; or make it a Keras layer.")

  return tf.variable_creator_scope(refuse)


def _concrete(shape):
  return [1 if d is None else d for d in shape]


def _fmt(shape):
  return "(" + ", ".join("None" if d is None else str(d) for d in shape) + \
      ("," if len(shape) == 1 else "") + ")"


def _trace_one(layers, index, shape, dtype):
  """(flops or None, output shape, output dtype, variables read) of layers[index]."""
  layer = layers[index]
  if is_keras_layer(layer):
    try:
      config = layer.get_config()
    except Exception:  # pylint: disable=broad-except
      return None, _keras_output_shape(layers, index, shape), dtype, []
    build_config = layer.get_build_config() if layer.built else None

    def make_clone():  # Called inside the scratch graph: the clone's state lives there.
      clone = type(layer).from_config(config)
      if build_config is not None:
        try:
          clone.build_from_config(build_config)
        except Exception:  # pylint: disable=broad-except
          pass  # Built by its first call instead.
      return clone

    return _trace_in_graph(layers, index, make_clone, shape, dtype)
  try:
    return _trace_in_graph(layers, index, lambda: layer, shape, dtype,
                           eager_state_error=True, original=True)
  except LayerError:
    raise
  except Exception:  # pylint: disable=broad-except
    # It reads eager variables (a tf.Module): trace it as a tf.function instead.
    return _trace_function(layers, index, layer, shape, dtype)


def _keras_output_shape(layers, index, shape):
  """The output shape of a Keras layer that cannot be cloned, if it says how to find it."""
  layer = layers[index]
  if type(layer).compute_output_shape is keras_layer_class().compute_output_shape:
    # Keras's default would build the layer here, on the wrong device.
    raise LayerError(
        f"GPipe traces each layer on a clone before building it, but "
        f"{describe(layer, index)} cannot be cloned (its get_config() fails) and does not "
        "define compute_output_shape(). Received: a layer of class "
        f"{type(layer).__name__}. Implement get_config() (Keras's serialization guide) or "
        "compute_output_shape() in the layer.")
  try:
    return tuple(layer.compute_output_shape(shape))
  except Exception as e:  # pylint: disable=broad-except
    raise _mismatch(layers, index, shape, e) from e


def _trace_in_graph(layers, index, make_layer, shape, dtype, eager_state_error=False,
                    original=False):
  """Traces `make_layer()` (the original, or a Keras clone made there) in a scratch graph.

  With `eager_state_error`, an error caused by reading eager state is re-raised as it is
  (the caller then traces a tf.function); any other error means the layer does not fit.
  `original`: the user's own callable, which may not create variables here.
  """
  graph = tf.Graph()
  with graph.as_default(), _refusing_variables(layers, index, original):
    x = tf.compat.v1.placeholder(dtype, _concrete(shape))
    try:
      layer = make_layer()
    except Exception:  # pylint: disable=broad-except
      # from_config() does not rebuild this layer: count it as unknown.
      return None, _keras_output_shape(layers, index, shape), dtype, []
    try:
      call_layer(layer, x, training=True)  # Builds: creates (never runs) its variables.
      first = len(graph.get_operations())
      y = call_layer(layer, x, training=True)
    except LayerError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      if eager_state_error and _reads_eager_state(e):
        raise
      raise _mismatch(layers, index, shape, e) from e
    y = _single_tensor(layers, index, y)
    flops = sum(op_flops(op) for op in graph.get_operations()[first:])
  return float(flops), tuple(y.shape.as_list()), y.dtype, []


def _reads_eager_state(error):
  text = str(error)
  return "EagerTensor" in text or "eager" in text.lower()


def _trace_function(layers, index, layer, shape, dtype):
  fn = tf.function(lambda t: call_layer(layer, t, training=True), autograph=False)
  try:
    with _refusing_variables(layers, index, True):
      concrete = fn.get_concrete_function(tf.TensorSpec(_concrete(shape), dtype))
  except LayerError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise _mismatch(layers, index, shape, e) from e
  y = _single_tensor(layers, index, concrete.structured_outputs)
  flops = sum(op_flops(op) for op in concrete.graph.get_operations())
  return float(flops), tuple(y.shape.as_list()), y.dtype, list(concrete.trainable_variables)


def _single_tensor(layers, index, y):
  if not isinstance(y, tf.Tensor):
    raise LayerError(
        f"Each pipeline layer must return one tensor, the next layer's input. Received: "
        f"{describe(layers[index], index)} returned {type(y).__name__}. Wrap it so that it "
        "returns a single tensor.")
  return y


def _mismatch(layers, index, shape, error):
  first_line = str(error).strip().splitlines()
  reason = " ".join(line.strip() for line in first_line[:6] if line.strip())[:600]
  if index == 0:
    source = "the pipeline's input"
  else:
    source = f"the output of {describe(layers[index - 1], index - 1)}"
  return LayerError(
      f"Each layer must accept the previous layer's output, but {describe(layers[index], index)} "
      f"cannot take {source}. Received: input shape {_fmt(shape)}; the layer raised "
      f"{type(error).__name__}: {reason} Fix the layer sizes so that consecutive layers "
      "fit, or reorder the layers.")


def _elements(shape):
  if shape.rank is None:
    return 0
  total = 1
  for d in shape.as_list():
    total *= 1 if d is None else d
  return total


def _float_tensors(tensors):
  return [t for t in tensors if t.dtype.is_floating or t.dtype.is_complex]


def op_flops(op):
  """FLOPs of one graph op, from its static shapes (see the module docstring)."""
  if op.type in _FREE_OPS:
    return 0
  outputs = _float_tensors(op.outputs)
  if not outputs:
    return 0
  out = outputs[0].shape
  if op.type in _MATMUL_OPS:
    a = op.inputs[0].shape.as_list()
    adjoint = op.get_attr(_MATMUL_OPS[op.type])
    k = a[-2] if adjoint else a[-1]
    return 2 * _elements(out) * (k or 1)
  if op.type in _CONV_OPS:
    kernel = op.inputs[1].shape.as_list()
    return 2 * _elements(out) * _product(kernel[:-1])
  if op.type == "DepthwiseConv2dNative":
    kernel = op.inputs[1].shape.as_list()
    return 2 * _elements(out) * _product(kernel[:2])
  if op.type in _CONV_TRANSPOSE_OPS:
    kernel = op.inputs[1].shape.as_list()
    return 2 * _elements(op.inputs[2].shape) * _product(kernel[:-1])
  if op.type == "Einsum":
    flops = _einsum_flops(op)
    if flops is not None:
      return flops
  return max(_elements(t.shape) for t in _float_tensors(list(op.inputs)) + outputs)


def _product(dims):
  total = 1
  for d in dims:
    total *= 1 if d is None else d
  return total


def _einsum_flops(op):
  """2 * the product of the sizes of every index letter, for equations without '...'."""
  equation = op.get_attr("equation")
  if isinstance(equation, bytes):
    equation = equation.decode()
  if "..." in equation:
    return None
  inputs = equation.replace(" ", "").split("->")[0].split(",")
  sizes = {}
  for letters, tensor in zip(inputs, op.inputs, strict=False):  # An estimate never raises.
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else []
    if len(dims) != len(letters):
      return None
    for letter, d in zip(letters, dims, strict=True):
      sizes[letter] = d or 1
  if not re.fullmatch(r"[a-zA-Z]*", "".join(inputs)):
    return None
  return 2 * _product(sizes.values())
