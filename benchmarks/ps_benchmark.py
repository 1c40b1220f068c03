"""diststrat's ParameterServerStrategy on a cluster against tf.distribute's, in one run.

Training-step throughput of an MLP 784-1024-1024-10 (batch 256 per step, plain SGD, the
whole step in one tf.function) on a cluster of 1 parameter server and 2 workers, every
process on this machine, talking gRPC over loopback:

  diststrat cached     `diststrat.cluster.LocalCluster(num_ps=1, num_workers=2)`: each
                       worker process runs its own training loop
                       (`strategy.run_step(step)`) on variables shared through the PS
                       (asynchronous training), with read caching (`cache_reads=True`,
                       the default in cluster mode).
  diststrat uncached   the same with `cache_reads=False`: every use of a variable in a
                       tower reads it from the PS.
  tf.distribute        `tf.distribute.experimental.ParameterServerStrategy` with a
                       `ClusterCoordinator`: a coordinator process schedules the steps on
                       the two worker servers (asynchronous training too), with a
                       per-worker dataset repeating the same batch.

All do the same work per worker step: read the variables from the PS, compute the
gradient of one batch of 256 on a worker, send it to the PS and apply
`var -= lr * grad` there. The figure is examples/s summed over both workers, measured
while both are busy, and the bytes the PS process sent and received per worker step (its
TCP sockets' counters, from `ss`, around the timed window). Blocks of the contenders
alternate (A B C, C B A, ...) in one run, all processes children of this one: the machine
drifts up to 2x between runs, so only same-run ratios mean anything. tf.distribute is
only ever the peer here; diststrat never uses it.

`--towers=2` splits each diststrat worker's batch over 2 towers (2 logical CPUs per
worker process), and `--eager` runs diststrat's step without tf.function: the cases where
a variable is used more than once per worker step, so that caching saves reads. The
tf.distribute peer runs as in the default configuration.

Usage:
  python benchmarks/ps_benchmark.py --out benchmarks/results/ps.json
  python benchmarks/ps_benchmark.py --quick        # a short smoke run
  python benchmarks/ps_benchmark.py --towers=2 --out benchmarks/results/ps_2towers.json
"""

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top
# The shared benchmark MLP; the directory is put first also for LocalCluster's children,
# which load this script by path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import _mlp  # pylint: disable=g-import-not-at-top,wrong-import-position

START_TIMEOUT = 120.0
BLOCK_TIMEOUT = 240.0


# --- the model, shared by both contenders --------------------------------------------


def ps_bytes(pid):
  """(bytes sent, bytes received) so far by the established TCP sockets of process `pid`.

  From `ss -tinp` (tcp_info's bytes_sent and bytes_received); None if `ss` is missing.
  TensorFlow's gRPC runtime pulls tensors: a worker fetches the values it reads over its
  connection to the PS, and the PS fetches the gradients over its own connections to the
  workers; both are sockets of the PS process.
  """
  try:
    text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                          text=True, timeout=10, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  sent = received = 0
  for entry in re.split(r"\n(?=\S)", text):  # One socket: a line, then indented info.
    if f"pid={pid}," in entry:
      sent += sum(int(n) for n in re.findall(r"bytes_sent:(\d+)", entry))
      received += sum(int(n) for n in re.findall(r"bytes_received:(\d+)", entry))
  return sent, received


def _bytes_per_step(before, after, steps):
  if before is None or after is None or not steps:
    return None
  return {"sent": (after[0] - before[0]) / steps, "received": (after[1] - before[1]) / steps}


def _wait_for_files(paths, timeout):
  deadline = time.monotonic() + timeout
  while not all(os.path.exists(p) for p in paths):
    if time.monotonic() > deadline:
      raise TimeoutError(f"barrier: {paths} did not all appear within {timeout} s")
    time.sleep(0.005)


# --- diststrat: one training loop per worker process ---------------------------------


