"""Keras 3 under diststrat: everything diststrat does for Keras, in one place.

- `_bridge.py`: the tf.distribute bridge. Keras 3 learns about distribution only through
  `tf.distribute.get_strategy()`; while a diststrat context is current, that returns an
  adapter that answers for diststrat (`model.fit`/`evaluate`/`predict` on every tower,
  Keras optimizers' all-reduce and updates, synchronized batch normalization).
- `_variable_rules.py`: how the variables Keras makes behave in towers (batch
  normalization's moving statistics, random seeds).

`install()` connects both to diststrat's core, which knows nothing of Keras: the bridge
follows the context stack as a mode listener, the variable rules are found by a
creation hook. `import diststrat` calls it. See docs/keras.md.
"""

from diststrat import _arguments
from diststrat import _context
from diststrat import _tf_internal
from diststrat._keras import _bridge
from diststrat._keras import _variable_rules
from diststrat.values import _variables


def install():
  """Connects the Keras support to diststrat's contexts and variables (idempotent)."""
  _context.add_mode_listener(_bridge.tf_mode)
  _arguments.register_variable_unwrapper(_tf_internal.keras_backing_variable)
  _variables.add_rules_finder(_variable_rules.find_rules)


__all__ = ["install"]
