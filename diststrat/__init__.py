"""diststrat: run TensorFlow model code unchanged on one device, many, or a cluster.

Example:
  >>> import diststrat as ds
  >>> ds.get_tower_context().num_towers
  1
"""

# Checks TensorFlow first, with a message that says how to fix it.
from diststrat import _tf  # noqa: F401

from diststrat import errors as errors
from diststrat import cross_tower_ops as cross_tower_ops
from diststrat import optimizers as optimizers
from diststrat import values as values
from diststrat import strategies as strategies
from diststrat import cluster as cluster
from diststrat import pipeline as pipeline
from diststrat import _keras
from diststrat._context import TowerContext as TowerContext
from diststrat._context import get_cross_tower_context as get_cross_tower_context
from diststrat._context import get_distribution_strategy as get_distribution_strategy
from diststrat._context import get_tower_context as get_tower_context
from diststrat._context import get_update_device as get_update_device
from diststrat._context import has_distribution_strategy as has_distribution_strategy
from diststrat._devices import canonicalize as canonicalize_device
from diststrat._devices import local_devices as local_devices
from diststrat._input import PerDeviceDataset as PerDeviceDataset
from diststrat._strategy import DistributionStrategy as DistributionStrategy
from diststrat.strategies import DefaultStrategy as DefaultStrategy
from diststrat.strategies import MirroredStrategy as MirroredStrategy
from diststrat.strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from diststrat.strategies import ParameterServerStrategy as ParameterServerStrategy

__version__ = "0.1.0"

_keras.install()  # Keras 3 models, optimizers and `fit` under every strategy.

__all__ = [
    "DistributionStrategy",
    "DefaultStrategy",
    "MirroredStrategy",
    "ParameterServerStrategy",
    "MultiWorkerMirroredStrategy",
    "TowerContext",
    "get_tower_context",
    "get_cross_tower_context",
    "get_distribution_strategy",
    "has_distribution_strategy",
    "get_update_device",
    "canonicalize_device",
    "local_devices",
    "PerDeviceDataset",
    "errors",
    "cross_tower_ops",
    "optimizers",
    "values",
    "strategies",
    "cluster",
    "pipeline",
]
