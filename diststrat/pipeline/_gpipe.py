"""`GPipe`: a sequence of layers cut into stages, one per device, run as a pipeline.

The class decides where things go: it cuts the layers into stages (`partition`), builds
each stage's layers on its device, and, inside `MirroredStrategy` towers, picks the
tower's own devices. `_schedule.run` decides when things run.

Data x pipeline parallelism: inside `MirroredStrategy`, `devices` maps each tower's
device to that tower's stage devices, `{tower_device: [stage devices]}`. Stage s's
variables are `MirroredVariable`s with one copy on each tower's stage-s device, so the
strategy's reductions and updates (and diststrat's optimizers) keep them equal as for
any mirrored variable. While a tower runs its stage s, the tower context names the
stage-s device, so reads take the tower's own copy there.
"""

import contextlib
import numbers

from typing import Any, Optional, Sequence

import numpy as np

from diststrat._tf import tf
from diststrat import _context
from diststrat import _devices
from diststrat import _tf_internal
from diststrat import errors
from diststrat._arguments import as_tf_variable
from diststrat.pipeline import _cost
from diststrat.pipeline import _partition
from diststrat.pipeline import _schedule
from diststrat.strategies import _default
from diststrat.strategies import _mirrored
from diststrat.values import _wrapped


class GPipe(tf.Module):
  """Runs layers in sequence as a pipeline: one stage per device, micro-batches flowing.

  The layers are cut into contiguous stages, one per device, and each batch into
  `num_micro_batches` micro-batches. Every micro-batch goes through the stages in order;
  while stage s works on micro-batch k, stage s - 1 can work on micro-batch k + 1 (inside
  `tf.function`, where TensorFlow runs ops of different devices at once). The backward
  pass runs the same way in reverse, and each variable's gradient is the sum over the
  micro-batches, as for the whole batch on one device.

  The layers are built when the pipeline first sees an input (or by `build()`): each
  stage's layers on its device. Pass layers that are not built yet.

  Args:
    layers: Keras 3 layers or callables (one tensor in, one tensor out), applied in
      order, or a `keras.Sequential` (its layers).
    devices: one device per stage. Default: all local GPUs, else all local CPU devices.
      Inside a `MirroredStrategy` with several towers: a dict from each tower's device to
      that tower's stage devices (every device used once).
    num_micro_batches: how many equal parts each batch is split into.
    recompute: if True, the backward pass recomputes each stage's forward instead of
      keeping its activations (less memory, about one more forward pass of compute).
    partition: "cost" to balance the stages by estimated FLOPs (see `estimate_costs`,
      `partition`), or a list with the number of layers of each stage.
    name: the name scope of the pipeline's ops.

  Example:
    >>> import keras, tensorflow as tf
    >>> from diststrat.pipeline import GPipe
    >>> layers = [keras.layers.Dense(8, activation="relu") for _ in range(3)]
    >>> pipe = GPipe(layers, devices=["/cpu:0"], num_micro_batches=2)
    >>> x = tf.ones([4, 5])
    >>> with tf.GradientTape() as tape:
    ...   loss = tf.reduce_sum(pipe(x, training=True))
    >>> len(tape.gradient(loss, pipe.trainable_variables)), pipe.stage_sizes
    (6, [3])
  """

  def __init__(self, layers: Any, devices: Any = None, num_micro_batches: int = 1,
               recompute: bool = False, partition: str | Sequence[int] = "cost",
               name: str = "gpipe") -> None:
    super().__init__(name=name)
    self._layers = _layer_list(layers)
    self._pipelines = _resolve_devices(devices)
    num_stages = len(next(iter(self._pipelines.values())))
    if len(self._layers) < num_stages:
      raise ValueError(
          "GPipe puts at least one layer on each device (one stage per device). Received: "
          f"{_count(len(self._layers), 'layer')} for {_count(num_stages, 'device')} "
          f"{list(next(iter(self._pipelines.values())))}. Pass at most "
          f"{_count(len(self._layers), 'device')}, or split the model into more layers.")
    self._num_stages = num_stages
    self._num_micro_batches = _check_micro_batches(num_micro_batches)
    self._recompute = _check_recompute(recompute)
    self._partition = _check_partition(partition, len(self._layers), num_stages)
    self._sizes: Optional[list[int]] = (None if self._partition == "cost"
                                        else list(self._partition))
    self._stage_costs: Optional[list[Optional[float]]] = None
    self._strategy: Any = None  # The strategy the layers were built under.
    if self._num_stages > 1:
      # XLA compiles a function for one device, which cannot reach the other stages'
      # variables: Keras (jit_compile="auto" on GPUs, or True) then compiles a model
      # holding these layers without it.
      for layer in self._layers:
        if _cost.is_keras_layer(layer):
          layer.supports_jit = False
    # (input shape, dtype) of the build a tower asked for, done in cross-tower context.
    self._pending_build: Optional[tuple[Any, Any]] = None

  # --- what the pipeline is ---

  @property
  def layers(self) -> list[Any]:
    """The layers, in order."""
    return list(self._layers)

  @property
  def devices(self) -> Any:
    """The stage devices: a tuple, or, for several towers, a dict tower device -> tuple."""
    if list(self._pipelines) == [None]:
      return self._pipelines[None]
    return dict(self._pipelines)

  @property
  def num_micro_batches(self) -> int:
    return self._num_micro_batches

  @property
  def recompute(self) -> bool:
    return self._recompute

  @property
  def built(self) -> bool:
    return self._strategy is not None

  @property
  def stage_sizes(self) -> list[int]:
    """The number of layers in each stage."""
    return list(self._check_partitioned("stage_sizes"))

  @property
  def stages(self) -> list[list[Any]]:
    """The layers of each stage: a list of lists."""
    self._check_partitioned("stages")
    return [self._layers[a:b] for a, b in self._ranges()]

  @property
  def stage_costs(self) -> list[Optional[float]]:
    """Each stage's estimated FLOPs for one micro-batch (None where unknown).

    For one example when the pipeline was built with an unknown batch size.
    """
    self._check_built("stage_costs")
    assert self._stage_costs is not None  # `_build` sets it before the pipeline is built.
    return list(self._stage_costs)

  @property
  def trainable_variables(self) -> list[Any]:
    """The layers' trainable variables, in layer order."""
    return _unique([v for layer in self._layers for v in _layer_variables(layer, True)])

  @property
  def non_trainable_variables(self) -> list[Any]:
    return _unique([v for layer in self._layers for v in _layer_variables(layer, False)])

  @property
  def variables(self) -> list[Any]:
    return self.trainable_variables + self.non_trainable_variables

  def __repr__(self):
    sizes = list(self._sizes) if self._sizes is not None else "cost (not built)"
    return (f"GPipe({len(self._layers)} layers, stages={sizes}, devices={self.devices}, "
            f"num_micro_batches={self._num_micro_batches}, recompute={self._recompute})")

  # --- building ---

  @errors.keeps_errors_in_tf_function
  def build(self, input_shape: Any, dtype: Any = "float32") -> None:
    """Partitions the layers and builds each stage's layers on its device.

    Called by the first call; call it yourself to see `stages` and `stage_costs` first,
    or to create the variables in `strategy.scope()` before any tower runs.

    Args:
      input_shape: the shape of a whole batch (the batch dimension may be None).
      dtype: the input's dtype.
    """
    if self.built:
      return
    input_shape = _cost.check_input_shape("GPipe", input_shape)
    tower = _context.get_tower_context()
    if _context.has_distribution_strategy() and tower is not None:
      # In a tower: build once, in cross-tower context, when every tower gets here.
      self._pending_build = (input_shape, tf.as_dtype(dtype))
      tower.merge_call(_build_in_merge_call, self)
      return
    self._build(input_shape, tf.as_dtype(dtype))

  def _build(self, input_shape, dtype):
    if self.built:
      return
    strategy = _context.get_distribution_strategy()
    columns = self._stage_device_columns(strategy)
    # An op placed on a device that does not exist runs elsewhere (soft placement): the
    # layers would be built on the CPU and then refused as "built elsewhere".
    _devices.check_exist([d for column in columns for d in column], "devices")
    micro_shape = list(input_shape)
    if micro_shape and micro_shape[0] is not None:
      micro_shape[0] //= self._num_micro_batches
    trace = _cost.trace_layers(self._layers, micro_shape, dtype)
    costs = trace.costs
    if self._partition == "cost":
      unknown = [i for i, c in enumerate(costs) if c is None]
      if unknown:
        raise ValueError(
            "partition='cost' needs every layer's cost, but "
            f"{_cost.describe(self._layers[unknown[0]], unknown[0])} cannot be traced (a "
            "Keras layer without a working get_config()). Received: "
            f"{len(unknown)} such layer(s). Give GPipe partition=[n0, n1, ...] instead.")
      sizes = _partition.partition(costs, self._num_stages)
    else:
      sizes = list(self._partition)
    self._sizes = sizes
    stage_costs = []
    for a, b in self._ranges():
      part = costs[a:b]
      stage_costs.append(None if any(c is None for c in part) else float(sum(part)))
    first_use = {}  # id(layer) -> (stage, index) of its first place in the list.
    for s, (a, b) in enumerate(self._ranges()):
      with _placement(strategy, columns[s]):
        for i in range(a, b):
          _place_seed_states(self._layers[i], columns[s], strategy)
          _build_layer(self._layers[i], trace.specs[i])
      declared = [as_tf_variable(v) for i in range(a, b)
                  for v in _layer_variables(self._layers[i], True)]
      for i in range(a, b):
        first = first_use.setdefault(id(self._layers[i]), (s, i))
        _check_placement(self._layers[i], i, s, columns[s], strategy,
                         shared_with=first if first[0] != s else None)
        _schedule.check_declared(s, declared, trace.captured[i])
    self._stage_costs = stage_costs
    self._strategy = strategy

  def _stage_device_columns(self, strategy):
    """For each stage, its device in every pipeline (one per tower), in tower order."""
    if isinstance(strategy, _mirrored.MirroredStrategy):
      towers = strategy.worker_devices
      pipelines = self._pipelines
      if list(pipelines) == [None]:
        if len(towers) != 1:
          raise ValueError(
              f"Inside a MirroredStrategy with {len(towers)} towers, each tower needs its "
              "own stage devices. Received: devices="
              f"{list(pipelines[None])}. Give devices={{tower_device: [stage devices], "
              "...}, one entry per tower of the strategy.")
        pipelines = {towers[0]: pipelines[None]}
      if set(pipelines) != set(towers):
        raise ValueError(
            "devices must give stage devices for exactly the towers of the strategy. "
            f"Received: towers {sorted(pipelines)} for the strategy's towers "
            f"{list(towers)}. Use the strategy's worker_devices as the keys.")
      self._pipelines = {t: pipelines[t] for t in towers}
      return [tuple(self._pipelines[t][s] for t in towers) for s in range(self._num_stages)]
    if not isinstance(strategy, _default.DefaultStrategy):
      raise ValueError(
          "GPipe runs with no strategy or inside MirroredStrategy: it places each stage's "
          f"variables on the stage's device. Received: {strategy!r}. Build and call the "
          "pipeline outside this strategy's scope, or inside a MirroredStrategy.")
    if list(self._pipelines) != [None]:
      raise ValueError(
          "devices given per tower ({tower_device: [stage devices]}) need a "
          "MirroredStrategy whose towers are those devices. Received: "
          f"devices={self.devices} with no strategy. Pass a list of stage devices, or "
          "build the pipeline inside the strategy's scope or towers.")
    return [(d,) for d in self._pipelines[None]]

  def _ranges(self):
    start = 0
    for size in self._sizes:
      yield start, start + size
      start += size

  def _check_partitioned(self, what: str) -> list[int]:
    """The number of layers in each stage; raises if the layers are not partitioned yet."""
    if self._sizes is None:
      raise errors.ContextError(
          f"GPipe.{what} is known once the layers are partitioned, which partition='cost' "
          "does when the pipeline is built. Call pipe.build(input_shape) or call the "
          "pipeline on a batch first.")
    return self._sizes

  def _check_built(self, what):
    if not self.built:
      raise errors.ContextError(
          f"GPipe.{what} is known once the pipeline is built. Call "
          "pipe.build(input_shape) or call the pipeline on a batch first.")

  # --- running ---

  @errors.keeps_errors_in_tf_function
  def __call__(self, x, training=None):
    """Returns the layers applied in sequence to `x`, run as a pipeline.

    Differentiable with `tf.GradientTape`: the gradients are those of the layers in
    sequence, computed by GPipe's backward schedule (docs/pipeline.md) when the tape
    is inside the same `tf.function` as the call (or in eager mode).

    Args:
      x: a batch: one tensor whose first dimension is divisible by `num_micro_batches`.
      training: passed to the layers that take it.

    Raises:
      ValueError: the batch size is not divisible by `num_micro_batches`.
    """
    x = tf.convert_to_tensor(x)
    batch = x.shape[0] if x.shape.rank else None
    if batch is not None and batch % self._num_micro_batches:
      raise ValueError(
          "GPipe splits each batch into num_micro_batches equal micro-batches, so the "
          "batch size must be divisible by num_micro_batches. Received: batch size "
          f"{batch} and num_micro_batches={self._num_micro_batches}. Use a batch size "
          f"that is a multiple of {self._num_micro_batches}, or a num_micro_batches that "
          f"divides {batch}.")
    if not self.built:
      _check_in_a_tower(_context.get_distribution_strategy())  # Before building there.
      self.build(x.shape, x.dtype)
    devices, context = self._tower_pipeline()
    if len(set(devices)) > 1 and _tf_internal.building_xla_function():
      raise ValueError(
          f"GPipe runs its stages on {len(devices)} devices, but it is called in a "
          "function compiled with XLA (tf.function(jit_compile=True)), which XLA compiles "
          "for one device: the stages' variables on the other devices are out of its "
          f"reach. Received: stage devices {list(devices)}. Call the pipeline in a "
          "tf.function without jit_compile, or eagerly.")
    if batch is None and self._num_micro_batches > 1:
      m = self._num_micro_batches
      with tf.device(devices[0]):
        size = tf.shape(x)[0]
        check = tf.debugging.Assert(tf.equal(size % m, 0), [
            "GPipe splits each batch into num_micro_batches equal micro-batches, so the "
            "batch size must be divisible by num_micro_batches. Received: batch size",
            size, f"and num_micro_batches={m}. Use batches whose size is a multiple of "
            f"{m}: with tf.data, batch(n, drop_remainder=True); in Keras fit, evaluate "
            f"and predict, a batch_size that is a multiple of {m} and a number of examples "
            "that is a multiple of batch_size (the last batch holds the rest)."])
      with tf.control_dependencies([check]):
        x = tf.identity(x)
    stages = []
    for s, (a, b) in enumerate(self._ranges()):
      layers = self._layers[a:b]
      variables = _unique([as_tf_variable(v) for layer in layers
                           for v in _layer_variables(layer, True)])
      state = _unique([as_tf_variable(v) for layer in layers
                       for v in _layer_variables(layer, False)])
      stages.append(_schedule.Stage(
          s, devices[s], _stage_function(layers, training), variables, state=state,
          context=lambda device=devices[s]: context(device)))
    return _schedule.run(stages, x, self._num_micro_batches, self._recompute,
                         name=self.name)

  def _tower_pipeline(self):
    """(stage devices, context factory) for the calling tower."""
    strategy = _context.get_distribution_strategy()
    if strategy is not self._strategy:
      raise errors.ContextError(
          f"This GPipe was built under {self._strategy!r} and is called under "
          f"{strategy!r} ({_context.describe_current_context()}). A pipeline's variables "
          "are placed for one strategy: call it where it was built, or build a new one.")
    if not isinstance(strategy, _mirrored.MirroredStrategy):
      return self._pipelines[None], lambda device: contextlib.nullcontext()
    tower = _check_in_a_tower(strategy)
    devices = self._pipelines[_devices.canonicalize(tower.device)]

    def stage_context(device):
      stage = devices.index(device)
      column = {t: stage_devices[stage] for t, stage_devices in self._pipelines.items()}
      return _context.enter_mode(strategy, _StageTowerContext(tower, device, column))

    return devices, stage_context


