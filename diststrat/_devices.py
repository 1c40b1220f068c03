"""Device strings: one canonical spelling per device, and the devices of this machine.

`canonicalize` is public as `diststrat.canonicalize_device`, `local_devices` as
`diststrat.local_devices`: strategy writers name devices the way diststrat does.
"""

import functools
import threading

from diststrat._tf import tf
from diststrat import _tf_internal

_LOCAL_DEFAULTS = tf.DeviceSpec(job="localhost", replica=0, task=0, device_type="CPU",
                                device_index=0)
# What `canonicalize` fills in: the local process's defaults, or its task's in a cluster.
_process_defaults = _LOCAL_DEFAULTS


def set_process_task(task: str | None) -> None:
  """Makes `canonicalize` fill in `task` (such as "/job:worker/replica:0/task:1") where a
  device string names no job, replica or task, as TensorFlow places "/cpu:0" in a
  process that is a task of a cluster; None: "/job:localhost/replica:0/task:0" again."""
  global _process_defaults
  _process_defaults = (_LOCAL_DEFAULTS if task is None
                       else _LOCAL_DEFAULTS.make_merged_spec(tf.DeviceSpec.from_string(task)))
  canonicalize.cache_clear()


@functools.lru_cache(maxsize=4096)
def canonicalize(device: str | tf.DeviceSpec | tf.config.LogicalDevice,
                 default: str | None = None) -> str:
  """Returns the full name of `device`: `/job:J/replica:R/task:T/device:TYPE:N`.

  Missing parts come from `default` (a device string), then from the local process
  (`/job:localhost/replica:0/task:0/device:CPU:0`; in a process that is a task of a
  `MultiWorkerMirroredStrategy` or `ParameterServerStrategy` cluster, that task, as
  TensorFlow places them). `"/cpu:1"`, `"/device:CPU:1"` and
  `"/job:localhost/replica:0/task:0/device:CPU:1"` all give the last of these.

  Example:
    >>> import diststrat as ds
    >>> ds.canonicalize_device("/cpu:1")
    '/job:localhost/replica:0/task:0/device:CPU:1'

  Args:
    device: a device string, `tf.DeviceSpec` or `tf.config.LogicalDevice`.
    default: optional device string whose fields fill what `device` leaves out.

  Returns:
    The canonical device string.

  Raises:
    ValueError: `device` is not a device string, or is a wildcard (`"/cpu:*"`).
  """
  if isinstance(device, tf.config.LogicalDevice):  # From tf.config.list_logical_devices().
    device = device.name
  if isinstance(device, tf.DeviceSpec):
    spec = device
  elif isinstance(device, str):
    if "*" in device:  # TensorFlow parses "/cpu:*" as "/cpu", which means CPU:0 here.
      raise _tf_internal.pass_through_autograph(ValueError(
          f"Expected one device, such as '/gpu:0'. Received: device={device!r}, a "
          "wildcard for several. Name each device; diststrat.local_devices() lists them."))
    try:
      spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as e:
      raise _tf_internal.pass_through_autograph(ValueError(
          f"Expected a device string such as '/gpu:0' or "
          f"'/job:ps/task:0/device:CPU:0'. Received: device={device!r}")) from e
  else:
    raise _tf_internal.pass_through_autograph(ValueError(
        f"Expected a device string such as '/gpu:0'. Received: "
        f"device={device!r} of type {type(device).__name__}"))
  base = _process_defaults
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


def canonicalize_all(devices, default=None):
  """Canonical names of `devices` (a device string or a sequence of them), as a tuple.

  Args:
    devices: a device string or `tf.DeviceSpec`, or a sequence of them.
    default: as in `canonicalize`: fills the parts each device leaves out.

  Raises:
    ValueError: a device is not a device string, or appears twice, or `devices` is
      unordered (a set).
  """
  if isinstance(devices, (str, tf.DeviceSpec, tf.config.LogicalDevice)):
    devices = (devices,)
  if not hasattr(devices, "__iter__"):
    count = (f" To use {devices} devices, pass diststrat.local_devices()[:{devices}]."
             if isinstance(devices, int) and not isinstance(devices, bool) else "")
    raise _tf_internal.pass_through_autograph(ValueError(
        f"devices must be a list of device strings, such as ['/gpu:0', "
        f"'/gpu:1']. Received: devices={devices!r} "
        f"({type(devices).__name__}).{count}"))
  if isinstance(devices, (set, frozenset, dict)):
    # Their order is the towers' order (tower ids, batch parts, variable copies), and a
    # set's changes from one run to the next.
    raise _tf_internal.pass_through_autograph(ValueError(
        f"devices must be an ordered sequence (a list or tuple): their order "
        f"is the towers' order, and a {type(devices).__name__}'s varies between "
        f"runs. Received: devices={devices!r}. Pass sorted(devices) or a list."))
  result = tuple(canonicalize(d, default) for d in devices)
  if len(set(result)) != len(result):
    raise _tf_internal.pass_through_autograph(ValueError(
        f"Each device may appear once. Received: devices={list(devices)!r}"))
  return result


def local_devices() -> tuple[str, ...]:
  """All local GPUs, else all local CPU devices (logical devices, canonical names).

  Example:
    >>> import diststrat as ds
    >>> all(d.startswith("/job:localhost/") for d in ds.local_devices())
    True
  """
  devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
  return tuple(canonicalize(d.name) for d in devices)


def device_type(device):
  """The device type of a device string: "GPU", "CPU", ... (None if it names none)."""
  return tf.DeviceSpec.from_string(device).device_type


# Canonical names of the logical devices TensorFlow listed last.
_known: frozenset[str] = frozenset()
_known_lock = threading.Lock()


def _list_devices():
  return frozenset(canonicalize(d.name) for d in tf.config.list_logical_devices())


def check_exist(devices, what="devices"):
  """Returns `devices` (canonical names) if TensorFlow knows each of them, else raises.

  TensorFlow runs an op placed on a device that does not exist on some other device
  without saying so (soft placement), so a strategy given "/gpu:0" on a machine without
  GPUs would run everything on the CPU while it reports GPUs. Devices of a cluster's
  other tasks count once this process is connected to the cluster.

  Args:
    devices: canonical device strings.
    what: how the error names the argument, such as "devices".

  Raises:
    ValueError: a device does not exist; the message lists the devices that do.
  """
  global _known
  missing = [d for d in devices if d not in _known]
  if missing:
    with _known_lock:
      _known = _list_devices()  # Devices appear as TensorFlow connects to clusters.
    missing = [d for d in devices if d not in _known]
  if missing:
    shown = sorted(_known, key=lambda d: (d.rsplit(":", 2)[0], int(d.rsplit(":", 1)[1])))
    raise _tf_internal.pass_through_autograph(ValueError(
        f"{what} must be devices that exist in this process. Received: "
        f"{', '.join(repr(d) for d in missing)}, which TensorFlow does not have; it has "
        f"{shown}. Name one of those (a GPU needs a GPU build of TensorFlow and a visible "
        "GPU; split a CPU into several with tf.config.set_logical_device_configuration "
        "before TensorFlow starts)."))
  return tuple(devices)
