"""The diststrat demo: train a digits classifier on several devices, then on one.

`make demo` (or `python examples/digits.py`) trains a small
Keras 3 CNN (convolutions, batch normalization, dropout) on scikit-learn's bundled 8x8
digits with `MirroredStrategy`: one tower per GPU, or, with no GPU, the CPU split into
`--towers` logical devices. The model is built and compiled in `strategy.scope()` and
trained with `model.fit`, as Keras users train: diststrat splits every batch across the
towers, sums the gradients and keeps every copy of the variables equal. It then trains
the same model on one device with no strategy and prints both results side by side.
`--loop=custom` trains with diststrat's own API instead (`call_for_each_tower` and a
diststrat optimizer in a `tf.function` step). See docs/demo.md.

`--strategy=multi_worker` and `--strategy=parameter_server` (or `ps`) train in a cluster
of processes: started by `diststrat-run` (which sets `TF_CONFIG`), this process is one
worker of that job; run alone, the demo starts a `LocalCluster` itself.

Examples:
  python examples/digits.py --towers=2 --epochs=10 --reduction=naive
  diststrat-run --workers 2 --cpus-per-worker 2 examples/digits.py --strategy=multi_worker
  diststrat-run --ps 1 --workers 2 examples/digits.py --strategy=parameter_server
"""

import contextlib

import dataclasses
import os
import sys
import time

from absl import app
from absl import flags
import keras
import numpy as np
from sklearn import datasets
from sklearn import model_selection
import tensorflow as tf
import tqdm

import diststrat as ds
from diststrat import cluster
from diststrat import cross_tower_ops


# --- choices: each is one small function, so a new one is one more entry ---


def _mirrored_strategy(config, devices):
  return ds.MirroredStrategy(devices, cross_tower_ops=REDUCTIONS[config.reduction]())


def _default_strategy(config, devices):
  del config, devices  # No strategy: TensorFlow places everything on its default device.
  return ds.DefaultStrategy()


def _in_cluster_strategy(config, devices):
  del devices
  raise AssertionError(f"--strategy={config.strategy} trains in LocalCluster workers: "
                       "see train()")


STRATEGIES = {"mirrored": _mirrored_strategy, "default": _default_strategy,
              "ps": _in_cluster_strategy, "parameter_server": _in_cluster_strategy,
              "multi_worker": _in_cluster_strategy}
CLUSTER_STRATEGIES = ("ps", "parameter_server", "multi_worker")
MULTI_WORKER_PROCESSES = 2

REDUCTIONS = {
    "auto": lambda: None,  # The strategy's own choice for its devices.
    "one_device": cross_tower_ops.ReductionToOneDevice,
    "collective": lambda: cross_tower_ops.AllReduceCrossTowerOps(algorithm="collective"),
    "hierarchical_copy": lambda: cross_tower_ops.AllReduceCrossTowerOps(
        algorithm="hierarchical_copy"),
    "naive": lambda: cross_tower_ops.AllReduceCrossTowerOps(algorithm="naive"),
}

# name -> (diststrat optimizer from a learning rate (--loop=custom), Keras optimizer from
# a learning rate (--loop=fit), the default learning rate).
OPTIMIZERS = {
    "sgd": (ds.optimizers.GradientDescent, keras.optimizers.SGD, 0.1),
    "momentum": (lambda lr: ds.optimizers.Momentum(lr, momentum=0.9),
                 lambda lr: keras.optimizers.SGD(lr, momentum=0.9), 0.02),
    "adam": (ds.optimizers.Adam, keras.optimizers.Adam, 0.005),
}
LOOPS = ("fit", "custom")

FLAGS = flags.FLAGS
flags.DEFINE_enum("strategy", "mirrored", sorted(STRATEGIES), "How to distribute training.")
flags.DEFINE_integer("towers", 4, "Towers on CPU: the CPU is split into this many logical "
                     "devices. With GPUs: use at most this many of them.", lower_bound=1)
flags.DEFINE_integer("epochs", 20, "Passes over the training examples.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Global batch size, split across the towers.",
                     lower_bound=1)
flags.DEFINE_enum("reduction", "auto", sorted(REDUCTIONS),
                  "How the towers' gradients are summed (diststrat.cross_tower_ops); "
                  "auto: the strategy's default for its devices.")
