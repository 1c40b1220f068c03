"""Keras `model.fit` under diststrat against tf.distribute, in one run.

The same Keras 3 model, built and compiled in each contender's scope, trained with
`model.fit` on the same global batches:

  - diststrat `MirroredStrategy` on 4 logical CPU devices (or the GPUs), with its default
    reduction and with `ReductionToOneDevice`;
  - `tf.distribute.MirroredStrategy` on the same devices, with its default cross-device
    ops and with `tf.distribute.ReductionToOneDevice`;
  - no strategy (one device, the whole global batch).

Three models: an MLP 784-1024-1024-10 (global batch 256), the demo's CNN on 8x8x1 images
(global batch 256), and the MLP under Keras's `mixed_float16` policy (float16
activations, float32 variables and logits, Keras's `LossScaleOptimizer`: under
diststrat its `apply` runs once per step on the summed gradients). Each model runs in a fresh process (tf.distribute keeps one collective
group per process), where every contender is built, traced and warmed up, then timed in
interleaved blocks of `model.fit(steps_per_epoch=...)` calls, the order alternating each
round. First fit calls (build, compile, fit one step) are timed 3 times per contender,
each a new model, the order alternating, after every contender fitted a tiny model and
the model itself was built once with no strategy (imports, Keras's first use of its
layers) (this machine drifts up to 2x between processes, so only same-process ratios mean
anything). diststrat never uses tf.distribute: it is only the peer here.

Usage:
  python benchmarks/keras_benchmark.py --out benchmarks/results/keras.json
  python benchmarks/keras_benchmark.py --quick   # a short smoke run
"""

import contextlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_string("out", "benchmarks/results/keras.json", "Where to write the JSON report.")
flags.DEFINE_bool("quick", False,
                  "A short smoke run (the MLP, float32 and mixed_float16, 2 rounds).")
flags.DEFINE_integer("rounds", None, "Timed blocks per contender (default 7; 2 with --quick).")
flags.DEFINE_integer("steps", None, "Training steps per timed block (default 20; 5 with --quick).")
flags.DEFINE_integer("num_devices", 4, "Towers: logical CPU devices, or the GPUs if any.",
                     lower_bound=1)
flags.DEFINE_integer("first_calls", None,
                     "First fit calls timed per contender, each a new model, the order "
                     "alternating (default 3; 1 with --quick).")
flags.DEFINE_string("group", None, "Internal: run one model's contenders in this process.")
FLAGS = flags.FLAGS

BATCH = 256
LR = 0.01


# --- the model and its data, the same for every contender --------------------------------


MIXED = "_mixed_float16"  # A model kind's suffix: built under the mixed_float16 policy.


def make_model(kind):
  import keras  # pylint: disable=g-import-not-at-top
  if kind.startswith("mlp"):
    layers = [keras.Input((784,)), keras.layers.Dense(1024, activation="relu"),
              keras.layers.Dense(1024, activation="relu"),
              keras.layers.Dense(10, dtype="float32")]  # float32 logits, as Keras advises.
  else:  # The demo's CNN (examples/digits.py; importing it defines the demo's flags too).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "examples"))
    import digits  # pylint: disable=g-import-not-at-top
    return digits.make_model()
  return keras.Sequential(layers)


def make_dataset(kind):
  rng = np.random.default_rng(0)
  shape = (784,) if kind.startswith("mlp") else (8, 8, 1)
  x = rng.standard_normal((4 * BATCH,) + shape).astype(np.float32)
  y = rng.integers(0, 10, 4 * BATCH).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()


