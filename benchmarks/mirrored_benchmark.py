"""diststrat's MirroredStrategy against tf.distribute.MirroredStrategy, in one run.

Measures, side by side in one process and interleaved in alternating blocks (this
machine drifts up to 2x between runs, so only same-run ratios mean anything):

  (a) training-step throughput of an MLP 784-1024-1024-10 (global batch 256) and a small
      CNN (conv 32, conv 64, dense 10 on 28x28x1, global batch 128), plain SGD, on 1, 2
      and 4 towers, the whole step in one tf.function;
  (b) first-call time (build + trace + first run) of the same steps: 3 per contender, each
      a new step, the order alternating, after the model ran once with no strategy; the
      median;
  (c) batch_reduce of 1, 16 and 64 MiB split into 50 float32 tensors on 4 devices, every
      algorithm, in GB/s (bytes of one tower's values / time), inside a tf.function that
      returns every copy of every result (TensorFlow prunes what a function does not
      return, so returning one copy would skip the copies to the other devices);
  (d) peak memory (resident set) of a 4-tower MLP training run, one fresh process per
      contender, against tf.distribute's default (its collective all-reduce here);
  (e) with --parts=first_call only: where a first call's time goes, for the steps of (a):
      the build (strategy, variables, inputs), the trace (`get_concrete_function`), the
      first run (TensorFlow's graph optimizations and kernels' set-up, and the step
      itself) and, for scale, a second run; FIRST_CALL_ROUNDS rounds in alternating
      order, medians.

Ratios are printed against tf.distribute's default cross-device ops and against its
best one in the same run.

Both libraries run the same algorithm: per-tower gradients, a sum across towers onto
each variable, `var -= lr * grad` on every copy. tf.distribute is only ever the peer
here; diststrat never uses it.

Usage:
  python benchmarks/mirrored_benchmark.py --out benchmarks/results/mirrored.json
  python benchmarks/mirrored_benchmark.py --quick   # a short smoke run
  python benchmarks/mirrored_benchmark.py --parts=batch_reduce   # (c) only
  python benchmarks/mirrored_benchmark.py --parts=first_call --towers=2,4,8   # (e)
"""

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
from _step_models import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    cnn_spec, initial_values, loss_fn, make_data, mlp_spec)

flags.DEFINE_string("out", "benchmarks/results/mirrored.json", "Where to write the JSON report.")
flags.DEFINE_bool("quick", False, "A short smoke run.")
flags.DEFINE_integer("rounds", None, "Timed blocks per contender (default 7; 2 with --quick).")
flags.DEFINE_multi_enum("parts", None, ["steps", "batch_reduce", "memory", "first_call"],
                        "What to measure (repeatable; default steps, batch_reduce and memory, "
                        "without memory with --quick; first_call only when named).")
flags.DEFINE_list("towers", None, "Tower counts of the step tables (default 1,2,4; 1,4 with "
                  "--quick). Counts above 4 split the CPU into that many logical devices.")
flags.DEFINE_string("group", None, "Internal: run one group of contenders in this process.")
FLAGS = flags.FLAGS

NUM_DEVICES = 4
LR = 0.01


def configure_devices():
  return _common.configure_devices(NUM_DEVICES)


# --- contenders: each returns (step function, its arguments) --------------------------


def build_none(spec, devices):
  """No strategy: one device, the whole global batch."""
  with tf.device(devices[0]):
    variables = [tf.Variable(v) for v in initial_values(spec)]
    x, y = (tf.constant(a) for a in make_data(spec))

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(spec, variables, x, y, spec["batch"])
    for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
      v.assign_sub(LR * g)
    return loss

  return step, (x, y)


