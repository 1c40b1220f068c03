"""Towers that run at once against towers that take turns, on logical CPUs of one machine.

Why `MirroredStrategy`'s CNN step sits at parity with tf.distribute's at 2 logical CPUs
while its MLP step is faster: the step time there is the towers' own convolutions, and
how fast they are depends on whether the towers run at the same time. This script
measures that without either library: plain TensorFlow, one tf.function per schedule,
the same models and data as benchmarks/mirrored_benchmark.py (benchmarks/_step_models.py: the MLP 784-1024-1024-10 on
a global batch of 256 and its CNN on 128), split over N towers, each with its own copy
of the variables. The gradients are summed on the first device, and every copy takes
`var -= lr * sum`. The schedules differ only in control dependencies between towers:

  - parallel: no dependency; TensorFlow runs the towers' ops as they become ready (what
    both libraries do);
  - staggered: tower i+1's forward pass starts after tower i's loss is computed;
  - serial: tower i+1 starts after tower i's gradients are computed.

Each tower count runs in a fresh process (the logical devices are fixed when TensorFlow
starts), the schedules interleaved in blocks of steps, the order reversed every round.
Ratios are against the parallel schedule of the same run.

Usage:
  python benchmarks/tower_schedule_benchmark.py --out benchmarks/results/tower_schedule.json
  python benchmarks/tower_schedule_benchmark.py --quick   # a short smoke run
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

flags.DEFINE_string("out", "benchmarks/results/tower_schedule.json",
                    "Where to write the JSON report.")
flags.DEFINE_bool("quick", False, "A short smoke run (2 rounds of 3 steps, 2 towers).")
flags.DEFINE_list("towers", None, "Tower counts, one process each (default 2,4; 2 with --quick).")
flags.DEFINE_integer("rounds", None, "Timed blocks per schedule (default 14; 2 with --quick).")
flags.DEFINE_integer("steps", None, "Steps per timed block (default 20; 3 with --quick).")
flags.DEFINE_string("group", None, "Internal: measure MODEL:TOWERS in this process.")
FLAGS = flags.FLAGS

SCHEDULES = ("parallel", "staggered", "serial")
LR = 0.01


def build_step(tf, mb, spec, devices, schedule):
  """A tf.function training step of `spec` over `devices`, towers ordered by `schedule`,
  and the last variable of each tower (to wait for the steps run)."""
  n = len(devices)
  x, y = mb.make_data(spec)
  xs, ys = np.array_split(x, n), np.array_split(y, n)
  copies, batches = [], []
  for i, device in enumerate(devices):
    with tf.device(device):
      copies.append([tf.Variable(v) for v in mb.initial_values(spec)])
      batches.append((tf.constant(xs[i]), tf.constant(ys[i])))

  @tf.function
  def step():
    grads, wait_for = [], []
    for i, device in enumerate(devices):
      with tf.device(device), tf.control_dependencies(wait_for):
        with tf.GradientTape() as tape:
          features = tf.identity(batches[i][0])  # Inside the dependency: the tower's first op.
          loss = mb.loss_fn(spec, copies[i], features, batches[i][1], spec["batch"])
      with tf.device(device):
        grads.append(tape.gradient(loss, copies[i]))
      wait_for = {"parallel": [], "staggered": [loss], "serial": grads[-1]}[schedule]
    for j in range(len(copies[0])):
      with tf.device(devices[0]):
        total = tf.add_n([g[j] for g in grads])
      for i, device in enumerate(devices):
        with tf.device(device):
          copies[i][j].assign_sub(LR * total)
    # Returns nothing, as the libraries' steps in mirrored_benchmark.py: the updates run
    # anyway (a tf.function keeps every stateful op), and returned values would add a
    # read of every copy, and a copy of it at the next update while the value lives.

  return step, [tower[-1] for tower in copies]


def wait_for(last_copies):
  """Returns once the steps queued so far ran: reads one element of the last variable
  updated on each device (ops on a device run in order)."""
  for variable in last_copies:
    variable[:1].numpy()


def run_group(group, rounds, steps):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import _step_models as mb  # pylint: disable=g-import-not-at-top
  model, n = group.split(":")
  devices = _common.configure_devices(int(n))[:int(n)]
  spec = {"mlp": mb.mlp_spec, "cnn": mb.cnn_spec}[model]()
  entries = []
  for s in SCHEDULES:
    step, last_copies = build_step(tf, mb, spec, devices, s)
    entries.append({"schedule": s, "step": step, "last": last_copies, "examples_per_s": []})
  for entry in entries:  # Trace and warm up every schedule before timing any.
    for _ in range(3):
      entry["step"]()
    wait_for(entry["last"])
  for r in range(rounds):
    for entry in entries if r % 2 == 0 else list(reversed(entries)):
      start = time.perf_counter()
      for _ in range(steps):
        entry["step"]()
      wait_for(entry["last"])
      entry["examples_per_s"].append(steps * spec["batch"] / (time.perf_counter() - start))
  for entry in entries:
    del entry["step"], entry["last"]
    entry["throughput"] = _common.summarize(entry.pop("examples_per_s"))
    entry.update(model=model, towers=int(n))
  return entries


def print_table(model, n, entries):
  parallel = next(e for e in entries if e["schedule"] == "parallel")["throughput"]["median"]
  print(f"\n### {model}, {n} towers: examples/s (median, min-max over blocks)\n")
  print("| schedule | examples/s | vs parallel |")
  print("|---|---|---|")
  for e in entries:
    t = e["throughput"]
    print(f"| {e['schedule']} | {_common.format_summary(t)} | "
          f"{_common.format_ratio(t['median'] / parallel)} |")
  sys.stdout.flush()


def main(argv):
  del argv  # Flags only.
  args = FLAGS
  rounds = args.rounds or (2 if args.quick else 14)
  steps = args.steps or (3 if args.quick else 20)
  if args.group:
    print(json.dumps(run_group(args.group, rounds, steps)))
    return
  towers = [int(t) for t in args.towers] if args.towers else ([2] if args.quick else [2, 4])
  report = {"command": " ".join(sys.argv), "rounds": rounds, "steps": steps, "results": []}
  for model in ("mlp", "cnn"):
    for n in towers:
      entries = _common.run_group(__file__, f"{model}:{n}", timeout=1200, rounds=rounds,
                                  steps=steps)
      report["results"].extend(entries)
      print_table(model, n, entries)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report["tensorflow"] = tf.__version__
  _common.write_report(report, args.out)


if __name__ == "__main__":
  app.run(main)
