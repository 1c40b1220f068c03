"""Choosing a reduction for a set of devices: the instant heuristic, and the default.

`choose_cross_tower_ops(devices)` is instant: it goes by the kind of device (NCCL for
several GPUs, `"naive"` otherwise: on logical CPU devices it measured fastest, the
collective all-reduce slowest). `default_cross_tower_ops(devices)` is what
`MirroredStrategy` uses when it is given none: the algorithm `DISTSTRAT_CROSS_TOWER_OPS`
names, else a `MeasuredCrossTowerOps` that times the shipped algorithms on the first
batch of each kind (docs/cross_tower_ops.md, "The default: measured").
"""

import os
from typing import Callable, Optional, Sequence

from diststrat import _devices
from diststrat.cross_tower_ops._all_reduce import AllReduceCrossTowerOps
from diststrat.cross_tower_ops._base import CrossTowerOps
from diststrat.cross_tower_ops._measured import MeasuredCrossTowerOps
from diststrat.cross_tower_ops._one_device import ReductionToOneDevice

ENVIRONMENT_VARIABLE = "DISTSTRAT_CROSS_TOWER_OPS"
_ALL_REDUCE = ("naive", "hierarchical_copy", "collective", "nccl")
_NAMES = ("auto", "one_device") + _ALL_REDUCE


def choose_cross_tower_ops(devices: str | Sequence[str]) -> AllReduceCrossTowerOps:
  """The all-reduce that suits `devices`, instantly: NCCL for several GPUs, `"naive"` else.

  On logical CPU devices `"naive"` measured the fastest of the shipped algorithms and the
  collective all-reduce the slowest (docs/cross_tower_ops.md, "Which one to pick").
  `MirroredStrategy()` does better than this guess: it measures (`"auto"`).

  Args:
    devices: a device string or a list of them.

  Returns:
    An `AllReduceCrossTowerOps`.

  Example:
    >>> from diststrat.cross_tower_ops import choose_cross_tower_ops
    >>> choose_cross_tower_ops(["/gpu:0", "/gpu:1"]).algorithm
    'nccl'
    >>> choose_cross_tower_ops(["/cpu:0", "/cpu:1"]).algorithm
    'naive'
  """
  devices = _devices.canonicalize_all(devices)
  gpus = [d for d in devices if _devices.device_type(d) == "GPU"]
  if len(devices) > 1 and len(gpus) == len(devices):
    return AllReduceCrossTowerOps("nccl")
  return AllReduceCrossTowerOps("naive")


def pinned_by_environment(devices: Sequence[str]) -> Optional[CrossTowerOps]:
  """The reduction `DISTSTRAT_CROSS_TOWER_OPS` names, or None when it is unset or `auto`.

  Values: `auto` (measure), `one_device` (`ReductionToOneDevice()`), or an algorithm of
  `AllReduceCrossTowerOps` (`naive`, `hierarchical_copy`, `collective`, `nccl`),
  optionally followed by `:<num_packs>` (`naive:4`).

  Raises:
    ValueError: any other value, or `nccl` for devices that are not all GPUs.
  """
  raw = os.environ.get(ENVIRONMENT_VARIABLE, "")
  value = raw.strip().lower()
  if value in ("", "auto"):
    return None
  name, colon, packs = value.partition(":")
  num_packs = int(packs) if packs.isdigit() and int(packs) >= 1 else None
  if name not in _NAMES or (colon and (num_packs is None or name not in _ALL_REDUCE)):
    raise ValueError(
        f"{ENVIRONMENT_VARIABLE} must be one of {', '.join(_NAMES)}; an all-reduce "
        f"algorithm may be followed by ':<num_packs>' (an integer >= 1, e.g. 'naive:4'). "
        f"Received: {ENVIRONMENT_VARIABLE}={raw!r}. Unset it (or set 'auto') to let "
        "MirroredStrategy measure.")
  if name == "one_device":
    return ReductionToOneDevice()
  if name == "nccl" and any(_devices.device_type(d) != "GPU" for d in devices):
    raise ValueError(
        f"{ENVIRONMENT_VARIABLE}=nccl runs on GPUs only, but the strategy's devices are "
        f"{list(devices)}. Set it to naive, hierarchical_copy, collective, one_device or "
        "auto.")
  return AllReduceCrossTowerOps(name, num_packs=num_packs or 1)


def default_cross_tower_ops(devices: Sequence[str],
                            budget: Optional[Callable[[], float]] = None) -> CrossTowerOps:
  """What a strategy given no `CrossTowerOps` reduces with: the environment's pin, else
  a `MeasuredCrossTowerOps` for `devices` (with the measurement `budget`, a callable)."""
  pinned = pinned_by_environment(devices)
  if pinned is not None:
    return pinned
  return MeasuredCrossTowerOps(devices, budget=budget)
