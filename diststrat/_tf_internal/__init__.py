"""The TensorFlow boundary: every place diststrat reaches past TensorFlow's or Keras's
public API.

Nothing outside this package imports `tensorflow.python` (or `tensorflow.core`) or
`keras.src`, touches a private attribute of a TensorFlow or Keras object, or calls one of
TensorFlow's private protocol methods on another object; tests/test_architecture.py
checks it. Each reach is one named function or class with the reason no public API does
the job, in the module of its kind:

| module | what it reaches |
|---|---|
| `_thread_state` | the calling thread's device scope, variable creators, control inputs, op callbacks, and whether a `tf.while_loop` body is being built; freeing the state TensorFlow keeps for a finished thread |
| `_collectives` | collective ops; setting up collectives across processes; a peer's health; aborting them |
| `_functions` | calling a traced function with a flat list of tensors; a `tf.function`'s XLA flag, and a copy of its options around another function; whether the function being traced is compiled with XLA |
| `_cluster_rpc` | probing a TensorFlow server; copying a remote handle; TensorFlow's error path, and knowing which calls are running; its wait for pending eager work |
| `_variables` | a `tf.Variable` around an existing handle; the protocols a distributed variable answers for its components; a checkpoint value read when the save writes it; whether a checkpoint creates its save counter; a sliced assignment; whether a SavedModel is tracing; how a SavedModel describes wrapped values |
| `_tapes` | recording on gradient tapes; whether one of this thread's tapes is recording, or one of its forward accumulators watches a tensor |
| `_keras` | Keras 3 variables, optimizers, per-output loss trackers, the dropout masks a recurrent cell caches, `fit`'s callbacks and `BackupAndRestore`'s paths; which Keras code creates a variable, and the delta of a Keras `assign_add`; a thread's Keras global state (its global seed generator, name counters and dtype policy) |
| `_distribute_stack` | TensorFlow's per-thread distribution-mode stack (`tf.distribute.get_strategy()`) |
| `_autograph` | letting diststrat's errors through AutoGraph; removing its generated files before `os._exit` |

Policy stays with the modules that own it: which collective op version to use
(diststrat/cross_tower_ops/_collective.py), which TensorFlow errors mean a cluster fault
(diststrat/_cluster_runtime/_faults.py), when to install the error translator
(diststrat/_cluster_runtime).

tests/test_tf_internal.py has a test named after every name exported here
(tests/test_architecture.py checks that too): after a TensorFlow or Keras upgrade, the
test of the reach that broke fails, instead of a user's training step. `PROTOCOLS` lists
the private method names TensorFlow calls on diststrat's own objects, defined where the
objects are.
"""

