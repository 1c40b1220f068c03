"""TensorFlow's collective ops, and setting them up across processes.

Collective ops have no public API outside `tf.distribute`, which diststrat does not build
on; nor has making a process a task that runs collectives with other processes on the
gRPC runtime, or asking a collective peer whether it is alive. These functions are the
ops and calls themselves: which op version to use, and when, is decided by their callers
(diststrat/cross_tower_ops/_collective.py).
"""

from tensorflow.core.protobuf import tensorflow_server_pb2 as _server_pb2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import context as _eager_context  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import collective_ops as _collective_ops  # pylint: disable=g-direct-tensorflow-import

from diststrat._tf import tf


def all_reduce_v1(value, group_size, group_key, instance_key, merge_op, final_op, timeout,
                  communication_hint="auto"):
  """One member of a `CollectiveReduce` (V1): every member gets the reduced value.

  Build it under `tf.device` of the member's device. `merge_op` is "Add", "Mul", "Min"
  or "Max"; `final_op` "Id" or "Div" (divide by `group_size`). `timeout` in seconds, 0
  for none.
  """
  return _collective_ops.all_reduce(
      value, group_size, group_key, instance_key, merge_op=merge_op, final_op=final_op,
      communication_hint=communication_hint, timeout=timeout)


def all_reduce_v2(value, group_size, group_key, instance_key, merge_op, final_op, timeout,
                  ordering_token, communication_hint="auto"):
  """One member of a `CollectiveReduceV2`, ordered after the ops that use `ordering_token`.

  `ordering_token` is a list of resource handles (one per device, in practice): the ops
  given the same token run one after another.
  """
  return _collective_ops.all_reduce_v2(
      value, group_size, group_key, instance_key, merge_op=merge_op, final_op=final_op,
      communication_hint=communication_hint, timeout=timeout, ordering_token=ordering_token)


def all_gather_v1(value, group_size, group_key, instance_key, timeout):
  """One member of a `CollectiveGather` (V1): every member gets every member's value,
  concatenated along the first axis in group-rank order."""
  return _collective_ops.all_gather(value, group_size, group_key, instance_key,
                                    timeout=timeout)


def all_gather_v2(value, group_size, group_key, instance_key, timeout, ordering_token):
  """One member of a `CollectiveGatherV2`; `ordering_token` as in `all_reduce_v2`."""
  return _collective_ops.all_gather_v2(value, group_size, group_key, instance_key,
                                       timeout=timeout, ordering_token=ordering_token)


def enable_cross_process_collectives(cluster_spec, task_type, task_id, leader,
                                     scoped_allocator_ops=()):
  """Makes this process a task of `cluster_spec` that runs collectives with the others.

  Starts this task's gRPC server on its address in the spec. Must run before this
  process's TensorFlow context is initialized (before any op).

  Args:
    cluster_spec: a `tf.train.ClusterSpec`.
    task_type, task_id: this process's task.
    leader: the task that leads collective groups, such as "/job:worker/replica:0/task:0".
    scoped_allocator_ops: op types whose outputs TensorFlow's ScopedAllocatorOptimizer
      may place in one buffer (such as "CollectiveReduce").

  Raises:
    RuntimeError: TensorFlow was initialized already (an op ran, devices were listed).
  """
  context = _eager_context.context()
  context.configure_collective_ops(collective_leader=leader,
                                   scoped_allocator_enabled_ops=tuple(scoped_allocator_ops))
  address = cluster_spec.task_address(task_type, task_id)
  server_def = _server_pb2.ServerDef(
      cluster=cluster_spec.as_cluster_def(), job_name=task_type, task_index=task_id,
      protocol="grpc", port=int(address.rsplit(":", 1)[1]),
      # Without it, every collective across processes times out (see
      # docs/design/tensorflow_facts.md).
      default_session_config=context.config)
  context.enable_collective_ops(server_def)
  context.ensure_initialized()


def abort_collectives(message, deadline_exceeded=False):
  """Makes every collective of this process that is running, or runs later, fail.

  A collective waiting for a peer that died or froze is blocked inside TensorFlow, and
  no public API can wake it: this is the only way to stop it without a timeout on every
  collective. The blocked calls raise `tf.errors.UnavailableError` (or
  `DeadlineExceededError`) with `message`. TensorFlow allows no collective in this
  process afterwards: the process must be restarted.
  """
  code = (tf.errors.DEADLINE_EXCEEDED if deadline_exceeded else tf.errors.UNAVAILABLE)
  _eager_context.context().abort_collective_ops(code, message)


def function_runs_collectives(name):
  """Whether the function `name` (as TensorFlow's execute path names a call: a traced
  function registered in this process) runs a collective op, in its body or in a
  function it calls (a `tf.while_loop` body, a branch, a nested call). False for a name
  that is an op, not a function. Reads the function library: call it off the hot path.
  """
  context = _eager_context.context()
  seen = set()
  pending = [name.decode() if isinstance(name, bytes) else str(name)]
  while pending:
    current = pending.pop()
    if current in seen:
      continue
    seen.add(current)
    try:
      function_def = context.get_function_def(current)
    except Exception:  # pylint: disable=broad-except
      continue  # An op, or a function of another library: no collective of ours.
    for node in function_def.node_def:
      if node.op.startswith("Collective"):
        return True
      if context.has_function(node.op):
        pending.append(node.op)  # A function called as an op.
      for value in node.attr.values():
        if value.HasField("func"):
          pending.append(value.func.name)
        elif value.HasField("list"):
          pending.extend(f.name for f in value.list.func)
  return False


def check_peer_health(task, timeout):
  """Returns if `task` (a collective peer) is alive within `timeout` seconds, else raises.

  Raises:
    tf.errors.UnavailableError: the task is down; FailedPreconditionError: it
      restarted; DeadlineExceededError: it did not answer in time.
  """
  _eager_context.context().check_collective_ops_peer_health(
      task, timeout_in_ms=max(1, int(timeout * 1000)))
