"""The package's layers and its TensorFlow boundary (docs/architecture.md) match its code.

- Every module belongs to one layer; a module imports only from lower layers or, inside
  its own layer, without cycles. Relative imports are resolved first, so an upward one
  fails like an absolute one. Imports sit at the top of modules.
- Only the boundary (`diststrat/_tf_internal/`) reaches past TensorFlow's and Keras's
  public API: imports of `tensorflow.python`, `tensorflow.core` or `keras.src`, module
  names of theirs in strings, `tf.__internal__`, a private attribute of a TensorFlow or
  Keras object (read, written, or named to getattr/setattr/hasattr), and calls of the
  private protocol methods TensorFlow calls on diststrat's objects.
- Every name the boundary exports has a test named after it in tests/test_tf_internal.py
  (the name, in snake case, is part of the test's name).
- No module uses another module's private names, except the implementer protocol
  documented in docs/write_your_own_strategy.md.
- Only the process layer (cluster/_processes.py, its fork server and namespaces) starts,
  signals or reaps a process.
"""

import ast
import pathlib
import re

import keras
import pytest
import tensorflow as tf

import diststrat  # noqa: F401  # pylint: disable=unused-import
from diststrat import _tf_internal

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent / "diststrat"
BOUNDARY = "_tf_internal"

# Lowest first; the same order as the picture in docs/architecture.md. A package's
# `__init__` is named by the package ("" is diststrat/__init__.py).
LAYERS = [
    ("foundation", ["_tf_version", "_tf", "_integrations", "_tf_internal._base", "_tf_internal._autograph",
                    "_tf_internal._thread_state", "_tf_internal._collectives",
                    "_tf_internal._functions", "_tf_internal._cluster_rpc",
                    "_tf_internal._variables", "_tf_internal._tapes", "_tf_internal._keras",
                    "_tf_internal._distribute_stack", "_tf_internal", "errors", "_devices",
                    "_arguments"]),
    ("contexts", ["_context"]),
    ("values", ["values._wrapped", "values._variables", "_input"]),
    ("reductions", ["cross_tower_ops._packing", "cross_tower_ops._collective",
                    "cross_tower_ops._launch", "cross_tower_ops._base",
                    "cross_tower_ops._one_device", "cross_tower_ops._all_reduce",
                    "cross_tower_ops._measured", "cross_tower_ops._choose", "cross_tower_ops._cross_worker",
                    "cross_tower_ops"]),
    ("strategy machinery", ["_strategy", "strategies._tower_threads",
                            "_cluster_runtime._faults", "_cluster_runtime._exposure",
                            "_cluster_runtime._host_threads",
                            "_cluster_runtime._environment", "_cluster_runtime._cluster_spec",
                            "_cluster_runtime._watchdog",
                            "_cluster_runtime.parameter_server._read_cache",
                            "_cluster_runtime.parameter_server._shared_variables",
                            "_cluster_runtime.parameter_server._connection",
                            "_cluster_runtime.parameter_server",
                            "_cluster_runtime.multi_worker._collective_watchdog",
                            "_cluster_runtime.multi_worker._worker_group",
                            "_cluster_runtime.multi_worker", "_cluster_runtime",
                            "optimizers._optimizer", "optimizers._mixin",
                            "optimizers._shipped", "optimizers"]),
    ("strategies", ["strategies._default", "strategies._mirrored", "strategies._ps_backends",
                    "strategies._parameter_server", "strategies._multi_worker",
                    "strategies"]),
    ("integrations", ["_keras._variable_rules", "_keras._file_callbacks",
                      "_keras._model_checks", "_keras._replay", "_keras._training", "_keras._facade",
                      "_keras._mode_listener", "_keras._thread_globals", "_keras"]),
    ("applications", ["cluster._isolation", "cluster._processes", "cluster._forkserver",
                      "cluster._serve", "cluster._task", "cluster._output", "cluster._job",
                      "cluster._local_cluster", "cluster", "cluster._child", "run",
                      "pipeline._partition", "pipeline._cost", "pipeline._schedule",
                      "pipeline._gpipe", "pipeline", "values", ""]),
]


def _module_name(path):
  parts = path.relative_to(ROOT).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _is_package(path):
  return path.name == "__init__.py"


