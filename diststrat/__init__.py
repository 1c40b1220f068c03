"""diststrat: run TensorFlow model code unchanged on one device, many, or a cluster.

Example:
  >>> import diststrat as ds
  >>> ds.get_tower_context().num_towers
  1

`import diststrat` imports no TensorFlow: its names are loaded on first use (PEP 562),
all at once, so that `diststrat-run --help` answers at once. The first `ds.<name>`
imports TensorFlow (checking its version, `_tf.py`), every submodule, and installs the
Keras support (`_keras.install()`: Keras 3 models, optimizers and `fit` under every
strategy). A program that imports only submodules (`from diststrat.strategies import
MirroredStrategy`) gets the Keras support too: the core installs it the first time a
strategy's context is entered (`_integrations.py`). A missing TensorFlow, or one too old
(read from its package metadata, `_tf_version.py`), is reported by `import diststrat`
itself.
"""

import importlib
import importlib.util
import threading
import typing

from diststrat import _integrations
from diststrat import _tf_version

__version__ = "0.1.0"

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

# Each public name: (module, attribute), attribute None for the module itself. The first
# use of any of them loads them all (`_load`). Type checkers read the imports below.
_NAMES = {
    "errors": ("diststrat.errors", None),
    "cross_tower_ops": ("diststrat.cross_tower_ops", None),
    "optimizers": ("diststrat.optimizers", None),
    "values": ("diststrat.values", None),
    "strategies": ("diststrat.strategies", None),
    "cluster": ("diststrat.cluster", None),
    "pipeline": ("diststrat.pipeline", None),
    "TowerContext": ("diststrat._context", "TowerContext"),
    "get_cross_tower_context": ("diststrat._context", "get_cross_tower_context"),
    "get_distribution_strategy": ("diststrat._context", "get_distribution_strategy"),
    "get_tower_context": ("diststrat._context", "get_tower_context"),
    "get_update_device": ("diststrat._context", "get_update_device"),
    "has_distribution_strategy": ("diststrat._context", "has_distribution_strategy"),
    "canonicalize_device": ("diststrat._devices", "canonicalize"),
    "local_devices": ("diststrat._devices", "local_devices"),
    "PerDeviceDataset": ("diststrat._input", "PerDeviceDataset"),
    "DistributionStrategy": ("diststrat._strategy", "DistributionStrategy"),
    "DefaultStrategy": ("diststrat.strategies", "DefaultStrategy"),
    "MirroredStrategy": ("diststrat.strategies", "MirroredStrategy"),
    "MultiWorkerMirroredStrategy": ("diststrat.strategies", "MultiWorkerMirroredStrategy"),
    "ParameterServerStrategy": ("diststrat.strategies", "ParameterServerStrategy"),
}

if typing.TYPE_CHECKING:
  from diststrat import errors as errors
  from diststrat import cross_tower_ops as cross_tower_ops
  from diststrat import optimizers as optimizers
  from diststrat import values as values
  from diststrat import strategies as strategies
  from diststrat import cluster as cluster
  from diststrat import pipeline as pipeline
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



def _tensorflow_missing() -> bool:
  try:
    return importlib.util.find_spec("tensorflow") is None
  except ValueError:  # Imported already, without a spec.
    return False


if _tensorflow_missing():
  importlib.import_module("diststrat._tf")  # Raises the ImportError that says how to fix it.
_tf_version.check_installed()  # Too old: refused here too, from its metadata (no import).

_lock = threading.RLock()


def _install_keras() -> None:
  importlib.import_module("diststrat._keras").install()


# Run on the first use of a name below, or by the core on first use (_integrations.py),
# however diststrat was imported.
_integrations.register(_install_keras)


def _load_default_strategy() -> None:
  importlib.import_module("diststrat.strategies._default")  # Registers it when imported.


# Run by the contexts the first time they need the default strategy: a program may import
# only submodules (`from diststrat.values import Mirrored`), which do not import it.
_integrations.register_default_strategy_loader(_load_default_strategy)


def _load() -> None:
  """Imports TensorFlow (checked first), every public name, and the Keras support."""
  with _lock:
    importlib.import_module("diststrat._tf")
    loaded = {}
    for name, (module, attribute) in _NAMES.items():
      value = importlib.import_module(module)
      loaded[name] = value if attribute is None else getattr(value, attribute)
    _integrations.install_pending()
    globals().update(loaded)


def __getattr__(name: str) -> typing.Any:
  if name in _NAMES:
    _load()
    return globals()[name]
  raise AttributeError(f"module 'diststrat' has no attribute {name!r}")


def __dir__() -> typing.List[str]:
  return sorted(set(globals()) | set(_NAMES))