def _build_in_merge_call(strategy, pipe):
  del strategy  # The cross-tower context of it is current.
  pipe._build(*pipe._pending_build)


class _StageTowerContext(_context.TowerContext):
  """A tower's context while its stage on `device` runs: reads take that device's copy.

  `merge_call` goes to the tower's own context, so it pauses the tower as usual. Each
  tower gets its part of the result as the part on its stage device (`column`: tower
  device -> that tower's device for this stage), where the stage's variables are: a
  write to them (BatchNormalization's moving statistics, a seed state) returns one op
  per copy, on the stage devices, not on the towers' own devices.
  """

  def __init__(self, tower, device, column):
    super().__init__(tower.distribution_strategy, tower.tower_id, tower.num_towers, device,
                     batch_share=tower.batch_share)
    self._tower = tower
    self._column = column

  def _merge_call(self, merge_fn, args, kwargs):
    return self._tower._merge_call(_MergeInStage(merge_fn, self._column), args, kwargs)


class _MergeInStage(_context.WrappedMergeFn):
  """A tower's merge_fn, whose result it gives as each tower's part on its stage device
  (see `_StageTowerContext`)."""

  def __init__(self, merge_fn, column):
    super().__init__(merge_fn)
    self.column = column

  def __call__(self, strategy, *args, **kwargs):
    result = self.tower_merge_fn(strategy, *args, **kwargs)
    try:
      parts = {tower: _wrapped.select_device(device, result)
               for tower, device in self.column.items()}
    except ValueError:
      return result  # Its parts are on the towers' own devices (or it is plain).
    return _wrapped.PerDevice(parts)