from diststrat._tf_internal._autograph import pass_through_autograph as pass_through_autograph
from diststrat._tf_internal._autograph import pass_through_autograph_class as pass_through_autograph_class
from diststrat._tf_internal._autograph import register_for_loop as register_for_loop
from diststrat._tf_internal._autograph import remove_autograph_generated_files as remove_autograph_generated_files
from diststrat._tf_internal._base import PROTOCOL_NAMES as PROTOCOL_NAMES
from diststrat._tf_internal._base import PROTOCOLS as PROTOCOLS
from diststrat._tf_internal._base import TensorFlowInternalsError as TensorFlowInternalsError
from diststrat._tf_internal._cluster_rpc import copy_to_device as copy_to_device
from diststrat._tf_internal._cluster_rpc import install_error_translator as install_error_translator
from diststrat._tf_internal._cluster_rpc import probe_tf_server as probe_tf_server
from diststrat._tf_internal._cluster_rpc import install_sync_hook as install_sync_hook
from diststrat._tf_internal._cluster_rpc import set_call_tracker as set_call_tracker
from diststrat._tf_internal._cluster_rpc import uninstall_error_translator as uninstall_error_translator
from diststrat._tf_internal._cluster_rpc import uninstall_sync_hook as uninstall_sync_hook
from diststrat._tf_internal._cluster_rpc import wait_for_pending_ops as wait_for_pending_ops
from diststrat._tf_internal._collectives import abort_collectives as abort_collectives
from diststrat._tf_internal._collectives import all_gather_v1 as all_gather_v1
from diststrat._tf_internal._collectives import all_gather_v2 as all_gather_v2
from diststrat._tf_internal._collectives import all_reduce_v1 as all_reduce_v1
from diststrat._tf_internal._collectives import all_reduce_v2 as all_reduce_v2
from diststrat._tf_internal._collectives import check_peer_health as check_peer_health
from diststrat._tf_internal._collectives import enable_cross_process_collectives as enable_cross_process_collectives
from diststrat._tf_internal._collectives import function_runs_collectives as function_runs_collectives
from diststrat._tf_internal._distribute_stack import tf_distribution_mode as tf_distribution_mode
from diststrat._tf_internal._functions import building_xla_function as building_xla_function
from diststrat._tf_internal._functions import call_flat as call_flat
from diststrat._tf_internal._functions import clone_tf_function as clone_tf_function
from diststrat._tf_internal._functions import tf_function_jit_compile as tf_function_jit_compile
from diststrat._tf_internal._keras import called_by_keras_loss as called_by_keras_loss
from diststrat._tf_internal._keras import called_by_keras_trainer as called_by_keras_trainer
from diststrat._tf_internal._keras import keras_backing_variable as keras_backing_variable
from diststrat._tf_internal._keras import keras_epoch_iterator_dataset as keras_epoch_iterator_dataset
from diststrat._tf_internal._keras import keras_fit_callbacks as keras_fit_callbacks
from diststrat._tf_internal._keras import keras_optimizer_strategy as keras_optimizer_strategy
from diststrat._tf_internal._keras import keras_seed_generators as keras_seed_generators
from diststrat._tf_internal._keras import keras_rnn_dropout_mask_slots as keras_rnn_dropout_mask_slots
from diststrat._tf_internal._keras import keras_thread_globals as keras_thread_globals
from diststrat._tf_internal._keras import keras_global_seed_generator as keras_global_seed_generator
from diststrat._tf_internal._keras import set_keras_global_seed_generator as set_keras_global_seed_generator
from diststrat._tf_internal._keras import keras_name_counters as keras_name_counters
from diststrat._tf_internal._keras import set_keras_name_counters as set_keras_name_counters
from diststrat._tf_internal._keras import keras_dtype_policy as keras_dtype_policy
from diststrat._tf_internal._keras import set_keras_dtype_policy as set_keras_dtype_policy
from diststrat._tf_internal._keras import keras_optimizer_step_count as keras_optimizer_step_count
from diststrat._tf_internal._keras import keras_in_stateless_scope as keras_in_stateless_scope
from diststrat._tf_internal._keras import keras_model_strategy as keras_model_strategy
from diststrat._tf_internal._keras import keras_model_on_stack as keras_model_on_stack
from diststrat._tf_internal._keras import keras_optimizer_being_created as keras_optimizer_being_created
from diststrat._tf_internal._keras import keras_loss_tracker as keras_loss_tracker
from diststrat._tf_internal._keras import keras_compile_loss as keras_compile_loss
from diststrat._tf_internal._keras import keras_output_loss_trackers as keras_output_loss_trackers
from diststrat._tf_internal._keras import keras_variable_origin as keras_variable_origin
from diststrat._tf_internal._keras import keras_assign_increment as keras_assign_increment
from diststrat._tf_internal._keras import restore_keras_backup_dir as restore_keras_backup_dir
from diststrat._tf_internal._keras import set_keras_backup_dir as set_keras_backup_dir
from diststrat._tf_internal._keras import wrap_keras_symbolic_build as wrap_keras_symbolic_build
from diststrat._tf_internal._tapes import gradient_tape_recording as gradient_tape_recording
from diststrat._tf_internal._tapes import forward_accumulator_watching as forward_accumulator_watching
from diststrat._tf_internal._tapes import record_backward as record_backward
from diststrat._tf_internal._tapes import record_variable_read as record_variable_read
from diststrat._tf_internal._tapes import should_record as should_record
from diststrat._tf_internal._tapes import stop_recording as stop_recording
from diststrat._tf_internal._tapes import variable_accessed as variable_accessed
from diststrat._tf_internal._thread_state import current_control_dependencies as current_control_dependencies
from diststrat._tf_internal._thread_state import current_device as current_device
from diststrat._tf_internal._thread_state import in_while_loop as in_while_loop
from diststrat._tf_internal._thread_state import op_callbacks as op_callbacks
from diststrat._tf_internal._thread_state import release_thread_state as release_thread_state
from diststrat._tf_internal._thread_state import set_op_callbacks as set_op_callbacks
from diststrat._tf_internal._thread_state import set_variable_creator_stack as set_variable_creator_stack
from diststrat._tf_internal._thread_state import variable_creator_stack as variable_creator_stack
from diststrat._tf_internal._thread_state import variable_creators as variable_creators
from diststrat._tf_internal._variables import READ_METHODS as READ_METHODS
from diststrat._tf_internal._variables import RESOURCE_METHODS as RESOURCE_METHODS
from diststrat._tf_internal._variables import ResourceVariableFromHandle as ResourceVariableFromHandle
from diststrat._tf_internal._variables import base_resource_method as base_resource_method
from diststrat._tf_internal._variables import copy_trackable_to_cpu as copy_trackable_to_cpu
from diststrat._tf_internal._variables import creating_checkpoint_save_counter as creating_checkpoint_save_counter
from diststrat._tf_internal._variables import deferred_checkpoint_value as deferred_checkpoint_value
from diststrat._tf_internal._variables import serialize_to_tensors as serialize_to_tensors
from diststrat._tf_internal._variables import dense_var_to_tensor as dense_var_to_tensor
from diststrat._tf_internal._variables import distributed_container as distributed_container
from diststrat._tf_internal._variables import export_to_saved_model_graph as export_to_saved_model_graph
from diststrat._tf_internal._variables import in_graph_mode as in_graph_mode
from diststrat._tf_internal._variables import in_saved_model_trace as in_saved_model_trace
from diststrat._tf_internal._variables import install_saved_model_device_rule as install_saved_model_device_rule
from diststrat._tf_internal._variables import save_as_tuple_of_components as save_as_tuple_of_components
from diststrat._tf_internal._variables import saved_model_trace as saved_model_trace
from diststrat._tf_internal._variables import saved_model_trace_options as saved_model_trace_options
from diststrat._tf_internal._variables import set_distributed_container as set_distributed_container
from diststrat._tf_internal._variables import shared_name as shared_name
from diststrat._tf_internal._variables import strided_slice_assign as strided_slice_assign
from diststrat._tf_internal._variables import unique_id as unique_id
from diststrat._tf_internal._variables import wrap_resource_methods as wrap_resource_methods
from diststrat._tf_internal._variables import write_object_proto as write_object_proto

