"""`diststrat-run`: start a training program as a cluster job of processes.

    diststrat-run --workers N [--ps P] [--cpus-per-worker M] [--max-restarts R] \\
        [--log-dir DIR] [--job-timeout S] script.py [script args...]

starts P parameter-server tasks (`diststrat.cluster.serve()`, no user code) and N
worker processes of `script.py` on this machine, each with `TF_CONFIG` set for its task,
so `ds.MultiWorkerMirroredStrategy()` or `ds.ParameterServerStrategy()` with no cluster
arguments joins the job. It streams every task's output prefixed with its name
(`[worker:0] ...`), and ends when every worker has exited: with status 0 if all
succeeded, else with the first failing task's status (128 + N for a signal N), after
stopping the others, with a summary naming the task that failed first and the last
lines it wrote. `--log-dir DIR` also keeps one file per task and attempt; `--job-timeout
S` stops a hung job (exit status 124). `--max-restarts R` starts the whole job again, up
to R times, after a failure: a program that checkpoints
(`keras.callbacks.BackupAndRestore`, `tf.train.CheckpointManager`) resumes. See
docs/launch.md.

This module is the command line only: it checks the arguments and hands a `JobPlan` to
`cluster/_job.py`, which runs the job through the process layer (`cluster/_processes.py`,
shared with `LocalCluster`). Nothing outlives the launcher: each task runs in its own
process group, which the launcher kills when the job ends, on Ctrl-C (SIGINT), on
SIGTERM and on SIGHUP (unless ignored when it starts, as SIGHUP under nohup); and each
task asks Linux to kill it when the launcher dies, so a launcher killed with SIGKILL
takes its tasks with it.

Security (docs/security.md): TensorFlow's servers listen on every interface and run any
graph any client sends. On one machine the job's processes run in a private network
namespace by default, where Linux allows it without privileges (`--no-isolate` turns
it off); a job across machines (`--hosts`) cannot be isolated, and says so.

Also `python -m diststrat.run ...`.
"""

import argparse
import os
import signal
import sys

from diststrat.cluster import _job
from diststrat.cluster._job import LaunchError
from diststrat.cluster._job import build_cluster_spec
from diststrat.cluster._job import tasks_of_host
from diststrat.cluster._job import tf_config

__all__ = ["build_cluster_spec", "tasks_of_host", "tf_config", "run", "main"]

DEFAULT_START_TIMEOUT = 120.0
DEFAULT_PORT_BASE = 8888
RESTART_COUNT_ENV = _job.RESTART_COUNT_ENV
_USAGE_ERROR = _job.USAGE_ERROR
_STOP_SIGNALS = _job.STOP_SIGNALS


# --- the command line ---


def _positive(least):
  def parse(text):
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < least:
      raise argparse.ArgumentTypeError(
          f"must be an integer >= {least}. Received: {text!r}")
    return value
  return parse


def _seconds(text):
  try:
    value = float(text)
  except ValueError:
    value = None
  if value is None or not value > 0:
    raise argparse.ArgumentTypeError(f"must be a positive number of seconds. Received: "
                                     f"{text!r}")
  return value


def _parser():
  parser = argparse.ArgumentParser(
      prog="diststrat-run",
      usage="%(prog)s --workers N [options] script.py [script arguments]",
      description="Start a TensorFlow program as a cluster job: P parameter servers and "
      "N worker processes, each with TF_CONFIG set for its task. See docs/launch.md.",
      epilog="Example: diststrat-run --workers 2 train.py --epochs=3")
  # Required, checked by `run`: a --workers after the script is the script's, and the
  # error says so.
  parser.add_argument("--workers", type=_positive(1), default=None,
                      help="worker processes of the script (per host with --hosts); "
                      "required")
  parser.add_argument("--ps", type=_positive(0), default=0,
                      help="parameter-server tasks (per host with --hosts); default 0")
  parser.add_argument("--cpus-per-worker", type=_positive(1), default=None,
                      help="split each worker's CPU into this many logical devices "
                      "(its towers, without GPUs)")
  parser.add_argument("--max-restarts", type=_positive(0), default=0,
                      help="start the whole job again after a failure, up to this many "
                      "times; default 0")
  parser.add_argument("--no-isolate", action="store_true",
                      help="do not run the job in a private network namespace (needed "
                      "when the script must reach the network)")
  parser.add_argument("--hosts", default=None,
                      help="comma-separated hosts of a job across machines; run the same "
                      "command on each, with its --task-index")
  parser.add_argument("--task-index", "--node-rank", dest="task_index", type=_positive(0),
                      default=None, help="this host's index in --hosts")
  parser.add_argument("--port-base", type=_positive(1), default=None,
                      help="first port of this host's tasks (default: free ports on one "
                      f"host, {DEFAULT_PORT_BASE} with --hosts)")
  parser.add_argument("--start-timeout", type=_seconds, default=DEFAULT_START_TIMEOUT,
                      help="seconds the parameter servers (started together) may take "
                      "to start; default 120")
  parser.add_argument("--log-dir", default=None,
                      help="also write each task's output to a file of its own: "
                      "LOG_DIR/attempt_0/worker_0.log, ... (one directory per attempt)")
  parser.add_argument("--job-timeout", type=_seconds, default=None,
                      help="stop the job (every task, restarts included) after this many "
                      "seconds; exit status 124")
  parser.add_argument("--heartbeat-timeout", type=_seconds, default=None,
                      help="a worker that prints nothing for this many seconds is taken to "
                      "be hung: the attempt fails (exit status 124)")
  parser.add_argument("script", nargs="?", help="the Python program each worker runs")
  parser.add_argument("script_args", nargs=argparse.REMAINDER,
                      help="arguments of the script")
  return parser


