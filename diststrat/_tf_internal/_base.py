"""What every module of the boundary shares: its error, and the protocol names."""

from diststrat._tf import tf

PROTOCOLS = {
    "distributed variables": ("_should_act_as_resource_variable", "_dense_var_to_tensor",
                              "_shared_name", "_unique_id", "_in_graph_mode",
                              "_strided_slice_assign", "_save_slice_info"),
    "checkpoints": ("_serialize_to_tensors", "_restore_from_tensors",
                    "_copy_trackable_to_cpu"),
    "optimizer slots": ("_create_or_restore_slot_variable",),
    "SavedModel": ("_export_to_saved_model_graph", "_write_object_proto",
                   "_trackable_children"),
    "Keras optimizer slots": ("_distributed_container",),
    "tf.distribute bridge": ("_use_merge_call", "_retrace_functions_for_each_device",
                             "_scale_loss_for_estimator"),
}
"""The private method names TensorFlow calls on diststrat's objects, by purpose.

diststrat's classes define them (a distributed variable is used as a resource variable,
saved, exported); code outside this package never calls them on another object: the
functions of `variables` do.
"""

PROTOCOL_NAMES = frozenset(name for names in PROTOCOLS.values() for name in names)


class TensorFlowInternalsError(ImportError):
  """A private TensorFlow or Keras API that diststrat relies on is missing or changed."""


def missing(what, detail):
  """The `TensorFlowInternalsError` for a reach that this TensorFlow does not support."""
  return TensorFlowInternalsError(
      f"diststrat relies on {what}, which this TensorFlow ({tf.__version__}) does not "
      f"provide as expected: {detail}. diststrat is tested with TensorFlow 2.21 (see "
      "CHANGELOG.md); install it, or report this with the version you use.")
