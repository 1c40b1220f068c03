"""The rules of the variables Keras 3 makes, as diststrat's variables apply them.

Keras creates the state it writes inside a model's call (batch normalization's moving
mean and variance, a `SeedGenerator`'s state behind Dropout and every random layer) with
aggregation NONE, and writes it in every tower. diststrat's own rule for a NONE
variable written in a tower is to refuse (it cannot know how to combine the towers'
values); for Keras's state the combination is known:

- every Keras-made variable: tower writes are merged (`merges_tower_writes`), a float
  as the mean of the towers' values weighted by each tower's share of the batch (batch
  normalization's moving mean then equals one device's), an integer as tower 0's;
- a Keras `assign_add(delta)` (or `assign_sub`) of a variable with aggregation SUM,
  which Keras writes as `assign(self + delta)`, sums the towers' deltas
  (`tower_write`), not their new values;
- a seed's state: tower i > 0 reads it with i hashed in, so each tower draws its own
  random stream (dropout masks differ across towers, not one mask repeated).

`find_rules` is the creation hook (`values._variables.add_rules_finder`) that tells a
Keras-made variable from the frames creating it.
"""

from diststrat._tf import tf
from diststrat import _context
from diststrat import _tf_internal
from diststrat.values import _variables


class KerasStateRules(_variables.VariableRules):
  """Any variable a `keras.Variable` makes: layer weights and state, optimizer and metric
  variables."""

  merges_tower_writes = True

  def tower_write(self, variable, method, value):
    # Keras writes `assign_add(delta)` as `assign(self + delta)`. Summed over the
    # towers, N copies of the old value would be added to the towers' deltas; a SUM
    # variable adds the towers' deltas, as on one device. (For MEAN and
    # ONLY_FIRST_REPLICA, the new values combine as the deltas would.)
    if method == "assign" and variable.aggregation == tf.VariableAggregation.SUM:
      increment = _tf_internal.keras_assign_increment(variable)
      if increment is not None:
        return increment
    return method, value


class KerasSeedRules(KerasStateRules):
  """The state of a Keras `SeedGenerator`: a random stream per tower."""

  def tower_read(self, value):
    tower_id = _context.get_tower_context().tower_id
    if not tower_id:
      return value
    seed = tf.random.experimental.stateless_fold_in(tf.cast(value, tf.int64), tower_id)
    return tf.cast(seed, value.dtype)


_STATE = KerasStateRules()
_SEED = KerasSeedRules()


def find_rules():
  """The rules of the variable being created now if Keras is creating it, else None."""
  origin = _tf_internal.keras_variable_origin()
  if origin == "seed":
    return _SEED
  if origin == "keras":
    return _STATE
  return None
