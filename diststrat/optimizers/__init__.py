"""Optimizers that work unchanged with one device, several towers, or parameter servers."""

from diststrat.optimizers._mixin import DistributedOptimizerMixin as DistributedOptimizerMixin
from diststrat.optimizers._optimizer import Optimizer as Optimizer
from diststrat.optimizers._shipped import Adam as Adam
from diststrat.optimizers._shipped import GradientDescent as GradientDescent
from diststrat.optimizers._shipped import Momentum as Momentum

__all__ = [
    "Optimizer",
    "DistributedOptimizerMixin",
    "GradientDescent",
    "Momentum",
    "Adam",
]