def build_diststrat(spec, devices, ops_name):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  ops = {
      "default": None,
      "one_device": lambda: ds.cross_tower_ops.ReductionToOneDevice(),
      "naive": lambda: ds.cross_tower_ops.AllReduceCrossTowerOps("naive"),
      "hierarchical_copy": lambda: ds.cross_tower_ops.AllReduceCrossTowerOps("hierarchical_copy"),
      "collective": lambda: ds.cross_tower_ops.AllReduceCrossTowerOps("collective"),
  }[ops_name]
  s = ds.MirroredStrategy(devices, cross_tower_ops=ops() if ops else None)
  n = len(devices)
  with s.scope():
    variables = [tf.Variable(v) for v in initial_values(spec)]
    opt = ds.optimizers.GradientDescent(LR, loss_reduction="sum")
  x, y = make_data(spec)
  parts = {}
  for i, d in enumerate(s.worker_devices):
    with tf.device(d):
      parts[d] = (tf.constant(np.array_split(x, n)[i]), tf.constant(np.array_split(y, n)[i]))
  px = ds.values.PerDevice({d: p[0] for d, p in parts.items()})
  py = ds.values.PerDevice({d: p[1] for d, p in parts.items()})

  def tower_fn(xp, yp):
    return opt.minimize(lambda: loss_fn(spec, variables, xp, yp, spec["batch"]),
                        var_list=variables)

  @tf.function
  def step(px, py):
    with s.scope():
      s.call_for_each_tower(tower_fn, px, py)

  _STRATEGIES[step] = s  # So the report can show the default's choice after its first call.
  return step, (px, py)


_STRATEGIES = {}  # diststrat step -> its strategy
_TF_STRATEGIES = {}


def tf_strategy(devices, ops_name):
  """One tf.distribute strategy per (devices, ops): two collective strategies in one
  process reuse the same collective keys and abort each other."""
  key = (tuple(devices), ops_name)
  if key not in _TF_STRATEGIES:
    ops = {
        "default": None,
        "one_device": lambda: tf.distribute.ReductionToOneDevice(),
        "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(),
    }[ops_name]
    _TF_STRATEGIES[key] = tf.distribute.MirroredStrategy(
        list(devices), cross_device_ops=ops() if ops else None)
  return _TF_STRATEGIES[key]


def warm_up(devices, n, quick):
  """Pays the process's one-time costs before any first call is timed: every contender
  builds and runs a tiny model once (imports, first traces, kernels, device set-up)."""
  spec = {"name": "mlp", "batch": 8, "input": (4,), "classes": 2,
          "shapes": [(4, 4), (4,), (4, 4), (4,), (4, 2), (2,)]}
  for _, _, builder in contenders(devices, n, quick):
    step, args = builder(spec)
    step(*args)
  sync()


def build_tf_distribute(spec, devices, ops_name):
  s = tf_strategy(devices, ops_name)
  n = len(devices)
  with s.scope():
    variables = [tf.Variable(v) for v in initial_values(spec)]
  x, y = make_data(spec)
  xs, ys = np.array_split(x, n), np.array_split(y, n)
  dist = s.experimental_distribute_values_from_function(
      lambda ctx: (tf.constant(xs[ctx.replica_id_in_sync_group]),
                   tf.constant(ys[ctx.replica_id_in_sync_group])))

  def apply(strategy, grads):
    reduced = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM, [(g, v) for g, v in zip(grads, variables, strict=True)])
    for v, g in zip(variables, reduced, strict=True):
      strategy.extended.update(v, lambda var, gc: var.assign_sub(LR * gc), args=(g,))

  def replica_fn(batch):
    xp, yp = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(spec, variables, xp, yp, spec["batch"])
    grads = tape.gradient(loss, variables)
    tf.distribute.get_replica_context().merge_call(apply, args=(grads,))

  @tf.function
  def step(batch):
    s.run(replica_fn, args=(batch,))

  return step, (dist,)


def contenders(devices, n, quick):
  """(label, library, builder) for n towers."""
  result = [("diststrat default", "diststrat",
             lambda spec: build_diststrat(spec, devices[:n], "default"))]
  if n > 1:  # The default measures; "naive" is the instant heuristic's pick on CPUs.
    result.append(("diststrat naive", "diststrat",
                   lambda spec: build_diststrat(spec, devices[:n], "naive")))
  if n > 1 and not quick:
    result.append(("diststrat one_device", "diststrat",
                   lambda spec: build_diststrat(spec, devices[:n], "one_device")))
  tf_ops = ["default", "one_device"] if quick else ["default", "one_device", "hierarchical_copy"]
  if n == 1:
    tf_ops = ["default"]
  for name in tf_ops:
    result.append((f"tf.distribute {name}", "tf.distribute",
                   lambda spec, name=name: build_tf_distribute(spec, devices[:n], name)))
  result.append(("no strategy (1 device)", "none", lambda spec: build_none(spec, devices)))
  return result


