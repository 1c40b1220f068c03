"""diststrat's ParameterServerStrategy on a cluster against tf.distribute's, in one run.

Training-step throughput of an MLP 784-1024-1024-10 (batch 256 per step, plain SGD, the
whole step in one tf.function) on a cluster of 1 parameter server and 2 workers, every
process on this machine, talking gRPC over loopback:

  diststrat       `diststrat.cluster.LocalCluster(num_ps=1, num_workers=2)`: each worker
                  process runs its own training loop (`strategy.run_step(step)`) on
                  variables shared through the PS: asynchronous training.
  tf.distribute   `tf.distribute.experimental.ParameterServerStrategy` with a
                  `ClusterCoordinator`: a coordinator process schedules the steps on the
                  two worker servers (asynchronous training too), with a per-worker
                  dataset repeating the same batch.

Both do the same work per step: read the variables from the PS, compute the gradient of
one batch of 256 on a worker, send it to the PS and apply `var -= lr * grad` there. The
figure is examples/s summed over both workers, measured while both are busy. Blocks of
the two contenders alternate (A B B A ...) in one run, all processes children of this
one: the machine drifts up to 2x between runs, so only the same-run ratio means
anything. tf.distribute is only ever the peer here; diststrat never uses it.

Usage:
  python benchmarks/ps_benchmark.py --out benchmarks/results/ps.json
  python benchmarks/ps_benchmark.py --quick        # a short smoke run
"""

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

BATCH = 256
LR = 0.01
SHAPES = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
START_TIMEOUT = 120.0
BLOCK_TIMEOUT = 240.0


# --- the model, shared by both contenders --------------------------------------------


def initial_values(seed=0):
  rng = np.random.default_rng(seed)
  values = []
  for shape in SHAPES:
    scale = np.sqrt(2.0 / shape[0]) if len(shape) > 1 else 0.0
    values.append((rng.standard_normal(shape) * scale).astype(np.float32))
  return values


def make_batch(seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((BATCH, 784)).astype(np.float32)
  y = rng.integers(0, 10, BATCH).astype(np.int32)
  return x, y


def loss_fn(variables, x, y):
  w1, b1, w2, b2, w3, b3 = variables
  h = tf.nn.relu(x @ w1 + b1)
  h = tf.nn.relu(h @ w2 + b2)
  logits = h @ w3 + b3
  return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)) / BATCH


def _wait_for_files(paths, timeout):
  deadline = time.monotonic() + timeout
  while not all(os.path.exists(p) for p in paths):
    if time.monotonic() > deadline:
      raise TimeoutError(f"barrier: {paths} did not all appear within {timeout} s")
    time.sleep(0.005)


# --- diststrat: one training loop per worker process ---------------------------------


def diststrat_worker(strategy, seconds, warmup, sync_dir, block):
  """Runs in each worker process of the LocalCluster (pickled by run_on_workers)."""
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    variables = [tf.Variable(v, name=f"mlp_{i}") for i, v in enumerate(initial_values())]
    opt = ds.optimizers.GradientDescent(LR)
  with tf.device(strategy.worker_devices[0]):
    x, y = (tf.constant(a) for a in make_batch())

  def tower_fn():
    return opt.minimize(lambda: loss_fn(variables, x, y), var_list=variables)

  @tf.function
  def step():
    strategy.call_for_each_tower(tower_fn)

  for _ in range(warmup):
    strategy.run_step(step)
  # Barrier: time only while both workers train.
  open(os.path.join(sync_dir, f"ready_{block}_{strategy.task_id}"), "w").close()
  _wait_for_files([os.path.join(sync_dir, f"ready_{block}_{i}") for i in range(2)], 120)
  steps, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    strategy.run_step(step)
    steps += 1
  return {"steps": steps, "seconds": time.perf_counter() - start,
          "loss": float(loss_fn(variables, x, y))}


def diststrat_block(cluster, seconds, warmup, sync_dir, block):
  results = cluster.run_on_workers(diststrat_worker, seconds=seconds, warmup=warmup,
                                   sync_dir=sync_dir, block=block)
  throughput = sum(r["steps"] / r["seconds"] for r in results) * BATCH
  return {"throughput": throughput, "steps": [r["steps"] for r in results],
          "loss": max(r["loss"] for r in results)}


# --- tf.distribute: servers, and a coordinator process --------------------------------


def serve(spec, job, task):
  """A tf.distribute.Server process for the peer's cluster."""
  server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task,
                                protocol="grpc", start=True)
  print("ready", flush=True)
  parent = os.getppid()
  while os.getppid() == parent:  # Exit with the benchmark.
    time.sleep(0.5)
  del server


def coordinator(spec):
  """Answers "block SECONDS WARMUP" lines on stdin with one JSON line each."""
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
  strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
  coord = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
  with strategy.scope():
    variables = [tf.Variable(v) for v in initial_values()]
  x_np, y_np = make_batch()

  def dataset_fn():
    return tf.data.Dataset.from_tensors((x_np, y_np)).repeat()

  iterator = iter(coord.create_per_worker_dataset(dataset_fn))

  @tf.function
  def step(iterator):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        loss = loss_fn(variables, x, y)
      for v, g in zip(variables, tape.gradient(loss, variables)):
        v.assign_sub(LR * g)
      return loss
    x, y = next(iterator)
    return strategy.run(replica_fn, args=(x, y))

  print("ready", flush=True)
  for line in sys.stdin:
    _, seconds, warmup = line.split()
    for _ in range(int(warmup)):
      coord.schedule(step, args=(iterator,))
    coord.join()
    in_flight, steps, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < float(seconds):
      in_flight.append(coord.schedule(step, args=(iterator,)))
      steps += 1
      if len(in_flight) > 4:  # Keep both workers fed, the queue short.
        in_flight.pop(0).fetch()
    coord.join()
    elapsed = time.perf_counter() - start
    loss = float(in_flight[-1].fetch()) if in_flight else float("nan")
    print(json.dumps({"throughput": steps * BATCH / elapsed, "steps": [steps],
                      "loss": loss}), flush=True)


