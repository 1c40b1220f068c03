"""What every benchmark script does the same way: devices and the JSON report."""

import json
import os


def configure_devices(count):
  """The towers' devices: up to `count` GPUs, else the CPU split into `count` logical ones.

  Call before TensorFlow initializes its devices (before any op runs).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices("GPU")
  if gpus:
    return [d.name for d in tf.config.list_logical_devices("GPU")][:count]
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * count)
  return [d.name for d in tf.config.list_logical_devices("CPU")]


def write_report(report, path, suffix=""):
  """Writes `report` as JSON to `path` (making its folder) and says where."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=2)
  print(f"\n{suffix}JSON written to {path}")
