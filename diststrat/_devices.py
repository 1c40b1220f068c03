"""Device strings: one canonical spelling per device."""

import functools

from diststrat._tf import tf
from diststrat import _tf_internal

_LOCAL_DEFAULTS = tf.DeviceSpec(job="localhost", replica=0, task=0, device_type="CPU",
                                device_index=0)


@functools.lru_cache(maxsize=4096)
def canonicalize(device, default=None):
  """Returns the full name of `device`: `/job:J/replica:R/task:T/device:TYPE:N`.

  Missing parts come from `default` (a device string), then from the local process
  (`/job:localhost/replica:0/task:0/device:CPU:0`). `"/cpu:1"`, `"/device:CPU:1"` and
  `"/job:localhost/replica:0/task:0/device:CPU:1"` all give the last of these.

  Args:
    device: a device string or `tf.DeviceSpec`.
    default: optional device string whose fields fill what `device` leaves out.

  Returns:
    The canonical device string.

  Raises:
    ValueError: `device` is not a device string.
  """
  if isinstance(device, tf.DeviceSpec):
    spec = device
  elif isinstance(device, str):
    try:
      spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as e:
      raise ValueError(f"Expected a device string such as '/gpu:0' or "
                       f"'/job:ps/task:0/device:CPU:0'. Received: device={device!r}") from e
  else:
    raise ValueError(f"Expected a device string such as '/gpu:0'. Received: "
                     f"device={device!r} of type {type(device).__name__}")
  base = _LOCAL_DEFAULTS
  if default:
    base = base.make_merged_spec(tf.DeviceSpec.from_string(default))
  merged = base.make_merged_spec(spec)
  if spec.device_type is not None and spec.device_index is None:
    merged = merged.replace(device_index=0)
  return merged.to_string()


def current_device():
  """The canonical device of the current `tf.device` scope, or None when there is none."""
  device = _tf_internal.current_device()
  return canonicalize(device) if device else None


def canonicalize_all(devices):
  """Canonical names of `devices` (a device string or a sequence of them), as a tuple."""
  if isinstance(devices, (str, tf.DeviceSpec)):
    devices = (devices,)
  result = tuple(canonicalize(d) for d in devices)
  if len(set(result)) != len(result):
    raise ValueError(f"Each device may appear once. Received: devices={list(devices)!r}")
  return result
