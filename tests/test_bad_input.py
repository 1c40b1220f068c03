"""Bad input gets a clear error at the call: what was wrong, what was received, the fix.

Each case here was once accepted silently (and ran something else than asked) or failed
later with TensorFlow's or Python's own error. Cluster specs are checked before any
connection is made, so these need no cluster.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import diststrat as ds
from diststrat._cluster_runtime import _cluster_spec
from conftest import CPUS

EXISTING = r"it has \['/job:localhost/replica:0/task:0/device:CPU:0'"


@pytest.mark.parametrize("make, what, missing", [
    (lambda: ds.MirroredStrategy(["/gpu:0", "/gpu:1"]), "devices", "GPU:0"),
    (lambda: ds.MirroredStrategy(["/cpu:7"]), "devices", "CPU:7"),
    (lambda: ds.ParameterServerStrategy(worker_devices=["/gpu:0"]), "worker_devices", "GPU:0"),
    (lambda: ds.ParameterServerStrategy(ps_devices=["/cpu:9"]), "ps_devices", "CPU:9"),
])
def test_a_device_that_does_not_exist_is_refused(make, what, missing):
  with pytest.raises(ValueError, match=rf"{what} must be devices that exist in this process. "
                     rf"Received: '/job:localhost/replica:0/task:0/device:{missing}'.* which "
                     rf"TensorFlow does not have; {EXISTING}"):
    make()


def test_reduce_onto_a_device_that_does_not_exist_is_refused():
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    per_tower = s.call_for_each_tower(lambda: tf.constant(1.0))
    with pytest.raises(ValueError, match=r"destinations must be devices that exist .*GPU:3"):
      s.reduce("sum", per_tower, destinations="/gpu:3")
    with pytest.raises(ValueError, match=r"reduce_to_device must be devices that exist .*GPU:5"):
      ds.cross_tower_ops.ReductionToOneDevice("/gpu:5").reduce("sum", per_tower, CPUS[0])


@pytest.mark.parametrize("value, shown", [("hello", r"'hello' \(str\)"),
                                          (object(), r"<object object at .*> \(object\)"),
                                          (tf.constant("x"), r".*\(EagerTensor, dtype string\)"),
                                          ({"a": "text"}, r"'text' \(str\)")])
def test_reduce_refuses_what_is_not_numbers(value, shown):
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope(), pytest.raises(TypeError, match=r"reduce\(\) combines numbers across towers: "
                                r"it takes per-tower values .* Received: " + shown):
    s.reduce("sum", value)


def test_reduce_still_takes_numbers_arrays_and_structures():
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    assert float(s.reduce("sum", 3.0).primary) == 3.0
    assert s.reduce("mean", np.ones([2], np.float32)).primary.numpy().tolist() == [1.0, 1.0]
    per_tower = s.call_for_each_tower(lambda: {"n": tf.constant(2)})
    assert int(s.reduce("sum", per_tower)["n"].primary) == 4
    with pytest.raises(TypeError, match=r"batch_reduce\(\) combines numbers"):
      s.batch_reduce("sum", [("no", None)])


def test_update_needs_a_variable_and_a_callable():
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(1.0)
    with pytest.raises(TypeError, match=r"update\(\) takes a variable as var \(a tf.Variable, a "
                       r"Keras variable, or one created in the strategy's scope\). Received: "
                       r"var=<tf.Tensor.*\(EagerTensor\)"):
      s.update(tf.constant(1.0), lambda c: c)
    with pytest.raises(TypeError, match=r"update\(\) takes a callable as fn, such as a "
                       r"function or a lambda. Received: fn=5 \(int\)"):
      s.update(v, 5)
    with pytest.raises(TypeError, match=r"update_non_slot\(\) takes a callable as fn"):
      s.update_non_slot(s.non_slot_devices([v]), 1)


def _per_tower(s):
  return s.call_for_each_tower(lambda i: tf.cast(i, tf.float32) + 1.0, s.worker_device_index)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("kind", ["mirrored", "ps"])
def test_update_refuses_per_tower_values_and_values_missing_a_copy_of_var(kind, mode):
  # update() takes values mirrored over var's devices (V(var)). A PerDevice was taken
  # as one value per copy (MirroredStrategy: the copies of var silently diverged), and
  # a Mirrored with no copy where var lives (ParameterServerStrategy: a reduce without
  # destinations=var) failed in DistributedValues.get(), which named neither update()
  # nor the fix.
  s = (ds.MirroredStrategy(CPUS[:2]) if kind == "mirrored" else
       ds.ParameterServerStrategy(worker_devices=CPUS[:2], ps_devices=CPUS[2:3]))
  run = tf.function(lambda call: call()) if mode == "function" else (lambda call: call())
  with s.scope():
    v = tf.Variable(0.0)
    calls = [lambda: s.update(v, lambda c, x: c.assign_add(x), _per_tower(s)),
             lambda: s.update(v, lambda c, x=None: c.assign_add(x), x=_per_tower(s)),
             lambda: s.update_non_slot(s.non_slot_devices([v]), lambda x: x, _per_tower(s))]
    for call in calls:
      with pytest.raises(ValueError, match=r"takes values mirrored over the devices it "
                         r"updates.*Received: a PerDevice.*reduce\("):
        run(call)
    if kind == "ps":
      with pytest.raises(ValueError, match=r"update\(\) takes values mirrored over the "
                         r"devices it updates \['/job:localhost/replica:0/task:0/device:CPU:2'"
                         r"\].*Received: a Mirrored with no copy on .*CPU:2.*destinations=var"):
        run(lambda: s.update(v, lambda c, x: c.assign_add(x), s.reduce("sum", _per_tower(s))))
    assert [float(c.numpy()) for c in s.unwrap(v)] == [0.0] * len(s.unwrap(v))  # Unwritten.


def test_update_of_a_tower_local_variable_with_per_tower_values_names_the_towers_way():
  # A tower-local variable's copies differ on purpose: update() with a PerDevice wrote
  # each its tower's value before update() refused per-tower values, and the refusal
  # said to reduce them first, which gives every copy one value.
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    v = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM)
    per_tower = _per_tower(s)
    with pytest.raises(ValueError, match=r"Received: a PerDevice.*tower-local variable.*"
                       r"strategy.call_for_each_tower\(lambda x: var.assign\(x\), value\)"):
      s.update(v, lambda c, x: c.assign(x), per_tower)
    s.call_for_each_tower(lambda x: v.assign(x), per_tower)  # The way it names.
  assert [float(c.numpy()) for c in s.unwrap(v)] == [1.0, 2.0]


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_non_callables_are_refused_at_the_call(mode):
  s = ds.MirroredStrategy(CPUS[:2])

  def run(fn):
    return tf.function(fn)() if mode == "function" else fn()

  with s.scope():
    with pytest.raises(TypeError, match=r"call_for_each_tower\(\) takes a callable as fn.*"
                       r"Received: fn=3 \(int\)"):
      run(lambda: s.call_for_each_tower(3))
    with pytest.raises(TypeError, match=r"merge_call\(\) takes a callable as merge_fn, called "
                       r"as merge_fn\(strategy, \*args, \*\*kwargs\). Received: merge_fn=7"):
      run(lambda: s.call_for_each_tower(lambda: ds.get_tower_context().merge_call(7)))
    with pytest.raises(TypeError, match=r"distribute_dataset\(\) takes a callable as "
                       r"dataset_fn"):
      s.distribute_dataset(5)
    per_tower = s.call_for_each_tower(lambda: tf.constant([1.0]))
    with pytest.raises(ValueError, match=r"axis must be an integer. Received: axis='x'"):
      s.gather(per_tower, axis="x")


@pytest.mark.parametrize("towers", [None, 2])
def test_distribute_dataset_given_tf_distributes_forms_of_input_says_what_to_pass(towers):
  """A tf.data.Dataset itself (what tf.distribute's experimental_distribute_dataset
  takes) was refused as "not a callable", and a function of a tf.distribute.InputContext
  (what its distribute_datasets_from_function takes) failed with Python's bare "<lambda>()
  missing 1 required positional argument: 'ctx'"; both now say what to pass."""
  s = ds.DefaultStrategy() if towers is None else ds.MirroredStrategy(CPUS[:towers])
  dataset = tf.data.Dataset.range(8).batch(4)
  with s.scope():
    with pytest.raises(TypeError, match=r"distribute_dataset\(\) takes a function returning "
                       r"the tf.data.Dataset of global batches, not the dataset itself: "
                       r"pass `lambda: dataset`"):
      s.distribute_dataset(dataset)
    with pytest.raises(TypeError, match=r"distribute_dataset\(\) calls dataset_fn with no "
                       r"arguments, but it needs some: missing a required argument: 'ctx'\. "
                       r".*tf.distribute.InputContext.*function of no arguments"):
      s.distribute_dataset(lambda ctx: dataset)
    # Arguments with defaults, or bound by a partial, still work.
    for dataset_fn in (lambda batches=dataset: batches,
                       functools.partial(lambda batches: batches, dataset)):
      got = [tf.concat(s.unwrap(b), 0).numpy().tolist() if towers else b.numpy().tolist()
             for b in s.distribute_dataset(dataset_fn)]
      assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("value", [-5, 0, "soon", float("nan"), True])
