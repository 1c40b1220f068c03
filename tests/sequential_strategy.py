"""A minimal strategy written only by filling DistributionStrategy's hooks.

It runs the towers one after another in the calling thread; each tower's `merge_call`
runs `merge_fn` for that tower alone. Variables live on the last device. It proves that
the base class is enough to write a strategy, and is the example in
docs/write_your_own_strategy.md.
"""

import tensorflow as tf

import diststrat as ds


class SequentialStrategy(ds.DistributionStrategy):
  """Towers run in turn on `devices`; reductions add with tf.math.add_n."""

  def __init__(self, devices):
    super().__init__()
    self._devices = tuple(ds.canonicalize_device(d) for d in devices)

  def __repr__(self):
    return f"SequentialStrategy({list(self._devices)})"

  def _create_variable(self, next_creator, kwargs, colocate_with):
    device = colocate_with.device if colocate_with is not None else self._devices[-1]
    with tf.device(device):
      return next_creator(**kwargs)

  def _call_for_each_tower(self, fn, args, kwargs):
    results = []
    shares = ds.values.batch_shares((args, kwargs)) or {}  # Of a split batch, if any.
    for tower_id, device in enumerate(self._devices):
      context = ds.TowerContext(self, tower_id, len(self._devices), device,
                                batch_share=shares.get(device))
      with tf.device(device), self._tower_scope(context):
        results.append(fn(*ds.values.select_device(device, args),
                          **ds.values.select_device(device, kwargs)))
    return ds.values.regroup(results, self._devices)

  def _reduce(self, aggregation, value, destinations):
    components = self.unwrap(value)
    with tf.device(destinations[0]):
      total = tf.math.add_n([tf.convert_to_tensor(c) for c in components])
      if aggregation == tf.VariableAggregation.MEAN:
        total = total / len(components)
    return self._broadcast(total, destinations)

  def _broadcast(self, tensor, destinations):
    copies = {}
    for device in destinations:
      with tf.device(device):
        copies[device] = tf.identity(tensor)
    return ds.values.Mirrored(copies)

  def _update(self, var, fn, args, kwargs):
    return self._run_on_devices([var.device], fn, args, kwargs, first_arg=var)

  def _update_non_slot(self, colocate_with, fn, args, kwargs):
    return self._run_on_devices([colocate_with.device], fn, args, kwargs)

  def _non_slot_devices(self, var_list):
    return min(var_list, key=lambda v: v.name)

  def _read_var(self, v):
    return tf.identity(v)

  def _num_towers(self):
    return len(self._devices)

  def _worker_devices(self):
    return self._devices

  def _parameter_devices(self):
    return self._devices[-1:]