# --- measurement ----------------------------------------------------------------------


def timed(fn, args):
  """Seconds of `fn(*args)` until its outputs exist on every device.

  Waits by reading back one element per device that holds an output (ops on a device run
  in order), not the outputs themselves: copying every output to numpy (200 tensors of
  up to 1.3 MB here) took as long as the reductions being timed.
  """
  start = time.perf_counter()
  out = fn(*args)
  last = {t.device: t for t in tf.nest.flatten(out) if hasattr(t, "device")}
  for t in last.values():
    with tf.device(t.device):
      tf.reshape(t, [-1])[:1].numpy()
  return time.perf_counter() - start


def sync():
  # Ops are asynchronous on accelerators; a value read back waits for the queue.
  tf.constant(0.0).numpy()


FIRST_CALLS = 3  # First calls timed per contender (1 with --quick).


def run_throughput(spec, devices, n, rounds, steps_per_block, quick):
  listed = contenders(devices, n, quick)
  # The model's own one-time costs (its kernels' first use: the CNN's convolutions) are
  # paid here, by none of the contenders: the warm-up's tiny model is an MLP.
  step, args = next(builder for _, library, builder in listed if library == "none")(spec)
  step(*args)
  sync()
  entries = [{"label": label, "library": library, "builder": builder, "first_calls_s": [],
              "examples_per_s": []} for label, library, builder in listed]
  # First calls: each contender builds and traces a new step FIRST_CALLS times, the order
  # reversed each time; the median is reported. diststrat's default measures its
  # reduction in its first one. The last step built is the one timed below.
  for r in range(1 if quick else FIRST_CALLS):
    for entry in entries if r % 2 == 0 else list(reversed(entries)):
      start = time.perf_counter()
      entry["step"], entry["args"] = entry["builder"](spec)
      entry["step"](*entry["args"])
      sync()
      entry["first_calls_s"].append(time.perf_counter() - start)
  for entry in entries:
    del entry["builder"]
    entry["first_call_s"] = _common.summarize(entry["first_calls_s"])["median"]
    if entry["step"] in _STRATEGIES and entry["label"] == "diststrat default":
      # Its measured choice.
      entry["label"] = f"{entry['label']}: {_STRATEGIES[entry['step']].cross_tower_ops!r}"
  for entry in entries:  # Warm up every contender before timing any.
    for _ in range(3):
      entry["step"](*entry["args"])
    sync()
  for r in range(rounds):
    order = entries if r % 2 == 0 else list(reversed(entries))
    for entry in order:
      start = time.perf_counter()
      for _ in range(steps_per_block):
        entry["step"](*entry["args"])
      sync()
      elapsed = time.perf_counter() - start
      entry["examples_per_s"].append(steps_per_block * spec["batch"] / elapsed)
  for entry in entries:
    del entry["step"], entry["args"]
  return entries


def reduce_contenders(devices):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  ours = {
      # The default: measures at its first call (a warm-up call here), then reuses it.
      "diststrat default (measured)": ds.MirroredStrategy(devices).cross_tower_ops,
      "diststrat one_device": ds.cross_tower_ops.ReductionToOneDevice(),
      "diststrat naive": ds.cross_tower_ops.AllReduceCrossTowerOps("naive"),
      "diststrat hierarchical_copy": ds.cross_tower_ops.AllReduceCrossTowerOps("hierarchical_copy"),
      "diststrat collective": ds.cross_tower_ops.AllReduceCrossTowerOps("collective"),
      "diststrat naive num_packs=2": ds.cross_tower_ops.AllReduceCrossTowerOps("naive", num_packs=2),
  }
  theirs = {
      "tf.distribute one_device": tf.distribute.ReductionToOneDevice(),
      "tf.distribute hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce(),
      "tf.distribute default (collective)": None,
  }
  return ours, theirs