def test_timeouts_must_be_positive_numbers(value):
  with pytest.raises(ValueError, match=r"tower_timeout must be a positive number of seconds. "
                     rf"Received: tower_timeout={value!r}"):
    ds.MirroredStrategy(CPUS[:1], tower_timeout=value)
  with pytest.raises(ValueError, match=r"tower_timeout must be a positive number"):
    ds.ParameterServerStrategy(tower_timeout=value)
  with pytest.raises(ValueError, match=r"collective_timeout must be a positive number"):
    ds.MultiWorkerMirroredStrategy(collective_timeout=value)


def _ps(spec, **kwargs):
  return ds.ParameterServerStrategy(cluster_spec=spec, step_timeout=2, **kwargs)


@pytest.mark.parametrize("spec, kwargs, message", [
    ({"ps": [2222], "worker": ["127.0.0.1:1"]}, {},
     r"cluster_spec\['ps'\] must hold 'host:port' addresses with a port from 1 to 65535, such "
     r"as '127.0.0.1:2222' or '\[::1\]:2222'. Received: 2222 \(int\)"),
    ({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:1"]}, {}, r"Received: '127.0.0.1:0'"),
    ({"ps": ["127.0.0.1:70000"], "worker": ["127.0.0.1:1"]}, {}, r"Received: '127.0.0.1:70000'"),
    ({"ps": ["grpc://127.0.0.1:2"], "worker": ["127.0.0.1:1"]}, {},
     r"cluster_spec\['ps'\] must hold plain 'host:port' addresses: TensorFlow's gRPC runtime "
     r"adds the scheme itself. Received: 'grpc://127.0.0.1:2'. Write '127.0.0.1:2'."),
    ({"ps": ["127.0.0.1:2", "127.0.0.1:2"], "worker": ["127.0.0.1:1"]}, {},
     r"Each task of cluster_spec needs its own address: two tasks cannot listen on one port. "
     r"Received: '127.0.0.1:2' for both /job:ps/replica:0/task:0 and /job:ps/replica:0/task:1"),
    ({"ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:2"]}, {},
     r"Received: '127.0.0.1:2' for both /job:ps/replica:0/task:0 and "
     r"/job:worker/replica:0/task:0"),
    # Host names are case-insensitive and "02" is port 2: one address, spelled twice.
    ({"ps": ["LocalHost:2"], "worker": ["localhost:02"]}, {},
     r"Each task of cluster_spec needs its own address: two tasks cannot listen on one port. "
     r"Received: 'LocalHost:2' for /job:ps/replica:0/task:0 and 'localhost:02' for "
     r"/job:worker/replica:0/task:0, one address spelled twice"),
    # Equal only after name resolution: both passed the check and failed at connect.
    ({"ps": ["localhost:2"], "worker": ["127.0.0.1:2"]}, {},
     r"Each task of cluster_spec needs its own address: two tasks cannot listen on one port. "
     r"Received: 'localhost:2' for /job:ps/replica:0/task:0 and '127.0.0.1:2' for "
     r"/job:worker/replica:0/task:0, one address: both hosts resolve to 127.0.0.1"),
    ({"ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:1"]}, {"task_id": True},
     r"task_id must be an index into cluster_spec\['worker'\], from 0 to 0. Received: "
     r"task_id=True"),
    # A cluster with no task for this worker was refused in words that name none of it:
    # "one of [] ..." (no worker job) and "from 0 to -1" (an empty worker job); a task id
    # that is not an integer as "from 0 to 0. Received: task_id='0'".
    ({"ps": ["127.0.0.1:2"]}, {},
     r"cluster_spec names no task for this worker process: it has no job besides 'ps' "
     r"with an address .* Received: cluster_spec=\{'ps': \['127.0.0.1:2'\]\}"),
    ({"ps": ["127.0.0.1:2"], "worker": []}, {},
     r"cluster_spec\['worker'\] lists no address, so this process cannot be task 0 of it. "
     r"Add this task's address to that job"),
    ({"ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:1"]}, {"task_id": "0"},
     r"from 0 to 0. Received: task_id='0' \(str, not an integer\)"),
])
def test_bad_cluster_specs_are_refused_before_connecting(spec, kwargs, message):
  with pytest.raises(ValueError, match=message):
    _ps(spec, **kwargs)


