"""GPipe on 4 logical devices against the same model on one device, in one run.

Measures, in one process (this machine drifts up to 2x between runs, so only same-run
ratios mean anything):

  (a) training-step time (forward, backward, SGD update; one tf.function) of a stack of
      --layers Dense(--width, relu) layers on a global batch of --batch examples: the
      layers in sequence on one device, then GPipe over 4 devices for each M in
      --micro_batches, with and without re-materialization. Contenders are timed in
      interleaved rounds; the median is reported.
  (b) the bubble: --traces steps of each GPipe contender are traced with TensorFlow's
      profiler (medians reported); every op of cell (micro-batch k, stage s) carries
      `stage_s` in its name, so the trace gives each device's busy intervals. Measured bubble = 1 - (sum over devices
      of busy time) / (S * step span), next to GPipe's (S - 1) / (M + S - 1). The trace
      also gives the time during which two or more stages run at once.
  (c) peak memory of one training step above the memory in use before it, from
      TensorFlow's allocator statistics (`tf.config.experimental.get_memory_info`): the
      BFC CPU allocator, turned on here with TF_CPU_ALLOCATOR_USE_BFC=true, is one
      allocator shared by the logical CPU devices, so the figure is the whole process's
      tensor memory.

Usage:
  python benchmarks/pipeline_benchmark.py
  python benchmarks/pipeline_benchmark.py --quick      # a short smoke run
  python benchmarks/pipeline_benchmark.py --inter_op_threads=4 --out=/tmp/pipe.json
"""

import glob
import json
import os
import re
import sys
import tempfile
import time

if __name__ == "__main__":
  # Before TensorFlow starts: allocator statistics on the CPU, quiet logs; and this
  # checkout's diststrat rather than another installed copy.
  os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_DEVICES = 4
LR = 0.01

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 16, "Number of Dense layers (8 or more).")
flags.DEFINE_integer("width", 512, "Units of every Dense layer, and input features.")
flags.DEFINE_integer("batch", 1024, "Global batch size.")
flags.DEFINE_list("micro_batches", ["1", "4", "8", "16"], "Values of M to measure.")
flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds.")
flags.DEFINE_integer("steps_per_round", 3, "Timed steps per contender per round.")
flags.DEFINE_integer("traces", 3, "Traced steps per GPipe contender (medians reported).")
flags.DEFINE_integer("inter_op_threads", 0,
                     "TensorFlow's inter-op thread pool size (0: TensorFlow's default, "
                     "the number of cores); it caps how many ops run at once.")
flags.DEFINE_bool("quick", False, "A short smoke run (small model, one round).")
flags.DEFINE_string("out", "", "Optional path of a JSON file for the results.")


def configure_devices():
  return _common.configure_devices(NUM_DEVICES)


# --- traces: which stage ran when --------------------------------------------------------

_CELL = re.compile(r"(forward|backward)/stage_(\d+)/micro_batch_(\d+)/")


