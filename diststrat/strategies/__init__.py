"""The strategies diststrat ships."""

from diststrat.strategies._default import DefaultStrategy as DefaultStrategy
from diststrat.strategies._mirrored import MirroredStrategy as MirroredStrategy

__all__ = ["DefaultStrategy", "MirroredStrategy"]
