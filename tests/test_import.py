"""diststrat says how to fix a missing or old TensorFlow, and exposes its submodules."""

import subprocess
import sys

import pytest

import diststrat as ds
from diststrat import _tf


@pytest.mark.processes
def test_missing_tensorflow_says_which_pip_install():
  code = ("import sys; sys.modules['tensorflow'] = None\n"
          "try:\n  import diststrat\nexcept ImportError as e:\n  print('ERR', e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=True).stdout
  assert "ERR diststrat needs TensorFlow >= 2.16" in out
  assert "pip install 'diststrat[tf]'" in out and "diststrat[tf-cpu]" in out


@pytest.mark.parametrize("version", ["2.15.1", "1.15.0", "2.9.0rc1"])
def test_old_tensorflow_is_refused(version):
  with pytest.raises(ImportError, match=f"found {version}. Upgrade it: `pip install -U"):
    _tf.check_version(version)


@pytest.mark.parametrize("version", ["2.16.0", "2.21.0", "2.22.0rc0", "3.0.0"])
def test_new_tensorflow_is_accepted(version):
  _tf.check_version(version)


def test_submodules_are_attributes():
  for name in ["values", "strategies", "errors"]:
    assert hasattr(ds, name)
  assert issubclass(ds.errors.ClusterError, RuntimeError)
  assert issubclass(ds.errors.ContextError, RuntimeError)
  assert issubclass(ds.errors.StructureMismatchError, ValueError)