__all__ = [
    # thread state
    "current_device", "variable_creator_stack", "variable_creators",
    "set_variable_creator_stack", "current_control_dependencies", "in_while_loop",
    "op_callbacks", "set_op_callbacks", "release_thread_state",
    # collectives
    "all_reduce_v1", "all_reduce_v2", "all_gather_v1", "all_gather_v2",
    "enable_cross_process_collectives", "check_peer_health", "abort_collectives",
    "function_runs_collectives",
    # functions
    "call_flat", "building_xla_function",
    # cluster RPC and TensorFlow's error path
    "probe_tf_server", "copy_to_device", "install_error_translator",
    "uninstall_error_translator", "set_call_tracker", "wait_for_pending_ops",
    "install_sync_hook", "uninstall_sync_hook",
    # variables
    "ResourceVariableFromHandle", "RESOURCE_METHODS", "READ_METHODS",
    "base_resource_method", "wrap_resource_methods", "shared_name", "unique_id",
    "in_graph_mode", "dense_var_to_tensor", "copy_trackable_to_cpu",
    "export_to_saved_model_graph", "write_object_proto", "set_distributed_container",
    "distributed_container", "deferred_checkpoint_value", "serialize_to_tensors",
    "strided_slice_assign", "in_saved_model_trace", "saved_model_trace_options", "saved_model_trace",
    "install_saved_model_device_rule", "save_as_tuple_of_components",
    "creating_checkpoint_save_counter",
    # tapes
    "gradient_tape_recording", "forward_accumulator_watching", "record_backward", "stop_recording", "should_record", "variable_accessed",
    "record_variable_read",
    # Keras
    "called_by_keras_loss", "called_by_keras_trainer", "keras_backing_variable", "keras_optimizer_strategy", "keras_seed_generators",
    "keras_rnn_dropout_mask_slots",
    "keras_thread_globals", "keras_global_seed_generator", "set_keras_global_seed_generator",
    "keras_name_counters", "set_keras_name_counters", "keras_dtype_policy",
    "set_keras_dtype_policy",
    "keras_optimizer_step_count", "keras_in_stateless_scope",
    "keras_model_strategy",
    "keras_model_on_stack",
    "keras_optimizer_being_created",
    "keras_output_loss_trackers",
    "keras_loss_tracker",
    "keras_compile_loss",
    "keras_variable_origin", "keras_assign_increment", "keras_fit_callbacks", "set_keras_backup_dir",
    "restore_keras_backup_dir", "keras_epoch_iterator_dataset", "wrap_keras_symbolic_build",
    # the distribution-mode stack
    "tf_distribution_mode",
    # AutoGraph
    "pass_through_autograph", "pass_through_autograph_class",
    "remove_autograph_generated_files",
    # the boundary itself
    "TensorFlowInternalsError", "PROTOCOLS", "PROTOCOL_NAMES",
]
