"""The launcher, `diststrat-run` (docs/launch.md), and the cluster a process reads from its
environment (TF_CONFIG, Slurm).

Jobs are real: `python -m diststrat.run` starts real processes on loopback. Every process
a job starts carries a marker in its environment (`_MARKER`); after each job, no process
with the job's marker may be left (`_assert_none_left`, which reads /proc/*/environ).
The references are computed here with numpy.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from diststrat import run as launcher
from diststrat.cluster import cluster_from_environment
from diststrat.cluster import cluster_from_slurm
from diststrat._cluster_runtime import _environment

REPO = pathlib.Path(__file__).resolve().parents[1]
_MARKER = "DISTSTRAT_LAUNCHER_TEST_JOB"
JOB_TIMEOUT = 150
STEPS, BATCH, FEATURES, LR = 6, 8, 3, 0.1


# --- helpers ---------------------------------------------------------------------------


def _processes_with(marker):
  """Process ids whose environment holds `_MARKER=marker` (zombies have none)."""
  needle = f"{_MARKER}={marker}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          found.append(int(entry))
    except OSError:
      continue
  return found


def _assert_none_left(marker, wait=10.0):
  deadline = time.monotonic() + wait  # Killed processes take a moment to disappear.
  while _processes_with(marker) and time.monotonic() < deadline:
    time.sleep(0.1)
  left = _processes_with(marker)
  assert not left, f"processes of the job left behind: {left}"


def _env(marker):
  env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
  env[_MARKER] = marker
  for name in list(env):
    if name.startswith("SLURM_") or name == "TF_CONFIG":
      del env[name]
  return env


def _launch(args, cwd, timeout=JOB_TIMEOUT, text=True, env=None):
  """Runs `diststrat-run args` to its end; returns the CompletedProcess (text, or bytes
  with `text=False`). `env`: more environment variables of the launcher."""
  marker = uuid.uuid4().hex
  try:
    return subprocess.run([sys.executable, "-m", "diststrat.run", *args], cwd=cwd,
                          env={**_env(marker), **(env or {})}, capture_output=True,
                          text=text, timeout=timeout, check=False)
  finally:
    _assert_none_left(marker)


def _write(directory, name, text):
  path = pathlib.Path(directory) / name
  path.write_text(textwrap.dedent(text))
  return path


def _free_port_base(count):
  """A port p with p..p+count-1 all free on every interface right now."""
  for _ in range(200):
    with socket.socket() as probe:
      probe.bind(("", 0))
      base = probe.getsockname()[1]
    if base + count >= 65536:
      continue
    sockets = []
    try:
      for port in range(base, base + count):
        sock = socket.socket()
        sockets.append(sock)
        sock.bind(("", port))
      return base
    except OSError:
      continue
    finally:
      for sock in sockets:
        sock.close()
  raise AssertionError("no free range of ports found")


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(STEPS, BATCH, FEATURES)).astype(np.float32)
  y = rng.normal(size=(STEPS, BATCH, 1)).astype(np.float32)
  return x, y


def _reference_weights():
  """Gradient descent on the mean squared error of each global batch, in numpy."""
  x, y = _data()
  w = np.zeros((FEATURES, 1), np.float64)
  for i in range(STEPS):
    w -= LR * 2.0 / BATCH * x[i].T @ (x[i] @ w - y[i])
  return w


# A training program as users write it: MultiWorkerMirroredStrategy() with no arguments,
# a checkpoint per step written by the chief, resumed from the latest one. Worker 1 kills
# itself at step KILL_AT of the job's first attempt (KILL_AT < 0: never).
_TRAIN_MWMS = f"""
import os, signal, sys
import numpy as np
import diststrat as ds
import tensorflow as tf

out, kill_at = sys.argv[1], int(sys.argv[2])
strategy = ds.MultiWorkerMirroredStrategy(collective_timeout=60)
rng = np.random.default_rng(0)
x = rng.normal(size=({STEPS}, {BATCH}, {FEATURES})).astype(np.float32)
y = rng.normal(size=({STEPS}, {BATCH}, 1)).astype(np.float32)
with strategy.scope():
  w = tf.Variable(np.zeros(({FEATURES}, 1), np.float32), name="w")
  opt = ds.optimizers.GradientDescent({LR})
checkpoint = tf.train.Checkpoint(w=w)
directory = os.path.join(out, "ckpt" if strategy.is_chief else f"scratch{{strategy.task_id}}")
manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
latest = tf.train.latest_checkpoint(os.path.join(out, "ckpt"))
start = 0
if latest:
  checkpoint.restore(latest).assert_existing_objects_matched()
  start = int(latest.rsplit("-", 1)[1])
print(f"towers {{strategy.num_towers}} start {{start}} attempt "
      f"{{os.environ['DISTSTRAT_RESTART_COUNT']}}", flush=True)
batches = iter(strategy.distribute_dataset(
    lambda: tf.data.Dataset.from_tensor_slices((x[start:], y[start:]))))

@tf.function
def step(bx, by):
  def tower(xi, yi):
    opt.minimize(lambda: tf.reduce_mean(tf.square(xi @ w - yi)), var_list=[w])
  strategy.call_for_each_tower(tower, bx, by)

for i in range(start, {STEPS}):
  if (i == kill_at and strategy.task_id == 1
      and os.environ["DISTSTRAT_RESTART_COUNT"] == "0"):
    os.kill(os.getpid(), signal.SIGKILL)
  step(*next(batches))
  if strategy.is_chief:
    manager.save(checkpoint_number=i + 1)
if strategy.is_chief:
  np.save(os.path.join(out, "w.npy"), w.numpy())
"""

# Keras: model.fit with BackupAndRestore (one path for every worker). Worker 1 kills itself
# at the start of epoch KILL_AT of the job's first attempt (KILL_AT < 0: never).
_FIT_MWMS = """
import os, signal, sys
import keras
import numpy as np
import diststrat as ds

strategy = ds.MultiWorkerMirroredStrategy(collective_timeout=60)
out, kill_at = sys.argv[1], int(sys.argv[2])
keras.utils.set_random_seed(0)
with strategy.scope():
  model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                            keras.layers.Dense(1)])
  model.compile(optimizer="adam", loss="mse")

class Kill(keras.callbacks.Callback):
  def on_epoch_begin(self, epoch, logs=None):
    print("epoch", epoch, "attempt", os.environ["DISTSTRAT_RESTART_COUNT"], flush=True)
    if (epoch == kill_at and strategy.task_id == 1
        and os.environ["DISTSTRAT_RESTART_COUNT"] == "0"):
      os.kill(os.getpid(), signal.SIGKILL)

rng = np.random.default_rng(0)
x, y = rng.random((128, 8), np.float32), rng.random((128, 1), np.float32)
model.fit(x, y, batch_size=32, epochs=4, verbose=0, shuffle=False,
          callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out, "backup")), Kill()])
if strategy.is_chief:
  np.savez(os.path.join(out, "weights.npz"), *model.get_weights())
"""

# ParameterServerStrategy() with no arguments: both workers add to one shared counter,
# then wait (bounded) until both are done.
_COUNT_PS = """
import sys, time
import diststrat as ds
import tensorflow as tf

n, workers, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
strategy = ds.ParameterServerStrategy(step_timeout=60)
with strategy.scope():
  counter = tf.Variable(0, name="counter")
for _ in range(n):
  counter.assign_add(1)
deadline = time.monotonic() + 60
while int(counter.numpy()) < n * workers and time.monotonic() < deadline:
  time.sleep(0.1)
with open(f"{out}/count{strategy.task_id}.txt", "w") as f:
  f.write(f"{int(counter.numpy())} {strategy.task_type} {strategy.task_id} "
          f"{len(strategy.cluster_spec['ps'])}")
