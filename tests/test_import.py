"""diststrat says how to fix a missing or old TensorFlow, and exposes its submodules."""

import subprocess
import sys

import pytest

import diststrat as ds
from diststrat import _tf
from diststrat import _tf_version
import tensorflow as tf


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


def test_names_load_on_first_use_and_dir_lists_them():
  """`import diststrat` defers TensorFlow (PEP 562); every public name still resolves,
  `dir()` and `__all__` list them, and an unknown name is an AttributeError."""
  assert set(ds.__all__) <= set(dir(ds))
  for name in ds.__all__:
    assert getattr(ds, name) is not None
  assert ds.canonicalize_device is ds._devices.canonicalize
  with pytest.raises(AttributeError, match="has no attribute 'NoSuchStrategy'"):
    _ = ds.NoSuchStrategy
  assert set(ds.cluster.__all__) <= set(dir(ds.cluster))
  with pytest.raises(AttributeError, match="diststrat.cluster' has no attribute 'nope'"):
    _ = ds.cluster.nope


@pytest.mark.processes
def test_first_use_imports_tensorflow_and_installs_the_keras_support():
  code = ("import sys\nimport diststrat as ds\n"
          "print('before', 'tensorflow' in sys.modules)\n"
          "from diststrat import MirroredStrategy\n"
          "from diststrat import _context\n"
          "from diststrat._keras import _mode_listener\n"
          "print('after', 'tensorflow' in sys.modules,\n"
          "      _mode_listener.tf_mode in _context._mode_listeners)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=True).stdout
  assert "before False" in out and "after True True" in out, out


@pytest.mark.processes
def test_a_program_that_imports_only_a_submodule_gets_the_keras_support():
  """No `ds.<name>` is ever used: the core installs the Keras support when the first
  context is entered, so Keras sees the strategy (its towers) inside the scope."""
  code = ("import tensorflow as tf\n"
          "cpu = tf.config.list_physical_devices('CPU')[0]\n"
          "tf.config.set_logical_device_configuration(\n"
          "    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
          "from diststrat.strategies import MirroredStrategy\n"
          "with MirroredStrategy().scope():\n"
          "  print('replicas', tf.distribute.get_strategy().num_replicas_in_sync)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=True).stdout
  assert "replicas 2" in out, out


@pytest.mark.processes
@pytest.mark.parametrize("imports", [
    "import diststrat as ds\nfrom diststrat.values import Mirrored\n",
    "from diststrat.values import Mirrored\nfrom diststrat import optimizers\n",
], ids=["package_then_submodule", "submodules_only"])
def test_a_program_that_imports_submodules_first_has_the_default_strategy(imports):
  """`from diststrat.values import ...` binds the submodules it loads as attributes of
  the package, so a later `ds.optimizers` no longer loads the strategies' layer, which
  registers the default strategy: the contexts load it when they first need it."""
  code = ("import tensorflow as tf\n" + imports +
          "import diststrat.optimizers\n"
          "print('get', Mirrored({'/cpu:0': 5}).get())\n"
          "v = tf.Variable(1.0)\n"
          "diststrat.optimizers.GradientDescent(0.5).apply_gradients([(tf.constant(1.0), v)])\n"
          "print('value', float(v.numpy()))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "get 5\nvalue 0.5" in out.stdout, out.stdout


@pytest.mark.processes
def test_old_tensorflow_is_refused_by_import_diststrat():
  """`import diststrat` imports no TensorFlow, yet refuses an old one at once (it was
  refused only at the first `ds.<name>`): from an imported module's version, and from
  the installed distribution's metadata when none is imported."""
  imported = ("import sys, types\n"
              "sys.modules['tensorflow'] = types.SimpleNamespace(__version__='2.15.0')\n")
  installed = ("import importlib.metadata as m\n"
               "real = m.version\n"
               "def version(name):\n"
               "  if name == 'tensorflow-cpu': return '2.14.1'\n"
               "  if name == 'tensorflow': raise m.PackageNotFoundError(name)\n"
               "  return real(name)\n"
               "m.version = version\n")
  for setup, found in ((imported, "2.15.0"), (installed, "2.14.1")):
    code = (setup + "try:\n  import diststrat\nexcept ImportError as e:\n  print('ERR', e)\n"
            "import sys\nprint('tensorflow imported:', hasattr(sys.modules.get('tensorflow'), "
            "'function'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert f"ERR diststrat needs TensorFlow >= 2.16, found {found}" in out, out
    assert "tensorflow imported: False" in out, out


def test_the_installed_version_is_read_without_importing_tensorflow():
  assert _tf_version.installed_version() == tf.__version__  # Imported here: its own.