def diststrat_worker(strategy, seconds, warmup, sync_dir, block, cache_reads, eager,
                     ps_pid):
  """Runs in each worker process of the LocalCluster (pickled by run_on_workers)."""
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  strategy.cache_reads = cache_reads
  with strategy.scope():
    variables = [tf.Variable(v, name=f"mlp_{i}") for i, v in enumerate(_mlp.initial_values())]
    opt = ds.optimizers.GradientDescent(_mlp.LR)
  devices = strategy.worker_devices
  per_tower = _mlp.BATCH // len(devices)  # loss_fn divides by BATCH: tower gradients add up.
  batch = {}
  for i, device in enumerate(devices):
    with tf.device(device):
      batch[device] = [tf.constant(a[i * per_tower:(i + 1) * per_tower])
                       for a in _mlp.make_batch()]
  xs, ys = (ds.values.PerDevice({d: batch[d][k] for d in devices}) for k in (0, 1))

  def tower_fn(x, y):
    return opt.minimize(lambda: _mlp.loss_fn(tf, variables, x, y), var_list=variables)

  def step():
    strategy.call_for_each_tower(tower_fn, xs, ys)

  if not eager:
    step = tf.function(step)
  for _ in range(warmup):
    strategy.run_step(step)
  # Barrier: time only while both workers train.
  open(os.path.join(sync_dir, f"ready_{block}_{strategy.task_id}"), "w").close()
  _wait_for_files([os.path.join(sync_dir, f"ready_{block}_{i}") for i in range(2)], 120)
  io_before = ps_bytes(ps_pid)
  steps, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    strategy.run_step(step)
    steps += 1
  elapsed = time.perf_counter() - start
  io_after = ps_bytes(ps_pid)
  x, y = batch[devices[0]]
  return {"steps": steps, "seconds": elapsed, "io": (io_before, io_after),
          "loss": float(_mlp.loss_fn(tf, variables, x, y)) * len(devices)}


def diststrat_block(cluster, seconds, warmup, sync_dir, block, cache_reads, eager):
  results = cluster.run_on_workers(diststrat_worker, seconds=seconds, warmup=warmup,
                                   sync_dir=sync_dir, block=block, cache_reads=cache_reads,
                                   eager=eager, ps_pid=cluster.pid("ps", 0))
  throughput = sum(r["steps"] / r["seconds"] for r in results) * _mlp.BATCH
  # Bytes over worker 0's window, per step taken by both workers in that window.
  first = results[0]
  steps = sum(r["steps"] * min(1.0, first["seconds"] / r["seconds"]) for r in results)
  return {"throughput": throughput, "steps": [r["steps"] for r in results],
          "loss": max(r["loss"] for r in results),
          "ps_bytes_per_step": _bytes_per_step(*first["io"], steps)}


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


def coordinator(spec, ps_pid):
  """Answers "block SECONDS WARMUP" lines on stdin with one JSON line each."""
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
  strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
  coord = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
  with strategy.scope():
    variables = [tf.Variable(v) for v in _mlp.initial_values()]
  x_np, y_np = _mlp.make_batch()

  def dataset_fn():
    return tf.data.Dataset.from_tensors((x_np, y_np)).repeat()

  iterator = iter(coord.create_per_worker_dataset(dataset_fn))

  @tf.function
  def step(iterator):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        loss = _mlp.loss_fn(tf, variables, x, y)
      for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
        v.assign_sub(_mlp.LR * g)
      return loss
    x, y = next(iterator)
    return strategy.run(replica_fn, args=(x, y))

  print("ready", flush=True)
  for line in sys.stdin:
    _, seconds, warmup = line.split()
    for _ in range(int(warmup)):
      coord.schedule(step, args=(iterator,))
    coord.join()
    io_before = ps_bytes(ps_pid)
    in_flight, steps, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < float(seconds):
      in_flight.append(coord.schedule(step, args=(iterator,)))
      steps += 1
      if len(in_flight) > 4:  # Keep both workers fed, the queue short.
        in_flight.pop(0).fetch()
    coord.join()
    elapsed = time.perf_counter() - start
    io_after = ps_bytes(ps_pid)
    loss = float(in_flight[-1].fetch()) if in_flight else float("nan")
    print(json.dumps({"throughput": steps * _mlp.BATCH / elapsed, "steps": [steps],
                      "loss": loss,
                      "ps_bytes_per_step": _bytes_per_step(io_before, io_after, steps)}),
          flush=True)


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
      self.coordinator = self._spawn("--coordinator", f"--ps_pid={servers[0].pid}")
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


CONTENDERS = ("diststrat cached", "diststrat uncached", "tf.distribute")


def _ratios(blocks, numerator, denominator):
  return _common.summarize([a["throughput"] / b["throughput"]
                            for a, b in zip(blocks[numerator], blocks[denominator], strict=False)])


def _median_bytes(blocks, direction):
  values = [b["ps_bytes_per_step"][direction] for b in blocks
            if b.get("ps_bytes_per_step") is not None]
  return _common.summarize(values)["median"] if values else None


