"""Who can reach a cluster's TensorFlow servers (docs/security.md).

TensorFlow's gRPC server listens on every interface and runs any graph any client sends.
A `LocalCluster` therefore runs its processes in a private network namespace where the
system allows it: the tasks reach each other, and nothing outside the cluster reaches
them. These tests ask a PS task for its status from this process, over loopback, as an
outside client would: without isolation it answers.
"""

import logging

import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import _tf_internal
from diststrat._cluster_runtime import _exposure
from diststrat.cluster import _isolation

TIMEOUT = 120
pytestmark = pytest.mark.usefixtures("no_child_left")  # (conftest.py)


def _count_fn(strategy, n):
  with strategy.scope():
    counter = tf.Variable(0.0, name="counter")
  for _ in range(n):
    counter.assign_add(1.0)
  return float(counter.numpy())


def _namespaces_allowed():
  try:
    _isolation.Namespace.create().close()
    return True
  except OSError:
    return False


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_a_local_cluster_is_unreachable_from_outside_it():
  assert _namespaces_allowed(), (
      "this machine does not allow unprivileged network namespaces, which LocalCluster's "
      "isolation needs (docs/security.md); the CI machine does")
  with ds.cluster.LocalCluster(num_ps=1, num_workers=2, result_timeout=100) as cluster:
    assert cluster.isolated
    address = cluster.cluster_spec["ps"][0]
    [outcome] = _tf_internal.probe_tf_server([address], timeout=5)
    assert outcome is not None and outcome.startswith("cannot be reached"), outcome
    # Connecting from this process, outside the namespace, is refused at once with the
    # fix, by both cluster strategies (it was "cannot be reached ... Start the task(s) (or
    # fix cluster_spec)" after the probe), before any server or connection is made.
    spec = cluster.cluster_spec
    isolated = (r"The cluster_spec names /job:{job}/replica:0/task:0 at {address}, a task of "
                r"LocalCluster\(num_ps=1, num_workers=2, running\), which runs isolated in a "
                r"private network namespace: no process outside it, this one included "
                r"\(worker task {task} would connect from here\), can reach its tasks. Run "
                r"the workers' code inside the cluster with cluster.run_on_workers\(fn\), or "
                r"create it with LocalCluster\(..., isolate=False\) to connect from this "
                r"process")
    with pytest.raises(ds.errors.ClusterError, match=isolated.format(
        job="ps", address=spec["ps"][0], task=1)) as info:
      ds.ParameterServerStrategy(cluster_spec=spec, task_type="worker", task_id=1,
                                 step_timeout=5)
    assert info.value.task == "/job:ps/replica:0/task:0"
    localhost = "localhost:" + spec["worker"][0].rsplit(":", 1)[1]
    with pytest.raises(ds.errors.ClusterError, match=isolated.format(
        job="worker", address=localhost, task=0)):
      ds.MultiWorkerMirroredStrategy(cluster_spec={"worker": [localhost, spec["worker"][1]]})
    # Inside, the cluster works: both workers share the PS's counter.
    assert sorted(cluster.run_on_workers(_count_fn, n=5))[-1] == 10.0
  assert _exposure.isolated_owner(address) is None  # Forgotten when the cluster stops.


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT)
def test_without_isolation_any_local_process_reaches_the_ps():
  with ds.cluster.LocalCluster(num_ps=1, num_workers=1, isolate=False,
                               result_timeout=100) as cluster:
    assert not cluster.isolated
    address = cluster.cluster_spec["ps"][0]
    assert _tf_internal.probe_tf_server([address], timeout=30) == [None]
    assert cluster.run_on_workers(_count_fn, n=3) == [3.0]


def test_bad_hosts_and_isolation_settings_are_refused():
  with pytest.raises(ValueError, match=r"host must be a name or address this machine "
                                       r"resolves, such as '127.0.0.1'. Received: "
                                       r"host='not-a-host'"):
    ds.cluster.LocalCluster(host="not-a-host")
  with pytest.raises(ValueError, match=r"isolate=True runs the cluster in a private network "
                                       r"that has only loopback, so host must be a loopback "
                                       r"address"):
    ds.cluster.LocalCluster(host="0.0.0.0", isolate=True)
  with pytest.raises(ValueError, match=r"isolate must be None \(when possible\), True or "
                                       r"False. Received: isolate='yes'"):
    ds.cluster.LocalCluster(isolate="yes")


def test_starting_a_server_warns_once_per_process(monkeypatch, caplog):
  monkeypatch.setattr(_exposure, "_warned", [])
  monkeypatch.delenv(_exposure.ISOLATED_ENV, raising=False)
  with caplog.at_level(logging.WARNING, logger="diststrat"):
    _exposure.server_started("/job:ps/replica:0/task:0", "127.0.0.1:2222")
    _exposure.server_started("/job:ps/replica:0/task:1", "127.0.0.1:2223")
  [record] = caplog.records
  assert ("TensorFlow listens on every network interface (0.0.0.0:2222, whatever host the "
          "cluster spec names) and runs any graph any client sends, without "
          "authentication") in record.getMessage()
  assert "docs/security.md" in record.getMessage()
  caplog.clear()
  monkeypatch.setattr(_exposure, "_warned", [])
  monkeypatch.setenv(_exposure.ISOLATED_ENV, "1")
  with caplog.at_level(logging.WARNING, logger="diststrat"):
    _exposure.server_started("/job:ps/replica:0/task:0", "127.0.0.1:2222")
  assert "reachable only from the job's own processes" in caplog.records[0].getMessage()


def test_a_parameter_servers_warning_names_its_warm_up_server(monkeypatch, caplog):
  """A PS also runs its warm-up client's server, outside the cluster spec: the warning
  names that port too (it named only the PS's)."""
  monkeypatch.setattr(_exposure, "_warned", [])
  monkeypatch.delenv(_exposure.ISOLATED_ENV, raising=False)
  with caplog.at_level(logging.WARNING, logger="diststrat"):
    _exposure.server_started("/job:ps/replica:0/task:0", "127.0.0.1:2222", warm_up_port=40001)
  message = caplog.records[0].getMessage()
  assert "a second one on port 40001 (job diststrat_warm_up" in message, message
  assert "(0.0.0.0:2222 and 0.0.0.0:40001," in message, message
