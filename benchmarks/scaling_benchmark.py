"""How the cost of a MirroredStrategy step grows with its towers: 1, 2, 4 and 8 devices.

For each device count N, one fresh process splits the CPU into N logical devices (or takes
N GPUs) and times, side by side and interleaved, the same training step of the MLP
784-1024-1024-10 on the same global batch of 256 (benchmarks/_mlp.py), split over N
towers:

  - diststrat `MirroredStrategy` with its default reduction (measured: the first step
    times the shipped algorithms and keeps the fastest; the table's "reduction" column
    shows the choice, read after the first call);
  - diststrat `MirroredStrategy` with `AllReduceCrossTowerOps("naive")` (N > 1);
  - `tf.distribute.MirroredStrategy` with its default cross-device ops, and with
    `ReductionToOneDevice` (N > 1; its fastest on logical CPUs);
  - no strategy: one device, the whole batch (the same work at every N, for reference).

Both libraries run the same algorithm as benchmarks/mirrored_benchmark.py: per-tower
gradients, a sum across towers onto each variable, `var -= lr * grad` on every copy, the
whole step in one tf.function. Two figures per contender:

  - step time: milliseconds per step, the median over blocks of steps, the contenders'
    blocks interleaved and their order reversed every round;
  - first call: seconds to build the model and run the first step (tracing the step and
    running it once), after every contender has run a tiny model once so that no first
    call pays the process's one-time costs; 3 times per contender, each a new model, the
    contenders' order reversed each time; the median.

Ratios are against tf.distribute's default, and against tf.distribute's fastest contender
at that N, in the same process. diststrat's default measures once per process, in its
first first call (the slowest of the 3 first calls, shown in the min-max range). One process per N
because tf.distribute keeps one collective group per process, and the logical devices
are fixed when TensorFlow starts; so compare step times across N only roughly (this
machine drifts between processes), and ratios within one N.

Usage:
  python benchmarks/scaling_benchmark.py --out benchmarks/results/scaling.json
  python benchmarks/scaling_benchmark.py --quick   # a short smoke run
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import _mlp  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_string("out", "benchmarks/results/scaling.json", "Where to write the JSON report.")
flags.DEFINE_bool("quick", False, "A short smoke run (2 rounds of 3 steps).")
flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Device counts, one process each.")
flags.DEFINE_integer("rounds", None, "Timed blocks per contender (default 7; 2 with --quick).")
flags.DEFINE_integer("steps", None, "Steps per timed block (default 10; 3 with --quick).")
flags.DEFINE_integer("first_calls", None,
                     "First calls timed per contender, each a new model and trace, the order "
                     "alternating (default 3; 1 with --quick).")
flags.DEFINE_integer("group", None, "Internal: measure this device count in this process.")
FLAGS = flags.FLAGS


# --- contenders: each builder returns (step function, its arguments) ----------------------


def _split(n):
  x, y = _mlp.make_batch()
  return np.array_split(x, n), np.array_split(y, n)


def build_diststrat(tf, devices, values, algorithm):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  ops = None if algorithm == "default" else ds.cross_tower_ops.AllReduceCrossTowerOps(algorithm)
  s = ds.MirroredStrategy(devices, cross_tower_ops=ops)
  with s.scope():
    variables = [tf.Variable(v) for v in values]
    opt = ds.optimizers.GradientDescent(_mlp.LR, loss_reduction="sum")
  xs, ys = _split(len(devices))
  px, py = {}, {}
  for i, d in enumerate(s.worker_devices):
    with tf.device(d):
      px[d], py[d] = tf.constant(xs[i]), tf.constant(ys[i])
  px, py = ds.values.PerDevice(px), ds.values.PerDevice(py)

  def tower_fn(x, y):
    return opt.minimize(lambda: _mlp.loss_fn(tf, variables, x, y), var_list=variables)

  @tf.function
  def step(px, py):
    with s.scope():
      s.call_for_each_tower(tower_fn, px, py)

  return step, (px, py), lambda: repr(s.cross_tower_ops)  # Asked after the first call.


_TF_STRATEGIES = {}


def build_tf_distribute(tf, devices, values, ops_name="default"):
  key = (tuple(devices), ops_name)
  if key not in _TF_STRATEGIES:  # One per process: two would share collective keys.
    ops = tf.distribute.ReductionToOneDevice() if ops_name == "one_device" else None
    _TF_STRATEGIES[key] = tf.distribute.MirroredStrategy(list(devices),
                                                         cross_device_ops=ops)
  s = _TF_STRATEGIES[key]
  with s.scope():
    variables = [tf.Variable(v) for v in values]
  xs, ys = _split(len(devices))
  batch = s.experimental_distribute_values_from_function(
      lambda ctx: (tf.constant(xs[ctx.replica_id_in_sync_group]),
                   tf.constant(ys[ctx.replica_id_in_sync_group])))

  def apply(strategy, grads):
    reduced = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM, list(zip(grads, variables, strict=True)))
    for v, g in zip(variables, reduced, strict=True):
      strategy.extended.update(v, lambda var, gc: var.assign_sub(_mlp.LR * gc), args=(g,))

  def replica_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = _mlp.loss_fn(tf, variables, x, y)
    grads = tape.gradient(loss, variables)
    tf.distribute.get_replica_context().merge_call(apply, args=(grads,))

  @tf.function
  def step(batch):
    s.run(replica_fn, args=(batch,))

  ops = type(s.extended._cross_device_ops).__name__  # pylint: disable=protected-access
  return step, (batch,), ops


def build_none(tf, devices, values):
  with tf.device(devices[0]):
    variables = [tf.Variable(v) for v in values]
    x, y = (tf.constant(a) for a in _mlp.make_batch())

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = _mlp.loss_fn(tf, variables, x, y)
    for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
      v.assign_sub(_mlp.LR * g)

  return step, (x, y), "-"


def contenders(tf, devices, values):
  """(label, library, builder) for the towers on `devices`, the model's initial `values`."""
  result = [("diststrat default", "diststrat",
             lambda: build_diststrat(tf, devices, values, "default"))]
  if len(devices) > 1:
    result.append(("diststrat naive", "diststrat",
                   lambda: build_diststrat(tf, devices, values, "naive")))
  result.append(("tf.distribute default", "tf.distribute",
                 lambda: build_tf_distribute(tf, devices, values)))
  if len(devices) > 1:
    result.append(("tf.distribute one_device", "tf.distribute",
                   lambda: build_tf_distribute(tf, devices, values, "one_device")))
  result.append(("no strategy (1 device)", "none", lambda: build_none(tf, devices, values)))
  return result


