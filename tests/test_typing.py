"""The public API is annotated (the package ships py.typed, so type checkers read it)."""

import inspect

import diststrat
from diststrat import cluster
from diststrat import cross_tower_ops
from diststrat import optimizers
from diststrat import pipeline
from diststrat import strategies
from diststrat import values

MODULES = (diststrat, cluster, cross_tower_ops, optimizers, pipeline, strategies, values)


def _public_callables():
  seen = set()
  for module in MODULES:
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name)
      if id(obj) in seen or not getattr(obj, "__module__", "").startswith("diststrat"):
        continue
      seen.add(id(obj))
      if inspect.isfunction(obj):
        yield f"{module.__name__}.{name}", obj
      elif inspect.isclass(obj) and not issubclass(obj, BaseException):
        for attr, member in vars(obj).items():
          if attr.startswith("_") and attr != "__init__":
            continue
          if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
          if inspect.isfunction(member):
            yield f"{module.__name__}.{name}.{attr}", member


def _missing(function):
  signature = inspect.signature(function)
  missing = [p.name for p in signature.parameters.values()
             if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             and p.annotation is inspect.Parameter.empty]
  if signature.return_annotation is inspect.Signature.empty:
    missing.append("return")
  return missing


def test_every_public_function_and_method_is_annotated():
  unannotated = {name: _missing(f) for name, f in _public_callables() if _missing(f)}
  assert not unannotated, "\n".join(f"{n}: {m}" for n, m in sorted(unannotated.items()))
