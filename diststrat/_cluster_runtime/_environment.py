"""Which cluster this process belongs to, read from its environment: TF_CONFIG, then Slurm.

A cluster strategy created with no cluster arguments asks `cluster_from_environment()`:

1. `TF_CONFIG` (set by `diststrat-run`, by Kubernetes operators, by hand):
   `{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": "worker", "index": 0}}`.
2. Slurm's variables, when `TF_CONFIG` is absent and this process is one task of a Slurm
   step of two tasks or more (`srun`): `cluster_from_slurm()`.
3. Otherwise None: the process runs alone.

Explicit arguments (`cluster_spec=...`) come before both. Everything here is a pure
function of the environment mapping it is given, so it is tested without Slurm.
"""

import dataclasses
import json
import os
import re
from typing import Mapping

from diststrat import errors

TF_CONFIG = "TF_CONFIG"
SLURM_NUM_PS_ENV = "DISTSTRAT_SLURM_NUM_PS"
"""How many of a Slurm step's tasks (the first ones) are parameter servers; default 0."""
SLURM_PORT_BASE_ENV = "DISTSTRAT_SLURM_PORT_BASE"
"""The first port of each node's tasks under Slurm; default `DEFAULT_SLURM_PORT_BASE`."""
SLURM_DISABLE_ENV = "DISTSTRAT_SLURM"
"""Set to "0" to ignore Slurm's variables."""
DEFAULT_SLURM_PORT_BASE = 8888  # tf.distribute's Slurm resolver's default too.


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """A cluster and this process's task in it.

  Attributes:
    cluster_spec: {job: ["host:port", ...]}, jobs "ps" (if any) and "worker".
    task_type: this process's job.
    task_id: this process's index in its job.
    source: where it was read: "TF_CONFIG" or "Slurm".
  """
  cluster_spec: dict
  task_type: str
  task_id: int
  source: str

  def tf_config(self) -> str:
    """The `TF_CONFIG` JSON text of this task."""
    return json.dumps({"cluster": self.cluster_spec,
                       "task": {"type": self.task_type, "index": self.task_id}})


def from_tf_config(text: str) -> ClusterConfig:
  """The cluster and task a `TF_CONFIG` JSON text names.

  Raises:
    ValueError: `text` is not such JSON, naming what was received.
  """
  try:
    config = json.loads(text)
    cluster, task = config["cluster"], config["task"]
    task_type, task_id = task["type"], task["index"]
    if (not isinstance(cluster, dict) or not isinstance(task_type, str)
        or isinstance(task_id, bool)):
      raise TypeError("wrong types")
    task_id = int(task_id)
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError("TF_CONFIG must be JSON such as {\"cluster\": {\"worker\": "
                     "[\"host:port\", ...]}, \"task\": {\"type\": \"worker\", \"index\": 0}}. "
                     f"Received: TF_CONFIG={text!r}") from e
  addresses = cluster.get(task_type)
  if not isinstance(addresses, (list, tuple)):
    raise ValueError(
        f"TF_CONFIG's task type must be a job of its cluster, one of {sorted(cluster)}"
        f"{' (its cluster is empty)' if not cluster else ''}. "
        f"Received: type={task_type!r} in TF_CONFIG={text!r}. Fix the TF_CONFIG the "
        "launcher sets (diststrat-run sets one per task).")
  if not addresses:
    raise ValueError(
        f"TF_CONFIG's cluster lists no address for its task's job {task_type!r}, so this "
        f"process cannot be task {task['index']!r} of it. Received: TF_CONFIG={text!r}. Fix "
        "the TF_CONFIG the launcher sets (diststrat-run sets one per task).")
  if not 0 <= task_id < len(addresses):
    raise ValueError(
        f"TF_CONFIG's task index must be an index into its cluster's {task_type!r} job, "
        f"from 0 to {len(addresses) - 1}. Received: index={task['index']!r} in "
        f"TF_CONFIG={text!r}. Fix the TF_CONFIG the launcher sets (diststrat-run sets one "
        "per task).")
  return ClusterConfig(cluster, task_type, task_id, TF_CONFIG)


def expand_hostlist(text: str) -> list:
  """Slurm's compressed host list as host names, in order.

  `"node[01-03,07],gpu5"` -> `["node01", "node02", "node03", "node07", "gpu5"]`; ranges
  keep their zero padding, and a name may have several bracket groups (`"r[1-2]n[1-2]"`).

  Raises:
    ValueError: unbalanced brackets or a range that is not `a-b` with a <= b.
  """
  hosts = []
  for item in _split_top_level(text, "hostlist"):
    hosts.extend(_expand_one(item, text))
  if not hosts:
    raise ValueError(f"A Slurm host list must name at least one host, such as "
                     f"'node[01-03]'. Received: {text!r}")
  return hosts


def _split_top_level(text, what):
  """`text` split at the commas outside brackets."""
  items, depth, current = [], 0, ""
  for char in text:
    if char == "[":
      depth += 1
    elif char == "]":
      depth -= 1
      if depth < 0:
        break
    if char == "," and depth == 0:
      items.append(current)
      current = ""
    else:
      current += char
  if depth != 0:
    raise ValueError(f"Unbalanced brackets in the Slurm {what} {text!r}.")
  items.append(current)
  return [item.strip() for item in items if item.strip()]


def _expand_one(item, text):
  match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
  if not match:
    return [item]
  prefix, ranges, rest = match.groups()
  expanded = []
  for part in ranges.split(","):
    low, dash, high = part.strip().partition("-")
    if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
      raise ValueError(f"Slurm host ranges look like 'node[01-03,07]'. Received: {text!r} "
                       f"(the range {part!r}).")
    width = len(low)
    for number in range(int(low), int(high if dash else low) + 1):
      expanded.append(f"{prefix}{number:0{width}d}")
  return [head + tail for head in expanded for tail in _expand_one(rest, text)]