def test_host_names_that_do_not_resolve_are_left_to_connecting(monkeypatch):
  # The duplicate check resolves only names that share a port, within a bound; a name
  # that fails or hangs (a bad DNS) is left out of it, and the spec passes.
  import socket  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  from diststrat._cluster_runtime import _cluster_spec  # pylint: disable=g-import-not-at-top
  release, asked, real_getaddrinfo = threading.Event(), [], socket.getaddrinfo

  def getaddrinfo(host, port, type=0):  # pylint: disable=redefined-builtin
    asked.append(host)
    if host == "hangs":
      release.wait(10)
    if host in ("hangs", "fails"):
      raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return real_getaddrinfo(host, port, type=type)

  monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
  monkeypatch.setattr(_cluster_spec, "_RESOLVE_TIMEOUT", 0.2)
  try:
    spec = {"ps": ["hangs:2", "fails:2"], "worker": ["127.0.0.1:2", "localhost:3"]}
    assert _cluster_spec.normalize_cluster_spec(spec, "worker", 0) == spec
    assert sorted(asked) == ["127.0.0.1", "fails", "hangs"]  # Not localhost: port 3.
    with pytest.raises(ValueError, match=r"'127.0.0.1:4' for /job:worker/replica:0/task:0 "
                                         r"and 'localhost:4' for /job:worker/replica:0/task:1"):
      _cluster_spec.normalize_cluster_spec(
          {"ps": ["hangs:4"], "worker": ["127.0.0.1:4", "localhost:4"]}, "worker", 0)
  finally:
    release.set()