# --- measurement ---------------------------------------------------------------------------


def run_group(n, rounds, steps, first_calls):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  devices = _common.configure_devices(n)[:n]
  sync = lambda: tf.constant(0.0).numpy()  # Waits for the queued work (GPUs).
  # Warm-up: every contender builds and runs a tiny model once (imports, first traces,
  # kernels, devices), so no first call below pays the process's one-time costs.
  tiny = [np.full(shape, 0.01, np.float32)
          for shape in [(784, 4), (4,), (4, 4), (4,), (4, 10), (10,)]]
  for _, _, builder in contenders(tf, devices, tiny):
    step, args, _ = builder()
    step(*args)
  sync()
  entries = [{"label": label, "library": library, "builder": builder, "first_call_s": []}
             for label, library, builder in contenders(tf, devices, _mlp.initial_values())]
  # First calls: each contender builds and traces a new model `first_calls` times, the
  # order reversed each time (so no contender is always the first after the warm-up);
  # the last model built is the one timed below.
  for r in range(first_calls):
    for e in entries if r % 2 == 0 else list(reversed(entries)):
      start = time.perf_counter()
      e["step"], e["args"], e["reduction"] = e["builder"]()
      e["step"](*e["args"])
      sync()
      e["first_call_s"].append(time.perf_counter() - start)
  for e in entries:
    del e["builder"]
    if callable(e["reduction"]):  # diststrat: its choice, made in the first call.
      e["reduction"] = e["reduction"]()
    e["step_ms"] = []
  for e in entries:  # Warm up every contender before timing any.
    for _ in range(3):
      e["step"](*e["args"])
  sync()
  for r in range(rounds):
    for e in entries if r % 2 == 0 else list(reversed(entries)):
      start = time.perf_counter()
      for _ in range(steps):
        e["step"](*e["args"])
      sync()
      e["step_ms"].append((time.perf_counter() - start) / steps * 1000)
  for e in entries:
    del e["step"], e["args"]
    e["step_ms"] = _common.summarize(e["step_ms"])
    e["first_call_s"] = _common.summarize(e["first_call_s"])
    e["devices"] = n
  return entries


