"""The strategies diststrat ships."""

from diststrat.strategies._default import DefaultStrategy as DefaultStrategy
from diststrat.strategies._mirrored import MirroredStrategy as MirroredStrategy
from diststrat.strategies._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from diststrat.strategies._parameter_server import ParameterServerStrategy as ParameterServerStrategy

__all__ = ["DefaultStrategy", "MirroredStrategy", "ParameterServerStrategy",
           "MultiWorkerMirroredStrategy"]