def _module_name_exists(dotted):
  relative = pathlib.Path(*dotted.split(".")[1:])
  return (ROOT / relative).with_suffix(".py").exists() or (ROOT / relative).is_dir()


def _absolute(node, path):
  """The absolute module an `ImportFrom` names (relative imports resolved)."""
  if not node.level:
    return node.module
  package = ["diststrat"] + list(path.relative_to(ROOT).parent.parts)
  if node.level > 1:
    package = package[:len(package) - (node.level - 1)]
  return ".".join(package + ([node.module] if node.module else []))


def _is_type_checking_block(node):
  """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:` (its body never runs)."""
  if not isinstance(node, ast.If):
    return False
  test = node.test
  return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or
          (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(path, text=None):
  """(module-level imports, function-level imports) of diststrat modules, by short name.

  Imports in the body of an `if TYPE_CHECKING:` block are left out: they never run, and
  only let annotations name a type of a higher layer (as strings).
  `text`, if given, stands for the file's contents.
  """
  tree = ast.parse(path.read_text() if text is None else text)
  top, inner = set(), set()

  def add(target, depth):
    if target == "diststrat" or target.startswith("diststrat."):
      (inner if depth else top).add(target[len("diststrat."):] if "." in target else "")

  def visit(node, depth):
    for child in ast.iter_child_nodes(node):
      if _is_type_checking_block(child):
        for branch in child.orelse:
          visit(ast.Module(body=[branch], type_ignores=[]), depth)
        continue
      child_depth = depth + isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
      if isinstance(child, ast.ImportFrom):
        module = _absolute(child, path)
        for alias in child.names:
          candidate = f"{module}.{alias.name}"
          add(candidate if _module_name_exists(candidate) else module, depth)
      elif isinstance(child, ast.Import):
        for alias in child.names:
          add(alias.name, depth)
      visit(child, child_depth)

  visit(tree, 0)
  return top, inner


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
LAYER_OF = {m: i for i, (_, modules) in enumerate(LAYERS) for m in modules}


def test_every_module_has_a_layer():
  missing = sorted(set(MODULES) - set(LAYER_OF))
  assert not missing, f"add these modules to LAYERS and docs/architecture.md: {missing}"
  gone = sorted(set(LAYER_OF) - set(MODULES))
  assert not gone, f"LAYERS names modules that do not exist: {gone}"


def _upward_imports(module, path, text=None):
  top, inner = _imports(path, text)
  upward = sorted(t for t in top if LAYER_OF.get(t, -1) > LAYER_OF[module])
  return upward, sorted(inner)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
  assert module in LAYER_OF, f"diststrat.{module} has no layer: add it to LAYERS"
  upward, inner = _upward_imports(module, MODULES[module])
  assert not upward, (f"diststrat.{module} ({LAYERS[LAYER_OF[module]][0]}) imports from "
                      f"higher layers: {upward}")
  assert not inner, f"diststrat.{module} imports inside a function: {inner}"


def test_no_cycles_within_a_layer():
  graph = {m: {t for t in _imports(p)[0] if t in MODULES and t != m} for m, p in MODULES.items()}
  state = {}

  def visit(module, path):
    state[module] = "open"
    for target in sorted(graph[module]):
      if state.get(target) == "open":
        cycle = path[path.index(target):] + [target]
        raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
      if target not in state:
        visit(target, path + [target])
    state[module] = "done"

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


@pytest.mark.parametrize("line", ["from ..strategies import _mirrored",
                                  "from .. import strategies",
                                  "from ..strategies._mirrored import MirroredStrategy"])
def test_a_relative_upward_import_is_caught(line):
  """Relative imports are resolved: in a reduction module, each of these is upward."""
  path = ROOT / "cross_tower_ops" / "_packing.py"
  upward, _ = _upward_imports("cross_tower_ops._packing", path,
                              path.read_text() + f"\n{line}\n")
  assert upward and all(u.startswith("strategies") for u in upward), upward


def test_an_import_for_type_checking_only_is_not_counted():
  """An upward import under `if TYPE_CHECKING:` never runs: annotations only."""
  path = ROOT / "cross_tower_ops" / "_packing.py"
  line = "from diststrat.strategies import _mirrored"
  for block in ("import typing\nif typing.TYPE_CHECKING:\n  {}\n",
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  {}\n"):
    upward, _ = _upward_imports("cross_tower_ops._packing", path,
                                path.read_text() + "\n" + block.format(line))
    assert not upward, upward
  upward, _ = _upward_imports(
      "cross_tower_ops._packing", path,
      path.read_text() + f"\nif TYPE_CHECKING:\n  pass\nelse:\n  {line}\n")
  assert upward == ["strategies._mirrored"], upward


# --- the TensorFlow boundary ---------------------------------------------------------------

_INTERNAL_MODULES = ("tensorflow.python", "tensorflow.core", "tensorflow.compiler",
                     "keras.src", "tf_keras")
# Documented names that start with an underscore: namedtuple's API, os._exit.
_STDLIB = frozenset(["_fields", "_asdict", "_replace", "_make", "_field_defaults", "_exit"])


def _private_names_of_tensorflow_and_keras():
  """The private attribute names of the TensorFlow and Keras objects diststrat handles."""
  variable = tf.Variable(1.0)
  function = tf.function(lambda: 1).get_concrete_function()
  objects = [variable, type(variable), tf.Variable, tf.constant(1.0), tf.Graph(), function,
             tf.Module(), keras.Variable(1.0), keras.layers.Dense(1), keras.Sequential(),
             keras.optimizers.SGD(), keras.metrics.Mean(), keras.random.SeedGenerator(1)]
  names = set()
  for obj in objects:
    names.update(n for n in dir(obj) if n.startswith("_") and not n.startswith("__"))
  return names


def _names_diststrat_defines():
  """Names defined outside the boundary: functions, classes, attributes set on self."""
  names = set()
  for module, path in MODULES.items():
    if module.split(".")[0] == BOUNDARY:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
      elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
        names.add(node.attr)
  return names


def _private_reaches(source, defined, foreign):
  """(line, what) for every reach past TensorFlow's or Keras's public API in `source`."""
  tree = ast.parse(source)
  classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
  found = []

  def private(name):
    return name.startswith("_") and not name.startswith("__")

  def forbidden(name):
    if name in _STDLIB:
      return False
    return name in _tf_internal.PROTOCOL_NAMES or name in foreign or name not in defined

  def own(base):
    return ((isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in classes))
            or (isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                and base.func.id == "super"))

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, f"import {a.name}") for a in node.names
                if a.name.startswith(_INTERNAL_MODULES)]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      if node.module.startswith(_INTERNAL_MODULES):
        found.append((node.lineno, f"from {node.module} import ..."))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if node.value.startswith(_INTERNAL_MODULES):
        found.append((node.lineno, f"the module name {node.value!r}"))
    elif isinstance(node, ast.Attribute):
      if node.attr == "__internal__":
        found.append((node.lineno, ast.unparse(node)))
      elif private(node.attr) and not own(node.value) and forbidden(node.attr):
        found.append((node.lineno, ast.unparse(node)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
          and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
          and isinstance(node.args[1].value, str) and private(node.args[1].value)
          and not own(node.args[0]) and forbidden(node.args[1].value)):
      found.append((node.lineno, ast.unparse(node)))
  return found


@pytest.fixture(scope="module")
def reach_rules():
  return _names_diststrat_defines(), _private_names_of_tensorflow_and_keras()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] != BOUNDARY))