def test_a_frozen_ps_at_start_from_the_environment_is_reported_within_step_timeout(
    monkeypatch):
  # Started from TF_CONFIG (the launcher, Slurm, Kubernetes), a worker first waited up to
  # step_timeout for its PS tasks, asking every 2 s, then asked them again with a
  # deadline of step_timeout: a PS that listens but never answers (frozen) was reported
  # after 2.5 x step_timeout. Every probe now ends within step_timeout of the first.
  # The probe and the clock are faked: a probe of a frozen task takes its whole timeout
  # on the fake clock, so no real time passes and the load of the machine cannot matter.
  from diststrat import _tf_internal  # pylint: disable=g-import-not-at-top
  from diststrat._cluster_runtime.parameter_server import _connection  # pylint: disable=g-import-not-at-top

  class Clock:
    now = 1000.0

    def monotonic(self):
      return self.now

    def sleep(self, seconds):
      self.now += seconds

  clock, probes = Clock(), []

  def frozen(addresses, timeout):
    probes.append((clock.now - 1000.0, timeout))
    clock.now += timeout
    return [f"did not answer within {timeout:g} s (frozen, overloaded or cut off)"
            for _ in addresses]

  monkeypatch.setattr(_connection, "time", clock)
  monkeypatch.setattr(_tf_internal, "probe_tf_server", frozen)
  monkeypatch.setenv("TF_CONFIG", '{"cluster": {"ps": ["127.0.0.1:2"], "worker": '
                     '["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}')
  with pytest.raises(ds.errors.ClusterError, match=r"Cannot connect /job:worker/replica:0/"
                     r"task:0 to the cluster: parameter server task /job:ps/replica:0/"
                     r"task:0 at 127.0.0.1:2 did not answer"):
    ds.ParameterServerStrategy(step_timeout=1.5)
  assert probes and clock.now - 1000.0 <= 1.5, probes


@pytest.mark.parametrize("role", ["parameter_server", "multi_worker", "server"])
def test_a_numpy_integer_task_id_is_taken_as_the_int(role):
  # Refused before ("task_id must be an index into cluster_spec['worker'], from 0 to 1.
  # Received: task_id=np.int64(1)"), though LocalCluster takes numpy task ids.
  spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
  if role != "multi_worker":
    spec["ps"] = ["127.0.0.1:3"]
  expected = _cluster_spec.resolve_cluster(spec, "worker", 1, role=role)
  config = _cluster_spec.resolve_cluster(spec, "worker", np.int64(1), role=role)
  assert config == expected and type(config.task_id) is int