def _closure_reduce(reduce_fn, local_results):
  """A tf.function with no arguments that runs `reduce_fn()` and returns every copy of
  every result (`local_results(m)`: the components of one reduced value).

  Every copy, not one: TensorFlow prunes the ops whose results a function does not
  return, so returning one copy would leave out the copies to the other devices for
  every algorithm but the collective one (whose results wait for each other), and the
  contenders would not do equal work.
  """
  @tf.function
  def run():
    return [c for m in reduce_fn() for c in local_results(m)]
  return run


def run_batch_reduce(devices, sizes_mib, rounds):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  ours, theirs = reduce_contenders(devices)
  results = []
  for size in sizes_mib:
    elements = size * 2**20 // 4 // 50
    rng = np.random.default_rng(size)
    host = [rng.standard_normal(elements).astype(np.float32) for _ in range(50)]
    entries = []
    per_device = []
    for t in range(50):
      comps = {}
      for d in devices:
        with tf.device(d):
          comps[d] = tf.constant(host[t])
      per_device.append(comps)
    values = [ds.values.PerDevice(c) for c in per_device]
    for label, ops in ours.items():
      # Both libraries capture their values by closure: passing them as arguments would
      # time Python's argument binding of 200 tensors, not the reduction.
      entries.append({"label": label, "library": "diststrat",
                      "fn": _closure_reduce(lambda ops=ops, values=values: ops.batch_reduce(
                          "sum", [(v, None) for v in values]), lambda m: m.values)})
    default_tf = tf_strategy(devices, "default")
    dist = [default_tf.experimental_distribute_values_from_function(
        lambda ctx, c=c: c[devices[ctx.replica_id_in_sync_group]]) for c in per_device]
    for label, ops in theirs.items():
      ops = ops or default_tf.extended._cross_device_ops  # pylint: disable=protected-access
      entries.append({"label": label, "library": "tf.distribute",
                      "fn": _closure_reduce(lambda ops=ops, dist=dist: ops.batch_reduce(
                          tf.distribute.ReduceOp.SUM, [(v, v) for v in dist]),
                                            default_tf.experimental_local_results)})
    for entry in entries:
      entry["fn"]()
      entry["fn"]()
      entry["gb_per_s"] = []
    for r in range(rounds):
      order = entries if r % 2 == 0 else list(reversed(entries))
      for entry in order:
        elapsed = timed(entry["fn"], ())
        entry["gb_per_s"].append(size * 2**20 / elapsed / 1e9)
    for entry in entries:
      del entry["fn"]
      entry["size_mib"] = size
    results.extend(entries)
  return results


# Peak memory: (label, library, reduction) in fresh processes; ratios are against
# tf.distribute's default (the collective all-reduce here).
MEMORY_CONTENDERS = [
    ("diststrat default", "diststrat", "default"),
    ("diststrat naive", "diststrat", "naive"),
    ("tf.distribute default", "tf.distribute", "default"),
    ("tf.distribute one_device", "tf.distribute", "one_device"),
]


def peak_memory(library, ops_name, steps):
  """Peak RSS (MiB) of a fresh process training the MLP on 4 towers with `library`'s
  `ops_name` reduction."""
  build = "build_diststrat" if library == "diststrat" else "build_tf_distribute"
  code = (
      "import sys, resource; sys.path.insert(0, %r)\n"
      "import mirrored_benchmark as b\n"
      "devices = b.configure_devices()\n"
      "spec = b.mlp_spec()\n"
      "step, args = b.%s(spec, devices, %r)\n"
      "for _ in range(%d): step(*args)\n"
      "b.sync()\n"
      "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)\n"
  ) % (os.path.dirname(os.path.abspath(__file__)), build, ops_name, steps)
  return float(_common.run_in_subprocess(["-c", code], name=f"peak memory of {library} "
                                         f"{ops_name}", timeout=600))


FIRST_CALL_ROUNDS = 7  # Rounds of the first-call breakdown (part (e)).
FIRST_CALL_CONTENDERS = ("diststrat default", "diststrat naive", "tf.distribute default",
                         "tf.distribute one_device", "no strategy (1 device)")


