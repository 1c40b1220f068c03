"""The two places where the pipeline reaches past TensorFlow's public API.

Why, and why not `tf.custom_gradient` / `tf.recompute_grad`:

- The pipeline's backward pass is its own schedule: stage by stage on each stage's
  device, micro-batch by micro-batch, gradients accumulated on the device of their
  variables. `tf.custom_gradient` can run such a backward, but inside `tf.function` it
  routes the result and every variable it read through one `IdentityN` op on the
  caller's device, so each step would copy every stage's weights to one device: the
  thing pipeline parallelism exists to avoid. `record_operation` records the same kind
  of tape entry with inputs that we choose: the input batch and one read of each
  variable, made on the variable's own device.
- `stop_recording` pauses every active tape of this thread. With re-materialization the
  forward pass must not leave its activations on the caller's tape; there is no public
  way to pause tapes one does not own (`GradientTape.stop_recording` pauses one tape).

Both are what `tf.custom_gradient` and `tf.recompute_grad` are built on, and have been
stable since TensorFlow 2.0. If they move, this module is the one place to change.
"""

from tensorflow.python.eager import record as _record  # pylint: disable=g-direct-tensorflow-import


def record_backward(op_name, outputs, inputs, backward):
  """Records on every active tape: `outputs` were computed from `inputs`.

  `backward(*output_gradients)` must return one gradient (or None) per input.
  """
  _record.record_operation_backprop_only(op_name, outputs, inputs, backward)


def stop_recording():
  """Context manager: no tape of this thread records while it is entered."""
  return _record.stop_recording()


def should_record(tensors):
  """True when some active tape of this thread watches one of `tensors`."""
  return _record.should_record_backprop(tensors)