def print_table(entries):
  print("\n### MLP 784-1024-1024-10, global batch 256: step time (ms, median, min-max over "
        "blocks) and first call (s, median, min-max), by device count\n")
  print("Speed ratios are tf.distribute's step time over the contender's (above 1.00x: "
        "faster than tf.distribute); first-call ratios are the contender's over "
        "tf.distribute's (below 1.00x: faster).\n")
  print("| devices | contender | reduction | step (ms) | speed vs tf.distribute default | "
        "speed vs fastest tf.distribute | first call (s) | first call vs tf.distribute "
        "default | first call vs fastest tf.distribute |")
  print("|---|---|---|---|---|---|---|---|---|")
  for n in sorted({e["devices"] for e in entries}):
    rows = [e for e in entries if e["devices"] == n]
    ref = next(e for e in rows if e["label"] == "tf.distribute default")
    tf_rows = [e for e in rows if e["library"] == "tf.distribute"]
    fastest = min(e["step_ms"]["median"] for e in tf_rows)
    fastest_first = min(e["first_call_s"]["median"] for e in tf_rows)
    for e in rows:
      t = e["step_ms"]
      e["speed_vs_tf_default"] = ref["step_ms"]["median"] / t["median"]
      e["speed_vs_fastest_tf"] = fastest / t["median"]
      f = e["first_call_s"]
      e["first_call_vs_tf_default"] = f["median"] / ref["first_call_s"]["median"]
      e["first_call_vs_fastest_tf"] = f["median"] / fastest_first
      print(f"| {n} | {e['label']} | {e['reduction']} | {_common.format_summary(t, '.1f')} | "
            f"{_common.format_ratio(e['speed_vs_tf_default'])} | "
            f"{_common.format_ratio(e['speed_vs_fastest_tf'])} | "
            f"{_common.format_summary(f, '.2f')} | "
            f"{_common.format_ratio(e['first_call_vs_tf_default'])} | "
            f"{_common.format_ratio(e['first_call_vs_fastest_tf'])} |")
  sys.stdout.flush()


def main(argv):
  del argv  # Flags only.
  rounds = FLAGS.rounds or (2 if FLAGS.quick else 7)
  steps = FLAGS.steps or (3 if FLAGS.quick else 10)
  first_calls = FLAGS.first_calls or (1 if FLAGS.quick else 3)
  if FLAGS.group:
    print(json.dumps(run_group(FLAGS.group, rounds, steps, first_calls)))
    return
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report = {"tensorflow": tf.__version__, "rounds": rounds, "steps_per_block": steps,
            "first_calls": first_calls, "command": " ".join(sys.argv), "results": []}
  for n in [int(n) for n in FLAGS.devices]:
    start = time.perf_counter()
    report["results"].extend(_common.run_group(__file__, n, timeout=1800, rounds=rounds,
                                               steps=steps, first_calls=first_calls))
    print(f"{n} device(s): {time.perf_counter() - start:.0f} s", flush=True)
  print_table(report["results"])
  _common.write_report(report, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