# --- arguments ---


def _layer_list(layers):
  if _is_plain_sequential(layers):
    layers = list(layers.layers)  # Its layers, without the InputLayer.
  elif _cost.is_keras_layer(layers):
    # Another model (functional, subclassed) computes what its call() says, which need
    # not be its layers in a chain: chaining them would compute something else.
    raise TypeError(
        "GPipe takes a list of layers, applied in order, or a keras.Sequential (whose "
        f"layers are applied in order). Received: the {type(layers).__name__} "
        f"{layers.name!r}, which is neither. Pass [{layers.name}] to run it whole as one "
        "layer (on one stage), or, for a model that applies its layers one after the "
        "other, the list of its layers in that order.")
  elif isinstance(layers, (list, tuple)):
    layers = list(layers)
  else:
    raise TypeError(
        "GPipe takes a list of layers (Keras 3 layers or callables) or a keras.Sequential. "
        f"Received: layers of type {type(layers).__name__}. Pass a list, e.g. [layer] for "
        "one layer.")
  if not layers:
    raise ValueError("GPipe needs at least one layer. Received: layers=[]. Pass the "
                     "model's layers in order.")
  for i, layer in enumerate(layers):
    if not callable(layer):
      raise TypeError(f"Each layer must be a Keras layer or a callable. Received: layer {i} "
                      f"= {layer!r}. Pass callables that take and return one tensor.")
  return layers


