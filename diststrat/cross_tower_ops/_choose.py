"""The one chooser of a reduction for a set of devices.

`MirroredStrategy` (and anything else that is given no `CrossTowerOps`) reduces with
what `choose_cross_tower_ops(devices)` returns. The choice goes by the kind of device
(NCCL for GPUs, the collective all-reduce, which also works across processes, otherwise),
not by speed: on logical CPU devices `"naive"` is faster. docs/cross_tower_ops.md ("Which
one to pick") gives measurements from benchmarks/mirrored_benchmark.py and says when to
pick another.
"""

from typing import Sequence

from diststrat import _devices
from diststrat.cross_tower_ops._all_reduce import AllReduceCrossTowerOps


def choose_cross_tower_ops(devices: str | Sequence[str]) -> AllReduceCrossTowerOps:
  """The all-reduce that suits `devices`: NCCL for several GPUs, collective ops otherwise.

  Args:
    devices: a device string or a list of them.

  Returns:
    An `AllReduceCrossTowerOps`.

  Example:
    >>> from diststrat.cross_tower_ops import choose_cross_tower_ops
    >>> choose_cross_tower_ops(["/gpu:0", "/gpu:1"]).algorithm
    'nccl'
    >>> choose_cross_tower_ops(["/cpu:0", "/cpu:1"]).algorithm
    'collective'
  """
  devices = _devices.canonicalize_all(devices)
  gpus = [d for d in devices if _devices.device_type(d) == "GPU"]
  if len(devices) > 1 and len(gpus) == len(devices):
    return AllReduceCrossTowerOps("nccl")
  return AllReduceCrossTowerOps("collective")
