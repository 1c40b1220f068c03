"""The package's layers (docs/architecture.md) match its imports.

Every module belongs to one layer; a module imports only from lower layers or, inside
its own layer, without cycles. Imports sit at the top of modules, except the one
documented cycle (the context module finds the default strategy when first asked).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "diststrat"

# Lowest first; the same order as the picture in docs/architecture.md.
LAYERS = [
    ("foundation", ["_tf", "errors", "_tf_internal", "_devices", "_arguments"]),
    ("contexts", ["_context"]),
    ("values", ["values._wrapped", "values._variables", "_input"]),
    ("reductions", ["cross_tower_ops._packing", "cross_tower_ops._collective",
                    "cross_tower_ops._launch", "cross_tower_ops._base",
                    "cross_tower_ops._one_device", "cross_tower_ops._all_reduce",
                    "cross_tower_ops._cross_worker", "cross_tower_ops"]),
    ("strategy machinery", ["_tf_distribute_bridge", "_strategy", "strategies._tower_threads",
                            "cluster._watchdog", "cluster._read_cache",
                            "cluster._shared_variables", "cluster._connection",
                            "cluster._worker_group",
                            "optimizers._optimizer", "optimizers._mixin",
                            "optimizers._shipped", "optimizers"]),
    ("strategies", ["strategies._default", "strategies._mirrored",
                    "strategies._parameter_server", "strategies._multi_worker",
                    "strategies"]),
    ("applications", ["cluster._local_cluster", "cluster", "cluster._child", "demo",
                      "pipeline._partition", "pipeline._cost", "pipeline._schedule",
                      "pipeline._gpipe", "pipeline", "values", ""]),
]
ALLOWED_FUNCTION_IMPORTS = {("_context", "strategies._default")}


def _module_name(path):
  parts = path.relative_to(ROOT).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _imports(path):
  """(module-level imports, function-level imports) of diststrat modules, by short name."""
  tree = ast.parse(path.read_text())
  top, inner = set(), set()

  def add(target, depth):
    if target == "diststrat" or target.startswith("diststrat."):
      (inner if depth else top).add(target[len("diststrat."):] if "." in target else "")

  def visit(node, depth):
    for child in ast.iter_child_nodes(node):
      child_depth = depth + isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
      if isinstance(child, ast.ImportFrom) and child.module:
        for alias in child.names:
          candidate = f"{child.module}.{alias.name}"
          known = _module_name_exists(candidate)
          add(candidate if known else child.module, depth)
      elif isinstance(child, ast.Import):
        for alias in child.names:
          add(alias.name, depth)
      visit(child, child_depth)

  visit(tree, 0)
  return top, inner


def _module_name_exists(dotted):
  relative = pathlib.Path(*dotted.split(".")[1:])
  return (ROOT / relative).with_suffix(".py").exists() or (ROOT / relative).is_dir()


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
LAYER_OF = {m: i for i, (_, modules) in enumerate(LAYERS) for m in modules}


def test_every_module_has_a_layer():
  missing = sorted(set(MODULES) - set(LAYER_OF))
  assert not missing, f"add these modules to LAYERS and docs/architecture.md: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
  if module not in LAYER_OF:
    pytest.skip("not placed (test_every_module_has_a_layer fails)")
  top, inner = _imports(MODULES[module])
  upward = sorted(t for t in top if LAYER_OF.get(t, -1) > LAYER_OF[module])
  assert not upward, (f"diststrat.{module} ({LAYERS[LAYER_OF[module]][0]}) imports from "
                      f"higher layers: {upward}")
  unexpected = sorted(t for t in inner if (module, t) not in ALLOWED_FUNCTION_IMPORTS)
  assert not unexpected, f"diststrat.{module} imports inside a function: {unexpected}"


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