def expand_tasks_per_node(text: str) -> list:
  """Slurm's tasks per node: `"2(x3),1"` -> `[2, 2, 2, 1]`.

  Raises:
    ValueError: an item that is not `n` or `n(xk)`.
  """
  counts = []
  for item in text.split(","):
    match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
    if not match:
      raise ValueError(f"Slurm tasks per node look like '2(x3),1'. Received: {text!r}")
    counts.extend([int(match.group(1))] * int(match.group(2) or 1))
  return counts


def _slurm_int(environ, name, default=None):
  text = environ.get(name)
  if text is None or text == "":
    if default is None:
      raise ValueError(f"Slurm's variable {name} is not set, and diststrat needs it to "
                       "build the cluster (run the program with srun).")
    return default
  if not text.strip().isdigit():
    raise ValueError(f"{name} must be a non-negative integer. Received: {name}={text!r}")
  return int(text)


def cluster_from_slurm(environ: Mapping | None = None, *, num_ps: int | None = None,
                       port_base: int | None = None) -> ClusterConfig | None:
  """The cluster of a Slurm step, as tf.distribute's Slurm resolver builds it.

  Every task of the step (`srun`) is one task of the cluster. Tasks are numbered by
  `SLURM_PROCID`; the nodes are `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`),
  expanded, each running `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_TASKS_PER_NODE`) tasks,
  the consecutive ranks on one node (Slurm's default block distribution); the k-th task
  of a node listens on `port_base + k`. The first `num_ps` ranks are parameter servers
  ("ps" tasks 0..num_ps-1), the others are workers.

  Args:
    environ: the variables (default: `os.environ`).
    num_ps: number of PS tasks (default: `DISTSTRAT_SLURM_NUM_PS`, else 0).
    port_base: the first port on each node (default: `DISTSTRAT_SLURM_PORT_BASE`, else
      8888).

  Returns:
    The `ClusterConfig` of this task, or None when the variables name no step of two
    tasks or more (no `SLURM_PROCID`, a one-task step, or `DISTSTRAT_SLURM=0`).

  Raises:
    ValueError: variables that disagree or do not parse, naming them.
  """
  environ = os.environ if environ is None else environ
  if environ.get(SLURM_DISABLE_ENV) == "0" or "SLURM_PROCID" not in environ:
    return None
  nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
  tasks_text = (environ.get("SLURM_STEP_TASKS_PER_NODE")
                or environ.get("SLURM_TASKS_PER_NODE"))
  if not nodelist or not tasks_text:
    return None
  rank = _slurm_int(environ, "SLURM_PROCID")
  tasks_name = "SLURM_STEP_NUM_TASKS" if environ.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
  hosts = expand_hostlist(nodelist)
  per_node = expand_tasks_per_node(tasks_text)
  if len(per_node) != len(hosts):
    raise ValueError(
        f"Slurm names {len(hosts)} nodes ({nodelist!r}) but tasks for {len(per_node)} "
        f"({tasks_text!r}); they must agree.")
  num_tasks = _slurm_int(environ, tasks_name, sum(per_node))
  if sum(per_node) != num_tasks:
    raise ValueError(f"Slurm's tasks per node ({tasks_text!r}) add up to {sum(per_node)}, "
                     f"not to the step's {num_tasks} tasks.")
  if num_tasks < 2:
    return None
  if num_ps is None:
    num_ps = _slurm_int(environ, SLURM_NUM_PS_ENV, 0)
  if port_base is None:
    port_base = _slurm_int(environ, SLURM_PORT_BASE_ENV, DEFAULT_SLURM_PORT_BASE)
  if not 0 <= num_ps < num_tasks:
    raise ValueError(f"A Slurm step of {num_tasks} tasks can have 0 to {num_tasks - 1} "
                     f"parameter servers (the others are workers). Received: num_ps={num_ps}"
                     f" ({SLURM_NUM_PS_ENV}).")
  if not rank < num_tasks:
    raise ValueError(f"SLURM_PROCID must be below the step's {num_tasks} tasks. Received: "
                     f"SLURM_PROCID={rank}")
  if not 0 < port_base <= 65536 - max(per_node):
    raise ValueError(f"port_base must leave room for {max(per_node)} ports per node below "
                     f"65536. Received: port_base={port_base}")
  addresses = [f"{host}:{port_base + k}" for host, count in zip(hosts, per_node, strict=True)
               for k in range(count)]
  spec = {"worker": addresses[num_ps:]}
  if num_ps:
    spec = {"ps": addresses[:num_ps], **spec}
  if rank < num_ps:
    return ClusterConfig(spec, "ps", rank, "Slurm")
  return ClusterConfig(spec, "worker", rank - num_ps, "Slurm")


def cluster_from_environment(environ: Mapping | None = None) -> ClusterConfig | None:
  """This process's cluster: `TF_CONFIG` if set, else Slurm's variables, else None.

  Raises:
    ValueError: a `TF_CONFIG` or Slurm variables that do not parse, naming them.
  """
  environ = os.environ if environ is None else environ
  text = environ.get(TF_CONFIG)
  if text:
    return from_tf_config(text)
  return cluster_from_slurm(environ)


def checked(check, source):
  """`check()`; a `ValueError` it raises says the cluster came from `source`, if any."""
  try:
    return check()
  except ValueError as e:
    if source is not None:
      where = ("the TF_CONFIG environment variable" if source == TF_CONFIG
               else "Slurm's SLURM_* variables")
      errors.add_note(e, f"(the cluster and task were read from {where}; pass "
                      "cluster_spec, task_type and task_id to choose them yourself)")
    raise