def test_multi_worker_refuses_duplicate_workers_before_starting_a_server():
  # Checked before TensorFlow is touched: this process (TensorFlow long initialized) would
  # otherwise fail with "must be created before TensorFlow initializes".
  with pytest.raises(ValueError, match=r"Received: '127.0.0.1:5' for both "
                     r"/job:worker/replica:0/task:0 and /job:worker/replica:0/task:1"):
    ds.MultiWorkerMirroredStrategy(cluster_spec={"worker": ["127.0.0.1:5", "127.0.0.1:5"]})


def test_mirrored_refuses_a_cross_tower_ops_that_is_not_one():
  # Once accepted, then AttributeError ('str' object has no attribute ...) at the first reduce.
  with pytest.raises(TypeError, match=r"cross_tower_ops must be a diststrat.cross_tower_ops."
                     r"CrossTowerOps \(such as AllReduceCrossTowerOps\(\"naive\"\) or "
                     r"ReductionToOneDevice\(\)\), or None to choose one by measurement. "
                     r"Received: cross_tower_ops='nccl' \(str\). For an all-reduce algorithm "
                     r"by name, pass AllReduceCrossTowerOps\('nccl'\)."):
    ds.MirroredStrategy(CPUS[:2], cross_tower_ops="nccl")
  with pytest.raises(TypeError, match=r"Received: cross_tower_ops=<class .*AllReduceCrossTowerOps"
                     r".*\(type\)\.$"):
    ds.MirroredStrategy(CPUS[:2], cross_tower_ops=ds.cross_tower_ops.AllReduceCrossTowerOps)
  ops = ds.cross_tower_ops.AllReduceCrossTowerOps("naive")
  assert ds.MirroredStrategy(CPUS[:2], cross_tower_ops=ops).cross_tower_ops is ops


def _run(mode, fn):
  return tf.function(fn)() if mode == "function" else fn()


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_batch_reduce_refuses_what_is_not_a_list_of_pairs(mode):
  # Once: TypeError: 'PerDevice' object is not iterable.
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    with pytest.raises(ValueError, match=r"batch_reduce\(\) takes value_destination_pairs, a "
                       r"list of \(value, destinations\) pairs such as \[\(per_tower, None\)\]. "
                       r"Received: value_destination_pairs=PerDevice\(.*\(PerDevice\). To "
                       r"reduce one value, call reduce\(aggregation, value, destinations\)."):
      _run(mode, lambda: s.batch_reduce(
          "sum", s.call_for_each_tower(lambda: tf.constant(1.0))))
    with pytest.raises(ValueError, match=r"Received: value_destination_pairs\[1\]=3.0 \(float\)."
                       r" Pair each value with its destinations \(None for the default\)."):
      _run(mode, lambda: s.batch_reduce("sum", [(1.0, None), 3.0]))
    pairs = zip([s.call_for_each_tower(lambda: tf.constant(2.0))], [None], strict=True)
    assert float(_run(mode, lambda: s.batch_reduce("sum", pairs)[0].primary)) == 4.0


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("axis", [2, 5, -3])
def test_gather_refuses_an_axis_the_values_do_not_have(mode, axis):
  # Once: TensorFlow's InvalidArgumentError from ConcatV2.
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    per_tower = s.call_for_each_tower(lambda: tf.ones([2, 3]))
    with pytest.raises(ValueError, match=r"gather\(\) concatenates along an axis of the towers' "
                       r"values, which have rank 2 \(shapes \(2, 3\), \(2, 3\)\): axis must be "
                       rf"from -2 to 1. Received: axis={axis}. Pass an axis the values have"):
      _run(mode, lambda: s.gather(per_tower, axis=axis))
    with pytest.raises(ValueError, match=r"rank 0 .*axis must be from -1 to 0. Received: axis=1"):
      _run(mode, lambda: s.gather({"n": s.call_for_each_tower(lambda: tf.constant(1.0))},
                                  axis=1))
    assert _run(mode, lambda: s.gather(per_tower, axis=-1)).shape == (2, 6)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("mirrored", [True, False])
@pytest.mark.parametrize("value, shown", [("x", r"'x' \(str\)"),
                                          (tf.constant(1.0), r"<tf.Tensor.*\((EagerTensor|"
                                                             r"SymbolicTensor|Tensor)\)")])