def test_only_the_boundary_reaches_past_public_apis(module, reach_rules):
  found = _private_reaches(MODULES[module].read_text(), *reach_rules)
  assert not found, (f"diststrat/{MODULES[module].relative_to(ROOT)} reaches past "
                     "TensorFlow's or Keras's public API; add a named function to "
                     f"diststrat/_tf_internal/ and call it instead: {found}")


@pytest.mark.parametrize("line, caught", [
    ("from tensorflow.python.ops import collective_ops", True),
    ("import keras.src.backend", True),
    ("x = sys.modules['keras.src.random.seed_generator']", True),
    ("y = tf.__internal__.distribute", True),
    ("v._distribution_strategy = s", True),          # a Keras optimizer's private state
    ("g = tf.compat.v1.get_default_graph()._variable_creator_stack", True),
    ("h = variable._copy_to_device('/cpu:0')", True),
    ("n = self.primary._shared_name", True),          # a protocol, on another object
    ("setattr(component, '_distributed_container', c)", True),
    ("z = obj._not_defined_by_diststrat", True),
    ("s = self._shared_name", False),                 # our own object
    ("s = strategy._batch_split()", False),           # a diststrat hook
    ("f = point._fields", False),                     # namedtuple's API
    ("from diststrat import _tf_internal", False),
])
def test_the_reach_check_catches(line, caught, reach_rules):
  assert bool(_private_reaches(line, *reach_rules)) is caught


