"""What every benchmark script does the same way: this checkout's diststrat, devices,
groups run in fresh processes, the summary of a measurement's rounds as the tables print
it, and the JSON report."""

import json
import os
import signal
import statistics
import subprocess
import sys

# Importing this module makes `import diststrat` this checkout's, not another installed
# copy (an editable install of another worktree, say): a script run as
# `python benchmarks/x.py` has benchmarks/ first on sys.path, not the repository. The
# processes a benchmark starts import this module too, or get this sys.path (LocalCluster).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != REPO:
  sys.path.insert(0, REPO)


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


# --- a group of work in a fresh process ---------------------------------------------------


KILL_WAIT = 10.0  # Seconds to wait for a killed process group's end.


def run_in_subprocess(args, name, timeout):
  """Runs `python ARGS...` (this interpreter) in a fresh process; returns the JSON value on
  the last line of its standard output.

  The child's standard output and error are captured. It runs in a session of its own:
  if it does not finish within `timeout` seconds, or this process is interrupted while
  waiting, its whole process group is killed (nothing is left running). A child that
  exits with an error, times out or prints no JSON raises RuntimeError naming `name`,
  with the end of its error output.
  """
  process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    stdout, stderr = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    _kill_group(process)
    try:  # Bounded: a process of another session could still hold the pipes open.
      _, stderr = process.communicate(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:
      stderr = "(its error output could not be read)"
    raise RuntimeError(f"{name} did not finish within {timeout:g} s and was killed:\n"
                       f"{stderr[-3000:]}") from None
  except BaseException:  # An interruption (Ctrl-C): the child goes too.
    _kill_group(process)
    try:
      process.wait(KILL_WAIT)
    except subprocess.TimeoutExpired:
      pass
    raise
  if process.returncode != 0:
    raise RuntimeError(f"{name} failed (exit status {process.returncode}):\n{stderr[-3000:]}")
  lines = stdout.strip().splitlines()
  try:
    return json.loads(lines[-1])
  except (IndexError, ValueError):
    raise RuntimeError(f"{name} printed no JSON on its last line of output "
                       f"({stdout[-300:]!r}):\n{stderr[-3000:]}") from None


def run_group(script, group, timeout, **flags):
  """Runs `script --group=GROUP --NAME=VALUE...` in a fresh process (`run_in_subprocess`,
  an error naming the group) and returns the JSON its last line prints. A flag that is
  True or False is passed as absl spells it: `--NAME` or `--noNAME`."""
  args = [os.path.abspath(script), f"--group={group}"]
  for key, value in flags.items():
    if isinstance(value, bool):
      args.append(f"--{'' if value else 'no'}{key}")
    else:
      args.append(f"--{key}={value}")
  return run_in_subprocess(args, name=f"benchmark group {group}", timeout=timeout)


def _kill_group(process):
  """SIGKILL to the process group `process` leads (it is not reaped yet, so the group's
  id is still its own)."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


# --- a measurement's rounds, and how the tables print them -------------------------------


def summarize(values, keep_values=True):
  """{"median", "min", "max"} of a measurement's rounds, and with `keep_values` the
  values themselves (under "values", in the order given)."""
  values = list(values)
  summary = {"median": statistics.median(values), "min": min(values), "max": max(values)}
  if keep_values:
    summary["values"] = values
  return summary


def format_summary(summary, spec=".0f", unit=""):
  """A summary as the tables print it: "MEDIAN (MIN-MAX)", each in `spec`, `unit` after the
  median: "1234 (1100-1300)"; with unit "x", a ratio's "1.05x (0.98-1.10)"."""
  return (f"{summary['median']:{spec}}{unit} "
          f"({summary['min']:{spec}}-{summary['max']:{spec}})")


def format_ratio(ratio):
  """A ratio as the tables print it: two decimals and "x" ("0.87x")."""
  return f"{ratio:.2f}x"
