"""diststrat's MultiWorkerMirroredStrategy against tf.distribute's, on one cluster shape.

Two worker processes on this machine talk over loopback gRPC; TensorFlow's collective
ops carry the reductions in both libraries. For each cluster shape (2 workers x 1
logical CPU device each, then 2 workers x 2), every contender's two worker processes are
started once and stay up (idle while the others run); the parent asks them for timed
blocks. In each round every contender runs a step block, then every contender runs an
all-reduce block; the order of the contenders reverses from one round to the next. Only
same-run ratios are reported: this machine drifts up to 2x between runs.

  (a) step throughput of an MLP 784-1024-1024-10 on a global batch of 256: each tower
      (replica) takes the gradients of a softmax cross-entropy on its share of the
      global batch, the gradients are summed across all towers of all workers, and
      `var -= lr * grad` runs on every copy; the whole step is one `tf.function`.
      examples/s counts the global batch (the workers' shares summed).
  (b) all-reduce bandwidth across processes: `batch_reduce("sum")` of 64 MiB of float32
      in 50 tensors (one value per tower, on every tower of every worker), GB/s = bytes
      of one tower's values reduced per second, in each worker (the workers' mean).

Ratios are taken round by round against tf.distribute: for steps, its contender that
runs the all-reduce in a tf.function (its "eager" twin runs the same step); for the
all-reduce, its best contender (eager or tf.function).
The loss after the warm-up steps is printed for every contender: the same algorithm
gives the same value in both libraries.

Contenders (--contenders takes any of these forms):

  diststrat hierarchical  `CrossWorkerAllReduce("hierarchical")` (the default): within
                          each worker first, then one collective member per worker.
  diststrat flat          `CrossWorkerAllReduce("flat")`: one collective over all towers.
  diststrat ... packs=N   the same with `num_packs=N` (tensors concatenated into N chunks).
  tf.distribute RING      `tf.distribute.MultiWorkerMirroredStrategy` with
                          `CommunicationOptions(implementation=RING)` (what AUTO picks on
                          CPUs), TF_CONFIG in each worker process. It uses CPU:0 of each
                          worker only (it never uses logical CPUs), so on the "x 2"
                          shape it runs 1 replica per worker on the same global batch.
  ... eager               the all-reduce blocks call batch_reduce eagerly instead of in a
                          `tf.function` (the steps are the same). tf.distribute reduces
                          tensor by tensor eagerly but concatenates all into one
                          collective in a `tf.function`; diststrat traces either way.

tf.distribute is only ever the peer here; diststrat never uses it.

Usage:
  python benchmarks/multi_worker_benchmark.py --out benchmarks/results/multi_worker.json
  python benchmarks/multi_worker_benchmark.py --quick   # a short smoke run
"""

import json
import logging as pylogging
import os
import select
import signal
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # `import diststrat` is this checkout's.
# The shared benchmark MLP; the directory is put first also for LocalCluster's children,
# which load this script by path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import _mlp  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_WORKERS = 2
REDUCE_MIB = 64
REDUCE_TENSORS = 50
START_TIMEOUT = 240.0  # Seconds for a contender's workers to come up (a loaded machine).
BLOCK_TIMEOUT = 300.0  # Seconds for one timed block's answer.
_REPLY = "@@ "  # Prefix of the workers' answer lines (anything else on stdout is noise).

flags.DEFINE_string("out", "benchmarks/results/multi_worker.json", "Where to write the JSON report.")
flags.DEFINE_bool("quick", False, "A short smoke run: 1 round of short blocks.")
flags.DEFINE_integer("rounds", None, "Rounds of interleaved blocks (default 5; 1 with --quick).")
flags.DEFINE_float("seconds", None, "Target seconds per timed block (default 4; 1.5 with --quick).")
flags.DEFINE_list("devices_per_worker", ["1", "2"], "Cluster shapes: logical CPUs per worker.")
flags.DEFINE_list("contenders", None, "Contenders to run (default: DEFAULT_CONTENDERS).")
flags.DEFINE_string("worker", None, "Internal: run one worker process of this contender.")
flags.DEFINE_integer("task", 0, "Internal: the worker's task index.")
flags.DEFINE_integer("cpus", 1, "Internal: logical CPU devices of the worker process.")
flags.DEFINE_string("spec", None, "Internal: the cluster spec, as JSON.")
FLAGS = flags.FLAGS

