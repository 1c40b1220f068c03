"""Wrapped values and distributed variables.

`PerDevice` holds one value per tower, `Mirrored` copies of one value; `regroup` and
`select_device` convert between per-tower structures and wrapped ones.
"""

from diststrat.values._wrapped import DistributedValues as DistributedValues
from diststrat.values._wrapped import batch_shares as batch_shares
from diststrat.values._wrapped import Mirrored as Mirrored
from diststrat.values._wrapped import PerDevice as PerDevice
from diststrat.values._wrapped import regroup as regroup
from diststrat.values._wrapped import select_device as select_device
from diststrat.values._variables import DistributedVariable as DistributedVariable
from diststrat.values._variables import MirroredVariable as MirroredVariable
from diststrat.values._variables import TowerLocalVariable as TowerLocalVariable

__all__ = [
    "DistributedValues",
    "PerDevice",
    "Mirrored",
    "regroup",
    "select_device",
    "batch_shares",
    "DistributedVariable",
    "MirroredVariable",
    "TowerLocalVariable",
]
