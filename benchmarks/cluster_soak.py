"""Soak test of cluster start-up: N starts of LocalCluster(1 PS, 3 workers).

Each start launches a PS and three worker processes at once (their first contacts with
the PS coincide), creates a shared variable in every worker and runs a few steps on it.
A start fails if any worker raises or the PS dies; the PS's exit status is recorded (a
SIGSEGV is -11). The goal is 0 failures in 200 starts (docs/parameter_server.md).

Not part of the test suite: 200 starts take about an hour on a 2-core machine.

Usage:
  python benchmarks/cluster_soak.py --starts=200
  python benchmarks/cluster_soak.py --starts=20 --workers=2   # a short run
"""

import collections
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diststrat.cluster import LocalCluster  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer("starts", 200, "Cluster starts.", lower_bound=1)
flags.DEFINE_integer("workers", 3, "Worker processes per start.", lower_bound=1)
flags.DEFINE_integer("steps", 5, "assign_add steps per worker after creating the variable.")
flags.DEFINE_string("out", "benchmarks/results/cluster_soak.json", "JSON report.")
FLAGS = flags.FLAGS


def first_contact(strategy, steps):
  """Runs in each worker process: first variable creation, then a few steps."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    counter = tf.Variable(0.0, name="counter")
  for _ in range(steps):
    counter.assign_add(1.0)
  return float(counter.numpy())


def one_start(workers, steps):
  """(outcome, PS exit status or None, seconds): outcome is "ok" or the error's first line."""
  start = time.monotonic()
  with LocalCluster(num_ps=1, num_workers=workers, start_timeout=120, result_timeout=300,
                    strategy_kwargs={"step_timeout": 120}) as cluster:
    try:
      results = cluster.run_on_workers(first_contact, steps=steps)
      outcome = "ok" if max(results) == workers * steps else f"wrong counts {results}"
    except Exception as e:  # pylint: disable=broad-except
      outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    status = cluster.exit_status("ps", 0)
  return outcome, status, time.monotonic() - start


def main(argv):
  del argv
  report = {"starts": [], "workers": FLAGS.workers, "command": " ".join(sys.argv)}
  failures = collections.Counter()
  for i in range(FLAGS.starts):
    outcome, status, seconds = one_start(FLAGS.workers, FLAGS.steps)
    report["starts"].append({"outcome": outcome, "ps_exit_status": status,
                             "seconds": round(seconds, 2)})
    if outcome != "ok" or status is not None:
      failures[f"{outcome} (PS exit status {status})"] += 1
    print(f"start {i + 1}/{FLAGS.starts}: {outcome}, PS exit status {status}, "
          f"{seconds:.1f} s; failures so far {sum(failures.values())}", flush=True)
  total = sum(failures.values())
  print(f"\nfailures / starts: {total} / {FLAGS.starts}")
  for what, count in failures.most_common():
    print(f"  {count} x {what}")
  report["failures"] = total
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=2)


if __name__ == "__main__":
  app.run(main)
