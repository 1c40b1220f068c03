"""Which TensorFlow diststrat needs, checked without importing TensorFlow.

`import diststrat` imports no TensorFlow (so that `diststrat-run --help` answers at once),
yet refuses a TensorFlow that is too old at once, with the fix: it reads the installed
version from the package metadata (`installed_version`). `_tf.py` checks the imported
module's `__version__` again when TensorFlow is first imported.
"""

import importlib.metadata
import sys
from typing import Optional

MIN_TF_VERSION = (2, 16)

INSTALL_HINT = (
    "Install it with `pip install 'diststrat[tf]'`, or `pip install 'diststrat[tf-cpu]'` "
    "on a machine without a GPU."
)

# The distributions that install the `tensorflow` package, in the order they are looked
# for.
_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
                  "tensorflow-macos", "tf-nightly", "tf-nightly-cpu")


def _parse_version(version):
  parts = []
  for piece in version.split(".")[:2]:
    digits = "".join(ch for ch in piece if ch.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


def check_version(version: str) -> None:
  """Raises ImportError when `version` (a TensorFlow version string) is too old."""
  if _parse_version(version) < MIN_TF_VERSION:
    raise ImportError(
        f"diststrat needs TensorFlow >= {'.'.join(map(str, MIN_TF_VERSION))}, "
        f"found {version}. Upgrade it: `pip install -U 'diststrat[tf]'` "
        "(or `pip install -U 'diststrat[tf-cpu]'`).")


def installed_version() -> Optional[str]:
  """The version of the TensorFlow this process would import: the imported module's, else
  the installed distribution's (no import); None when neither says."""
  module = sys.modules.get("tensorflow")
  if module is not None and isinstance(getattr(module, "__version__", None), str):
    return module.__version__
  for name in _DISTRIBUTIONS:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def check_installed() -> None:
  """Raises ImportError when the TensorFlow this process would import is too old."""
  version = installed_version()
  if version is not None:
    check_version(version)


__all__ = ["MIN_TF_VERSION", "INSTALL_HINT", "check_version", "installed_version",
           "check_installed"]
