"""What tests/test_keras*.py share: the strategies they run under, and comparisons."""

import types

import numpy as np
import tensorflow as tf

import diststrat as ds
from conftest import CPUS

# name -> a fresh strategy. Default, Mirrored on 1, 2 and 4 towers, ParameterServer
# (in one process: towers on 2 or 4 CPU devices, variables on another one).
STRATEGIES = {
    "default": ds.DefaultStrategy,
    "mirrored1": lambda: ds.MirroredStrategy(CPUS[:1]),
    "mirrored2": lambda: ds.MirroredStrategy(CPUS[:2]),
    "mirrored4": lambda: ds.MirroredStrategy(CPUS),
    "ps2": lambda: ds.ParameterServerStrategy(worker_devices=CPUS[:2], ps_devices=CPUS[3:]),
    "ps4": lambda: ds.ParameterServerStrategy(worker_devices=CPUS, ps_devices=CPUS[:1]),
}
TOL = dict(rtol=1e-5, atol=2e-6)  # float32: sums in another order.


def copies(variable):
  """The values of every copy of a (Keras or TensorFlow) variable, as numpy arrays."""
  value = getattr(variable, "value", variable)
  value = value if isinstance(value, tf.Variable) else variable
  if isinstance(value, ds.values.DistributedValues):
    return [np.asarray(c.numpy()) for c in value.values]
  return [np.asarray(value.numpy())]


def assert_copies_equal(variables):
  for variable in variables:
    values = copies(variable)
    for other in values[1:]:
      np.testing.assert_array_equal(other, values[0], err_msg=getattr(variable, "path", ""))


def assert_all_close(got, expected, **tol):
  assert len(got) == len(expected)
  for g, e in zip(got, expected, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), **(tol or TOL))


def frozen(arrays):
  """Read-only copies of `arrays`, as a tuple: a reference computed once (lru_cache) and
  shared by several tests, which no test can change."""
  result = []
  for array in arrays:
    array = np.array(array, copy=True)
    array.setflags(write=False)
    result.append(array)
  return tuple(result)


def frozen_history(history):
  """A read-only copy of a Keras `History.history` (name -> tuple of floats)."""
  return types.MappingProxyType({k: tuple(float(x) for x in v) for k, v in history.items()})