def _is_plain_sequential(layers):
  """Whether `layers` is a keras.Sequential that applies its layers in order (its class
  does not override `call`)."""
  if not _cost.is_keras_layer(layers):
    return False
  import keras  # pylint: disable=g-import-not-at-top
  return isinstance(layers, keras.Sequential) and type(layers).call is keras.Sequential.call


def _resolve_devices(devices):
  """{tower device or None: tuple of stage devices}, every device canonical and used once."""
  if devices is None:
    devices = _devices.local_devices()
  if isinstance(devices, dict):
    if not devices:
      raise ValueError("devices={} names no tower. Received: devices={}. Give "
                       "{tower_device: [stage devices], ...}.")
    pipelines = {_devices.canonicalize(t): _stage_devices(d) for t, d in devices.items()}
    lengths = {len(d) for d in pipelines.values()}
    if len(lengths) > 1:
      raise ValueError(
          "Every tower's pipeline needs the same number of stages. Received: devices="
          f"{devices!r}. Give each tower as many stage devices as the others.")
    used = [d for stage_devices in pipelines.values() for d in stage_devices]
    if len(set(used)) != len(used):
      raise ValueError(
          "Each device may hold one stage of one tower's pipeline. Received: devices="
          f"{devices!r}, which uses a device twice. Give every tower its own devices.")
    return pipelines
  return {None: _stage_devices(devices)}


