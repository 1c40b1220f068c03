"""AutoGraph: letting diststrat's errors through as themselves.

Inside `tf.function`, AutoGraph rebuilds errors raised in converted code from their
message, as another type (`StagingError`) and without their notes, unless they are
marked to pass through.
"""

_AUTOGRAPH_PASS_THROUGH = "ag_pass_through"
_AUTOGRAPH_METADATA = "ag_error_metadata"


def pass_through_autograph(error):
  """Makes AutoGraph re-raise `error` itself: same type, message and notes.

  AutoGraph leaves alone an error that has `ag_pass_through`; one that already carries
  its `ag_error_metadata` (attached in converted code deeper down, such as a tower
  function) would be rebuilt at the top, so that is removed.
  """
  setattr(error, _AUTOGRAPH_PASS_THROUGH, True)
  if _AUTOGRAPH_METADATA in getattr(error, "__dict__", {}):
    delattr(error, _AUTOGRAPH_METADATA)
  return error


def pass_through_autograph_class(cls):
  """Class decorator: every error of `cls` passes through AutoGraph as itself."""
  setattr(cls, _AUTOGRAPH_PASS_THROUGH, True)
  return cls