def run(rounds, seconds, warmup, towers, eager):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  blocks = {name: [] for name in CONTENDERS}
  started = time.perf_counter()
  strategy_kwargs = {}
  if towers > 1:  # Each worker process splits its CPU into `towers` logical devices.
    strategy_kwargs["worker_devices"] = [f"/cpu:{i}" for i in range(towers)]
  with tempfile.TemporaryDirectory() as sync_dir, \
      ds.cluster.LocalCluster(num_ps=1, num_workers=2, result_timeout=BLOCK_TIMEOUT,
                              cpus_per_worker=towers if towers > 1 else None,
                              strategy_kwargs=strategy_kwargs) as cluster:
    peer = _Peer()
    try:
      block = 0
      for r in range(rounds):
        for name in (CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]):
          if name == "tf.distribute":
            result = peer.block(seconds, warmup)
          else:
            result = diststrat_block(cluster, seconds, warmup, sync_dir, block,
                                     cache_reads=name == "diststrat cached", eager=eager)
            block += 1
          blocks[name].append(result)
          io = result.get("ps_bytes_per_step")
          io = (f", PS sent/received {io['sent'] / 1e6:.2f}/{io['received'] / 1e6:.2f} "
                "MB per step" if io else "")
          print(f"  round {r + 1}/{rounds} {name:18s} {result['throughput']:7.0f} "
                f"examples/s (steps {result['steps']}, loss {result['loss']:.3f}{io})",
                file=sys.stderr, flush=True)
    finally:
      peer.stop()
  towers_text = f"{towers} towers per worker" if towers > 1 else "1 tower per worker"
  return {
      "model": "MLP 784-1024-1024-10, batch 256 per worker step, SGD, 1 PS + 2 workers",
      "diststrat": f"{towers_text}, step {'eager' if eager else 'in one tf.function'}",
      "rounds": rounds, "seconds_per_block": seconds, "warmup_steps": warmup,
      "towers": towers, "eager": eager,
      "throughput": {name: _common.summarize([b["throughput"] for b in blocks[name]])
                     for name in CONTENDERS},
      "vs_tf_distribute": {name: _ratios(blocks, name, "tf.distribute")
                           for name in CONTENDERS},
      "cached_vs_uncached": _ratios(blocks, "diststrat cached", "diststrat uncached"),
      "ps_mb_per_step": {name: {d: (None if _median_bytes(blocks[name], d) is None
                                    else _median_bytes(blocks[name], d) / 1e6)
                                for d in ("sent", "received")} for name in CONTENDERS},
      "blocks": blocks,
      "wall_seconds": time.perf_counter() - started,
      "tensorflow": tf.__version__,
      "cpus": os.cpu_count(),
  }


def print_report(report):
  print(f"\n### {report['model']}; diststrat: {report['diststrat']}. Examples/s, median "
        f"(min-max) over {report['rounds']} interleaved blocks of "
        f"{report['seconds_per_block']:g} s\n")
  print("| contender | examples/s | vs tf.distribute | PS MB sent / received per step |")
  print("|---|---|---|---|")
  for name in CONTENDERS:
    t, mb = report["throughput"][name], report["ps_mb_per_step"][name]
    io = "n/a" if mb["sent"] is None else f"{mb['sent']:.2f} / {mb['received']:.2f}"
    print(f"| {name} | {_common.format_summary(t)} | "
          f"{_common.format_summary(report['vs_tf_distribute'][name], '.2f', 'x')} | {io} |")
  ratio = report["cached_vs_uncached"]
  print(f"\ndiststrat cached / uncached: {_common.format_summary(ratio, '.2f', 'x')}; per round: "
        + ", ".join(f"{v:.2f}" for v in ratio["values"]))


flags.DEFINE_string("out", "benchmarks/results/ps.json", "Where to write the JSON report.")
flags.DEFINE_bool("quick", False, "A short smoke run.")
flags.DEFINE_integer("rounds", None, "Rounds of blocks (default 4; 1 with --quick).")
flags.DEFINE_float("seconds", None, "Timed seconds per block (default 8; 3 with --quick).")
flags.DEFINE_integer("towers", 1, "Towers per diststrat worker process (logical CPUs).")
flags.DEFINE_bool("eager", False, "Run diststrat's step eagerly, not in a tf.function.")
flags.DEFINE_integer("ps_pid", None, "Internal: the tf.distribute PS process id.")
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
    return coordinator(json.loads(args.spec), args.ps_pid)
  rounds = args.rounds or (1 if args.quick else 4)
  seconds = args.seconds or (3.0 if args.quick else 8.0)
  report = run(rounds, seconds, warmup=3 if args.quick else 5, towers=args.towers,
               eager=args.eager)
  print_report(report)
  _common.write_report(report, args.out)


if __name__ == "__main__":
  app.run(main)