def test_read_var_needs_a_variable(mode, mirrored, value, shown):
  # Once: AttributeError: 'str' object has no attribute 'read_value'.
  s = ds.MirroredStrategy(CPUS[:2]) if mirrored else ds.get_distribution_strategy()
  with s.scope(), pytest.raises(
      TypeError, match=r"read_var\(\) takes a variable as v \(a tf.Variable, a Keras variable, "
      r"or one created in the strategy's scope\). Received: v=" + shown + r". A tensor is "
      r"already a value: use it directly"):
    _run(mode, lambda: s.read_var(value))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_reduce_refuses_booleans_in_every_strategy(mode):
  # Once: TensorFlow's raw TypeError from AddN under Mirrored, and the tensor returned
  # unchanged by the default strategy.
  message = (r"reduce\(\) combines numbers across towers: it takes per-tower values \(what "
             r"call_for_each_tower returns\) of a float, integer or complex dtype, .*"
             r"dtype bool\). Booleans cannot be summed or averaged: cast them first, such as "
             r"tf.cast\(value, tf.int32\)")
  mirrored = ds.MirroredStrategy(CPUS[:2])
  with mirrored.scope():
    with pytest.raises(TypeError, match=message):
      _run(mode, lambda: mirrored.reduce(
          "sum", mirrored.call_for_each_tower(lambda: tf.constant(True))))
    with pytest.raises(TypeError, match=message):
      _run(mode, lambda: mirrored.batch_reduce("mean", [(tf.constant([True]), None)]))
    with pytest.raises(TypeError, match=message):
      _run(mode, lambda: mirrored.reduce("sum", {"ok": 1.0, "flag": True}))
  default = ds.get_distribution_strategy()
  with pytest.raises(TypeError, match=message):
    _run(mode, lambda: default.reduce("sum", tf.constant(True)))
  counted = _run(mode, lambda: default.reduce("sum", tf.cast(tf.constant(True), tf.int32)))
  assert int(counted) == 1


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("ops", [
    ds.cross_tower_ops.AllReduceCrossTowerOps("naive"),
    ds.cross_tower_ops.AllReduceCrossTowerOps("hierarchical_copy"),
    ds.cross_tower_ops.AllReduceCrossTowerOps("collective"),
    ds.cross_tower_ops.ReductionToOneDevice()], ids=repr)
