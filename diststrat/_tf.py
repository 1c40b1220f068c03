"""Imports TensorFlow once, and says how to fix it when it is missing or too old.

Every diststrat module imports `tf` from here, so the check runs exactly once, on
`import diststrat`.
"""

MIN_TF_VERSION = (2, 16)

_INSTALL_HINT = (
    "Install it with `pip install 'diststrat[tf]'`, or `pip install 'diststrat[tf-cpu]'` "
    "on a machine without a GPU."
)

try:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
  raise ImportError(
      "diststrat needs TensorFlow >= "
      f"{'.'.join(map(str, MIN_TF_VERSION))}, but it could not be imported "
      f"({e}). {_INSTALL_HINT}") from e


def _parse_version(version):
  parts = []
  for piece in version.split(".")[:2]:
    digits = "".join(ch for ch in piece if ch.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


def check_version(version):
  """Raises ImportError when `version` (a TensorFlow version string) is too old."""
  if _parse_version(version) < MIN_TF_VERSION:
    raise ImportError(
        f"diststrat needs TensorFlow >= {'.'.join(map(str, MIN_TF_VERSION))}, "
        f"found {version}. Upgrade it: `pip install -U 'diststrat[tf]'` "
        "(or `pip install -U 'diststrat[tf-cpu]'`).")


check_version(tf.__version__)

__all__ = ["tf", "check_version", "MIN_TF_VERSION"]
