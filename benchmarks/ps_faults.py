"""How each path a worker takes reports a PS fault: the figures of docs/parameter_server.md's
fault table.

One `LocalCluster(1 PS, 1 worker)`, `step_timeout=--step_timeout`. For each fault (the PS
killed, the PS frozen with SIGSTOP) and each path (a `run_step` step, an eager
`numpy()`, `read_var`, an eager `assign_add`, `strategy.update`, a
`CheckpointManager.save`), `--repeats` times: the worker uses the path once (so that it is
traced), asks for the fault, uses the path again and records what it raised and after how
long; then the PS is resumed or restarted and the worker reconnects. Every call on a
faulty PS is waited for at most step_timeout + 30 s ("blocked" beyond).

Then `--kills` times, the PS is killed at a seeded random moment while the worker saves
checkpoints back to back: counted are the saves that raised `ClusterError` naming the
task, those that raised anything else, and those that raised but were registered as the
latest checkpoint anyway.

Usage:
  python benchmarks/ps_faults.py                      # about 2-3 minutes on 2 cores
  python benchmarks/ps_faults.py --repeats=1 --kills=5
"""

import json
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
# The fault helpers of tests/test_ps_faults.py (tests/fault_control.py says why they live
# there); the worker process, which gets this sys.path, imports them too.
sys.path.insert(0, os.path.join(_common.REPO, "tests"))
from diststrat.cluster import LocalCluster  # pylint: disable=g-import-not-at-top
import fault_control  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_integer("repeats", 3, "Faults per (fault, path).", lower_bound=1)
flags.DEFINE_integer("kills", 20, "PS kills during checkpoint saves.", lower_bound=0)
flags.DEFINE_float("step_timeout", 5.0, "The strategy's step_timeout, seconds.")
flags.DEFINE_integer("seed", 18, "Seed of the kill delays.")
flags.DEFINE_string("out", "benchmarks/results/ps_faults.json", "JSON report.")
FLAGS = flags.FLAGS

PATHS = ("run_step", "numpy", "read_var", "assign_add", "update", "CheckpointManager.save")
EXTRA_WAIT = 30.0


def bounded(fn, timeout):
  """{"kind", "error", "task", "seconds"}: fn() in a thread, waited for at most `timeout`
  (fault_control.bounded); "error" is the type's name of what it raised."""
  outcome = fault_control.describe(*fault_control.bounded(fn, timeout))
  return {"kind": outcome["kind"], "error": outcome["type"], "task": outcome["task"],
          "seconds": outcome["elapsed"]}


