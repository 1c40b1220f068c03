"""The strategies diststrat ships."""

from diststrat.strategies._default import DefaultStrategy as DefaultStrategy

__all__ = ["DefaultStrategy"]
