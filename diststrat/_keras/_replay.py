"""A gradient Keras transformed after the sum, computed on each device instead of copied.

Keras's `apply` runs once, in cross-tower context, on the first device's copy of each
summed gradient (`_training.apply_summed`). When Keras changes a gradient before it
updates a variable (clipping, `LossScaleOptimizer`'s unscaling), the tensor it hands
to `extended.update` is a new one, computed on the first device; updating every copy
of the variable from it would copy it to every other device, each step. In a traced
step, `per_device` builds the same computation again on each other device, from that
device's copy of the sum: the ops between the sums and the value are replayed there.

Only where a copy costs: between CPU devices of one process TensorFlow's copy shares the
buffer (no bytes move; docs/design/tensorflow_facts.md), cheaper than computing again,
so on CPUs the value is copied as before (`REPLAY_ON_CPUS`, which tests set to check the
replay on logical CPUs).

What is replayed: stateless ops whose result has more than one element, back to the
sums. What is not: a value of one element (a norm, a loss scale, a clipping factor) is
used as it is, from wherever it was computed (one scalar copied); anything else (an op
that reads or writes state, a function call, control flow, a `tf.while_loop` input,
eager tensors) makes `per_device` give up, and the value is copied as before.
"""

import re
from typing import Any

from diststrat._tf import tf

# Op types never replayed even when TensorFlow does not mark them stateful: they call
# functions or carry control flow, whose bodies this does not rebuild.
_NOT_REPLAYED = frozenset({
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "Switch", "Merge", "Enter", "Exit",
    "NextIteration", "LoopCond", "Placeholder", "PlaceholderWithDefault"})
# Ops looked at for one value at most (replayed or not): beyond, it is copied. Clipping
# or unscaling a gradient takes a few; a value that depends on the model's whole graph
# (not only on the sums) is not worth walking.
_MAX_OPS = 128

# Whether to replay where every device is a CPU (see the module's docstring).
REPLAY_ON_CPUS = False

_SHARED = object()  # "the same tensor on every device": it depends on no sum


class Replayer:
  """Replays, per device, what lies between per-device `sources` and a value.

  Args:
    sources: `{tensor.ref(): {device: tensor}}`: the first device's copy of each sum,
      and its copy on each device.
    devices: the devices to compute on; the first is where the values already are.
  """

  def __init__(self, sources: dict, devices):
    self._sources = sources
    self._devices = tuple(devices)
    self._replayed: dict = {}  # op -> {device: new op}, or _SHARED
    self._pays = len(self._devices) > 1 and (REPLAY_ON_CPUS or any(
        tf.DeviceSpec.from_string(d).device_type != "CPU" for d in self._devices))

  @property
  def devices(self):
    return self._devices

  def per_device(self, value: Any):
    """`{device: tensor}` computing `value` on each device, or None (copy it instead)."""
    if not self._pays or not isinstance(value, tf.Tensor) or tf.executing_eagerly() or \
        not hasattr(value, "op"):
      return None
    try:
      mapped = self._map(value, budget=[_MAX_OPS])
    except (_GiveUp, RecursionError):
      return None
    if mapped is _SHARED:
      return None
    return mapped

  def _map(self, tensor, budget):
    found = self._sources.get(tensor.ref())
    if found is not None:
      return found
    if tensor.shape.num_elements() == 1:
      return _SHARED  # A scalar: used as it is (one small copy).
    op = tensor.op
    if op.type == "Placeholder":
      outer = _captured_from(tensor)
      if outer is None:
        raise _GiveUp()
      if not hasattr(outer, "op"):
        return _SHARED  # An eager tensor the function captured: a constant.
      return self._map(outer, budget)
    if op not in self._replayed:
      self._replayed[op] = self._replay(op, budget)
    copies = self._replayed[op]
    if copies is _SHARED:
      return _SHARED
    return {d: (tensor if d == self._devices[0] else copies[d].outputs[tensor.value_index])
            for d in self._devices}

  def _replay(self, op, budget):
    budget[0] -= 1
    if budget[0] < 0 or op.type in _NOT_REPLAYED or op.op_def.is_stateful or any(
        t.dtype in (tf.resource, tf.variant) for t in list(op.inputs) + list(op.outputs)):
      raise _GiveUp()
    inputs = [self._map(t, budget) for t in op.inputs]
    if all(i is _SHARED for i in inputs):
      return _SHARED  # Depends on no sum (a constant): every device uses it as it is.
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}  # colocation
    base = re.sub(r"[^A-Za-z0-9_.\-]", "_", op.name.split("/")[-1])
    replayed = {}
    for k, device in enumerate(self._devices[1:], start=1):
      args = [t if i is _SHARED else i[device] for t, i in zip(op.inputs, inputs, strict=True)]
      with op.graph.as_default(), tf.control_dependencies(None), \
          tf.control_dependencies(op.control_inputs), tf.device(device):
        replayed[device] = op.graph.create_op(
            op.type, args, [t.dtype for t in op.outputs], name=f"{base}_tower{k}",
            attrs=attrs)
    return replayed


class _GiveUp(Exception):
  """Something between the sums and the value cannot be replayed."""


def _captured_from(placeholder):
  """The outer tensor a function graph's placeholder captures, or None."""
  for external, internal in getattr(placeholder.graph, "captures", ()):
    if internal.graph is placeholder.graph and internal.name == placeholder.name:
      return external
  return None