def run_first_call_parts(spec, devices, n, rounds):
  """Part (e): each contender's first call in parts, in milliseconds (medians)."""
  warm_up(devices, n, False)
  listed = [c for c in contenders(devices, n, False) if c[0] in FIRST_CALL_CONTENDERS]
  step, args = next(builder for _, library, builder in listed if library == "none")(spec)
  step(*args)  # The model's own one-time costs, paid by no contender (as in (b)).
  sync()
  parts = {label: [] for label, _, _ in listed}
  for r in range(rounds):
    for label, _, builder in listed if r % 2 == 0 else list(reversed(listed)):
      times = [time.perf_counter()]
      step, args = builder(spec)
      times.append(time.perf_counter())
      step.get_concrete_function(*args)
      times.append(time.perf_counter())
      for _ in range(2):
        step(*args)
        sync()
        times.append(time.perf_counter())
      parts[label].append(np.diff(times) * 1000)
  entries = []
  for label, _, _ in listed:
    medians = np.median(np.array(parts[label]), axis=0)
    totals = [float(sum(p[:3])) for p in parts[label]]
    entries.append({"label": label, "build_ms": float(medians[0]), "trace_ms": float(medians[1]),
                    "first_run_ms": float(medians[2]), "second_run_ms": float(medians[3]),
                    "first_call_ms": _common.summarize(totals)})
  return entries


def print_first_call_parts(model, n, entries):
  fastest = min(e["first_call_ms"]["median"] for e in entries
                if e["label"].startswith("tf.distribute"))
  print(f"\n### {model}, {n} tower(s): a first call in parts (ms, medians of "
        f"{len(entries[0]['first_call_ms']['values'])} rounds)\n")
  print("| contender | build | trace | first run | a second run, for scale | first call "
        "(build + trace + first run; median, min-max) | vs fastest tf.distribute |")
  print("|---|---|---|---|---|---|---|")
  for e in entries:
    print(f"| {e['label']} | {e['build_ms']:.1f} | {e['trace_ms']:.1f} | "
          f"{e['first_run_ms']:.1f} | {e['second_run_ms']:.1f} | "
          f"{_common.format_summary(e['first_call_ms'])} | "
          f"{_common.format_ratio(e['first_call_ms']['median'] / fastest)} |")
  sys.stdout.flush()


def run_group(group, quick, rounds):
  """Runs one measurement group in this process; returns its entries.

  tf.distribute keeps one collective group per process (a second MirroredStrategy over
  other devices aborts the first), so each group runs in a fresh process: diststrat and
  tf.distribute are still measured side by side, interleaved, inside it.
  """
  if group == "batch_reduce":
    devices = configure_devices()
    warm_up(devices, len(devices), quick)
    entries = run_batch_reduce(devices, [1, 16] if quick else [1, 16, 64], rounds)
    for e in entries:
      e["throughput"] = _common.summarize(e.pop("gb_per_s"), keep_values=False)
    return entries
  if group.startswith("first_call:"):
    _, model, n = group.split(":")
    devices = _common.configure_devices(max(NUM_DEVICES, int(n)))
    return run_first_call_parts(mlp_spec() if model == "mlp" else cnn_spec(), devices,
                                int(n), 2 if quick else FIRST_CALL_ROUNDS)
  model, n = group.split(":")
  n = int(n)
  devices = _common.configure_devices(max(NUM_DEVICES, n))
  spec = mlp_spec() if model == "mlp" else cnn_spec()
  warm_up(devices, n, quick)
  steps = 3 if quick else (10 if model == "mlp" else 4)
  entries = run_throughput(spec, devices, n, rounds, steps, quick)
  for e in entries:
    e.update(model=model, towers=n)
    e["throughput"] = _common.summarize(e.pop("examples_per_s"), keep_values=False)
  return entries


