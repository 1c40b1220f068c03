"""Imports TensorFlow once, and says how to fix it when it is missing or too old.

Every diststrat module that uses TensorFlow imports `tf` from here. `import diststrat`
itself imports no TensorFlow: it checks the installed version from the package metadata
(`_tf_version.py`); this module checks the imported one.
"""

from diststrat._tf_version import INSTALL_HINT as _INSTALL_HINT
from diststrat._tf_version import MIN_TF_VERSION
from diststrat._tf_version import check_version

try:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
  raise ImportError(
      "diststrat needs TensorFlow >= "
      f"{'.'.join(map(str, MIN_TF_VERSION))}, but it could not be imported "
      f"({e}). {_INSTALL_HINT}") from e


check_version(tf.__version__)

__all__ = ["tf", "check_version", "MIN_TF_VERSION"]