def trace(fn, *args):
  """Runs `fn(*args)` under TensorFlow's profiler; returns {stage: [(start, end) in us]}."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  logdir = tempfile.mkdtemp(prefix="pipeline_trace_")
  tf.profiler.experimental.start(logdir)
  try:
    result = fn(*args)
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
  finally:
    tf.profiler.experimental.stop()
  paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
  space = xplane_pb2.XSpace()
  with open(paths[0], "rb") as f:
    space.ParseFromString(f.read())
  intervals = {}
  for plane in space.planes:
    for line in plane.lines:
      for event in line.events:
        match = _CELL.search(plane.event_metadata[event.metadata_id].name)
        if match:
          start = (line.timestamp_ns * 1000 + event.offset_ps) / 1e6
          intervals.setdefault(int(match.group(2)), []).append(
              (start, start + event.duration_ps / 1e6))
  return intervals


def merge(intervals):
  """Sorted, disjoint intervals covering the same time."""
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def summarize_trace(intervals, num_stages):
  """Busy time per stage, measured bubble, and time with two or more stages running."""
  per_stage = {s: merge(v) for s, v in intervals.items()}
  start = min(a for v in per_stage.values() for a, _ in v)
  end = max(b for v in per_stage.values() for _, b in v)
  span = end - start
  busy = {s: sum(b - a for a, b in v) for s, v in per_stage.items()}
  edges = sorted([(a, 1) for v in per_stage.values() for a, _ in v] +
                 [(b, -1) for v in per_stage.values() for _, b in v])
  running, last, concurrent, most = 0, start, 0.0, 0
  for t, step in edges:
    if running >= 2:
      concurrent += t - last
    running += step
    most = max(most, running)
    last = t
  return {"span_us": span, "busy_fraction": {s: busy[s] / span for s in sorted(busy)},
          "bubble": 1.0 - sum(busy.values()) / (num_stages * span),
          "concurrent_fraction": concurrent / span, "max_concurrent_stages": most}


def median_summary(summaries):
  """The median of each figure over several traced steps."""
  def median(values):
    return _common.summarize(values)["median"]

  result = {}
  for key, value in summaries[0].items():
    if isinstance(value, dict):
      result[key] = {s: median(x[key][s] for x in summaries) for s in value}
    else:
      result[key] = median(x[key] for x in summaries)
  return result


# --- contenders ----------------------------------------------------------------------------


def make_layers(seed):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(seed)
  return [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.layers)]


def make_step(forward, variables):
  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(forward(x)))
    for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
      v.assign_sub(LR * g)
    return loss
  return step


def contenders(devices, x):
  from diststrat.pipeline import GPipe  # pylint: disable=g-import-not-at-top
  result = {}
  layers = make_layers(0)
  with tf.device(devices[0]):
    for layer in layers:
      layer.build((None, FLAGS.width))

  def sequential(t):
    with tf.device(devices[0]):
      for layer in layers:
        t = layer(t, training=True)
    return t

  result["sequential, 1 device"] = (make_step(sequential, [
      v for layer in layers for v in layer.trainable_variables]), None)
  for recompute in (False, True):
    for m in [int(m) for m in FLAGS.micro_batches]:
      pipe = GPipe(make_layers(0), devices=devices, num_micro_batches=m, recompute=recompute)
      pipe.build(x.shape)
      name = f"GPipe S={len(devices)} M={m}" + (" recompute" if recompute else "")
      result[name] = (make_step(lambda t, p=pipe: p(t, training=True),
                                pipe.trainable_variables), pipe)
  return result


def time_steps(steps, x):
  times = {name: [] for name in steps}
  for _ in range(FLAGS.rounds):
    for name, (step, _) in steps.items():
      for _ in range(FLAGS.steps_per_round):
        start = time.perf_counter()
        step(x).numpy()
        times[name].append(time.perf_counter() - start)
  return {name: _common.summarize(t)["median"] for name, t in times.items()}


def peak_memory(step, x):
  """Peak bytes above the bytes in use before one step, or None without statistics."""
  step(x).numpy()
  device = "CPU:0" if not tf.config.list_physical_devices("GPU") else "GPU:0"
  before = tf.config.experimental.get_memory_info(device)["current"]
  tf.config.experimental.reset_memory_stats(device)
  step(x).numpy()
  peak = tf.config.experimental.get_memory_info(device)["peak"]
  return None if peak == 0 else peak - before


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.layers, FLAGS.width, FLAGS.batch, FLAGS.rounds = 8, 128, 128, 1
  tf.get_logger().setLevel("ERROR")  # One tf.function per contender is not retracing.
  if FLAGS.inter_op_threads:
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
  devices = configure_devices()
  x = tf.random.stateless_normal([FLAGS.batch, FLAGS.width], seed=[1, 2])
  steps = contenders(devices, x)
  for step, _ in steps.values():  # Trace and warm up every contender first.
    step(x).numpy()
    step(x).numpy()
  times = time_steps(steps, x)
  num_stages = len(devices)
  rows = []
  for name, (step, pipe) in steps.items():
    row = {"contender": name, "step_ms": times[name] * 1e3,
           "vs_sequential": times[name] / times["sequential, 1 device"],
           "peak_memory_mib": None, "stages": None}
    memory = peak_memory(step, x)
    row["peak_memory_mib"] = None if memory is None else memory / 2**20
    if pipe is not None:
      row["stages"] = pipe.stage_sizes
      m = pipe.num_micro_batches
      row["bubble_gpipe"] = (num_stages - 1) / (m + num_stages - 1)
      summaries = [summarize_trace(trace(step, x), num_stages) for _ in range(FLAGS.traces)]
      row.update(median_summary(summaries))
    rows.append(row)
  print_table(rows, devices)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"flags": {k: FLAGS[k].value for k in ("layers", "width", "batch",
                                                       "micro_batches", "rounds",
                                                       "steps_per_round", "traces",
                                                       "inter_op_threads")},
                 "devices": devices, "rows": rows}, f, indent=1)


def print_table(rows, devices):
  print(f"\n{FLAGS.layers} x Dense({FLAGS.width}, relu), batch {FLAGS.batch}, "
        f"{len(devices)} devices ({devices[0].split('/')[-1]}...), inter-op threads "
        f"{FLAGS.inter_op_threads or 'default'}; median of {FLAGS.rounds} x "
        f"{FLAGS.steps_per_round} steps. Memory: peak above start of a step, BFC allocator.")
  header = (f"{'contender':<28}{'step ms':>9}{'vs seq':>8}{'peak MiB':>10}"
            f"{'bubble':>8}{'GPipe':>7}{'>=2 run':>9}{'max':>5}  stage busy")
  print(header)
  print("-" * len(header))
  for r in rows:
    memory = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.1f}"
    line = f"{r['contender']:<28}{r['step_ms']:>9.1f}{r['vs_sequential']:>8.2f}{memory:>10}"
    if r["stages"] is not None:
      busy = " ".join(f"{b:.2f}" for b in r["busy_fraction"].values())
      line += (f"{r['bubble']:>8.2f}{r['bubble_gpipe']:>7.2f}"
               f"{r['concurrent_fraction']:>9.2f}{r['max_concurrent_stages']:>5.0f}  {busy}")
    print(line)
  by_name = {r["contender"]: r for r in rows}
  print("\nRatios:")
  for m in FLAGS.micro_batches:
    keep = by_name.get(f"GPipe S={len(devices)} M={m}")
    again = by_name.get(f"GPipe S={len(devices)} M={m} recompute")
    if keep and again:
      memory = ""
      if keep["peak_memory_mib"] and again["peak_memory_mib"]:
        memory = f", peak memory x{again['peak_memory_mib'] / keep['peak_memory_mib']:.2f}"
      print(f"  M={m}: recompute / keep: step time x{again['step_ms'] / keep['step_ms']:.2f}"
            f"{memory}")


if __name__ == "__main__":
  app.run(main)