def test_every_boundary_name_has_a_test():
  tests = {node.name for node in ast.walk(ast.parse((TESTS / "test_tf_internal.py").read_text()))
           if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}

  def snake(name):  # ResourceVariableFromHandle -> resource_variable_from_handle
    return name.lower() if name.isupper() else re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()

  untested = [name for name in _tf_internal.__all__
              if not any(f"_{snake(name)}_" in f"{t}_" for t in tests)]
  assert not untested, ("tests/test_tf_internal.py needs a test named after each of: "
                        f"{untested}")


def test_no_merge_conflict_markers_are_left():
  root = pathlib.Path(__file__).resolve().parents[1]
  marked = []
  for pattern in ("*.py", "*.md", "*.toml", "*.cfg", "Makefile"):
    for path in root.rglob(pattern):
      if any(part.startswith(".") for part in path.relative_to(root).parts):
        continue  # .venv, .git, .pytest_cache
      for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "=======":
          marked.append(f"{path.relative_to(root)}:{number}")
  assert not marked, marked


def test_no_file_cites_a_document_outside_the_repository():
  """Code and docs cite what is in the repository (docs/, the code), not the planning
  documents and tracker the maintainers work from."""
  root = pathlib.Path(__file__).resolve().parents[1]
  outside = re.compile(r"\bSPEC\b|TF_NOTES|\bissue \d+|\.\./shared/")
  cited = []
  for pattern in ("*.py", "*.md", "*.toml", "Makefile"):
    for path in root.rglob(pattern):
      if any(part.startswith(".") for part in path.relative_to(root).parts):
        continue
      if path.name == "test_architecture.py":
        continue  # This test names what it looks for.
      for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if outside.search(line):
          cited.append(f"{path.relative_to(root)}:{number}: {line.strip()[:80]}")
  assert not cited, "\n".join(cited)


# --- one process layer ---------------------------------------------------------------

PROCESS_LAYER = ("cluster._processes", "cluster._isolation", "cluster._forkserver")
_STARTS_OR_SIGNALS = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                   "getstatusoutput"},
    "os": {"fork", "forkpty", "kill", "killpg", "system", "popen", "posix_spawn",
           "posix_spawnp", "execv", "execve", "execvp", "execvpe", "execl", "execle",
           "execlp", "execlpe", "spawnv", "spawnve", "spawnl", "spawnle", "setns",
           "unshare", "waitpid"},
    "multiprocessing": {"Process", "Pool", "get_context", "set_start_method"},
}
_KERNEL_CALLS = ("prctl", "setns", "unshare")  # Through ctypes: the orphan policy, networks.


def _process_calls(text):
  """The process-starting, -signalling and -reaping calls a module's source makes."""
  found = []
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      if node.attr in _STARTS_OR_SIGNALS.get(node.value.id, ()):
        found.append(f"{node.value.id}.{node.attr}")
    elif isinstance(node, ast.ImportFrom) and node.module in _STARTS_OR_SIGNALS:
      found += [f"{node.module}.{a.name}" for a in node.names
                if a.name in _STARTS_OR_SIGNALS[node.module]]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      found += [f"{call} (in a string)" for call in _KERNEL_CALLS
                if re.search(rf"\b{call}\(", node.value)]
  return found


@pytest.mark.parametrize("module", sorted(set(MODULES) - set(PROCESS_LAYER)))
def test_only_the_process_layer_starts_or_signals_processes(module):
  """LocalCluster and diststrat-run start, signal and reap processes through
  cluster/_processes.py (and its fork server and network namespaces): one process layer,
  one orphan policy (docs/architecture.md)."""
  calls = _process_calls(MODULES[module].read_text())
  assert not calls, (f"diststrat.{module} starts or signals processes itself ({calls}): "
                     "do it through diststrat/cluster/_processes.py")