flags.DEFINE_float("learning_rate", None,
                   "Learning rate. Default: 0.005 for adam, 0.02 for momentum, 0.1 for sgd.")
flags.DEFINE_enum("optimizer", "adam", sorted(OPTIMIZERS),
                  "The optimizer: Keras's with --loop=fit, diststrat.optimizers' with "
                  "--loop=custom.")
flags.DEFINE_enum("loop", "fit", LOOPS, "fit: Keras's model.fit, the model built and "
                  "compiled in strategy.scope(). custom: diststrat's own training loop "
                  "(call_for_each_tower in a tf.function step, a diststrat optimizer).")
flags.DEFINE_integer("seed", 0, "Seeds the held-out split, the shuffling and the weights.")
flags.DEFINE_bool("compare", True, "Also train on one device with no strategy, and compare.")


@dataclasses.dataclass
class Config:
  """One training run; the fields mirror the command-line flags."""
  strategy: str = "mirrored"
  towers: int = 4
  epochs: int = 20
  batch_size: int = 64
  reduction: str = "auto"
  learning_rate: float | None = None
  optimizer: str = "adam"
  seed: int = 0
  loop: str = "fit"
  progress: bool = False  # A progress bar on stderr (Keras's with fit, tqdm's with custom).


# --- devices ---


def tower_devices(towers):
  """The devices to run `towers` towers on: the local GPUs, else logical CPU devices.

  With no GPU, the CPU is split into `towers` logical devices, which works only before
  TensorFlow initializes its devices. If someone already configured or initialized them
  (a test's conftest.py, an earlier call), the existing logical devices are used.

  Raises:
    ValueError: there are fewer usable devices than `towers`.
  """
  if tf.config.list_physical_devices("GPU"):
    return [d.name for d in tf.config.list_logical_devices("GPU")][:towers]
  cpu = tf.config.list_physical_devices("CPU")[0]
  if tf.config.get_logical_device_configuration(cpu) is None:
    try:
      tf.config.set_logical_device_configuration(
          cpu, [tf.config.LogicalDeviceConfiguration()] * towers)
    except RuntimeError:
      pass  # TensorFlow's devices are already initialized: use them as they are.
  cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
  if len(cpus) < towers:
    raise ValueError(
        f"{towers} towers need {towers} devices, but TensorFlow was initialized with "
        f"{len(cpus)} logical CPU devices. Run the demo in a fresh process, or ask for "
        f"--towers={len(cpus)} or fewer.")
  return cpus[:towers]


def short_name(device):
  return device.rsplit("device:", 1)[-1]


# --- data and model ---


def load_data(seed):
  """The 8x8 digits bundled with scikit-learn (no download): 80% train, 20% held out.

  Images are (8, 8, 1) arrays of pixel values in [0, 1].
  """
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)  # Pixel values are 0..16.
  return model_selection.train_test_split(x, y.astype(np.int32), test_size=0.2,
                                          random_state=seed, stratify=y)


def make_model():
  """A small CNN: two convolutions with batch normalization, dropout, a linear read-out."""
  return keras.Sequential([
      keras.Input(shape=(8, 8, 1)),
      keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
      keras.layers.BatchNormalization(),
      keras.layers.ReLU(),
      keras.layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False),
      keras.layers.BatchNormalization(),
      keras.layers.ReLU(),
      keras.layers.Flatten(),
      keras.layers.Dropout(0.25),
      keras.layers.Dense(10),
  ])


MODEL_DESCRIPTION = "a small CNN (2 conv + batch norm, dropout, dense)"


# --- training ---