def _stage_devices(devices):
  if isinstance(devices, (str, tf.DeviceSpec)) or not hasattr(devices, "__iter__"):
    raise ValueError(
        "devices must be a list of device strings, one per stage. Received: "
        f"devices={devices!r}. Pass e.g. ['/gpu:0', '/gpu:1'].")
  devices = _devices.canonicalize_all(list(devices))
  if not devices:
    raise ValueError("GPipe needs at least one device. Received: devices=[]. Pass one "
                     "device per stage, or None for all local devices.")
  return devices


def _check_micro_batches(num_micro_batches):
  if (isinstance(num_micro_batches, bool) or
      not isinstance(num_micro_batches, numbers.Integral) or num_micro_batches < 1):
    raise ValueError(
        "num_micro_batches must be a positive int. Received: "
        f"num_micro_batches={num_micro_batches!r}. Pass e.g. 4.")
  return int(num_micro_batches)


def _check_recompute(recompute):
  if not isinstance(recompute, (bool, np.bool_)):
    raise ValueError(
        "recompute must be True or False. Received: "
        f"recompute={recompute!r} of type {type(recompute).__name__} (a string such as "
        "'False' would count as True). Pass True or False; convert a flag read from a "
        "command line or a config file first.")
  return bool(recompute)


def _check_partition(partition, num_layers, num_stages):
  if isinstance(partition, str):
    if partition != "cost":
      raise ValueError(
          "partition must be 'cost' or a list of layer counts, one per stage. Received: "
          f"partition={partition!r}. Pass 'cost', or e.g. [2, 3] for two stages.")
    return partition
  try:
    sizes = [int(n) for n in partition]
    valid = all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
                for n in partition)
  except (TypeError, ValueError):
    sizes, valid = [], False
  if not valid or len(sizes) != num_stages or any(n < 1 for n in sizes) or \
      sum(sizes) != num_layers:
    raise ValueError(
        "partition must give each of the stages (one per device) a positive number of "
        "layers, adding up to the number of layers. Received: "
        f"partition={partition!r} for {num_layers} layers and {num_stages} stages. Pass "
        f"{num_stages} positive ints that sum to {num_layers}, or 'cost'.")
  return sizes


