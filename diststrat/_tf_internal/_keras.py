"""Keras 3 objects, where Keras has no public accessor.

- A Keras 3 variable holds its TensorFlow variable in `_value`
  (`keras_backing_variable`); a Keras optimizer keeps the tf.distribute strategy it was
  created under in `_distribution_strategy` (`keras_optimizer_strategy`).
- A compiled model's per-output loss trackers live on its `_compile_loss`
  (`keras_output_loss_trackers`).
- Which Keras code is creating a variable (layer state, a random seed's state) is told
  by no argument of the variable creator; the creating frames say it
  (`keras_variable_origin`).

Keras's modules are looked up among those already imported (a Keras variable being
created means Keras is loaded), never imported here.
"""

import sys

from diststrat._tf import tf


def keras_backing_variable(value):
  """The `tf.Variable` a Keras 3 variable holds, or None if `value` is not one.

  Keras 3 keeps it in `_value`; its public `.value` reads the variable instead.
  """
  if type(value).__module__.startswith("keras") and hasattr(value, "_value"):
    inner = getattr(value, "_value")
    if isinstance(inner, tf.Variable):
      return inner
  return None


def keras_optimizer_strategy(optimizer):
  """The `tf.distribute` strategy a Keras 3 optimizer captured when created, or None.

  Keras's TensorFlow optimizer applies its updates through that strategy, and has no
  public accessor for it.
  """
  return getattr(optimizer, "_distribution_strategy", None)


def keras_output_loss_trackers(model):
  """The `keras.metrics.Mean` trackers of a compiled Keras 3 model's per-output losses.

  Keras keeps them on the model's `_compile_loss` (a `CompileLoss`, built on the first
  step); they are the "<output>_loss" entries of the logs. No public accessor tells them
  from the model's other metrics. Empty when the model has none (one output, not
  compiled, not built yet).
  """
  compile_loss = getattr(model, "_compile_loss", None)
  return list(getattr(compile_loss, "metrics", None) or [])


# Where Keras 3 (TensorFlow backend) makes the tf.Variable behind a `keras.Variable`, and
# where a SeedGenerator makes its state.
_KERAS_VARIABLE_MODULE = "keras.src.backend.tensorflow.core"
_KERAS_SEED_MODULE = "keras.src.random.seed_generator"
_KERAS_FRAMES_SEARCHED = 60


def _keras_code(module_name, path):
  obj = sys.modules.get(module_name)
  for name in path:
    obj = getattr(obj, name, None)
  return getattr(obj, "__code__", None)


def keras_variable_origin():
  """Who is creating the variable being created now: "seed", "keras" or None.

  "keras": a `keras.Variable` (layer weights and state, optimizer and metric variables)
  is making its TensorFlow variable; "seed": that variable is the state of a Keras
  `SeedGenerator` (Dropout and every random layer); None: anything else. Call it from a
  variable creator. Keras passes nothing that says so, so the calling frames are
  searched for `keras.Variable._initialize` and `SeedGenerator.__init__`.
  """
  variable_init = _keras_code(_KERAS_VARIABLE_MODULE, ("Variable", "_initialize"))
  if variable_init is None:
    return None
  seed_init = _keras_code(_KERAS_SEED_MODULE, ("SeedGenerator", "__init__"))
  frame = sys._getframe(1)  # pylint: disable=protected-access
  origin = None
  for _ in range(_KERAS_FRAMES_SEARCHED):
    if frame is None:
      break
    if frame.f_code is variable_init:
      origin = "keras"
    elif frame.f_code is seed_init:
      return "seed" if origin else None
    frame = frame.f_back
  return origin