def test_cross_tower_ops_check_their_arguments_in_both_modes(mode, ops):
  # Once: TensorFlow's "Value passed to parameter 'inputs' has DataType bool not in list
  # of allowed values" (strings: summed by concatenation with hierarchical_copy), and
  # inside tf.function every argument error rebuilt by AutoGraph ("in user code:" and a
  # traceback in front of the message).
  from diststrat.values import PerDevice

  def per_device(*values):
    return PerDevice(dict(zip(CPUS, [tf.constant(v) for v in values], strict=False)))

  with pytest.raises(TypeError, match=r"^reduce\(\) combines numbers across towers.*dtype "
                     r"bool\). Booleans cannot be summed or averaged: cast them first"):
    _run(mode, lambda: ops.reduce("sum", per_device(True, False)))
  with pytest.raises(TypeError, match=r"^batch_reduce\(\) combines numbers.*dtype string"):
    _run(mode, lambda: ops.batch_reduce("sum", [(per_device("a", "b"), None)]))
  with pytest.raises(ValueError, match=r"^aggregation must be one of"):
    _run(mode, lambda: ops.reduce("max", per_device(1.0, 2.0)))
  with pytest.raises(ValueError, match=r"^reduce\(\) needs components of one shape"):
    _run(mode, lambda: ops.reduce("sum", per_device([1.0], [1.0, 2.0])))
  with pytest.raises(ValueError, match=r"^broadcast\(\) needs destinations"):
    _run(mode, lambda: ops.broadcast(tf.constant(1.0), None))
  with pytest.raises(ValueError, match=r"^destinations must be devices that exist"):
    _run(mode, lambda: ops.reduce("sum", per_device(1.0, 2.0), "/gpu:0"))
  total = _run(mode, lambda: ops.reduce("sum", per_device(1.0, 2.0)))
  assert [float(v) for v in total.values] == [3.0, 3.0]
  copies = _run(mode, lambda: ops.broadcast(tf.constant("text"), CPUS[:2]))
  assert [bytes(v.numpy()) for v in copies.values] == [b"text", b"text"]


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("mirrored", [True, False])
def test_non_slot_devices_and_colocate_vars_with_need_variables(mode, mirrored):
  # Once: non_slot_devices(None) raised "'NoneType' object is not iterable", one variable
  # "Cannot iterate over a scalar tensor" (OperatorNotAllowedInGraphError traced), a
  # tensor item AttributeError "Tensor.name is undefined" (default strategy), and traced
  # every message came prefixed with "in user code:"; colocate_vars_with(None) was
  # ignored without a word.
  s = ds.MirroredStrategy(CPUS[:2]) if mirrored else ds.get_distribution_strategy()
  with s.scope():
    v = tf.Variable(1.0, name="w")
    with pytest.raises(TypeError, match=r"^non_slot_devices\(\) takes var_list, a list of "
                       r"variables. Received: var_list=<variable 'w'>, one variable, not a "
                       r"list. Pass \[variable\]"):
      _run(mode, lambda: s.non_slot_devices(v))
    with pytest.raises(TypeError, match=r"^non_slot_devices\(\) takes var_list, a list of "
                       r"variables. Received: var_list=None \(NoneType\)"):
      _run(mode, lambda: s.non_slot_devices(None))
    with pytest.raises(TypeError, match=r"^non_slot_devices\(\) .*Received: var_list\[0\]="
                       r"<tf.Tensor"):
      _run(mode, lambda: s.non_slot_devices([tf.constant(1.0)]))
    with pytest.raises(ValueError, match=r"^non_slot_devices\(\) needs at least one variable"):
      _run(mode, lambda: s.non_slot_devices([]))
    with pytest.raises(TypeError, match=r"^colocate_vars_with\(\) takes a variable as var .*"
                       r"Received: var=None \(NoneType\)"):
      s.colocate_vars_with(None)
    assert s.non_slot_devices([v]) is not None


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gather_refuses_values_whose_other_dimensions_differ(mode):
  # Once: TensorFlow's InvalidArgumentError from ConcatV2 eagerly, a ValueError about
  # "Dimension 0 in both shapes" traced (the dimension of a shape of the axis tensor).
  s = ds.MirroredStrategy(CPUS[:2])
  with s.scope():
    per_tower = s.call_for_each_tower(
        lambda: tf.ones([2, 3 + ds.get_tower_context().tower_id]))
    with pytest.raises(ValueError, match=r"^gather\(\) concatenates the towers' values along "
                       r"axis 0, so their other dimensions must agree. Received: shapes "
                       r"\(2, 3\), \(2, 4\). Make every tower return values of one shape "
                       r"but along axis, or gather along axis=1"):
      _run(mode, lambda: s.gather(per_tower, axis=0))
    assert _run(mode, lambda: s.gather(per_tower, axis=1)).shape == (2, 7)
    ragged = s.call_for_each_tower(lambda: tf.ones([1 + ds.get_tower_context().tower_id, 3]))
    assert _run(mode, lambda: s.gather(ragged)).shape == (3, 3)
    with pytest.raises(ValueError, match=r"other dimensions must agree. Received: shapes "
                       r"\(1, 3\), \(2,\)"):
      _run(mode, lambda: s.gather(s.call_for_each_tower(
          lambda: tf.ones([1, 3]) if ds.get_tower_context().tower_id == 0 else tf.ones([2]))))


def test_strategies_take_logical_devices_and_explain_a_count():
  # Once: MirroredStrategy(2) raised "'int' object is not iterable", and the devices of
  # tf.config.list_logical_devices() (which tf.distribute.MirroredStrategy takes) were
  # refused as not device strings.
  with pytest.raises(ValueError, match=r"devices must be a list of device strings, such as "
                     r"\['/gpu:0', '/gpu:1'\]. Received: devices=2 \(int\). To use 2 "
                     r"devices, pass diststrat.local_devices\(\)\[:2\]."):
    ds.MirroredStrategy(2)
  logical = tf.config.list_logical_devices("CPU")[:2]
  assert ds.MirroredStrategy(logical).worker_devices == tuple(CPUS[:2])
  assert ds.canonicalize_device(logical[1]) == CPUS[1]


@pytest.mark.parametrize("make", [
    lambda: ds.MirroredStrategy(["/cpu:*"]),
    lambda: ds.canonicalize_device("/device:CPU:*"),
    lambda: ds.pipeline.GPipe([tf.keras.layers.Dense(2)], devices=["/cpu:*"]),
])
def test_a_wildcard_device_is_refused(make):
  # "/cpu:*" was taken as CPU:0: a strategy or pipeline on one device where the user
  # asked for all of them.
  with pytest.raises(ValueError, match=r"Expected one device, such as '/gpu:0'. Received: "
                     r"device='/(device:)?(cpu|CPU):\*', a wildcard for several. Name each "
                     r"device; diststrat.local_devices\(\) lists them."):
    make()