def _script_arguments(argv, args):
  """The arguments after the script, all of them, as `python script.py ...` passes them.

  argparse gives them as the end of `argv`, but drops a "--" that comes right after the
  script (`script.py -- a`: the script would see ["a"], not ["--", "a"])."""
  tail = list(args.script_args)
  start = len(argv) - len(tail)
  if (argv[start:] == tail and start >= 2 and argv[start - 1] == "--"
      and argv[start - 2] == args.script):
    return ["--", *tail]
  return tail


def _given_to_the_script(args, option):
  """A hint when `option` was given after the script (so to the script), else ""."""
  given = [a for a in args.script_args if a == option or a.startswith(option + "=")]
  if args.script is None or not given:
    return ""
  return (f". {given[0]} comes after the script ({args.script!r}), so it is one of the "
          "script's arguments: put the launcher's options before the script, as in "
          "diststrat-run --workers 2 train.py --epochs=3")


class _Options:
  """The checked command line."""

  def __init__(self, args):
    self.num_ps, self.num_workers = args.ps, args.workers
    self.cpus = args.cpus_per_worker
    self.max_restarts = args.max_restarts
    self.script, self.script_args = args.script, list(args.script_args)
    self.start_timeout = args.start_timeout
    if not os.path.isfile(self.script):
      raise LaunchError(f"The script {self.script!r} does not exist (or is not a file); "
                        "no task was started. Give the path of a Python program, relative "
                        f"to {os.getcwd()!r} or absolute.", _USAGE_ERROR)
    self.port_base = args.port_base
    if args.hosts is None:
      if args.task_index not in (None, 0):
        raise LaunchError("--task-index applies to a job across machines: give --hosts "
                          f"too. Received: --task-index {args.task_index}", _USAGE_ERROR)
      self.hosts, self.host_index = ["127.0.0.1"], 0
      self.multi_host = False
    else:
      self.hosts = [h.strip() for h in args.hosts.split(",")]
      if args.task_index is None or args.task_index >= len(self.hosts):
        given = ("no --task-index" if args.task_index is None else
                 f"--task-index {args.task_index}")
        raise LaunchError(
            f"--hosts names {len(self.hosts)} host(s), so --task-index (this host's place "
            f"in it) must be from 0 to {len(self.hosts) - 1}; run the same command on "
            f"each host with its own. Received: {given}", _USAGE_ERROR)
      self.host_index = args.task_index
      self.multi_host = True
      if self.port_base is None:
        self.port_base = DEFAULT_PORT_BASE
    self.isolate = not args.no_isolate and not self.multi_host
    if self.port_base is not None:
      try:
        build_cluster_spec(self.hosts, self.num_ps, self.num_workers, self.port_base)
      except ValueError as e:
        raise LaunchError(str(e), _USAGE_ERROR) from e
    if self.multi_host:
      _job.check_hosts(self.hosts)
    self.log_dir = args.log_dir
    if self.log_dir == "":
      raise LaunchError("--log-dir must name a directory (made if missing). Received: "
                        "--log-dir '', an empty path (an unset variable?).", _USAGE_ERROR)
    if self.log_dir is not None and os.path.exists(self.log_dir) and not os.path.isdir(
        self.log_dir):
      raise LaunchError(f"--log-dir must name a directory (made if missing). Received: "
                        f"--log-dir {self.log_dir!r}, a file.", _USAGE_ERROR)
    self.job_timeout, self.heartbeat_timeout = args.job_timeout, args.heartbeat_timeout

  def plan(self) -> _job.JobPlan:
    return _job.JobPlan(
        num_ps=self.num_ps, num_workers=self.num_workers, script=self.script,
        script_args=self.script_args, cpus=self.cpus, max_restarts=self.max_restarts,
        hosts=self.hosts, host_index=self.host_index, port_base=self.port_base,
        isolate=self.isolate, start_timeout=self.start_timeout,
        across_hosts=self.multi_host, log_dir=self.log_dir, job_timeout=self.job_timeout,
        heartbeat_timeout=self.heartbeat_timeout)


def run(argv: list | None = None) -> int:
  """Runs the launcher with command-line arguments `argv`; returns its exit status."""
  parser = _parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  if args.workers is None:
    parser.error("the following arguments are required: --workers" +
                 _given_to_the_script(args, "--workers"))
  if args.script is None:  # argparse would also call the script's arguments required.
    parser.error("the script to run is missing: diststrat-run [options] script.py "
                 "[script arguments]")
  args.script_args = _script_arguments(argv, args)
  stopping: list[int] = []

  def interrupt(signum, frame):
    del frame
    if not stopping:
      stopping.append(signum)
      raise _job.Interrupted(signum)

  # A stop signal that the launcher inherits ignored stays ignored, as Python leaves it:
  # SIGHUP under `nohup`, SIGINT in a shell script's background job (`... &`). The
  # handlers are in place before the checks, which may wait (`--hosts` names to resolve).
  previous = {sig: signal.signal(sig, interrupt) for sig in _STOP_SIGNALS
              if signal.getsignal(sig) != signal.SIG_IGN}
  try:
    try:
      options = _Options(args)
    except LaunchError as e:
      _job.say(str(e))
      return e.status
    return _job.run_job(options.plan())
  except _job.Interrupted as e:
    _job.say(f"stopped by {signal.Signals(e.signum).name}; every task was stopped.")
    return 128 + e.signum
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def main() -> None:
  """The `diststrat-run` console script."""
  sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
  main()
