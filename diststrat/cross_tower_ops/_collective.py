"""TensorFlow collective ops: which version runs where, and the keys that name each one.

TensorFlow has no public API for collective ops outside `tf.distribute`; the ops
themselves come from `_tf_internal`, and every algorithm that uses them calls the
functions below.

Which op version: the V1 collective ops keep the parameters they resolved inside the
kernel, and run again in a `tf.while_loop` body before an earlier run finished
everywhere (Keras with `steps_per_execution` > 1) they fail intermittently across
processes with "CollectiveRegistry::Lookup did not find collective implementation".
The V2 ops resolve them per run and are safe there, but each run with a timeout holds
two threads until the timeout expires, finished or not (one for V1). So: V2 in a
`tf.while_loop` body, V1 elsewhere. The V2 ops take an ordering token: a resource per
device, so that TensorFlow's automatic control dependencies chain the collectives of
one device one after another (as every member in every process builds them in the same
order) and leave the members on other devices free (chained together they would wait
for each other). See docs/design/tensorflow_facts.md.
"""

import hashlib
import threading
import typing

from diststrat._tf import tf
from diststrat import _tf_internal

# Keys of the groups that span processes (MultiWorkerMirroredStrategy's) and of their
# instances. tf.distribute numbers its groups and instances from 1: starting far above lets
# both libraries run collectives in one process without their keys meeting.
_FIRST_GROUP_KEY = 100_000
_FIRST_INSTANCE_KEY = 100_000_000
# Keys of the groups within one process (the "collective" all-reduce of a
# MirroredStrategy, such as one its measured default times) and of their instances.
# They are kept apart from the keys above: whether a process runs such a collective may
# depend on timing (the measured default times "collective" only if its budget lasts),
# and the keys across processes must not move with it. A group's key is derived from its
# devices, whose names hold the process's task, so the groups of different processes get
# different keys: in a cluster the group leader (task 0) resolves every group, a local
# one too, and two tasks' local groups under one key failed with "is joining a group
# that is already full".
_FIRST_LOCAL_GROUP_KEY = 1 << 30
_LOCAL_GROUP_KEYS = (1 << 31) - 1 - _FIRST_LOCAL_GROUP_KEY  # Group keys are int32.
_FIRST_LOCAL_INSTANCE_KEY = 1_000_000_000


def _within_one_task(devices):
  """True if every device of `devices` is in one task (job, replica, task): a group that
  one process launches alone."""
  tasks = {(spec.job, spec.replica, spec.task)
           for spec in (tf.DeviceSpec.from_string(d) for d in devices)}
  return len(tasks) == 1