@pytest.mark.parametrize("make", [
    lambda devices: ds.MirroredStrategy(set(devices)),
    lambda devices: ds.MirroredStrategy(frozenset(devices)),
    lambda devices: ds.values.regroup([1, 2], set(devices)),
])
def test_unordered_devices_are_refused(make):
  """A set was accepted: the towers' order (tower ids, batch parts) changed between runs."""
  with pytest.raises(ValueError, match=r"devices must be an ordered sequence \(a list or "
                     r"tuple\): their order is the towers' order"):
    make(CPUS[:2])


def test_constructors_and_dataset_errors_keep_their_message_in_a_tf_function():
  """Optimizers made in a step's first trace, the batches of an unbatched dataset taken
  with next() in a step, and the other constructors' argument checks: their errors
  reached a tf.function's caller rewritten by AutoGraph ("in user code:", files and
  lines, then the message)."""
  s = ds.MirroredStrategy(CPUS[:2])
  unbatched = s.distribute_dataset(lambda: tf.data.Dataset.range(4))
  ops = ds.cross_tower_ops

  def next_unbatched():
    return next(iter(unbatched))

  cases = [
      next_unbatched,
      lambda: ds.PerDeviceDataset(3, CPUS[:2]),
      lambda: ds.optimizers.GradientDescent(0.1, loss_reduction="max"),
      lambda: ds.optimizers.Momentum("fast", 0.9),
      lambda: ds.optimizers.Adam(learning_rate=None),
      lambda: ds.MirroredStrategy(CPUS[:2], cross_tower_ops="naive"),
      lambda: ops.AllReduceCrossTowerOps("fastest"),
      lambda: ops.ReductionToOneDevice(accumulation_fn=3),
      lambda: ops.CrossWorkerAllReduce(scheme="ring"),
  ]
  for i, fn in enumerate(cases):
    with pytest.raises((TypeError, ValueError)) as eager:
      fn()
    with pytest.raises((TypeError, ValueError)) as traced:
      tf.function(fn)()
    assert (type(traced.value), str(traced.value)) == (type(eager.value), str(eager.value)), i


def test_colocate_vars_with_refuses_what_names_no_device_at_the_call():
  """`colocate_vars_with(3.0)` was taken; the next variable created inside it failed with
  "destinations must be None, a device string, ..." (MirroredStrategy) or
  AttributeError "'float' object has no attribute 'device'" (the default strategy)."""
  for s in (ds.MirroredStrategy(CPUS[:2]), ds.get_distribution_strategy()):
    with s.scope():
      v = tf.Variable(1.0)

      def traced(s=s):
        s.colocate_vars_with(["/cpu:0", 1])

      for fn in (functools.partial(s.colocate_vars_with, 3.0), tf.function(traced)):
        with pytest.raises(TypeError, match=r"^colocate_vars_with\(\) takes a variable as "
                           r"var .*Received: var=(3.0 \(float\)|\['/cpu:0', 1\] \(list\))\. "
                           r"Pass the variable .*or what non_slot_devices\(\) returns"):
          fn()
      for anchor in (v, s.non_slot_devices([v])):  # Still taken.
        with s.colocate_vars_with(anchor):
          w = tf.Variable(2.0)
        assert [c.device for c in s.unwrap(w)] == [c.device for c in s.unwrap(v)]


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_broadcast_refuses_what_is_no_tensor_with_one_type_in_both_modes(strategy):
  """broadcast(object()) raised TensorFlow's ValueError "Attempt to convert a value ...
  with an unsupported type" in eager mode and its TypeError "Failed to convert elements
  of ..." inside a tf.function: one mistake, two types."""
  s = ds.DefaultStrategy() if strategy == "default" else ds.MirroredStrategy(CPUS[:2])
  message = (r"^broadcast\(\) copies tensors: it takes a tensor, a variable, or a value "
             r"tf.convert_to_tensor takes .* Received: <object object at .*> \(object\)")
  with s.scope():
    for mode in ("eager", "function"):
      with pytest.raises(TypeError, match=message):
        _run(mode, lambda: s.broadcast(object()))
      with pytest.raises(TypeError, match=message):
        _run(mode, lambda: s.broadcast({"a": 1.0, "b": [object()]}))
    # What it takes still broadcasts: numbers, strings, arrays, structures of them.
    copies = s.broadcast({"n": 2, "s": "text", "a": np.ones(2, np.float32)})
    assert [int(c) for c in s.unwrap(copies["n"])] == [2] * s.num_towers
    assert [bytes(tf.convert_to_tensor(c).numpy()) for c in s.unwrap(copies["s"])] == (
        [b"text"] * s.num_towers)