# The contenders run by default. Any name of the form "diststrat SCHEME[ packs=N]" or
# "tf.distribute IMPLEMENTATION", optionally followed by " eager" (the all-reduce blocks
# then call batch_reduce eagerly instead of in a tf.function), can be given with
# --contenders.
DEFAULT_CONTENDERS = [
    "diststrat hierarchical", "diststrat hierarchical eager", "diststrat flat",
    "diststrat flat eager", "diststrat hierarchical packs=2", "tf.distribute RING",
    "tf.distribute RING eager"]


def parse_contender(name):
  """(library, options) of a contender's name (see DEFAULT_CONTENDERS)."""
  words = name.split()
  eager = bool(words) and words[-1] == "eager"
  if eager:
    words = words[:-1]
  library, options = _parse_words(name, words)
  return library, dict(options, eager=eager)


def _parse_words(name, words):
  if len(words) in (2, 3) and words[0] == "diststrat" and words[1] in ("hierarchical", "flat"):
    packs = 1
    if len(words) == 3:
      if not words[2].startswith("packs="):
        raise ValueError(f"Unknown contender {name!r}")
      packs = int(words[2][len("packs="):])
    return "diststrat", {"scheme": words[1], "num_packs": packs}
  if len(words) == 2 and words[0] == "tf.distribute" and words[1] in ("RING", "AUTO"):
    return "tf.distribute", {"implementation": words[1]}
  raise ValueError(f"Unknown contender {name!r}: expected 'diststrat hierarchical|flat"
                   "[ packs=N][ eager]' or 'tf.distribute RING|AUTO[ eager]'.")


# --- the model and the data, shared by every contender ----------------------------------


def shards(num_towers):
  """The global batch split into `num_towers` parts, in global tower order."""
  x, y = _mlp.make_batch()
  return list(zip(np.array_split(x, num_towers), np.array_split(y, num_towers), strict=True))


def reduce_inputs(seed):
  """The 50 host arrays (64 MiB in all) a tower all-reduces; different per tower."""
  elements = REDUCE_MIB * 2**20 // 4 // REDUCE_TENSORS
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(elements).astype(np.float32) for _ in range(REDUCE_TENSORS)]


# --- a worker process: builds its contender, then answers timed blocks ----------------