class _Peer:
  """The tf.distribute contender: 1 PS and 2 worker servers, a coordinator (chief)."""

  def __init__(self):
    from diststrat.cluster._local_cluster import free_ports  # pylint: disable=g-import-not-at-top
    ps, w0, w1, chief = (f"127.0.0.1:{p}" for p in free_ports(4))
    self.spec = {"ps": [ps], "worker": [w0, w1], "chief": [chief]}
    self.processes = []
    try:
      servers = [self._spawn(f"--serve={job}:{task}")
                 for job, task in (("ps", 0), ("worker", 0), ("worker", 1))]
      for p in servers:
        self._read_line(p, START_TIMEOUT)
      self.coordinator = self._spawn("--coordinator")
      self._read_line(self.coordinator, START_TIMEOUT)
    except BaseException:
      self.stop()
      raise

  def _spawn(self, *args):
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args,
                          "--spec", json.dumps(self.spec)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.processes.append(p)
    return p

  @staticmethod
  def _read_line(p, timeout):
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line:
      raise RuntimeError(f"tf.distribute process {p.args[2:4]} gave no answer within "
                         f"{timeout:g} s (exit code {p.poll()})")
    return line

  def block(self, seconds, warmup):
    self.coordinator.stdin.write(f"block {seconds} {warmup}\n")
    self.coordinator.stdin.flush()
    return json.loads(self._read_line(self.coordinator, BLOCK_TIMEOUT))

  def stop(self):
    for p in self.processes:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
      p.wait(10)


# --- the run ------------------------------------------------------------------------------


def summarize(values):
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "values": values}


def run(rounds, seconds, warmup):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  blocks = {"diststrat": [], "tf.distribute": []}
  started = time.perf_counter()
  with tempfile.TemporaryDirectory() as sync_dir, \
      ds.cluster.LocalCluster(num_ps=1, num_workers=2, result_timeout=BLOCK_TIMEOUT) as cluster:
    peer = _Peer()
    try:
      for r in range(rounds):
        order = ["diststrat", "tf.distribute"] if r % 2 == 0 else ["tf.distribute", "diststrat"]
        for name in order:
          if name == "diststrat":
            result = diststrat_block(cluster, seconds, warmup, sync_dir, block=r)
          else:
            result = peer.block(seconds, warmup)
          blocks[name].append(result)
          print(f"  round {r + 1}/{rounds} {name:13s} {result['throughput']:7.0f} examples/s "
                f"(steps {result['steps']}, loss {result['loss']:.3f})", file=sys.stderr,
                flush=True)
    finally:
      peer.stop()
  ours = [b["throughput"] for b in blocks["diststrat"]]
  theirs = [b["throughput"] for b in blocks["tf.distribute"]]
  return {
      "model": "MLP 784-1024-1024-10, batch 256 per step, SGD, 1 PS + 2 workers",
      "rounds": rounds, "seconds_per_block": seconds, "warmup_steps": warmup,
      "throughput": {"diststrat": summarize(ours), "tf.distribute": summarize(theirs)},
      "ratio": summarize([a / b for a, b in zip(ours, theirs)]),
      "blocks": blocks,
      "wall_seconds": time.perf_counter() - started,
      "tensorflow": tf.__version__,
      "cpus": os.cpu_count(),
  }


def print_report(report):
  t, ratio = report["throughput"], report["ratio"]
  print(f"\n### {report['model']}: examples/s, median (min-max) over "
        f"{report['rounds']} interleaved blocks of {report['seconds_per_block']:g} s\n")
  print("| contender | examples/s | vs tf.distribute |")
  print("|---|---|---|")
  for name in ("diststrat", "tf.distribute"):
    s = t[name]
    vs = (f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
          if name == "diststrat" else "1.00x")
    print(f"| {name} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) | {vs} |")
  print(f"\nratio per round (diststrat / tf.distribute): "
        + ", ".join(f"{v:.2f}" for v in ratio["values"]))


flags.DEFINE_string("out", "benchmarks/results/ps.json", "Where to write the JSON report.")
flags.DEFINE_bool("quick", False, "A short smoke run.")
flags.DEFINE_integer("rounds", None, "Rounds of blocks (default 4; 1 with --quick).")
flags.DEFINE_float("seconds", None, "Timed seconds per block (default 8; 3 with --quick).")
flags.DEFINE_string("serve", None, "Internal: serve the tf.distribute task JOB:TASK.")
flags.DEFINE_bool("coordinator", False, "Internal: run the tf.distribute coordinator.")
flags.DEFINE_string("spec", None, "Internal: the cluster spec, as JSON.")
FLAGS = flags.FLAGS


def main(argv):
  del argv  # Flags only.
  args = FLAGS
  if args.serve:
    job, task = args.serve.split(":")
    return serve(json.loads(args.spec), job, int(task))
  if args.coordinator:
    return coordinator(json.loads(args.spec))
  rounds = args.rounds or (1 if args.quick else 4)
  seconds = args.seconds or (3.0 if args.quick else 8.0)
  report = run(rounds, seconds, warmup=3 if args.quick else 5)
  print_report(report)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  print(f"\nJSON written to {args.out}")


if __name__ == "__main__":
  app.run(main)