def worker(strategy, sync_dir, ckpt_dir, repeats, kills, seed):
  """Runs in the worker process: every (fault, path) `repeats` times, then the kills."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  control = fault_control.Control(sync_dir, timeout=120.0)
  with strategy.scope():
    v = tf.Variable(tf.zeros([256, 256]), name="v")
    weights = [tf.Variable(tf.random.stateless_normal([256, 256], seed=[i, 0]),
                           name=f"w{i}") for i in range(16)]

  @tf.function
  def step():
    v.assign_add(tf.ones([256, 256]))
    return strategy.call_for_each_tower(lambda: tf.reduce_sum(v))

  manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v, weights=weights),
                                       os.path.join(ckpt_dir, "paths"), max_to_keep=5)
  paths = {
      "run_step": lambda: strategy.run_step(step),
      "numpy": v.numpy,
      "read_var": lambda: strategy.read_var(v).numpy(),
      "assign_add": lambda: v.assign_add(tf.ones([256, 256])),
      "update": lambda: strategy.update(v, lambda c: c.assign_add(tf.ones([256, 256]))),
      "CheckpointManager.save": manager.save,
  }
  manager.save()  # A checkpoint to restore after each restart.
  limit = strategy.step_timeout + EXTRA_WAIT
  records = []
  for fault in ("kill", "freeze"):
    for name in PATHS:
      for _ in range(repeats):
        paths[name]()
        control(fault)
        records.append({"fault": fault, "path": name, **bounded(paths[name], limit)})
        control("restart" if fault == "kill" else "thaw")
        fault_control.reconnect(strategy)
        if fault == "kill":
          manager.restore_or_initialize()
  # Kills during back-to-back saves.
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(weights=weights),
                                       os.path.join(ckpt_dir, "kills"), max_to_keep=100)
  start = time.monotonic()
  for _ in range(3):
    manager.save()
  save_seconds = (time.monotonic() - start) / 3
  rng = random.Random(seed)
  saves = []
  for _ in range(kills):
    delay = rng.uniform(0.0, 2.0 * save_seconds)
    control(f"kill_after {delay:.4f}")
    deadline = time.monotonic() + 60
    record = {"delay": delay, "saved_before_failure": 0, "kind": "none failed"}
    while time.monotonic() < deadline:
      before = manager.latest_checkpoint
      outcome = bounded(manager.save, limit)
      if outcome["kind"] == "returned":
        record["saved_before_failure"] += 1
        continue
      record.update(outcome, registered=manager.latest_checkpoint != before or
                    tf.train.latest_checkpoint(os.path.join(ckpt_dir, "kills")) != before)
      break
    saves.append(record)
    control("restart")
    fault_control.reconnect(strategy)
    manager.restore_or_initialize()
  return {"records": records, "saves": saves, "save_seconds": save_seconds}


def main(argv):
  del argv
  sync_dir, ckpt_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
  started = time.time()
  with LocalCluster(1, 1, strategy_kwargs={"step_timeout": FLAGS.step_timeout},
                    start_timeout=120, result_timeout=7200) as cluster:
    join = fault_control.serve_faults(cluster, sync_dir)
    try:
      [result] = cluster.run_on_workers(worker, sync_dir=sync_dir, ckpt_dir=ckpt_dir,
                                        repeats=FLAGS.repeats, kills=FLAGS.kills,
                                        seed=FLAGS.seed)
    finally:
      join()
  print(f"step_timeout {FLAGS.step_timeout:g} s; {FLAGS.repeats} fault(s) per path; "
        f"every call waited for at most step_timeout + {EXTRA_WAIT:g} s")
  print(f"{'fault':8} {'path':24} {'outcomes':40} seconds to raise: median (min-max)")
  for fault in ("kill", "freeze"):
    for name in PATHS:
      rows = [r for r in result["records"] if r["fault"] == fault and r["path"] == name]
      kinds = {}
      for r in rows:
        key = (f"{r['error']} naming {r['task']}" if r["kind"] == "raised" else r["kind"])
        kinds[key] = kinds.get(key, 0) + 1
      times = [r["seconds"] for r in rows if r["kind"] == "raised"]
      summary = ", ".join(f"{n}x {k}" for k, n in kinds.items())
      timing = _common.format_summary(_common.summarize(times), ".2f") if times else "-"
      print(f"{fault:8} {name:24} {summary:40} {timing}")
  saves = result["saves"]
  if saves:
    cluster_errors = sum(1 for s in saves if s["kind"] == "raised" and
                         s["error"] == "ClusterError" and s["task"] is not None)
    other = [s for s in saves if not (s["kind"] == "raised" and s["error"] == "ClusterError")]
    registered = sum(1 for s in saves if s.get("registered"))
    print(f"PS killed during checkpoint saves (one save takes {result['save_seconds']:.3f} s): "
          f"{len(saves)} kills; the failed save raised ClusterError naming the task "
          f"{cluster_errors}/{len(saves)}; anything else {len(other)} "
          f"({[(s['kind'], s.get('error')) for s in other]}); a failed save registered as "
          f"the latest {registered}/{len(saves)}; saves that succeeded after the kill "
          f"request before one failed: {sum(s['saved_before_failure'] for s in saves)}")
  report = {"flags": {"repeats": FLAGS.repeats, "kills": FLAGS.kills,
                      "step_timeout": FLAGS.step_timeout, "seed": FLAGS.seed},
            "seconds": time.time() - started, **result}
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {FLAGS.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
  app.run(main)
