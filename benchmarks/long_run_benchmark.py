"""Memory and threads over a long run of Keras `model.fit`, diststrat against tf.distribute.

The same small Keras model (an MLP 32-64-64-1, global batch 64, Adam) is trained with
`model.fit` under diststrat's `MirroredStrategy` and under `tf.distribute.MirroredStrategy`
on the same 4 logical CPU devices (or the GPUs), in two ways:

  - `eager`: `compile(run_eagerly=True)`, the way one debugs a model: every step runs
    Python, so a strategy's per-step threads and objects show up here;
  - `function`: Keras's default, each step one `tf.function`.

Each contender and way runs in a fresh process. After a warm-up fit, it trains in
segments of `--steps` steps and records, after each segment, the Python objects the
garbage collector tracks (after a collection), the live threads, and the resident set
size. The table gives what each segment after the first added: a run whose memory
stays flat adds about nothing, segment after segment. RSS moves by a few hundred KiB
on its own (the allocator, caches filled once), so only a growth that repeats in every
segment is a leak.

Usage:
  python benchmarks/long_run_benchmark.py --out benchmarks/results/long_run.json
  python benchmarks/long_run_benchmark.py --steps=200 --segments=3   # a quicker run
"""

import gc
import json
import os
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_string("out", "benchmarks/results/long_run.json", "Where to write the JSON report.")
flags.DEFINE_integer("steps", 800, "Training steps per segment.", lower_bound=1)
flags.DEFINE_integer("segments", 4, "Segments measured per run (the first one is not "
                     "counted: it settles the process).", lower_bound=2)
flags.DEFINE_integer("num_devices", 4, "Towers: logical CPU devices, or the GPUs if any.",
                     lower_bound=1)
flags.DEFINE_string("group", None, "Internal: run one contender and way in this process.")
FLAGS = flags.FLAGS

BATCH = 64
BATCHES = 8  # Batches per epoch: the data is 8 global batches, repeated.
CONTENDERS = ("diststrat", "tf.distribute")
WAYS = ("eager", "function")


def _rss_kib():
  """This process's resident set size in KiB (Linux)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _measure(contender, way):
  """Trains in this process and returns {"objects", "threads", "rss_kib"} per segment."""
  devices = _common.configure_devices(FLAGS.num_devices)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  if contender == "diststrat":
    strategy = ds.MirroredStrategy(devices)
  else:
    strategy = tf.distribute.MirroredStrategy(devices)
  keras.utils.set_random_seed(0)
  with strategy.scope():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse",
                  run_eagerly=(way == "eager"))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((BATCH * BATCHES, 32)).astype("float32")
  y = rng.standard_normal((BATCH * BATCHES, 1)).astype("float32")
  epochs = max(1, FLAGS.steps // BATCHES)
  model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)  # Warm-up: traces, builds.
  samples = []
  for _ in range(FLAGS.segments + 1):
    gc.collect()
    samples.append({"objects": len(gc.get_objects()), "threads": threading.active_count(),
                    "rss_kib": _rss_kib()})
    if len(samples) <= FLAGS.segments:
      model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
  return {"samples": samples, "steps_per_segment": epochs * BATCHES}


def _segments(result):
  """What each segment after the first added, per measure (a list per measure)."""
  counted = result["samples"][1:]  # From the end of the first segment.
  return {key: [b[key] - a[key] for a, b in zip(counted, counted[1:], strict=False)]
          for key in ("objects", "threads", "rss_kib")}


def _signed(values):
  return ", ".join(f"{v:+d}" for v in values)


def main(argv):
  del argv
  if FLAGS.group:
    contender, way = FLAGS.group.split(":")
    print(json.dumps(_measure(contender, way)))
    return
  report = {"steps": FLAGS.steps, "segments": FLAGS.segments,
            "num_devices": FLAGS.num_devices, "results": {}}
  for way in WAYS:
    for contender in CONTENDERS:
      result = _common.run_group(__file__, f"{contender}:{way}", timeout=3600,
                                 steps=FLAGS.steps, segments=FLAGS.segments,
                                 num_devices=FLAGS.num_devices)
      result["added_per_segment"] = _segments(result)
      report["results"][f"{contender}:{way}"] = result
  _common.write_report(report, FLAGS.out)
  steps = next(iter(report["results"].values()))["steps_per_segment"]
  print(f"\n### Keras fit, MLP 32-64-64-1, {FLAGS.num_devices} towers, global batch {BATCH}: "
        f"what each segment of {steps} steps added (after a first segment)\n")
  print("| way | contender | Python objects | threads | RSS (KiB) |")
  print("|---|---|---|---|---|")
  for way in WAYS:
    for contender in CONTENDERS:
      added = report["results"][f"{contender}:{way}"]["added_per_segment"]
      print(f"| {way} | {contender} | {_signed(added['objects'])} | "
            f"{_signed(added['threads'])} | {_signed(added['rss_kib'])} |")


if __name__ == "__main__":
  app.run(main)
