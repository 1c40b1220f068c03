"""TensorFlow collective all-reduce, and the keys that name each collective.

TensorFlow has no public API for collective ops outside `tf.distribute`; the ops come from
`_tf_internal` (the V2 ops with an ordering token per device: see there why), and every
algorithm that uses them calls the functions below.
"""

import threading

from diststrat._tf import tf
from diststrat import _tf_internal

# tf.distribute numbers its groups and instances from 1. Starting far above lets both
# libraries run collectives in one process without their keys meeting.
_FIRST_GROUP_KEY = 100_000
_FIRST_INSTANCE_KEY = 100_000_000


class _Keys:
  """Hands out group and instance keys, deterministically in the order they are asked for.

  The same program asks in the same order, so it gets the same keys. A device set keeps
  its group key for the life of the process; every new collective gets a new instance key.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._groups = {}
    self._next_instance = _FIRST_INSTANCE_KEY

  def group_key(self, devices):
    """The key of the group of `devices` (any order); the same in every process that
    asks for its groups in the same order."""
    members = frozenset(devices)
    with self._lock:
      if members not in self._groups:
        self._groups[members] = _FIRST_GROUP_KEY + len(self._groups)
      return self._groups[members]

  def instance_key(self):
    with self._lock:
      key = self._next_instance
      self._next_instance += 1
      return key


_KEYS = _Keys()


def all_reduce(values, devices, mean, timeout, communication_hint="auto", group=None):
  """Sums one tensor per device with one collective; every device gets the total.

  Must be built inside one graph (a `tf.function`): TensorFlow runs a collective only when
  every member of its group is launched, so the members cannot be run one by one.

  Args:
    values: the tensors to add, `values[i]` on `devices[i]`; same dtype and shape.
    devices: canonical device strings, one per value, all different: the members this
      process launches.
    mean: divide the total by the group's size (floating and complex dtypes only; the
      caller divides integers itself, since the collective's division truncates).
    timeout: seconds a member waits for the others before failing; 0 waits forever.
    communication_hint: "auto" (ring on CPUs) or "nccl".
    group: every device of the group, in every process (default: `devices`). Other
      processes launch the members this one does not.

  Returns:
    A list with the reduced tensor on each of `devices`, in the same order.
  """
  group = tuple(devices if group is None else group)
  group_key = _KEYS.group_key(group)
  instance_key = _KEYS.instance_key()
  results = []
  for value, device in zip(values, devices):
    with tf.device(device):
      results.append(_tf_internal.collective_all_reduce(
          value, len(group), group_key, instance_key, mean, timeout, communication_hint))
  return results


def all_reduce_max(value, device, group, timeout):
  """This process's member (on `device`) of a collective maximum over `group`."""
  with tf.device(device):
    return _tf_internal.collective_all_reduce_max(
        value, len(group), _KEYS.group_key(group), _KEYS.instance_key(), timeout)


def all_gather(value, device, group, timeout):
  """This process's member of a collective gather over `group`: the members' values,
  of one shape, concatenated along axis 0 in the group's order."""
  with tf.device(device):
    return _tf_internal.collective_all_gather(
        value, len(group), _KEYS.group_key(group), _KEYS.instance_key(), timeout)


def run_together(results, devices):
  """`results` (a list of columns, one tensor per device in each) made to run all or none.

  Inside a `tf.function`, TensorFlow prunes collective ops whose outputs nobody uses: they
  are not among the stateful ops it always runs. If a caller used only the result on one
  device, the other members of its group would be pruned, and that member would wait for
  them until it timed out. Here every result waits, through one barrier, for every
  collective in `results` to finish, so using any of them runs all of them.
  """
  with tf.device(devices[0]):
    barrier = tf.group(*[r.op for column in results for r in column])
  gated = []
  for k, device in enumerate(devices):
    with tf.device(device), tf.control_dependencies([barrier]):
      gated.append(tf.raw_ops.IdentityN(input=[column[k] for column in results]))
  return [tuple(g[j] for g in gated) for j in range(len(results))]