def train(config, strategy=None):
  """Trains and evaluates once, as `config` says (with `strategy` if given).

  With `--strategy=ps` it starts a `LocalCluster` (one parameter server, one worker
  process) and runs this same function in the worker, with its ParameterServerStrategy.
  With `--strategy=multi_worker` it starts 2 worker processes of `--towers / 2` towers
  each and runs it in both, with their MultiWorkerMirroredStrategy (synchronous: every
  step all-reduces the gradients of all towers of both); the report is worker 0's.

  Returns:
    A dict of results: label, accuracy (on the held-out 20%), final_loss (the last
    epoch's mean training loss), examples_per_second (timed from the end of the first
    step, so tf.function tracing is excluded), wall_time and first_step_time (seconds),
    steps, strategy (class name), devices, reduction (a description, or None),
    copies (of each weight) and copies_max_difference.
  """
  if config.strategy in CLUSTER_STRATEGIES and strategy is None:
    if cluster.cluster_from_environment() is None:
      return _train_on_local_cluster(config)
    strategy = _strategy_of_this_task(config)  # Under diststrat-run (TF_CONFIG) or Slurm.
  if config.loop not in LOOPS:
    raise ValueError(f"loop must be one of {LOOPS}. Received: loop={config.loop!r}")
  x_train, x_test, y_train, y_test = load_data(config.seed)
  no_strategy = config.strategy == "default"
  if strategy is None:
    devices = tower_devices(1 if no_strategy else config.towers)
    strategy = STRATEGIES[config.strategy](config, devices)
  else:
    devices = list(strategy.worker_devices)
  steps_per_epoch = len(x_train) // config.batch_size
  if steps_per_epoch == 0:
    raise ValueError(f"--batch_size={config.batch_size} is larger than the "
                     f"{len(x_train)} training examples.")
  towers = strategy.num_towers
  label = "one device, no strategy" if no_strategy else \
      f"{config.strategy}, {towers} tower{'s' if towers > 1 else ''}"

  def dataset():  # Global batches; diststrat splits each across the towers.
    data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    data = data.shuffle(len(x_train), seed=config.seed, reshuffle_each_iteration=True)
    return data.batch(config.batch_size, drop_remainder=True)

  keras.utils.set_random_seed(config.seed)  # The same initial weights in every run.
  run = _train_with_fit if config.loop == "fit" else _train_with_custom_loop
  model, timing, final_loss = run(config, strategy, dataset, steps_per_epoch, label)
  with strategy.scope():
    copies = [strategy.unwrap(w.value) for w in model.weights]
  predictions = np.argmax(model.predict(x_test, batch_size=len(x_test), verbose=0), axis=1)
  total_steps = steps_per_epoch * config.epochs
  timed_examples = (total_steps - 1) * config.batch_size
  return {
      "label": label,
      "loop": config.loop,
      "accuracy": float(np.mean(predictions == y_test)),
      "final_loss": final_loss,
      "examples_per_second": timed_examples / (timing.end - timing.first_step_done)
                             if timed_examples else float("nan"),
      "wall_time": timing.end - timing.start,
      "first_step_time": timing.first_step_done - timing.start,
      "steps": total_steps,
      "strategy": type(strategy).__name__,
      "devices": devices,
      "workers": getattr(strategy, "num_workers", 1),
      "reduction": describe_reduction(strategy, config.reduction),
      "copies": max(len(c) for c in copies),
      "copies_max_difference": max(float(tf.reduce_max(tf.abs(tf.cast(c - cs[0], tf.float32))))
                                   for cs in copies for c in cs),
      "train_examples": len(x_train),
      "test_examples": len(x_test),
  }


class _Timing:
  """Start, end of the first step (tracing is over), end: `time.perf_counter()` values."""

  def __init__(self):
    self.start = time.perf_counter()
    self.first_step_done = self.end = None

  def step_done(self):
    if self.first_step_done is None:
      self.first_step_done = time.perf_counter()


class _TimingCallback(keras.callbacks.Callback):

  def __init__(self, timing):
    super().__init__()
    self._timing = timing

  def on_train_batch_end(self, batch, logs=None):
    self._timing.step_done()

  def on_train_end(self, logs=None):
    self._timing.end = time.perf_counter()