@pytest.mark.parametrize("line", ["import subprocess\nsubprocess.Popen(['x'])\n",
                                  "import os\nos.killpg(1, 9)\n",
                                  "from multiprocessing import Process\n",
                                  "code = 'libc.prctl(1, 9)'\n"])
def test_the_process_layer_check_catches(line):
  assert _process_calls(line)


# --- private names stay in their module --------------------------------------------------

PROTOCOL_DOC = TESTS.parent / "docs" / "write_your_own_strategy.md"
# Documented names of the standard library that start with an underscore.
_STDLIB_PRIVATE = frozenset(["_exit", "_fields", "_asdict", "_replace", "_make",
                             "_field_defaults"])


def _protocol_names():
  """The underscored names docs/write_your_own_strategy.md documents: the hooks a strategy
  implements or overrides, and the helpers it calls (the implementer protocol)."""
  return frozenset(re.findall(r"`(?:self\.|TowerContext\.)?(_[a-z]\w*)\(",
                              PROTOCOL_DOC.read_text()))


def _defined_in(tree):
  """Every name a module defines: functions, classes, assigned names and attributes,
  parameters."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
      names.add(node.attr)
    elif isinstance(node, ast.arg):
      names.add(node.arg)
  return names


def _foreign_private_uses(source, protocol):
  """(line, what) for each private name of another module that `source` uses: an
  underscored attribute of an object other than self, cls or super() that the module does
  not define itself (so: another module's), unless it is part of the implementer
  protocol; and `from diststrat... import _name` of a name that is not a module."""
  tree = ast.parse(source)
  own = _defined_in(tree)
  found = []

  def foreign(name):
    return (name.startswith("_") and not name.startswith("__") and name not in own
            and name not in protocol and name not in _STDLIB_PRIVATE)

  def mine(base):
    return ((isinstance(base, ast.Name) and base.id in ("self", "cls"))
            or (isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                and base.func.id == "super"))

  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and foreign(node.attr) and not mine(node.value):
      found.append((node.lineno, ast.unparse(node)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
          and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
          and isinstance(node.args[1].value, str) and foreign(node.args[1].value)
          and not mine(node.args[0])):
      found.append((node.lineno, ast.unparse(node)))
    elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
          and node.module.split(".")[0] == "diststrat"):
      for alias in node.names:
        dotted = f"{node.module}.{alias.name}"[len("diststrat."):]
        if alias.name.startswith("_") and dotted not in MODULES and foreign(alias.name):
          found.append((node.lineno, f"from {node.module} import {alias.name}"))
  return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] != BOUNDARY))
def test_no_module_uses_another_modules_private_names(module):
  """Modules talk through their public names; the exceptions are the implementer
  protocol (docs/write_your_own_strategy.md: hooks and helpers, called across modules by
  design) and the TensorFlow boundary, which reaches into TensorFlow's privates."""
  found = _foreign_private_uses(MODULES[module].read_text(), _protocol_names())
  assert not found, (f"diststrat/{MODULES[module].relative_to(ROOT)} uses private names of "
                     f"other modules: {found}. Give the name a public one in its module "
                     "(or, for a strategy hook, document it in "
                     "docs/write_your_own_strategy.md)")


def test_the_protocol_document_names_the_hooks():
  names = _protocol_names()
  for hook in ("_create_variable", "_call_for_each_tower", "_reduce", "_batch_reduce",
               "_merge_call", "_tower_scope", "_batch_split", "_num_processes"):
    assert hook in names, hook


@pytest.mark.parametrize("line, caught", [
    ("from diststrat.cluster import _local_cluster\nx = _local_cluster._describe_exit(1)",
     True),
    ("from diststrat.cluster._processes import _kill", True),
    ("x = strategy._private_state", True),
    ("getattr(strategy, '_private_state')", True),
    ("class A:\n  def _helper(self): pass\ndef f(a): return a._helper()", False),
    ("x = strategy._batch_split()", False),           # the implementer protocol
    ("x = self._anything", False),
    ("from diststrat import _context", False),         # a private module, not a name
    ("import os\nos._exit(1)", False),
])
def test_the_private_use_check_catches(line, caught):
  assert bool(_foreign_private_uses(line, _protocol_names())) is caught