def build_diststrat(spec, task, cpus, options):
  """(step, step args, reduce fn, description) for one diststrat worker."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if cpus > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * cpus)
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  ops = ds.cross_tower_ops.CrossWorkerAllReduce(options["scheme"],
                                                num_packs=options["num_packs"])
  strategy = ds.MultiWorkerMirroredStrategy(cluster_spec=spec, task_type="worker",
                                            task_id=task, cross_worker_ops=ops)
  devices = list(strategy.worker_devices)
  first = task * len(devices)
  with strategy.scope():
    variables = [tf.Variable(v, name=f"mlp_{i}") for i, v in enumerate(_mlp.initial_values())]
    opt = ds.optimizers.GradientDescent(_mlp.LR, loss_reduction="sum")
  parts = shards(strategy.num_towers)
  xs, ys = {}, {}
  for i, d in enumerate(devices):
    with tf.device(d):
      xs[d], ys[d] = (tf.constant(a) for a in parts[first + i])
  px, py = ds.values.PerDevice(xs), ds.values.PerDevice(ys)

  def tower_fn(x, y):
    opt.minimize(lambda: _mlp.loss_fn(tf, variables, x, y), var_list=variables)

  @tf.function
  def step(px, py):
    strategy.call_for_each_tower(tower_fn, px, py)
    return variables[-1].read_value()

  values = []
  per_tower = {d: reduce_inputs(first + i) for i, d in enumerate(devices)}
  for t in range(REDUCE_TENSORS):
    components = {}
    for d in devices:
      with tf.device(d):
        components[d] = tf.constant(per_tower[d][t])
    values.append(ds.values.PerDevice(components))
  del per_tower

  def reduce_all():
    # Values captured by closure: as arguments, Python's binding of 50 x towers tensors
    # would be timed too.
    reduced = strategy.batch_reduce("sum", [(v, None) for v in values])
    return [c for m in reduced for c in m.values]  # Every copy, so none is pruned.

  if not options["eager"]:
    reduce_all = tf.function(reduce_all)

  def check():
    return float(_mlp.loss_fn(tf, [v.read_value() for v in variables], *_mlp.make_batch()))

  described = {"replicas": strategy.num_towers, "replicas_per_worker": len(devices),
               "devices": devices, "cross_worker_ops": repr(ops),
               "all_reduce_call": "eager" if options["eager"] else "tf.function",
               "diststrat": ds.__file__}
  return step, (px, py), reduce_all, check, described


def build_tf_distribute(spec, task, cpus, options):
  """(step, step args, reduce fn, description) for one tf.distribute worker (TF_CONFIG)."""
  del cpus  # tf.distribute's MultiWorkerMirroredStrategy uses CPU:0 only.
  os.environ["TF_CONFIG"] = json.dumps({"cluster": spec,
                                        "task": {"type": "worker", "index": task}})
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                           options["implementation"])
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=implementation))
  with strategy.scope():
    variables = [tf.Variable(v, name=f"mlp_{i}") for i, v in enumerate(_mlp.initial_values())]
  parts = shards(strategy.num_replicas_in_sync)
  batch = strategy.experimental_distribute_values_from_function(
      lambda ctx: tuple(tf.constant(a) for a in parts[ctx.replica_id_in_sync_group]))

  def apply(s, grads):
    reduced = s.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM,
                                         [(g, v) for g, v in zip(grads, variables, strict=True)])
    for v, g in zip(variables, reduced, strict=True):
      s.extended.update(v, lambda var, gc: var.assign_sub(_mlp.LR * gc), args=(g,))

  def replica_fn(b):
    x, y = b
    with tf.GradientTape() as tape:
      loss = _mlp.loss_fn(tf, variables, x, y)
    grads = tape.gradient(loss, variables)
    tf.distribute.get_replica_context().merge_call(apply, args=(grads,))

  @tf.function
  def step(b):
    strategy.run(replica_fn, args=(b,))
    return variables[-1].read_value()

  first = task * strategy.num_replicas_in_sync // NUM_WORKERS
  host = reduce_inputs(first)
  values = [strategy.experimental_distribute_values_from_function(
      lambda ctx, a=a: tf.constant(a)) for a in host]
  del host

  def reduce_all():
    reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM,
                                                [(v, v) for v in values])
    return [c for m in reduced for c in strategy.experimental_local_results(m)]

  if not options["eager"]:
    reduce_all = tf.function(reduce_all)

  def check():
    return float(_mlp.loss_fn(tf, [v.read_value() for v in variables], *_mlp.make_batch()))

  local = strategy.extended.worker_devices
  described = {"replicas": strategy.num_replicas_in_sync, "replicas_per_worker": len(local),
               "devices": list(local), "implementation": options["implementation"],
               "all_reduce_call": "eager" if options["eager"] else "tf.function"}
  return step, (batch,), reduce_all, check, described


def _reply(message):
  sys.stdout.write(_REPLY + json.dumps(message) + "\n")
  sys.stdout.flush()


def _timed(fn, args, count):
  """Seconds for `count` calls of fn(*args), after one untimed call.

  The untimed call lines the workers up: each call is synchronous across workers (its
  collectives wait for every worker), so the timed calls start together.
  """
  out = fn(*args)
  _read(out)
  start = time.perf_counter()
  for _ in range(count):
    out = fn(*args)
  _read(out)
  return time.perf_counter() - start


def _read(out):
  """Waits for a result (a tensor or a list of them) by reading a few elements back."""
  last = out[-1] if isinstance(out, (list, tuple)) else out
  np.asarray(last[:1])


def worker_main(name, spec, task, cpus):
  """A worker process: builds `name`, answers commands on stdin until "quit" or EOF."""
  library, options = parse_contender(name)
  logging.set_verbosity(logging.ERROR)  # TensorFlow's info lines and retracing warnings.
  pylogging.getLogger("tensorflow").setLevel(pylogging.ERROR)
  started = time.perf_counter()
  build = build_diststrat if library == "diststrat" else build_tf_distribute
  step, args, reduce_all, check, described = build(spec, task, cpus, options)
  first = time.perf_counter()
  _read(step(*args))
  _read(reduce_all())
  described.update(start_s=first - started, first_calls_s=time.perf_counter() - first)
  _reply({"ready": described})
  for line in sys.stdin:
    command, count = line.split()
    count = int(count)
    if command == "quit":
      break
    if command == "warmup":  # 1 + count steps, then the loss after them (all agree)
      train_s = _timed(step, args, count)
      reduce_s = _timed(reduce_all, (), 2)
      _reply({"train_s": train_s, "steps": count, "reduce_s": reduce_s, "reduces": 2,
              "loss": check()})
    elif command == "train":
      _reply({"seconds": _timed(step, args, count), "count": count})
    elif command == "reduce":
      _reply({"seconds": _timed(reduce_all, (), count), "count": count})
    else:
      raise ValueError(f"unknown command {line!r}")


# --- the parent: the contenders' processes, interleaved blocks ------------------------


class _Contender:
  """The worker processes of one contender, up for the whole shape."""

  def __init__(self, name, cpus):
    from diststrat.cluster._local_cluster import free_ports  # pylint: disable=g-import-not-at-top
    self.name = name
    self.library = parse_contender(name)[0]
    self.cpus = cpus
    self.spec = {"worker": [f"127.0.0.1:{p}" for p in free_ports(NUM_WORKERS)]}
    self.processes = []
    self.described = None
    self.steps = self.reduces = None

  def start(self):
    for task in range(NUM_WORKERS):
      self.processes.append(subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), "--worker", self.name,
           "--task", str(task), "--cpus", str(self.cpus), "--spec", json.dumps(self.spec)],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
          # Level 3: grappler's ScopedAllocatorOptimizer logs an error line per function
          # whose collectives take arguments; Python errors still reach stderr.
          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")))
    answers = self._answers(START_TIMEOUT)
    self.described = answers[0]["ready"]
    self.described["start_s"] = max(a["ready"]["start_s"] for a in answers)

  def _send(self, command, count):
    for p in self.processes:
      p.stdin.write(f"{command} {count}\n")
      p.stdin.flush()

  def _answers(self, timeout):
    deadline = time.monotonic() + timeout
    answers = []
    for p in self.processes:
      while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, left))
        line = p.stdout.readline() if ready else ""
        if not line:
          raise RuntimeError(
              f"{self.name}: worker {self.processes.index(p)} gave no answer within "
              f"{timeout:g} s (exit code {p.poll()}; its error output is above)")
        if line.startswith(_REPLY):
          answers.append(json.loads(line[len(_REPLY):]))
          break
    return answers

  def ask(self, command, count, timeout=BLOCK_TIMEOUT):
    self._send(command, count)
    return self._answers(timeout)

  def stop(self):
    for p in self.processes:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    for p in self.processes:
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:  # pragma: no cover - the kernel did not kill it
        pass
      for stream in (p.stdin, p.stdout):
        try:
          stream.close()
        except OSError:
          pass


def run_shape(cpus, names, rounds, seconds):
  """All contenders on 2 workers x `cpus` devices, interleaved; returns their entries."""
  contenders = []
  try:
    for name in names:
      c = _Contender(name, cpus)
      contenders.append(c)
      c.start()
      print(f"  {name}: up in {c.described['start_s']:.1f} s, {c.described['replicas']} "
            f"replicas ({c.described['replicas_per_worker']} per worker)",
            file=sys.stderr, flush=True)
    for c in contenders:  # Warm-up: also sets each contender's block lengths.
      answers = c.ask("warmup", 10)
      a = answers[0]
      c.warmup_loss = [x["loss"] for x in answers]
      c.steps = max(5, int(seconds * a["steps"] / a["train_s"]))
      c.reduces = max(3, int(seconds * a["reduces"] / a["reduce_s"]))
      c.blocks = {"train": [], "reduce": []}
    for r in range(rounds):
      order = contenders if r % 2 == 0 else list(reversed(contenders))
      for kind in ("train", "reduce"):
        for c in order:
          count = c.steps if kind == "train" else c.reduces
          answers = c.ask(kind, count)
          elapsed = [a["seconds"] for a in answers]
          if kind == "train":  # The global batch, summed over the workers' shares.
            value = sum(count * _mlp.BATCH / NUM_WORKERS / s for s in elapsed)
          else:  # One tower's bytes, per second, in each worker (their mean).
            value = statistics.mean(count * REDUCE_MIB * 2**20 / s / 1e9 for s in elapsed)
          c.blocks[kind].append(value)
          unit = "examples/s" if kind == "train" else "GB/s"
          print(f"  x{cpus} round {r + 1}/{rounds} {kind:6s} {c.name:32s} {value:9.2f} {unit}",
                file=sys.stderr, flush=True)
        # The timed blocks of both halves alternate: A B C then C B A (train), etc.
  finally:
    for c in contenders:
      c.stop()
  # Ratios, block by block within each round, against tf.distribute's reference for the
  # measure. Steps: its first contender that reduces in a tf.function (an "eager"
  # contender runs the same step; the better of two equal contenders would be a lucky
  # draw, not a better peer). All-reduce: its best contender (highest median), as
  # eager and tf.function reduce differently there.
  theirs = [c for c in contenders if c.library == "tf.distribute"]
  step_peer = next((c for c in theirs if not parse_contender(c.name)[1]["eager"]), theirs[0])
  best = {"train": step_peer,
          "reduce": max(theirs, key=lambda c: _common.summarize(c.blocks["reduce"])["median"])}
  entries = []
  for c in contenders:
    entry = {"label": c.name, "library": c.library, "devices_per_worker": cpus,
             "workers": NUM_WORKERS, "ran": c.described, "warmup_loss": c.warmup_loss,
             "steps_per_block": c.steps, "reduces_per_block": c.reduces}
    for kind, key in (("train", "throughput"), ("reduce", "gb_per_s")):
      entry[key] = _common.summarize(c.blocks[kind])
      entry[key + "_ratio"] = _common.summarize(
          [a / b for a, b in zip(c.blocks[kind], best[kind].blocks[kind], strict=False)])
      entry[key + "_ratio_against"] = best[kind].name
    entries.append(entry)
  return entries


def print_shape(cpus, entries):
  first = entries[0]
  print(f"\n### 2 workers x {cpus} logical CPU(s): MLP step throughput and 64 MiB "
        "all-reduce (median, min-max over blocks)\n")
  print(f"Ratios are per round, against "
        f"{first['throughput_ratio_against']} for steps, {first['gb_per_s_ratio_against']} "
        "for the all-reduce.\n")
  print("| contender | replicas (per worker) | examples/s | vs tf.distribute | "
        "all-reduce GB/s | vs tf.distribute |")
  print("|---|---|---|---|---|---|")
  for e in entries:
    ran, text = e["ran"], _common.format_summary
    print(f"| {e['label']} | {ran['replicas']} ({ran['replicas_per_worker']}) | "
          f"{text(e['throughput'])} | {text(e['throughput_ratio'], '.2f', 'x')} | "
          f"{text(e['gb_per_s'], '.2f')} | {text(e['gb_per_s_ratio'], '.2f', 'x')} |")
  print("\nWhat each contender ran (worker 0's towers; worker 1 has the same on task:1):\n")
  for e in entries:
    ran = e["ran"]
    how = ran.get("cross_worker_ops") or f"CommunicationOptions({ran['implementation']})"
    print(f"- {e['label']}: {how}, {ran['replicas']} replicas, towers "
          f"{', '.join(ran['devices'])}; all-reduce called in {ran['all_reduce_call']}; "
          f"{e['steps_per_block']} steps and {e['reduces_per_block']} all-reduces per block")
  losses = {e["label"]: e["warmup_loss"] for e in entries}
  print("\nLoss after the 11 warm-up steps, per worker (the same algorithm everywhere): " +
        "; ".join(f"{k} {', '.join(f'{x:.5f}' for x in v)}" for k, v in losses.items()))
  sys.stdout.flush()


def main(argv):
  del argv  # Flags only.
  args = FLAGS
  if args.worker:
    return worker_main(args.worker, json.loads(args.spec), args.task, args.cpus)
  rounds = args.rounds or (1 if args.quick else 5)
  seconds = args.seconds or (1.5 if args.quick else 4.0)
  names = args.contenders or DEFAULT_CONTENDERS
  if not any(parse_contender(n)[0] == "tf.distribute" for n in names):
    raise ValueError(f"--contenders must include a tf.distribute one. Received: {names}")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report = {"tensorflow": tf.__version__, "command": " ".join(sys.argv), "rounds": rounds,
            "seconds_per_block": seconds, "cpus": os.cpu_count(),
            "load_before": os.getloadavg(), "shapes": []}
  started = time.perf_counter()
  for cpus in [int(c) for c in args.devices_per_worker]:
    entries = run_shape(cpus, names, rounds, seconds)
    report["shapes"].append({"devices_per_worker": cpus, "entries": entries})
    print_shape(cpus, entries)
  report["wall_seconds"] = time.perf_counter() - started
  report["load_after"] = os.getloadavg()
  _common.write_report(report, args.out, suffix=f"wall time {report['wall_seconds']:.0f} s; ")


if __name__ == "__main__":
  app.run(main)