def build(kind, scope):
  """A compiled model, created in `scope` (a context manager, or None for no strategy)."""
  import keras  # pylint: disable=g-import-not-at-top

  def make():
    keras.utils.set_random_seed(0)
    if kind.endswith(MIXED):  # Keras then wraps the optimizer in a LossScaleOptimizer.
      keras.mixed_precision.set_global_policy("mixed_float16")
    try:
      model = make_model(kind)
      model.compile(optimizer=keras.optimizers.SGD(LR),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
      keras.mixed_precision.set_global_policy("float32")
    return model

  if scope is None:
    return make()
  with scope:
    return make()


# --- contenders: (label, library, scope factory or None) ---------------------------------

_TF_STRATEGIES = {}


def tf_strategy(devices, ops_name):
  """One tf.distribute strategy per cross-device ops (two would share collective keys)."""
  if ops_name not in _TF_STRATEGIES:
    ops = {"default": None, "one_device": tf.distribute.ReductionToOneDevice}[ops_name]
    _TF_STRATEGIES[ops_name] = tf.distribute.MirroredStrategy(
        list(devices), cross_device_ops=ops() if ops else None)
  return _TF_STRATEGIES[ops_name]


def contenders(devices):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  result = [
      ("diststrat", "diststrat", lambda: ds.MirroredStrategy(devices).scope()),
      ("diststrat one_device", "diststrat", lambda: ds.MirroredStrategy(
          devices, cross_tower_ops=ds.cross_tower_ops.ReductionToOneDevice()).scope()),
  ]
  for name in ("default", "one_device"):
    result.append((f"tf.distribute {name}", "tf.distribute",
                   lambda name=name: tf_strategy(devices, name).scope()))
  result.append(("no strategy (1 device)", "none", None))
  return result


def describe_reduction(label, devices, model):
  """The reduction each contender uses, in words (for the report); asked after the first
  fit, so diststrat's default shows the algorithm it measured fastest."""
  if label == "diststrat":
    return repr(model.distribute_strategy.diststrat_strategy.cross_tower_ops)
  if label == "tf.distribute default":
    strategy = tf_strategy(devices, "default")
    return type(strategy.extended._cross_device_ops).__name__  # pylint: disable=protected-access
  return {"diststrat one_device": "ReductionToOneDevice()",
          "tf.distribute one_device": "ReductionToOneDevice",
          "no strategy (1 device)": "-"}[label]


# --- measurement ------------------------------------------------------------------------


class _StepClock:
  """A Keras callback: the time from the end of a fit call's first step to its last.

  So each block times steady-state training steps, not what every `fit` call pays
  before its first step (callbacks, the epoch iterator; tf.distribute also builds a
  distributed iterator per call).
  """

  def __init__(self):
    import keras  # pylint: disable=g-import-not-at-top
    self.callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=self._batch_end, on_train_begin=self._begin)
    self.first = self.last = None

  def _begin(self, logs=None):
    self.first = self.last = None

  def _batch_end(self, batch, logs=None):
    now = time.perf_counter()
    if self.first is None:
      self.first = now
    self.last = now


def fit_block(model, dataset, steps, clock=None):
  """Runs `steps` training steps; returns the seconds of all but the first."""
  clock = clock or _StepClock()
  model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
            callbacks=[clock.callback])
  return clock.last - clock.first