"""

# Prints "ready" and sleeps: for signals sent to the launcher.
_SLEEPER = """
import os, time
print("ready", os.getpid(), flush=True)
time.sleep(600)
"""


# --- the cluster spec (pure functions) ---------------------------------------------------


def test_cluster_spec_of_several_hosts_is_the_same_on_every_host():
  spec = launcher.build_cluster_spec(["h1", "h2"], num_ps=1, num_workers=2, port_base=5000)
  assert spec == {"ps": ["h1:5000", "h2:5000"],
                  "worker": ["h1:5001", "h1:5002", "h2:5001", "h2:5002"]}
  assert launcher.tasks_of_host(1, num_ps=1, num_workers=2) == [
      ("ps", 1), ("worker", 2), ("worker", 3)]
  assert launcher.build_cluster_spec(["a"], 0, 2, 7000) == {"worker": ["a:7000", "a:7001"]}
  config = json.loads(launcher.tf_config(spec, "worker", 3))
  assert config == {"cluster": spec, "task": {"type": "worker", "index": 3}}


@pytest.mark.parametrize("hosts, port_base, match", [
    (["a", "a"], 5000, "a host can be named once only"),
    ([], 5000, "at least one host"),
    (["a", "", "b"], 5000, r"hosts has an empty name \(entry 2 of 3: two commas in a row"),
    (["a"], 65535, "must leave 3 ports below 65536"),
])
def test_cluster_spec_rejects(hosts, port_base, match):
  with pytest.raises(ValueError, match=match):
    launcher.build_cluster_spec(hosts, 1, 2, port_base)


# --- Slurm (pure functions) ------------------------------------------------------------


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu5", ["gpu5"]),
    ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_slurm_host_lists_expand(text, hosts):
  assert _environment.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, match", [("node[01-03", "Unbalanced brackets"),
                                         ("node[3-1]", "ranges look like"),
                                         ("node[a-b]", "ranges look like")])
def test_slurm_host_lists_that_do_not_parse(text, match):
  with pytest.raises(ValueError, match=match):
    _environment.expand_hostlist(text)


def test_slurm_tasks_per_node_expand():
  assert _environment.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
  assert _environment.expand_tasks_per_node("4") == [4]
  with pytest.raises(ValueError, match=r"look like '2\(x3\),1'. Received: '2x3'"):
    _environment.expand_tasks_per_node("2x3")


def _slurm(rank, nodes="node[01-02]", per_node="2(x2)", tasks="4", **extra):
  return {"SLURM_PROCID": str(rank), "SLURM_STEP_NODELIST": nodes,
          "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_STEP_NUM_TASKS": tasks, **extra}


def test_slurm_variables_give_the_cluster():
  spec = {"ps": ["node01:8888"], "worker": ["node01:8889", "node02:8888", "node02:8889"]}
  configs = [cluster_from_slurm(_slurm(rank), num_ps=1) for rank in range(4)]
  assert [(c.task_type, c.task_id) for c in configs] == [
      ("ps", 0), ("worker", 0), ("worker", 1), ("worker", 2)]
  assert all(c.cluster_spec == spec and c.source == "Slurm" for c in configs)
  # Workers only, another port base, from the variables; the job's node list as fallback.
  environ = {"SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n[7-8]",
             "SLURM_TASKS_PER_NODE": "2,1", "SLURM_NTASKS": "3",
             "DISTSTRAT_SLURM_PORT_BASE": "9000"}
  config = cluster_from_slurm(environ)
  assert config.cluster_spec == {"worker": ["n7:9000", "n7:9001", "n8:9000"]}
  assert (config.task_type, config.task_id) == ("worker", 2)
  assert json.loads(config.tf_config())["task"] == {"type": "worker", "index": 2}


def test_slurm_without_a_step_of_several_tasks_is_no_cluster():
  assert cluster_from_slurm({}) is None
  assert cluster_from_slurm(_slurm(0, nodes="n1", per_node="1", tasks="1")) is None
  assert cluster_from_slurm(_slurm(0, DISTSTRAT_SLURM="0")) is None


@pytest.mark.parametrize("environ, match", [
    (_slurm(0, per_node="2"), r"names 2 nodes .* but tasks for 1"),
    (_slurm(0, tasks="5"), "add up to 4, not to the step's 5 tasks"),
    (_slurm(4), "SLURM_PROCID must be below the step's 4 tasks"),
    (_slurm(0, DISTSTRAT_SLURM_NUM_PS="4"), "can have 0 to 3 parameter servers"),
    (_slurm("x"), "SLURM_PROCID must be a non-negative integer"),
])
def test_slurm_variables_that_disagree(environ, match):
  with pytest.raises(ValueError, match=match):
    cluster_from_slurm(environ)


def test_tf_config_comes_before_slurm():
  tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                          "task": {"type": "worker", "index": 1}})
  config = cluster_from_environment({"TF_CONFIG": tf_config, **_slurm(0)})
  assert (config.source, config.task_id, config.cluster_spec) == (
      "TF_CONFIG", 1, {"worker": ["a:1", "b:2"]})
  assert cluster_from_environment(_slurm(3)).source == "Slurm"
  assert cluster_from_environment({}) is None
  with pytest.raises(ValueError, match="TF_CONFIG must be JSON such as"):
    cluster_from_environment({"TF_CONFIG": "{\"cluster\": 1}"})


@pytest.mark.parametrize("task, match", [
    ({"type": "worker", "index": -1},
     r"TF_CONFIG's task index must be an index into its cluster's 'worker' job, from 0 to 1. "
     r"Received: index=-1 in TF_CONFIG='.*'. Fix the TF_CONFIG the launcher sets "
     r"\(diststrat-run sets one per task\)."),
    ({"type": "worker", "index": 2}, r"from 0 to 1. Received: index=2 in TF_CONFIG="),
    ({"type": "chief", "index": 0},
     r"TF_CONFIG's task type must be a job of its cluster, one of \['worker'\]. Received: "
     r"type='chief' in TF_CONFIG='.*'. Fix the TF_CONFIG the launcher sets"),
])
def test_tf_config_naming_a_task_outside_its_cluster_is_refused(monkeypatch, task, match):
  # Once: the task index -1 was returned as it was (a negative task id).
  tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": task})
  with pytest.raises(ValueError, match=match):
    cluster_from_environment({"TF_CONFIG": tf_config})
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("TF_CONFIG", tf_config)
  with pytest.raises(ValueError, match=match):
    ds.MultiWorkerMirroredStrategy()  # Refused before a server starts.


_PS_CLUSTER = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}


@pytest.mark.parametrize("cluster, task, match", [
    (_PS_CLUSTER, {"type": "ps", "index": 0},
     r"This process is parameter server task 0 by the TF_CONFIG environment variable.*"
     r"Run diststrat.cluster.serve\(\) in PS tasks"),
    ({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, {"type": "worker", "index": 0},
     r"ParameterServerStrategy\(\) read its cluster from the TF_CONFIG environment "
     r"variable, which names no parameter server.*launch with diststrat-run --ps 1"),
    ({**_PS_CLUSTER, "worker": ["127.0.0.1:2"]}, {"type": "worker", "index": 3},
     r"TF_CONFIG's task index must be an index into its cluster's 'worker' job, from 0 to "
     r"0. Received: index=3"),
    # An empty job was refused as "from 0 to -1".
    ({**_PS_CLUSTER, "worker": []}, {"type": "worker", "index": 0},
     r"TF_CONFIG's cluster lists no address for its task's job 'worker', so this process "
     r"cannot be task 0 of it"),
])
def test_parameter_server_strategy_rejects_a_tf_config_it_cannot_use(
    monkeypatch, cluster, task, match):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": task}))
  with pytest.raises(ValueError, match=match):
    ds.ParameterServerStrategy()


def test_multi_worker_strategy_rejects_a_tf_config_with_parameter_servers(monkeypatch):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": _PS_CLUSTER,
                                              "task": {"type": "worker", "index": 0}}))
  with pytest.raises(ValueError, match="runs on worker tasks only") as info:
    ds.MultiWorkerMirroredStrategy()
  assert "read from the TF_CONFIG environment variable" in str(info.value.__notes__)
  monkeypatch.setenv("TF_CONFIG", "not json")
  with pytest.raises(ValueError, match="TF_CONFIG must be JSON such as"):
    ds.MultiWorkerMirroredStrategy()


def test_serve_needs_a_cluster(monkeypatch):
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("TF_CONFIG", raising=False)
  for name in [n for n in os.environ if n.startswith("SLURM_")]:
    monkeypatch.delenv(name)
  with pytest.raises(ValueError, match=r"serve\(\) needs a cluster: set TF_CONFIG"):
    ds.cluster.serve()
  with pytest.raises(ValueError, match=r"task_id must be an index into cluster_spec\['ps'\], "
                     r"from 0 to 0. Received: task_id=1"):
    ds.cluster.serve({"ps": ["127.0.0.1:1"]}, "ps", 1)
  with pytest.raises(ValueError, match=r"task_type must name a job of cluster_spec, one of "
                     r"\['ps'\]. Received: task_type='chief'"):
    ds.cluster.serve({"ps": ["127.0.0.1:1"]}, "chief", 0)


def test_serve_on_a_taken_port_names_the_task_and_the_port(monkeypatch):
  """A PS whose port another process holds (Slurm's default 8888 is Jupyter's) raised
  TensorFlow's `UnknownError: Could not start gRPC server`, naming neither."""
  import diststrat as ds  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("TF_CONFIG", raising=False)
  with socket.socket() as taken:
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(ds.errors.ClusterError, match=(
        rf"Cannot start the TensorFlow server of /job:ps/replica:0/task:0 at "
        rf"127.0.0.1:{port}: port {port} is taken \(Address already in use\)\. Stop "
        r"what listens there, or give the task another port \(cluster_spec; "
        r"DISTSTRAT_SLURM_PORT_BASE under Slurm; --port-base with diststrat-run\)")) as info:
      ds.cluster.serve({"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}, "ps", 0)
  assert info.value.task == "/job:ps/replica:0/task:0"


def test_a_probe_of_a_worker_that_connects_to_itself_is_not_an_answer(monkeypatch):
  """A parameter server looks four times a second at its workers' addresses, in the
  kernel's range of ephemeral ports; a connection to such a port where nothing listens
  can get that very port as its own and connect to itself (rare, but it asks often).
  The PS took that for a worker that started, and stopped 2 s later while its workers
  were still starting, which then failed with "Connection refused" (CI, 2026-11-28)."""
  from diststrat.cluster import _serve  # pylint: disable=g-import-not-at-top
  with socket.create_server(("127.0.0.1", 0)) as listening:
    assert _serve._worker_answers(f"127.0.0.1:{listening.getsockname()[1]}")
  with socket.socket() as closed:
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
  assert not _serve._worker_answers(f"127.0.0.1:{port}")

  asked = []

  def connects_to_itself(address, timeout):
    asked.append((address, timeout))
    sock = socket.socket()
    sock.bind(address)  # What the kernel does when it picks the port it connects to.
    sock.connect(address)
    assert sock.getsockname() == sock.getpeername()
    return sock

  monkeypatch.setattr(_serve.socket, "create_connection", connects_to_itself)
  assert not _serve._worker_answers(f"127.0.0.1:{port}")
  assert asked == [(("127.0.0.1", port), _serve._CONNECT_TIMEOUT)]


def _run_tasks(script, environs, cwd, timeout=JOB_TIMEOUT):
  """Starts one process of `script` per environment at once (as srun does); waits."""
  marker = uuid.uuid4().hex
  processes = []
  try:
    for extra in environs:
      processes.append(subprocess.Popen(
          [sys.executable, str(script)], cwd=cwd, env={**_env(marker), **extra},
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    for process in processes:
      outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    return [p.returncode for p in processes], outputs
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait(10)
    _assert_none_left(marker)


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_slurm_step_runs_parameter_server_strategy_and_serve(tmp_path):
  """Three processes with Slurm's variables: rank 0 serves, ranks 1 and 2 count, and
  every task ends with status 0: the PS once its workers have ended (it used to serve
  forever, so the Slurm step never ended)."""
  script = _write(tmp_path, "slurm_ps.py", textwrap.dedent("""
      import diststrat as ds
      config = ds.cluster.cluster_from_environment()
      if config.task_type == "ps":
        ds.cluster.serve(workers_gone_for=2)
        raise AssertionError("serve() returned")
      """) + textwrap.dedent(_COUNT_PS))
  base = _free_port_base(3)
  common = {"SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_TASKS_PER_NODE": "3",
            "SLURM_STEP_NUM_TASKS": "3", "DISTSTRAT_SLURM_NUM_PS": "1",
            "DISTSTRAT_SLURM_PORT_BASE": str(base)}
  marker = uuid.uuid4().hex
  processes = []
  try:
    for rank in range(3):  # All at once, as srun starts them: the workers wait for the PS.
      processes.append(subprocess.Popen(
          [sys.executable, str(script), "20", "2", str(tmp_path)], cwd=tmp_path,
          env={**_env(marker), **common, "SLURM_PROCID": str(rank)},
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    ps, workers = processes[0], processes[1:]
    outputs = [w.communicate(timeout=JOB_TIMEOUT)[0] for w in workers]
    if [w.returncode for w in workers] != [0, 0]:
      ps.kill()
      outputs.append("the parameter server's output:\n" + ps.communicate(timeout=30)[0])
    assert [w.returncode for w in workers] == [0, 0], outputs
    ps_output = ps.communicate(timeout=30)[0]  # 2 s after the last worker, and a margin.
    assert ps.returncode == 0, ps_output
    assert "every worker of its job has ended" in ps_output, ps_output
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
      process.communicate(timeout=10)
    _assert_none_left(marker)
  counts = sorted((tmp_path / f"count{i}.txt").read_text() for i in range(2))
  assert counts == ["40 worker 0 1", "40 worker 1 1"]


# Two machines on one: this network namespace is host A (10.77.0.1), a second one,
# linked to it by a veth pair, host B (10.77.0.2). Each runs its launcher; their exit
# statuses are printed last. Needs unprivileged user namespaces and iproute2.
_TWO_HOSTS = """
set -eu
ip link set lo up
unshare -n sleep 600 &
holder=$!
trap 'kill $holder 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ "$(readlink /proc/$holder/ns/net)" != "$(readlink /proc/self/ns/net)" ] && break; sleep 0.1; done
ip link add va type veth peer name vb netns $holder
ip addr add 10.77.0.1/24 dev va
ip link set va up
nsenter -t $holder -n sh -c 'ip link set lo up; ip addr add 10.77.0.2/24 dev vb; ip link set vb up'
run() {{ {python} -m diststrat.run --ps 1 --workers 1 --hosts 10.77.0.1,10.77.0.2 \\
          --port-base 23456 --task-index $1 --job-timeout {timeout} {script} 10 2 {out}; }}
run 0 > {out}/host0.log 2>&1 &
a=$!
nsenter -t $holder -n sh -c "$(declare -f run); run 1" > {out}/host1.log 2>&1 &
b=$!
sa=0; wait $a || sa=$?
sb=0; wait $b || sb=$?
echo "statuses $sa $sb"
"""


def _namespaces_work():
  try:
    return subprocess.run(["unshare", "-Urn", "ip", "link", "add", "va", "type", "veth",
                           "peer", "name", "vb"], capture_output=True,
                          timeout=10).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_a_parameter_server_job_across_two_hosts_ends_with_status_0_on_both(tmp_path):
  """Host A's worker ends first; host A's launcher must not stop its PS while host B's
  worker still uses it (it did: B's worker failed with "Connection refused"). Each PS
  ends by itself once every worker of the job has ended (serve()), and both launchers
  exit with 0."""
  if not _namespaces_work():
    pytest.skip("needs unprivileged user and network namespaces and iproute2 (ip)")
  script = _write(tmp_path, "count.py", _COUNT_PS.replace(
      "with open(", "if strategy.task_id == 1:\n  time.sleep(3)  # B ends after A.\n"
      "with open(", 1))
  shell = _write(tmp_path, "two_hosts.sh", _TWO_HOSTS.format(
      python=sys.executable, script=script, out=tmp_path, timeout=JOB_TIMEOUT))
  marker = uuid.uuid4().hex
  # Six TensorFlow processes at once on a 2-core machine: one thread per op pool each,
  # so that they do not starve the other pytest worker's tests (one took 27 s instead
  # of 1 s beside this test, a faulthandler dump showed it tracing, not blocked).
  env = dict(_env(marker), TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
  done = subprocess.run(["unshare", "-Urn", "bash", str(shell)], env=env,
                        cwd=tmp_path, capture_output=True, text=True,
                        timeout=JOB_TIMEOUT + 30)
  logs = "\n".join((tmp_path / f"host{i}.log").read_text() for i in (0, 1))
  assert "statuses 0 0" in done.stdout, (done.stdout, done.stderr, logs)
  assert "serve the job's other workers" in logs, logs  # A's launcher waited for B.
  counts = sorted((tmp_path / f"count{i}.txt").read_text() for i in range(2))
  assert counts == ["20 worker 0 2", "20 worker 1 2"]
  _assert_none_left(marker)


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_slurm_step_runs_multi_worker_mirrored_strategy(tmp_path):
  script = _write(tmp_path, "slurm_mw.py", """
      import diststrat as ds
      import tensorflow as tf
      s = ds.MultiWorkerMirroredStrategy(collective_timeout=60)
      total = s.reduce("sum", s.call_for_each_tower(
          lambda: tf.constant(float(ds.get_tower_context().tower_id + 1))))
      print("RESULT", s.task_type, s.task_id, s.num_workers, s.cluster_spec["worker"],
            float(s.unwrap(total)[0]), flush=True)
      """)
  base = _free_port_base(2)
  common = {"SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_TASKS_PER_NODE": "2",
            "SLURM_NTASKS": "2", "DISTSTRAT_SLURM_PORT_BASE": str(base)}
  codes, outputs = _run_tasks(script, [{**common, "SLURM_PROCID": str(r)} for r in (0, 1)],
                              tmp_path)
  assert codes == [0, 0], outputs
  addresses = [f"'127.0.0.1:{base}', '127.0.0.1:{base + 1}'"]
  for rank, output in enumerate(outputs):
    line = [l for l in output.splitlines() if l.startswith("RESULT")][0]
    # One tower per worker (towers 1 and 2): 3.0 everywhere.
    assert line == f"RESULT worker {rank} 2 [{addresses[0]}] 3.0", output


# --- jobs ------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_multi_worker_job_trains_like_one_process(tmp_path):
  script = _write(tmp_path, "train.py", _TRAIN_MWMS)
  proc = _launch(["--workers", "2", "--cpus-per-worker", "2", str(script), str(tmp_path),
                  "-1"], tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  # Each task's output, prefixed with its name; 2 workers x 2 logical CPUs.
  assert "[worker:0] towers 4 start 0 attempt 0" in proc.stdout
  assert "[worker:1] towers 4 start 0 attempt 0" in proc.stdout
  np.testing.assert_allclose(np.load(tmp_path / "w.npy"), _reference_weights(),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_parameter_server_job_shares_variables(tmp_path):
  script = _write(tmp_path, "count.py", _COUNT_PS)
  proc = _launch(["--ps", "1", "--workers", "2", str(script), "50", "2", str(tmp_path)],
                 tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  counts = sorted((tmp_path / f"count{i}.txt").read_text() for i in range(2))
  assert counts == ["100 worker 0 1", "100 worker 1 1"]
  assert "[ps:0]" in proc.stdout + proc.stderr  # The PS task's output is streamed too.


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_a_worker_that_joins_late_on_one_host_keeps_its_parameter_server(tmp_path):
  """On one host the launcher stops the PS tasks itself once the workers are done. Their
  own watch (`serve()`'s, for jobs across hosts) ended a PS 10 s after worker 0 left,
  while worker 1 had not yet connected (preparing its data, or importing TensorFlow on a
  loaded machine), and the job failed: "Parameter server ps:0 exited with code 0 while
  the workers ran"."""
  script = _write(tmp_path, "late.py", """
      import json, os, socket, time
      config = json.loads(os.environ["TF_CONFIG"])
      index = config["task"]["index"]
      if index == 0:  # Answers at its address for a moment, as a strategy's server does.
        port = int(config["cluster"]["worker"][0].rsplit(":", 1)[1])
        with socket.create_server(("", port)):
          time.sleep(0.75)
      else:
        time.sleep(13)  # More than serve()'s 10 s after worker 0 left.
      print("worker", index, "done", flush=True)
      """)
  proc = _launch(["--ps", "1", "--workers", "2", str(script)], tmp_path, timeout=80)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "[worker:1] worker 1 done" in proc.stdout
  assert "parameter server /job:ps/replica:0/task:0 stops" not in proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_a_bad_launch_is_not_restarted(tmp_path):
  """--max-restarts restarts a job whose task failed; a launch that cannot start (here a
  log file that is a directory) fails once, saying so, without a traceback."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  (tmp_path / "logs" / "attempt_0" / "worker_0.log").mkdir(parents=True)
  proc = _launch(["--workers", "1", "--max-restarts", "2", "--log-dir",
                  str(tmp_path / "logs"), str(script)], tmp_path, timeout=60)
  assert proc.returncode == 1, proc.stderr[-4000:]
  assert "--log-dir: cannot create" in proc.stderr and "(Is a directory)" in proc.stderr
  assert "not restarting: --max-restarts does not apply to this failure" in proc.stderr
  assert "restarting the job" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(2 * JOB_TIMEOUT + 30)
def test_a_killed_worker_restarts_the_job_which_resumes_from_its_checkpoint(tmp_path):
  script = _write(tmp_path, "train.py", _TRAIN_MWMS)
  proc = _launch(["--workers", "2", "--max-restarts", "1", str(script), str(tmp_path), "3"],
                 tmp_path, timeout=2 * JOB_TIMEOUT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "Task worker:1 was killed by signal SIGKILL" in proc.stderr
  assert "restarting the job (1 of --max-restarts 1)" in proc.stderr
  resumed = [line for line in proc.stdout.splitlines()
             if line.startswith("[worker:0]") and "attempt 1" in line]
  assert resumed and " start 0 " not in resumed[0], proc.stdout  # From a checkpoint.
  np.testing.assert_allclose(np.load(tmp_path / "w.npy"), _reference_weights(),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.processes
@pytest.mark.timeout(3 * JOB_TIMEOUT + 30)
def test_keras_fit_with_backup_and_restore_resumes_after_a_killed_worker(tmp_path):
  script = _write(tmp_path, "fit.py", _FIT_MWMS)
  runs = {}
  for name, kill_at, restarts in (("killed", "2", "1"), ("uninterrupted", "-1", "0")):
    out = tmp_path / name
    out.mkdir()
    proc = _launch(["--workers", "2", "--max-restarts", restarts, str(script), str(out),
                    kill_at], tmp_path, timeout=2 * JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs[name] = (proc, np.load(out / "weights.npz"))
  killed = runs["killed"][0]
  assert "Task worker:1 was killed by signal SIGKILL" in killed.stderr
  # The second attempt starts at epoch 2 in both workers: the backup of epochs 0 and 1.
  attempt_1 = [l for l in killed.stdout.splitlines() if l.endswith("attempt 1")]
  assert sorted(attempt_1) == ["[worker:0] epoch 2 attempt 1", "[worker:0] epoch 3 attempt 1",
                               "[worker:1] epoch 2 attempt 1",
                               "[worker:1] epoch 3 attempt 1"], killed.stdout
  (_, killed_weights), (_, uninterrupted) = runs["killed"], runs["uninterrupted"]
  for a, b in zip(killed_weights.values(), uninterrupted.values(), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_job_on_hosts_runs_and_says_it_is_not_isolated(tmp_path):
  script = _write(tmp_path, "hello.py", """
      import json, os, sys
      config = json.loads(os.environ["TF_CONFIG"])
      print("task", config["task"]["type"], config["task"]["index"], config["cluster"])
      # Run as `python hello.py a b` would be; the launcher imported nothing into it.
      print("argv", sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)),
            __name__, [m for m in sys.modules if m.startswith(("diststrat", "tensorflow"))])
      """)
  base = _free_port_base(2)
  proc = _launch(["--workers", "2", "--hosts", "127.0.0.1", "--task-index", "0",
                  "--port-base", str(base), str(script), "a", "b"], tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  spec = {"worker": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]}
  for i in range(2):
    assert f"[worker:{i}] task worker {i} {spec}" in proc.stdout
    assert f"[worker:{i}] argv [{str(script)!r}, 'a', 'b'] True __main__ []" in proc.stdout
  assert ("diststrat-run: WARNING: a job across machines cannot run in a private network: "
          "TensorFlow's servers listen on every interface") in proc.stderr


# --- bad launches: fast, named, nothing left ------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_help_and_argument_errors_do_not_import_tensorflow(tmp_path):
  """`--help` and argument errors answer without importing TensorFlow (which takes
  seconds): the launcher's command line, run as `python -m diststrat.run` runs it."""
  code = textwrap.dedent("""
      import sys
      from diststrat import run
      for argv in (["--help"], ["--workers", "0", "x.py"], ["--workers", "1", "no.py"]):
        try:
          print("status", run.run(argv))
        except SystemExit as e:
          print("exit", e.code)
      print("tensorflow imported:", "tensorflow" in sys.modules)
      """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env("none"),
                        capture_output=True, text=True, timeout=100, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "usage: diststrat-run" in proc.stdout
  assert "exit 0" in proc.stdout and "exit 2" in proc.stdout and "status 2" in proc.stdout, (
      proc.stdout)
  assert "tensorflow imported: False" in proc.stdout, proc.stdout
  help_proc = subprocess.run([sys.executable, "-m", "diststrat.run", "--help"], cwd=tmp_path,
                             env=_env("none"), capture_output=True, text=True, timeout=100,
                             check=False)
  assert help_proc.returncode == 0 and "usage: diststrat-run" in help_proc.stdout



# In this process (`launcher.run`, the console script's body): no TensorFlow import to wait
# for, and nothing is started.


def test_a_script_that_does_not_exist(tmp_path, monkeypatch, capfd):
  monkeypatch.chdir(tmp_path)
  assert launcher.run(["--workers", "2", "missing.py"]) == 2
  err = capfd.readouterr().err
  assert "The script 'missing.py' does not exist" in err and "no task was started" in err


def test_zero_workers_is_a_usage_error(tmp_path, capfd):
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  with pytest.raises(SystemExit) as info:
    launcher.run(["--workers", "0", str(script)])
  assert info.value.code == 2
  assert "--workers: must be an integer >= 1. Received: '0'" in capfd.readouterr().err


def test_no_script_is_a_usage_error_naming_the_script(capfd):
  with pytest.raises(SystemExit) as info:
    launcher.run(["--workers", "1"])
  assert info.value.code == 2
  err = capfd.readouterr().err
  assert "error: the script to run is missing: diststrat-run [options] script.py" in err
  assert "script_args" not in err


@pytest.mark.parametrize("after, script_args", [
    (["--", "a"], ["--", "a"]),
    (["--"], ["--"]),
    (["--", "--workers", "3"], ["--", "--workers", "3"]),
    (["a", "--", "b"], ["a", "--", "b"]),
    (["--workers", "3", "-h"], ["--workers", "3", "-h"]),
])
def test_everything_after_the_script_is_the_scripts_as_under_python(
    tmp_path, monkeypatch, after, script_args):
  """`python script.py -- a` gives the script ["--", "a"]: so does the launcher (it
  dropped a "--" that followed the script, so the script got ["a"])."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  plans = []
  monkeypatch.setattr(launcher._job, "run_job", lambda plan: plans.append(plan) or 0)
  for before in ([], ["--"]):  # A "--" before the script ends the launcher's options.
    assert launcher.run(["--workers", "1", *before, str(script), *after]) == 0
    assert plans.pop().script_args == script_args, (before, after)


def test_launcher_options_after_the_script_are_named_when_workers_is_missing(
    tmp_path, capfd):
  """`diststrat-run train.py --workers 2`: the error says that --workers went to the
  script (it said only that --workers is required)."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  with pytest.raises(SystemExit) as info:
    launcher.run([str(script), "--workers=2", "--ps", "1"])
  assert info.value.code == 2
  err = capfd.readouterr().err
  assert "error: the following arguments are required: --workers" in err
  assert (f"--workers=2 comes after the script ({str(script)!r}), so it is one of the "
          "script's arguments: put the launcher's options before the script, as in "
          "diststrat-run --workers 2 train.py --epochs=3") in err, err


def test_an_empty_log_dir_is_a_usage_error(tmp_path, monkeypatch, capfd):
  """`--log-dir ""` (`--log-dir "$LOGS"` with LOGS unset) wrote the logs to
  ./attempt_0/ of the working directory, saying nothing."""
  monkeypatch.chdir(tmp_path)
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  assert launcher.run(["--workers", "1", "--log-dir", "", str(script)]) == 2
  assert ("--log-dir must name a directory (made if missing). Received: --log-dir '', an "
          "empty path") in capfd.readouterr().err
  assert not (tmp_path / "attempt_0").exists()


@pytest.mark.parametrize("args, match", [
    (["--task-index", "1"], "--task-index applies to a job across machines"),
    (["--hosts", "a,b", "--task-index", "2"], "Received: --task-index 2"),
    (["--hosts", "a,b"], "must be from 0 to 1; run the same command on each host with its "
     "own. Received: no --task-index"),
    (["--hosts", "a,a", "--task-index", "0"], "a host can be named once only"),
])
def test_bad_host_options(tmp_path, capfd, args, match):
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  assert launcher.run(["--workers", "1", *args, str(script)]) == 2
  assert match in capfd.readouterr().err


def test_hosts_with_ports_say_that_ports_come_from_port_base(tmp_path, capfd):
  """`--hosts 10.0.0.1:2222,...` (addresses as TF_CONFIG writes them) was refused as a
  name that "does not resolve", which did not say that the port was the matter."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  assert launcher.run(["--workers", "1", "--hosts", "127.0.0.1:2222", "--task-index", "0",
                       str(script)]) == 2
  assert ("--hosts takes host names without ports: '127.0.0.1:2222' names port 2222. Give "
          "the hosts alone (--hosts 127.0.0.1,...), and their first port with --port-base "
          "2222") in capfd.readouterr().err


@pytest.mark.parametrize("hosts, match", [
    ("nosuchhost.invalid", "--hosts names 'nosuchhost.invalid', which does not resolve to an "
     "address"),
    ("127.0.0.1,localhost", "--hosts names '127.0.0.1' and 'localhost', which are the same "
     "machine ("),
    ("localhost,127.0.0.1", "their tasks would listen on the same ports. Name each machine "
     "once; to run more tasks on one machine, raise --workers or --ps"),
])
def test_hosts_that_cannot_run_a_job_are_refused(tmp_path, capfd, hosts, match):
  """Refused up front (exit status 2, nothing started), naming the host(s) and the fix."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  assert launcher.run(["--workers", "1", "--hosts", hosts, "--task-index", "0",
                       str(script)]) == 2
  out, err = capfd.readouterr()
  assert match in err, err
  assert "[worker:" not in out + err


def test_a_taken_port_in_process_warns_of_no_isolate(tmp_path, capfd):
  """In-process: the port check fails before any task starts, after the --no-isolate
  warning (test_a_taken_port runs the launcher as a process)."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    status = launcher.run(["--workers", "2", "--no-isolate", "--port-base", str(port - 1),
                           str(script)])
  out, err = capfd.readouterr()
  assert status == 1, err
  assert (f"The port of task worker:1 (127.0.0.1:{port}) is taken by another process"
          in err)
  assert ("diststrat-run: WARNING: --no-isolate: the job runs without a private network. "
          "TensorFlow's servers listen on every interface") in err
  assert "[worker:" not in out + err  # Nothing started.


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_task_that_exits_at_once_stops_the_job(tmp_path):
  script = _write(tmp_path, "fail.py", """
      import json, os, sys, time
      if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        sys.exit(7)
      time.sleep(600)
      """)
  start = time.monotonic()
  proc = _launch(["--ps", "1", "--workers", "2", str(script)], tmp_path, timeout=100)
  assert proc.returncode == 7, proc.stderr[-4000:]
  assert "Task worker:1 exited with code 7" in proc.stderr
  assert "The other tasks were stopped." in proc.stderr
  assert time.monotonic() - start < 100  # Not the worker's 600 s sleep.


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_parameter_servers_start_together_within_start_timeout(tmp_path, monkeypatch,
                                                               capfd, no_child_left):
  """`--start-timeout` is what each PS task may take: the launcher started its PS tasks
  one after another, each once the previous one served, against one deadline, so
  `--ps 8` (8 TensorFlow imports in a row) failed the default 120 s though each PS
  started in 15. Here each PS serves only once all 3 have started: they start together
  now; one after another, ps:0 waited for the others until the deadline."""
  started = tmp_path / "started"
  started.mkdir()
  fake_serve = textwrap.dedent(f"""
      import json, os, time
      index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
      open(os.path.join({str(started)!r}, str(index)), "w").close()
      while len(os.listdir({str(started)!r})) < 3:
        time.sleep(0.05)
      fd = int(os.environ["DISTSTRAT_READY_FD"])
      os.write(fd, b"ready\\n")
      os.close(fd)
      time.sleep(600)
      """)
  monkeypatch.setattr(launcher._job._task, "SERVE_UNTIL_STOPPED_CODE", fake_serve)
  marker = uuid.uuid4().hex
  monkeypatch.setenv(_MARKER, marker)
  script = _write(tmp_path, "ok.py", "import json, os\nprint('worker after', "
                  "sorted(os.listdir(os.environ['STARTED'])))\n")
  monkeypatch.setenv("STARTED", str(started))
  try:
    status = launcher.run(["--ps", "3", "--workers", "1", "--start-timeout", "10",
                           str(script)])
  finally:
    _assert_none_left(marker)
  out, err = capfd.readouterr()
  assert status == 0, err
  assert "[worker:0] worker after ['0', '1', '2']" in out, out


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_job_on_one_host_of_hosts_stops_its_parameter_server_once_its_workers_are_done(
    tmp_path, monkeypatch, capfd, no_child_left):
  """`--hosts` of one host: every worker of the job is this launcher's, so once they are
  done it stops its PS tasks, as on one machine. It waited for them to end by themselves
  (serve()'s watch for other hosts' workers), forever for a worker that never listened
  at its address (a script that ends before it creates its strategy)."""
  fake_serve = textwrap.dedent("""
      import os, time
      fd = int(os.environ["DISTSTRAT_READY_FD"])
      os.write(fd, b"ready\\n")
      os.close(fd)
      time.sleep(600)
      """)
  for code in ("SERVE_CODE", "SERVE_UNTIL_STOPPED_CODE"):  # One host: a PS serves on.
    monkeypatch.setattr(launcher._job._task, code, fake_serve)
  marker = uuid.uuid4().hex
  monkeypatch.setenv(_MARKER, marker)
  script = _write(tmp_path, "ok.py", "print('done early')\n")
  try:
    status = launcher.run(["--ps", "1", "--workers", "1", "--hosts", "127.0.0.1",
                           "--task-index", "0", "--port-base", str(_free_port_base(2)),
                           "--job-timeout", "10", str(script)])
  finally:
    _assert_none_left(marker)
  out, err = capfd.readouterr()
  assert status == 0, err
  assert "[worker:0] done early" in out
  assert "--job-timeout" not in err and "serve the job's other workers" not in err, err


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_a_taken_port(tmp_path):
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    proc = _launch(["--workers", "2", "--no-isolate", "--port-base", str(port - 1),
                    str(script)], tmp_path, timeout=60)
  assert proc.returncode == 1, proc.stderr[-4000:]
  assert (f"The port of task worker:1 (127.0.0.1:{port}) is taken by another process"
          in proc.stderr)
  assert "[worker:" not in proc.stdout  # Nothing started.


@pytest.mark.processes
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_a_second_job_on_the_same_port_base_is_refused(tmp_path):
  """Two --no-isolate jobs from one --port-base: the second is refused at once, while the
  first one's tasks have not bound their ports yet (as while they import TensorFlow), not
  later by TensorFlow ("Could not start gRPC server")."""
  sleeper = _write(tmp_path, "sleep.py", _SLEEPER)
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  base = _free_port_base(2)
  marker = uuid.uuid4().hex
  first = _start_and_wait_ready(["--workers", "2", "--no-isolate", "--port-base", str(base),
                                 str(sleeper)], tmp_path, marker, 2)
  try:
    second = _launch(["--workers", "2", "--no-isolate", "--port-base", str(base),
                      str(script)], tmp_path, timeout=60)
    assert second.returncode == 1, second.stderr[-4000:]
    assert (f"The port of task worker:0 (127.0.0.1:{base}) is taken by another "
            "diststrat-run job on this machine, which started from an overlapping "
            "--port-base; no task was started. Choose another --port-base") in second.stderr
    assert "[worker:" not in second.stdout + second.stderr
  finally:
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
  _assert_none_left(marker, wait=15)


# --- signals to the launcher --------------------------------------------------------------


def _start_and_wait_ready(args, cwd, marker, count, **popen):
  """Starts the launcher (`popen`: more arguments of Popen); returns it once `count`
  tasks printed "ready"."""
  launcher_process = subprocess.Popen(
      [sys.executable, "-m", "diststrat.run", *args], cwd=cwd, env=_env(marker),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
  ready = 0
  deadline = time.monotonic() + JOB_TIMEOUT
  lines = []
  while ready < count and time.monotonic() < deadline:
    line = launcher_process.stdout.readline()
    if not line:
      break
    lines.append(line)
    ready += "ready" in line
  assert ready == count, lines
  return launcher_process


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("sig, ps", [(signal.SIGINT, 0), (signal.SIGTERM, 0),
                                     (signal.SIGKILL, 1)])
@pytest.mark.processes
def test_a_signalled_launcher_leaves_nothing_behind(tmp_path, sig, ps):
  script = _write(tmp_path, "sleep.py", _SLEEPER)
  marker = uuid.uuid4().hex
  process = _start_and_wait_ready(["--ps", str(ps), "--workers", "2", str(script)],
                                  tmp_path, marker, 2)
  try:
    assert len(_processes_with(marker)) >= 3 + ps  # Launcher, workers (PS, namespace).
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    if sig == signal.SIGKILL:
      assert process.returncode == -signal.SIGKILL
    else:
      assert process.returncode == 128 + sig
      assert f"stopped by {signal.Signals(sig).name}; every task was stopped" in err
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(10)
  _assert_none_left(marker, wait=15)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.processes
def test_a_signal_while_the_job_stops_lets_the_stop_finish(tmp_path):
  """SIGTERM to the launcher while it stops a failed job: the stop finishes, then the
  launcher exits with 143. The signal landed in a thread copying a task's output (the
  main thread blocks it while stopping), whose handler ran in the main thread all the
  same and broke off the stop: the process worker 0 had started in a session of its own
  lived on."""
  script = _write(tmp_path, "stop.py", """
      import json, os, signal, subprocess, sys, time
      if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        print("ready", flush=True)
        time.sleep(0.3)
        sys.exit(3)
      subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                       start_new_session=True)

      def stopped_slowly(signum, frame):  # Time for the test to signal the launcher.
        print("term", flush=True)
        time.sleep(1.5)
        os._exit(0)

      signal.signal(signal.SIGTERM, stopped_slowly)
      print("ready", flush=True)
      time.sleep(600)
      """)
  marker = uuid.uuid4().hex
  process = _start_and_wait_ready(["--workers", "2", str(script)], tmp_path, marker, 2)
  try:
    # Worker 0 got SIGTERM: the launcher is stopping the job.
    assert any("term" in line for line in process.stdout), process.stderr.read()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert ("stopped 1 process(es) that the job's tasks started outside their process "
            "groups and left running") in err, err
    assert "stopped by SIGTERM; every task was stopped" in err
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(10)
    try:
      _assert_none_left(marker)
    finally:
      for pid in _processes_with(marker):  # Not to outlive the test if it fails.
        os.kill(pid, signal.SIGKILL)


# --- logs, timeouts, the summary of a failed job, output as the tasks wrote it ---------


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.processes
def test_sighup_stops_the_job_and_what_its_tasks_started_unless_ignored_as_under_nohup(
    tmp_path):
  """SIGHUP (the terminal or ssh session closed) killed the launcher outright: its tasks
  died of their death signal, but a process a task had started lived on. It stops the
  job as SIGTERM does (status 129); a launcher that inherits SIGHUP ignored (`nohup`)
  keeps ignoring it."""
  script = _write(tmp_path, "parent.py", """
      import subprocess, sys
      child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
      print("ready", child.pid, flush=True)
      child.wait()
      """)
  marker = uuid.uuid4().hex
  nohup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731
  process = _start_and_wait_ready(["--workers", "1", str(script)], tmp_path, marker, 1,
                                  preexec_fn=nohup)
  try:
    process.send_signal(signal.SIGHUP)  # Ignored, as under nohup.
    time.sleep(0.5)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    _assert_none_left(marker, wait=15)
    process = _start_and_wait_ready(["--workers", "1", str(script)], tmp_path, marker, 1)
    process.send_signal(signal.SIGHUP)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGHUP, err
    assert "stopped by SIGHUP; every task was stopped" in err
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(10)
  _assert_none_left(marker, wait=15)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_ctrl_c_while_hosts_resolve_stops_the_launcher_without_a_traceback(tmp_path):
  """Ctrl-C while the launcher resolves `--hosts` (a slow DNS answer: up to 10 s) printed
  a Python traceback (KeyboardInterrupt, in the launcher's frames): the launcher took
  the stop signals only from the job's start on."""
  script = _write(tmp_path, "ok.py", "print('hi')\n")
  code = textwrap.dedent(f"""
      import socket, sys, time
      from diststrat import run

      def slow_dns(*args, **kwargs):
        print("resolving", flush=True)
        time.sleep(30)

      socket.getaddrinfo = slow_dns
      sys.exit(run.run(["--workers", "1", "--hosts", "a.invalid", "--task-index", "0",
                        {str(script)!r}]))
      """)
  process = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=_env("none"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert process.stdout.readline() == "resolving\n", process.communicate(timeout=30)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(10)
  assert process.returncode == 128 + signal.SIGINT, err
  assert "Traceback" not in err and "diststrat-run: stopped by SIGINT" in err, err


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.processes
def test_sigint_ignored_at_start_stays_ignored_as_under_python(tmp_path):
  """A shell script's background job (`diststrat-run ... &`) starts with SIGINT ignored,
  so that Ctrl-C, which reaches the script's whole process group, leaves it running;
  Python keeps ignoring it. The launcher stopped the job on it all the same."""
  script = _write(tmp_path, "sleep.py", _SLEEPER)
  marker = uuid.uuid4().hex
  background = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
  process = _start_and_wait_ready(["--workers", "1", str(script)], tmp_path, marker, 1,
                                  preexec_fn=background)
  try:
    process.send_signal(signal.SIGINT)  # Ignored, as by `python sleep.py &`.
    time.sleep(0.5)
    assert process.poll() is None, process.communicate(timeout=60)[1]
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(10)
  _assert_none_left(marker, wait=15)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_log_dir_keeps_one_file_per_task_and_attempt(tmp_path):
  # The stdout line is written in two pieces with a stderr line between them: the log
  # keeps whole lines (it cut the stdout line with the stderr one, about 1 run in 5
  # when unbuffered output arrived in pieces).
  script = _write(tmp_path, "attempts.py", """
      import json, os, sys, time
      index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
      attempt = os.environ["DISTSTRAT_RESTART_COUNT"]
      sys.stdout.write("out of worker ")
      sys.stdout.flush()
      time.sleep(0.3)
      print("err of worker", index, file=sys.stderr, flush=True)
      time.sleep(0.3)
      print(index, "attempt", attempt, flush=True)
      if index == 1 and attempt == "0":
        sys.exit(5)
      """)
  logs = tmp_path / "logs"
  proc = _launch(["--workers", "2", "--max-restarts", "1", "--log-dir", str(logs),
                  str(script)], tmp_path, timeout=100)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "[worker:1] out of worker 1 attempt 0" in proc.stdout  # The stream, as before.
  files = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())
  assert files == ["attempt_0/worker_0.log", "attempt_0/worker_1.log",
                   "attempt_1/worker_0.log", "attempt_1/worker_1.log"], files
  # Unprefixed, both streams (worker 0 of the first attempt may be stopped early).
  log = (logs / "attempt_1" / "worker_1.log").read_text()
  assert sorted(log.splitlines()) == ["err of worker 1", "out of worker 1 attempt 1"], log


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_after_restarts_the_summary_names_the_last_attempts_first_failure(tmp_path):
  script = _write(tmp_path, "fail_twice.py", """
      import json, os, sys, time
      index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
      attempt = os.environ["DISTSTRAT_RESTART_COUNT"]
      if (index, attempt) in ((1, "0"), (0, "1")):
        sys.exit(5 if attempt == "0" else 6)
      time.sleep(600)
      """)
  proc = _launch(["--workers", "2", "--max-restarts", "1", str(script)], tmp_path,
                 timeout=100)
  assert proc.returncode == 6, proc.stderr[-4000:]
  assert ("Root cause: task worker:0, the first to fail in the last attempt (after 1 "
          "restart(s)), exited with code 6") in proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_job_timeout_stops_a_hung_job(tmp_path):
  script = _write(tmp_path, "sleep.py", _SLEEPER)
  start = time.monotonic()
  proc = _launch(["--ps", "0", "--workers", "2", "--job-timeout", "3", str(script)],
                 tmp_path, timeout=100)
  assert proc.returncode == 124, proc.stderr[-4000:]
  assert ("The job ran longer than --job-timeout 3 s (restarts included) and was stopped. "
          "If it needs longer, give a larger --job-timeout.") in proc.stderr
  assert "Its tasks were stopped." in proc.stderr  # No task failed: the timeout stopped them.
  assert time.monotonic() - start < 90  # Not the workers' 600 s sleep.


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_heartbeat_timeout_fails_a_silent_worker(tmp_path):
  script = _write(tmp_path, "silent.py", """
      import json, os, time
      index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
      for i in range(3000):  # Worker 0 prints every 0.1 s; worker 1 once, then nothing.
        if index == 0 or i == 0:
          print("tick", i, flush=True)
        time.sleep(0.1)
      """)
  proc = _launch(["--workers", "2", "--heartbeat-timeout", "3", "--job-timeout", "80",
                  str(script)], tmp_path, timeout=100)
  assert proc.returncode == 124, proc.stderr[-4000:]
  assert ("Task worker:1 printed nothing for 3 s (--heartbeat-timeout 3), so it was taken "
          "to be hung.") in proc.stderr
  assert "Root cause: task worker:1, the first to fail" in proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_failed_job_ends_with_a_summary_of_its_root_cause(tmp_path):
  script = _write(tmp_path, "crash.py", """
      import json, os, time
      index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

      def divide(n):
        return 1 / n

      print("worker", index, "starts", flush=True)
      if index == 1:
        divide(0)
      time.sleep(600)
      """)
  proc = _launch(["--workers", "2", str(script)], tmp_path, timeout=100)
  assert proc.returncode == 1, proc.stderr[-4000:]
  summary = proc.stderr[proc.stderr.index("diststrat-run: the job failed."):].splitlines()
  assert summary[:5] == [
      "diststrat-run: the job failed. Root cause: task worker:1, the first to fail, exited "
      "with code 1; the launcher's exit status is 1. Its last lines:",
      "  [worker:1] Traceback (most recent call last):",
      f'  [worker:1]   File "{script}", line 10, in <module>',
      "  [worker:1]     divide(0)",
      f'  [worker:1]   File "{script}", line 6, in divide'], proc.stderr
  assert summary[-1] == "  [worker:1] ZeroDivisionError: division by zero", proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, status", [
    ("def fail():\n  raise KeyError('missing')\n\nfail()\n", 1),
    ("x = 1\ndef fail(:\n  pass\n", 1),  # A SyntaxError: no frame of the script runs.
    ("def fail():\n  raise KeyboardInterrupt\n\nfail()\n", 128 + signal.SIGINT),
], ids=["exception", "syntax_error", "keyboard_interrupt"])
def test_a_traceback_starts_at_the_script_as_under_python(tmp_path, body, status):
  """Neither the launcher's code (`<string>`) nor runpy's frames come first: the task's
  traceback is the one `python script.py` prints, and it ends the same way (an uncaught
  KeyboardInterrupt kills Python with SIGINT)."""
  script = _write(tmp_path, "raise.py", body)
  alone = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False)
  proc = _launch(["--workers", "1", str(script)], tmp_path, timeout=100)
  assert (128 - alone.returncode if alone.returncode < 0 else alone.returncode) == status
  assert proc.returncode == status, proc.stderr[-4000:]
  task_lines = [line[len("[worker:0] "):] for line in proc.stderr.splitlines()
                if line.startswith("[worker:0] ")]
  assert task_lines == alone.stderr.splitlines(), (task_lines, alone.stderr)
  assert "runpy" not in proc.stderr and "<string>" not in proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_symlinked_script_imports_from_its_real_directory_as_under_python(tmp_path):
  real = tmp_path / "real"
  real.mkdir()
  _write(real, "helper.py", "VALUE = 'from the real directory'\n")
  _write(real, "main.py", "import helper, sys\nprint(helper.VALUE, sys.path[0])\n")
  (tmp_path / "main.py").symlink_to(real / "main.py")
  alone = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False)
  proc = _launch(["--workers", "1", "main.py"], tmp_path, timeout=100)
  assert proc.returncode == alone.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.strip() == f"[worker:0] {alone.stdout.strip()}", proc.stdout
  assert alone.stdout.strip() == f"from the real directory {real}"


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_with_pythonsafepath_sys_path_is_as_under_python(tmp_path):
  """PYTHONSAFEPATH: `python script.py` puts no directory first on sys.path. The task
  replaced sys.path's first entry with the script's directory all the same, and that
  entry was PYTHONPATH's first: a module there no longer imported."""
  libs = tmp_path / "libs"
  libs.mkdir()
  _write(libs, "mylib.py", "VALUE = 'from PYTHONPATH'\n")
  script = _write(tmp_path, "main.py", """
      import sys
      import mylib
      print(mylib.VALUE, sys.path[:2])
      """)
  env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join([str(libs), str(REPO)])}
  alone = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=False, env={**_env("none"), **env})
  proc = _launch(["--workers", "1", str(script)], tmp_path, timeout=100, env=env)
  assert alone.returncode == 0, alone.stderr
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.strip() == f"[worker:0] {alone.stdout.strip()}", proc.stdout
  assert alone.stdout.startswith(f"from PYTHONPATH [{str(libs)!r}, {str(REPO)!r}]")


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_what_a_task_started_in_a_session_of_its_own_is_stopped_with_the_job(tmp_path):
  """A process a task started out of its process group's reach (its own session) is
  stopped when the job ends, and the launcher names it (`_launch` checks that no
  process of the job is left)."""
  script = _write(tmp_path, "daemon.py", """
      import subprocess, sys
      child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               start_new_session=True)
      print("started", child.pid, flush=True)
      """)
  proc = _launch(["--workers", "1", str(script)], tmp_path, timeout=100)
  assert proc.returncode == 0, proc.stderr[-4000:]
  pid = int(proc.stdout.split("started ")[1].split()[0])
  assert (f"stopped 1 process(es) that the job's tasks started outside their process "
          f"groups and left running: pid {pid} ({sys.executable} -c import time; "
          "time.sleep(600))") in proc.stderr


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_carriage_returns_keep_the_task_prefix(tmp_path):
  """A progress bar redraws its line with "\\r": every redraw keeps the prefix."""
  script = _write(tmp_path, "bar.py", """
      import sys
      for i in range(3):
        sys.stdout.write(f"\\rstep {i}/3 [{'=' * i}]")
        sys.stdout.flush()
      sys.stdout.write("\\n")
      sys.stdout.write("a\\rb\\n")
      sys.stdout.write("no end")
      """)
  proc = _launch(["--workers", "1", str(script)], tmp_path, timeout=100, text=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout == (b"\r[worker:0] step 0/3 []\r[worker:0] step 1/3 [=]"
                         b"\r[worker:0] step 2/3 [==]\n[worker:0] a\r[worker:0] b\n"
                         b"[worker:0] no end\n"), proc.stdout
