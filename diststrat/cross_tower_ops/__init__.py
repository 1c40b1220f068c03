"""Cross-tower reduction: combine per-tower values across devices.

`CrossTowerOps` is the base class; `ReductionToOneDevice` and `AllReduceCrossTowerOps`
ship, `choose_cross_tower_ops(devices)` picks one for a set of devices instantly, and
`MeasuredCrossTowerOps` (`MirroredStrategy`'s default) picks by timing them. See
docs/cross_tower_ops.md. `CrossWorkerAllReduce` reduces across the worker processes of
a `MultiWorkerMirroredStrategy`, its `cross_worker_ops` (docs/multi_worker.md).
"""

from diststrat.cross_tower_ops._all_reduce import AllReduceCrossTowerOps as AllReduceCrossTowerOps
from diststrat.cross_tower_ops._choose import choose_cross_tower_ops as choose_cross_tower_ops
from diststrat.cross_tower_ops._base import CrossTowerOps as CrossTowerOps
from diststrat.cross_tower_ops._measured import MeasuredCrossTowerOps as MeasuredCrossTowerOps
from diststrat.cross_tower_ops._cross_worker import CrossWorkerAllReduce as CrossWorkerAllReduce
from diststrat.cross_tower_ops._one_device import ReductionToOneDevice as ReductionToOneDevice

__all__ = [
    "CrossTowerOps",
    "ReductionToOneDevice",
    "AllReduceCrossTowerOps",
    "choose_cross_tower_ops",
    "MeasuredCrossTowerOps",
    "CrossWorkerAllReduce",
]