def warm_up(devices):
  """Pays the process's one-time costs (imports, Keras's first trace, each library's
  set-up) before any first fit call is timed: every contender fits a tiny model once.
  tf.distribute's strategies are made here (one per process, see tf_strategy);
  diststrat's are made anew in each first fit call, which its figure includes."""
  import keras  # pylint: disable=g-import-not-at-top
  data = tf.data.Dataset.from_tensors((np.zeros((BATCH, 4), np.float32),
                                       np.zeros((BATCH,), np.int32))).repeat()
  for _, _, scope in contenders(devices):
    with scope() if scope else contextlib.nullcontext():
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
      model.compile(optimizer=keras.optimizers.SGD(LR),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit_block(model, data, 1)


def run_group(kind, towers, rounds, steps, first_calls):
  devices = _common.configure_devices(towers)
  warm_up(devices)
  # The model's own one-time costs (importing the demo's module for the CNN, Keras's
  # first use of its layer classes) are paid here, by none of the contenders.
  build(kind, None)
  entries = [{"label": label, "library": library, "scope": scope, "first_call_s": [],
              "examples_per_s": []} for label, library, scope in contenders(devices)]
  # First fit calls: each contender builds a new model and fits one step (tracing it)
  # `first_calls` times, the order reversed each time; the median is reported. The last
  # model built is the one timed below. diststrat's default measures its reduction in
  # its first one (the slowest, in the min-max range).
  for r in range(first_calls):
    for entry in entries if r % 2 == 0 else list(reversed(entries)):
      dataset = make_dataset(kind)
      scope = entry["scope"]
      start = time.perf_counter()
      model = build(kind, scope() if scope else None)
      fit_block(model, dataset, 1)  # Traces the step.
      entry["first_call_s"].append(time.perf_counter() - start)
      entry["model"], entry["dataset"] = model, dataset
  for entry in entries:
    del entry["scope"]
    entry["first_calls_s"] = entry.pop("first_call_s")
    entry["first_call_s"] = _common.summarize(entry["first_calls_s"])["median"]
    entry["reduction"] = describe_reduction(entry["label"], devices, entry["model"])
  for entry in entries:  # Warm up every contender before timing any.
    fit_block(entry["model"], entry["dataset"], steps)
  for r in range(rounds):
    for entry in entries if r % 2 == 0 else list(reversed(entries)):
      elapsed = fit_block(entry["model"], entry["dataset"], steps + 1)
      entry["examples_per_s"].append(steps * BATCH / elapsed)
  for entry in entries:
    del entry["model"], entry["dataset"]
    entry["throughput"] = _common.summarize(entry.pop("examples_per_s"), keep_values=False)
    entry.update(model=kind, towers=len(devices))
  return entries


def print_table(kind, entries):
  tf_entries = [e for e in entries if e["library"] == "tf.distribute"]
  best_tf = max(tf_entries, key=lambda e: e["throughput"]["median"])
  none = next(e for e in entries if e["library"] == "none")
  first_default = next(e for e in entries if e["label"] == "tf.distribute default")["first_call_s"]
  first_fastest = min(e["first_call_s"] for e in tf_entries)
  print(f"\n### {kind}, {entries[0]['towers']} towers, global batch {BATCH}: model.fit "
        "examples/s (median, min-max over blocks)\n")
  print("| contender | reduction | examples/s | vs best tf.distribute | vs no strategy | "
        "first fit call (s, median of the first calls, min-max) | first fit call vs tf.distribute default | "
        "first fit call vs fastest tf.distribute |")
  print("|---|---|---|---|---|---|---|---|")
  ratio = _common.format_ratio
  for e in entries:
    t = e["throughput"]
    # The first-call ratios go into the JSON report too (entries are written after this).
    e["first_call_vs_tf_default"] = e["first_call_s"] / first_default
    e["first_call_vs_fastest_tf"] = e["first_call_s"] / first_fastest
    print(f"| {e['label']} | {e['reduction']} | {_common.format_summary(t)} | "
          f"{ratio(t['median'] / best_tf['throughput']['median'])} | "
          f"{ratio(t['median'] / none['throughput']['median'])} | {e['first_call_s']:.2f} "
          f"({min(e['first_calls_s']):.2f}-{max(e['first_calls_s']):.2f}) | "
          f"{ratio(e['first_call_vs_tf_default'])} | {ratio(e['first_call_vs_fastest_tf'])} |")
  sys.stdout.flush()


def main(argv):
  del argv  # Flags only.
  args = FLAGS
  rounds = args.rounds or (2 if args.quick else 7)
  steps = args.steps or (5 if args.quick else 20)
  first_calls = args.first_calls or (1 if args.quick else 3)
  if args.group:
    print(json.dumps(run_group(args.group, args.num_devices, rounds, steps, first_calls)))
    return
  report = {"tensorflow": tf.__version__, "rounds": rounds, "steps_per_block": steps,
            "first_calls": first_calls, "command": " ".join(sys.argv), "results": []}
  try:
    import keras  # pylint: disable=g-import-not-at-top
    report["keras"] = keras.__version__
  except ImportError:
    pass
  for kind in (["mlp", "mlp" + MIXED] if args.quick else ["mlp", "cnn", "mlp" + MIXED]):
    entries = _common.run_group(__file__, kind, timeout=1800, rounds=rounds, steps=steps,
                                num_devices=args.num_devices, first_calls=first_calls)
    report["results"].extend(entries)
    print_table(kind, entries)
  _common.write_report(report, args.out)


if __name__ == "__main__":
  app.run(main)