def _train_with_fit(config, strategy, dataset, steps_per_epoch, label):
  """Keras's own way: build and compile in the strategy's scope, then `model.fit`."""
  del steps_per_epoch  # One epoch is one pass over `dataset()`.
  _, make_optimizer, default_lr = OPTIMIZERS[config.optimizer]
  with strategy.scope():
    model = make_model()  # Variables mirrored on every tower's device.
    model.compile(optimizer=make_optimizer(config.learning_rate or default_lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  timing = _Timing()
  # Keras prints its progress bar on stdout; the demo keeps stdout for the report.
  with contextlib.redirect_stdout(sys.stderr):
    if config.progress:
      print(f"{label}: model.fit")
    history = model.fit(dataset(), epochs=config.epochs, shuffle=False,
                        verbose=1 if config.progress else 0,
                        callbacks=[_TimingCallback(timing)])
  return model, timing, history.history["loss"][-1]


def _train_with_custom_loop(config, strategy, dataset, steps_per_epoch, label):
  """diststrat's own API: `call_for_each_tower` in a `tf.function` step."""
  make_optimizer, _, default_lr = OPTIMIZERS[config.optimizer]
  total_steps = steps_per_epoch * config.epochs
  with strategy.scope():
    model = make_model()  # Its variables are mirrored on every tower's device.
    optimizer = make_optimizer(config.learning_rate or default_lr)
    batches = iter(strategy.distribute_dataset(lambda: dataset().repeat(config.epochs)))

  def tower_fn(images, labels):  # Runs once per tower, on that tower's part of the batch.
    with tf.GradientTape() as tape:
      logits = model(images, training=True)
      loss = tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    grads_and_vars = optimizer.compute_gradients(loss, model.trainable_variables, tape=tape)
    optimizer.apply_gradients(grads_and_vars)  # merge_call: sum over towers, update copies.
    return loss

  @tf.function
  def train_step():  # One whole step: next batch, all towers, gradients summed, update.
    images, labels = batches.get_next()
    per_tower_loss = strategy.call_for_each_tower(tower_fn, images, labels)
    return strategy.unwrap(strategy.reduce("mean", per_tower_loss))[0]

  # A cluster's steps run under its watchdog (a dead or frozen PS becomes a ClusterError).
  run_step = getattr(strategy, "run_step", lambda fn: fn())
  bar = tqdm.tqdm(total=total_steps, desc=f"{label:<23}", unit="step", file=sys.stderr,
                  disable=not config.progress, dynamic_ncols=True)
  timing = _Timing()
  with strategy.scope():
    for epoch in range(config.epochs):
      epoch_loss = 0.0
      for step in range(steps_per_epoch):
        epoch_loss += float(run_step(train_step))
        timing.step_done()
        bar.set_postfix_str(f"epoch {epoch + 1}/{config.epochs}, "
                            f"loss {epoch_loss / (step + 1):.4f}", refresh=False)
        bar.update()
    timing.end = time.perf_counter()
  bar.close()
  return model, timing, epoch_loss / steps_per_epoch


def _train_on_local_cluster(config):
  if config.strategy in ("ps", "parameter_server"):
    local = cluster.LocalCluster(num_ps=1, num_workers=1)
  else:
    if config.towers % MULTI_WORKER_PROCESSES:
      raise ValueError(f"--strategy=multi_worker runs {MULTI_WORKER_PROCESSES} worker "
                       "processes with the same number of towers each, so --towers must be "
                       f"a multiple of {MULTI_WORKER_PROCESSES}. Received: "
                       f"--towers={config.towers}.")
    local = cluster.LocalCluster(num_ps=0, num_workers=MULTI_WORKER_PROCESSES,
                                 cpus_per_worker=config.towers // MULTI_WORKER_PROCESSES)
  with local:
    results = local.run_on_workers(_train_in_worker, config=dataclasses.asdict(config))
  return results[0]  # The chief's (every worker trains the same model).


def _strategy_of_this_task(config):
  """This process's strategy in the cluster its environment names (TF_CONFIG, Slurm)."""
  if config.strategy == "multi_worker":
    return ds.MultiWorkerMirroredStrategy()
  return ds.ParameterServerStrategy()


def _train_in_worker(strategy, config):
  """Runs in the LocalCluster's worker process (module-level: it is pickled)."""
  config = Config(**config)
  config.progress = False  # The bar would come from another process.
  return train(config, strategy=strategy)


# --- the report ---


def describe_reduction(strategy, flag):
  """How `strategy` sums the towers' values, in words; None with no strategy."""
  ops = getattr(strategy, "cross_tower_ops", None)
  if ops is None:
    return None
  algorithm = getattr(ops, "algorithm", None)
  scheme = getattr(ops, "scheme", None)
  if scheme is not None:  # Across worker processes: TensorFlow's collective ops over gRPC.
    words = f"{scheme} all-reduce across the worker processes"
  else:
    words = f"{algorithm} all-reduce" if algorithm else "reduction to one device"
  words += f" ({type(ops).__name__})"
  return f"{words}, the default here" if flag == "auto" else words


def format_report(config, result, baseline=None):
  """The results as a few lines of text; `baseline` is the one-device run, if any."""
  lr = config.learning_rate or OPTIMIZERS[config.optimizer][2]
  runs = [result] + ([baseline] if baseline else [])
  rows = [
      ("", [r["label"] for r in runs]),
      ("held-out accuracy", [f"{r['accuracy']:.1%}" for r in runs]),
      ("final train loss", [f"{r['final_loss']:.4f}" for r in runs]),
      ("examples/second *", [f"{r['examples_per_second']:,.0f}" for r in runs]),
      ("wall time", [f"{r['wall_time']:.1f} s" for r in runs]),
  ]
  lines = [
      "",
      f"diststrat demo: {MODEL_DESCRIPTION} learns scikit-learn's 8x8 digits",
      f"  {result['train_examples']} training / {result['test_examples']} held-out images, "
      f"{config.epochs} epochs x {result['steps'] // config.epochs} batches of "
      f"{config.batch_size}, {config.optimizer} (learning rate {lr:g})",
      "  trained with " + ("Keras's model.fit, the model built and compiled in "
                           "strategy.scope()" if config.loop == "fit" else
                           "diststrat's custom loop (call_for_each_tower, "
                           f"diststrat.optimizers.{type(OPTIMIZERS[config.optimizer][0](lr)).__name__})"),
      "",
  ]
  lines += [(f"  {name:<20}" + "".join(f"{c:<27}" for c in cells)).rstrip()
            for name, cells in rows]
  lines.append("")
  devices = result["devices"]
  workers = result.get("workers", 1)
  lines.append(f"  strategy   {result['strategy']} on "
               f"{', '.join(short_name(d) for d in devices)}" +
               (f" of each of {workers} worker processes" if workers > 1 else ""))
  if result["reduction"]:
    lines.append(f"  reduction  {result['reduction']}")
  if result["copies"] > 1:
    where = f" in each of {workers} processes" if workers > 1 else ""
    lines.append(f"  variables  {result['copies']} copies of each weight{where} (batch norm's "
                 "moving statistics included), one per device; they differ by at most "
                 f"{result['copies_max_difference']:g}")
  if baseline:
    ratio = result["examples_per_second"] / baseline["examples_per_second"]
    lines.append(f"  speed      {ratio:.2f}x the examples/second of one device")
    if len(devices) * workers > 1 and all("CPU" in d for d in devices):
      lines.append(f"             (the {len(devices) * workers} logical CPU devices share "
                   f"{os.cpu_count()} cores: expect a speed-up only on GPUs)")
  lines.append("  * timed after the first step, so tf.function tracing is excluded "
               f"(first step: {result['first_step_time']:.1f} s)")
  return "\n".join(lines) + "\n"


# --- the command line ---


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}. Flags look like --towers=2.")
  config = Config(strategy=FLAGS.strategy, towers=FLAGS.towers, epochs=FLAGS.epochs,
                  batch_size=FLAGS.batch_size, reduction=FLAGS.reduction,
                  learning_rate=FLAGS.learning_rate, optimizer=FLAGS.optimizer,
                  seed=FLAGS.seed, loop=FLAGS.loop, progress=True)
  environment = cluster.cluster_from_environment()
  if environment is not None and config.strategy in CLUSTER_STRATEGIES:
    config.progress = False  # Progress bars of several processes would mix.
  if (environment is not None and config.strategy in CLUSTER_STRATEGIES
      and environment.task_id != 0):  # Worker 0 reports and compares; the others are done.
    result = train(config)
    print(f"{result['label']}: worker {environment.task_id} done, held-out accuracy "
          f"{result['accuracy']:.1%}")
    return
  result = train(config)
  baseline = None
  if FLAGS.compare and config.strategy != "default":
    baseline = train(dataclasses.replace(config, strategy="default"))
  sys.stdout.write(format_report(config, result, baseline))


if __name__ == "__main__":
  app.run(main)
