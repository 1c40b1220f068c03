"""The public API is annotated (the package ships py.typed, so type checkers read it)."""

import inspect
import types
import typing

import pytest

import diststrat
from diststrat import cluster
from diststrat import cross_tower_ops
from diststrat import optimizers
from diststrat import pipeline
from diststrat import strategies
from diststrat import values

MODULES = (diststrat, cluster, cross_tower_ops, optimizers, pipeline, strategies, values)


def _public_objects():
  seen = set()
  for module in MODULES:
    for name in getattr(module, "__all__", ()):
      obj = getattr(module, name)
      if id(obj) in seen or not getattr(obj, "__module__", "").startswith("diststrat"):
        continue
      seen.add(id(obj))
      yield f"{module.__name__}.{name}", obj


def _own_and_private_bases(cls):
  """`cls`, then the bases it gets public members from that are not public themselves
  (mixins such as `ClusterTaskMixin`): their members are part of `cls`'s API."""
  public = {id(obj) for _, obj in _public_objects()}
  return [cls] + [base for base in cls.__mro__[1:]
                  if base.__module__.startswith("diststrat") and id(base) not in public]


def _public_callables():
  """(name, function) of every public function and method, and of every public property's
  getter and setter."""
  for qualified, obj in _public_objects():
    if inspect.isfunction(obj):
      yield qualified, obj
    elif inspect.isclass(obj) and not issubclass(obj, BaseException):
      for cls in _own_and_private_bases(obj):
        for attr, member in vars(cls).items():
          if attr.startswith("_") and attr != "__init__":
            continue
          if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
          if inspect.isfunction(member):
            yield f"{qualified}.{attr}", member
          elif isinstance(member, property):
            yield f"{qualified}.{attr} (property)", member.fget
            if member.fset is not None:
              yield f"{qualified}.{attr} (property setter)", member.fset


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


def test_properties_are_checked():
  """The check above sees properties, inherited ones from private mixins too."""
  names = {name for name, _ in _public_callables()}
  assert "diststrat.MirroredStrategy.cross_tower_ops (property)" in names
  assert "diststrat.ParameterServerStrategy.step_timeout (property setter)" in names
  assert "diststrat.MultiWorkerMirroredStrategy.task_id (property)" in names  # A mixin's.


# --- return types that say what comes back, not Any ------------------------------------

# Annotations naming a type of a higher layer are strings (the module imports it only
# for type checkers), resolved here against the package's public names.
_PUBLIC_NAMES = {name: getattr(diststrat, name) for name in diststrat.__all__}


def _return_type(function):
  return typing.get_type_hints(function, localns=_PUBLIC_NAMES)["return"]


def _members(hint):
  """The types of a union (`Optional[X]`, `X | None`), or {hint}."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return set(typing.get_args(hint))
  return {hint}


def _contains_any(hint):
  return hint is typing.Any or any(_contains_any(a) for a in typing.get_args(hint))


_NONE = type(None)
REAL_RETURN_TYPES = [
    (diststrat.get_tower_context, {diststrat.TowerContext, _NONE}),
    (diststrat.get_cross_tower_context, {diststrat.DistributionStrategy, _NONE}),
    (diststrat.get_distribution_strategy, {diststrat.DistributionStrategy}),
    (diststrat.get_update_device, {str, _NONE}),
    (diststrat.TowerContext.distribution_strategy.fget, {diststrat.DistributionStrategy}),
    (values.DistributedVariable.distribution_strategy.fget,
     {diststrat.DistributionStrategy, _NONE}),
]


@pytest.mark.parametrize("function, expected", REAL_RETURN_TYPES,
                         ids=[function.__qualname__ for function, _ in REAL_RETURN_TYPES])
def test_context_getters_return_their_real_types(function, expected):
  returned = _return_type(function)
  assert not _contains_any(returned), f"{function.__qualname__} returns {returned}"
  assert _members(returned) == expected, f"{function.__qualname__} returns {returned}"


def test_an_any_return_type_is_caught():
  def getter() -> typing.Optional[typing.Any]:
    return None

  assert _contains_any(_return_type(getter))
  assert not _contains_any(_return_type(diststrat.get_update_device))


# --- hyperparameters: what the annotations admit is what the optimizers take ----------

HYPERPARAMETERS = [(optimizers.GradientDescent, ["learning_rate"]),
                   (optimizers.Momentum, ["learning_rate", "momentum"]),
                   (optimizers.Adam, ["learning_rate", "beta1", "beta2", "epsilon"])]


@pytest.mark.parametrize("cls, names", HYPERPARAMETERS, ids=lambda x: getattr(x, "__name__", ""))
def test_hyperparameter_annotations_admit_tensors_variables_and_schedules(cls, names):
  """docs/optimizers.md: a hyperparameter may be a number, a tensor, a variable or a
  callable; an annotation of `float` would make type checkers refuse all but numbers."""
  hints = typing.get_type_hints(cls.__init__)
  narrow = {name: hints[name] for name in names if hints[name] is not typing.Any}
  assert not narrow, f"{cls.__name__}: {narrow}"


def test_serve_is_annotated_as_never_returning():
  """`cluster.serve()` never returns (it serves until the job ends, then ends the
  process; its docs say so): `NoReturn` tells type checkers, where `None` did not."""
  assert typing.get_type_hints(cluster.serve)["return"] is typing.NoReturn


def test_cache_reads_max_bytes_admits_none_as_documented():
  """`ParameterServerStrategy(cache_reads_max_bytes=None)` means no limit (its docstring
  and docs/parameter_server.md) and is taken, but the annotation was `int`."""
  hints = typing.get_type_hints(diststrat.ParameterServerStrategy.__init__)
  assert _NONE in _members(hints["cache_reads_max_bytes"]), hints["cache_reads_max_bytes"]
  strategy = diststrat.ParameterServerStrategy(worker_devices=["/cpu:0"],
                                               ps_devices=["/cpu:1"],
                                               cache_reads_max_bytes=None)
  assert strategy.parameter_devices[0].endswith("CPU:1")