def main(argv):
  del argv  # Flags only.
  args = FLAGS
  rounds = args.rounds or (2 if args.quick else 7)
  if args.group:
    print(json.dumps(run_group(args.group, args.quick, rounds)))
    return
  report = {"tensorflow": tf.__version__, "rounds": rounds, "command": " ".join(sys.argv),
            "throughput": [], "batch_reduce": [], "memory": {}}
  parts = args.parts or (["steps", "batch_reduce"] if args.quick else
                         ["steps", "batch_reduce", "memory"])
  towers = ([int(n) for n in args.towers] if args.towers else
            [1, 4] if args.quick else [1, 2, 4])
  if "steps" in parts:
    for model in (["mlp"] if args.quick else ["mlp", "cnn"]):
      for n in towers:
        entries = _common.run_group(__file__, f"{model}:{n}", timeout=1200, rounds=rounds,
                                    quick=args.quick)
        report["throughput"].extend(entries)
        print_throughput(model, n, entries)
  if "batch_reduce" in parts:
    report["batch_reduce"] = _common.run_group(__file__, "batch_reduce", timeout=1200,
                                               rounds=rounds, quick=args.quick)
    print_batch_reduce(report["batch_reduce"])
  if "first_call" in parts:
    report["first_call"] = []
    for model in (["mlp"] if args.quick else ["mlp", "cnn"]):
      for n in [t for t in towers if t > 1]:
        entries = _common.run_group(__file__, f"first_call:{model}:{n}", timeout=1200,
                                    quick=args.quick)
        report["first_call"].extend(entries)
        print_first_call_parts(model, n, entries)
  if "memory" in parts:
    for label, library, ops_name in MEMORY_CONTENDERS:
      report["memory"][label] = peak_memory(library, ops_name, 20)
    print_memory(report["memory"])
  _common.write_report(report, args.out)


def _best_tf(entries, key="throughput"):
  tf_entries = [e for e in entries if e["library"] == "tf.distribute"]
  return max(tf_entries, key=lambda e: e[key]["median"]) if tf_entries else None


def _default_tf(entries):
  return next(e for e in entries if e["label"].startswith("tf.distribute default"))


def print_throughput(model, n, entries):
  best_tf = _best_tf(entries)
  default_tf = _default_tf(entries)
  none = next(e for e in entries if e["library"] == "none")
  first_default = default_tf["first_call_s"]
  first_fastest = min(x["first_call_s"] for x in entries if x["library"] == "tf.distribute")
  print(f"\n### {model}, {n} tower(s): examples/s (median, min-max over blocks)\n")
  print("| contender | examples/s | vs tf.distribute default | vs best tf.distribute | "
        "vs no strategy | first call (s, median, min-max) | first call vs tf.distribute default | "
        "first call vs fastest tf.distribute |")
  print("|---|---|---|---|---|---|---|---|")
  ratio = _common.format_ratio
  for e in entries:
    t = e["throughput"]
    print(f"| {e['label']} | {_common.format_summary(t)} | "
          f"{ratio(t['median'] / default_tf['throughput']['median'])} | "
          f"{ratio(t['median'] / best_tf['throughput']['median'])} | "
          f"{ratio(t['median'] / none['throughput']['median'])} | {e['first_call_s']:.2f} "
          f"({min(e['first_calls_s']):.2f}-{max(e['first_calls_s']):.2f}) | "
          f"{ratio(e['first_call_s'] / first_default)} | "
          f"{ratio(e['first_call_s'] / first_fastest)} |")
  sys.stdout.flush()


def print_batch_reduce(entries):
  for size in sorted({e["size_mib"] for e in entries}):
    rows = [e for e in entries if e["size_mib"] == size]
    best_tf = _best_tf(rows)
    default_tf = _default_tf(rows)
    print(f"\n### batch_reduce of {size} MiB in 50 float32 tensors, {NUM_DEVICES} devices, "
          "inside tf.function, every copy returned: GB/s per tower (median, min-max)\n")
    print("| algorithm | GB/s | vs tf.distribute default | vs best tf.distribute |")
    print("|---|---|---|---|")
    ratio = _common.format_ratio
    for e in rows:
      t = e["throughput"]
      print(f"| {e['label']} | {_common.format_summary(t, '.2f')} | "
            f"{ratio(t['median'] / default_tf['throughput']['median'])} | "
            f"{ratio(t['median'] / best_tf['throughput']['median'])} |")
  sys.stdout.flush()


def print_memory(memory):
  print("\n### peak memory of 4-tower MLP training, 20 steps (fresh process each)\n")
  print("| contender | peak RSS (MiB) | vs tf.distribute default (collective) |")
  print("|---|---|---|")
  for label, mib in memory.items():
    print(f"| {label} | {mib:.0f} | "
          f"{_common.format_ratio(mib / memory['tf.distribute default'])} |")


if __name__ == "__main__":
  app.run(main)