class _Keys:
  """Hands out group and instance keys.

  Groups that span processes, and their instances, are numbered in the order they are
  asked for, counting those only: every worker that builds the same collectives across
  processes in the same order gets the same keys, whatever collectives it runs within
  itself. A group within one process gets a key derived from its device names (unique to
  its task), its instances numbers from a range of their own. A device set keeps its
  group key for the life of the process; every new collective gets a new instance key.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._groups = {}
    self._local_group_keys = set()
    self._next_group = _FIRST_GROUP_KEY
    self._next_instance = _FIRST_INSTANCE_KEY
    self._next_local_instance = _FIRST_LOCAL_INSTANCE_KEY

  def group_key(self, devices):
    """The key of the group of `devices` (any order): across processes, the same in
    every process that asks for its groups across processes in the same order."""
    members = frozenset(devices)
    with self._lock:
      key = self._groups.get(members)
      if key is None:
        if _within_one_task(members):
          key = self._local_group_key(members)
        else:
          key = self._next_group
          self._next_group += 1
        self._groups[members] = key
      return key

  def _local_group_key(self, members):
    digest = hashlib.sha256("\n".join(sorted(members)).encode()).digest()
    offset = int.from_bytes(digest[:8], "big") % _LOCAL_GROUP_KEYS
    while _FIRST_LOCAL_GROUP_KEY + offset in self._local_group_keys:  # Two sets, one hash.
      offset = (offset + 1) % _LOCAL_GROUP_KEYS
    key = _FIRST_LOCAL_GROUP_KEY + offset
    self._local_group_keys.add(key)
    return key

  def instance_key(self, group_key):
    """A new instance key for a collective of the group `group_key`."""
    with self._lock:
      if group_key >= _FIRST_LOCAL_GROUP_KEY:
        key = self._next_local_instance
        self._next_local_instance += 1
      else:
        key = self._next_instance
        self._next_instance += 1
      return key


_KEYS = _Keys()

# device -> a resource handle on it (see `_ordering_token`)
_ORDERING_TOKENS: dict[str, typing.Any] = {}
_ORDERING_TOKENS_LOCK = threading.Lock()


def _ordering_token():
  """The ordering token of the current device scope, for the V2 ops: `[handle]`.

  One resource per device, made once, eagerly, outside any function: a raw variable
  handle (no `tf.Variable`, so no strategy's variable creator sees it).
  """
  device = _tf_internal.current_device()
  with _ORDERING_TOKENS_LOCK:
    token = _ORDERING_TOKENS.get(device)
    if token is None:
      with tf.init_scope(), tf.device(device):
        token = tf.raw_ops.VarHandleOp(
            dtype=tf.float32, shape=[],
            shared_name=f"diststrat_collective_ordering_token_{len(_ORDERING_TOKENS)}")
        tf.raw_ops.AssignVariableOp(resource=token, value=tf.zeros([]))
      _ORDERING_TOKENS[device] = token
  return [token]


def _reduce_op(value, group_size, group_key, instance_key, merge_op, final_op, timeout,
               communication_hint="auto"):
  """One member of a collective reduction, of the version that suits where it is built."""
  if _tf_internal.in_while_loop():
    return _tf_internal.all_reduce_v2(
        value, group_size, group_key, instance_key, merge_op, final_op, timeout,
        ordering_token=_ordering_token(), communication_hint=communication_hint)
  return _tf_internal.all_reduce_v1(value, group_size, group_key, instance_key, merge_op,
                                    final_op, timeout, communication_hint=communication_hint)


# The dtypes TensorFlow 2.21's collective kernels take; others travel in a carrier.
_COLLECTIVE_DTYPES = frozenset([tf.bfloat16, tf.float16, tf.float32, tf.float64, tf.int32,
                                tf.int64])
_WIDER = {tf.int8: tf.int32, tf.int16: tf.int32, tf.uint8: tf.int32, tf.uint16: tf.int32,
          tf.uint32: tf.int64}


def _carried(value, gather=False):
  """`value` in a dtype the collectives take, and the function that turns a sum (or, with
  `gather`, a gather along axis 0) of such values back into `value`'s dtype.

  A complex value travels as its real and imaginary parts on a last axis of 2; a small
  or unsigned integer in a wider signed one (its sum wraps back as the dtype's own
  addition would); uint64 as int64, bit for bit (two's complement adds alike); for a
  gather, whose kernels do not take bfloat16 or bool, bfloat16 as float32 (exactly) and
  bool as int32. Other dtypes go as they are, and TensorFlow's error names them.
  """
  dtype = value.dtype
  if gather and dtype == tf.bfloat16:
    return tf.cast(value, tf.float32), lambda total: tf.cast(total, dtype)
  if gather and dtype == tf.bool:
    return tf.cast(value, tf.int32), lambda total: tf.cast(total, dtype)
  if dtype in _COLLECTIVE_DTYPES:
    return value, lambda total: total
  if dtype.is_complex:
    return (tf.stack([tf.math.real(value), tf.math.imag(value)], axis=-1),
            lambda total: tf.complex(total[..., 0], total[..., 1]))
  if dtype in _WIDER:
    return tf.cast(value, _WIDER[dtype]), lambda total: tf.cast(total, dtype)
  if dtype == tf.uint64:
    return tf.bitcast(value, tf.int64), lambda total: tf.bitcast(total, tf.uint64)
  return value, lambda total: total


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
  instance_key = _KEYS.instance_key(group_key)
  results = []
  for value, device in zip(values, devices, strict=True):
    with tf.device(device):
      carrier, back = _carried(value)
      carrier, unpad = _never_empty(carrier)
      results.append(back(unpad(_reduce_op(carrier, len(group), group_key, instance_key,
                                            "Add", "Div" if mean else "Id", timeout,
                                            communication_hint))))
  return results


def _never_empty(value):
  """`value`, flattened with one zero after it when its size is not known statically,
  and the function that turns the reduced result back into `value`'s shape.

  TensorFlow's collective reductions (V1 and V2) crash the process (SIGSEGV) on some
  empty tensors, such as one a function gets from numpy: an algorithm skips a value it
  knows to be empty, but one of unknown size may turn out empty when it runs. The zero
  adds nothing to a sum or a mean.
  """
  if value.shape.num_elements():
    return value, lambda total: total
  shape = tf.shape(value)
  padded = tf.concat([tf.reshape(value, [-1]), tf.zeros([1], value.dtype)], axis=0)

  def unpad(total):
    result = tf.reshape(total[:-1], shape)
    result.set_shape(value.shape)
    return result
  return padded, unpad


def all_gather(value, device, group, timeout):
  """This process's member of a collective gather over `group`: the members' values,
  of one shape, concatenated along axis 0 in the group's order."""
  with tf.device(device):
    carrier, back = _carried(value, gather=True)
    if carrier.dtype not in _COLLECTIVE_DTYPES:
      raise TypeError(
          f"gather() across worker processes carries numbers and booleans only: "
          f"TensorFlow's collectives cannot carry {value.dtype.name} values. Gather "
          "numbers (e.g. ids or codes) instead and map them back afterwards.")
    group_size, group_key = len(group), _KEYS.group_key(group)
    instance_key = _KEYS.instance_key(group_key)
    if _tf_internal.in_while_loop():
      return back(_tf_internal.all_gather_v2(carrier, group_size, group_key, instance_key,
                                             timeout, ordering_token=_ordering_token()))
    return back(_tf_internal.all_gather_v1(carrier, group_size, group_key, instance_key,
                                           timeout))


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