def _count(n, noun):
  return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# --- layers ---


def _layer_variables(layer, trainable):
  attribute = "trainable_variables" if trainable else "non_trainable_variables"
  return list(getattr(layer, attribute, None) or ())


def _unique(variables):
  seen, result = set(), []
  for v in variables:
    if id(v) not in seen:
      seen.add(id(v))
      result.append(v)
  return result


def _stage_function(layers, training):
  def apply(x):
    for layer in layers:
      x = _cost.call_layer(layer, x, training)
    return x
  return apply


@contextlib.contextmanager
def _placement(strategy, column):
  """Variables created inside go to `column` (one device, or one per tower, mirrored)."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(tf.init_scope())  # Build out of any tf.function being traced.
    if isinstance(strategy, _mirrored.MirroredStrategy):
      stack.enter_context(strategy._variable_creation_scope())
      stack.enter_context(strategy.colocate_vars_with(list(column)))
    stack.enter_context(tf.device(column[0]))
    yield


def _build_layer(layer, spec):
  """Builds an unbuilt Keras layer for input `spec` = (shape, dtype), symbolically."""
  if not _cost.is_keras_layer(layer) or layer.built:
    return
  import keras  # pylint: disable=g-import-not-at-top
  shape, dtype = spec
  layer(keras.KerasTensor(shape, dtype=tf.as_dtype(dtype).name))


def _place_seed_states(layer, column, strategy):
  """Moves the seed states of a Keras layer to its stage (under `_placement`).

  Keras layers that draw random numbers (Dropout, GaussianNoise, ...) make their
  `SeedGenerator`, and its state variable, in `__init__` (and count themselves built):
  on whatever device was current then, before GPipe could place it. Each such state is
  made again here, by a new `SeedGenerator` (so that it is created as Keras makes seed
  states), given the old state's value (its seed and its count), and put in the old
  generator's place.
  """
  if not _cost.is_keras_layer(layer):
    return
  for generator in _tf_internal.keras_seed_generators(layer):
    if _placed_on(as_tf_variable(generator.state), column, strategy):
      continue
    import keras  # pylint: disable=g-import-not-at-top
    value = generator.state.numpy()
    fresh = keras.random.SeedGenerator(seed=int(value[0]), name=generator.name)
    fresh.state.assign(value)
    generator.state = fresh.state


def _placed_on(variable, column, strategy):
  """Whether `variable` is where GPipe puts a stage's variables: on `column`, mirrored
  over it inside a MirroredStrategy."""
  mirrored = isinstance(strategy, _mirrored.MirroredStrategy)
  return (_where(variable) == tuple(column)
          and mirrored == isinstance(variable, _wrapped.DistributedValues))


def _where(variable):
  """The devices `variable` lives on (its copies', for a distributed one)."""
  if isinstance(variable, _wrapped.DistributedValues):
    return tuple(variable.devices)
  return (_devices.canonicalize(variable.device),) if variable.device else ()


def _check_in_a_tower(strategy):
  """The calling tower's context; under a MirroredStrategy, a ContextError outside its
  towers (a pipeline runs on the stage devices of one tower)."""
  tower = _context.get_tower_context()
  if tower is None and isinstance(strategy, _mirrored.MirroredStrategy):
    raise errors.ContextError(
        f"Inside {strategy!r}, a GPipe runs in a tower, on that tower's stage devices, "
        f"but it was called in {_context.describe_current_context()}. Call it from the "
        "function given to strategy.call_for_each_tower().")
  return tower


def _check_placement(layer, index, stage, column, strategy, shared_with=None):
  """Raises if `layer`'s variables are not where stage `stage` puts them.

  `shared_with`: (stage, index) of the same layer's first place in the list, when that
  is another stage.
  """
  for v in _layer_variables(layer, True) + _layer_variables(layer, False):
    variable = as_tf_variable(v)
    if _placed_on(variable, column, strategy):
      continue
    if shared_with is not None:
      other_stage, other_index = shared_with
      raise ValueError(
          f"{_cost.describe(layer, index)} is the same layer as layer {other_index} (its "
          f"weights are shared), but the partition puts layer {other_index} on stage "
          f"{other_stage} and layer {index} on stage {stage}: a variable lives on one "
          f"stage's device. Received: variable {variable.name!r} on {list(_where(variable))}. "
          "Give an explicit partition=[n0, n1, ...] that keeps every use of a layer with "
          "variables in one stage.")
    where = _where(variable)
    raise ValueError(
        f"GPipe places stage {stage}'s variables on {list(column)} when it builds its "
        f"layers, but {_cost.describe(layer, index)} was built before, with variable "
        f"{variable.name!r} on {list(where)}. Received: a layer built elsewhere. Pass "
        "layers that are not built yet (e.g. a keras.Sequential without keras.Input), "
        "or build them under tf.device() of their stage's device with an explicit "
        "partition.")
