"""Tasks of one cluster on one machine share its cores (_cluster_runtime/_host_threads.py)."""

import socket

import pytest
import tensorflow as tf

from diststrat._cluster_runtime import _exposure
from diststrat._cluster_runtime import _host_threads


def test_tasks_on_this_machine_counts_local_addresses_of_every_job():
  spec = {"worker": ["127.0.0.1:1000", "localhost:1001", f"{socket.gethostname()}:1002",
                     "[::1]:1003", "nosuchhost.invalid:1004"],
          "ps": ["127.0.0.1:1005", "192.0.2.1:1006"]}  # 192.0.2.0/24: documentation only.
  assert _host_threads.tasks_on_this_machine(spec) == 5


class _Threading:
  """tf.config.threading's intra-op calls, recorded (TensorFlow runs already here)."""

  def __init__(self, monkeypatch, current=0):
    self.current, self.set_to = current, None
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads",
                        lambda: self.current)
    monkeypatch.setattr(tf.config.threading, "set_intra_op_parallelism_threads", self.set)

  def set(self, value):
    self.set_to = value


@pytest.mark.parametrize("cores, local, expected", [
    (2, 2, 1), (8, 2, 4), (8, 3, 2), (2, 4, 1), (8, 1, None), (1, 2, None)])
def test_a_worker_takes_its_share_of_the_cores(monkeypatch, cores, local, expected):
  monkeypatch.delenv(_host_threads.THREADS_VARIABLE, raising=False)
  monkeypatch.setattr(_host_threads, "usable_cores", lambda: cores)
  monkeypatch.setattr(_host_threads, "machine_cores", lambda: cores)
  threading = _Threading(monkeypatch)
  spec = {"worker": [f"127.0.0.1:{1000 + i}" for i in range(local)] + ["192.0.2.1:1"]}
  assert _host_threads.share_cores(spec, "test") == expected
  assert threading.set_to == expected


def test_the_programs_thread_count_stands(monkeypatch):
  monkeypatch.setattr(_host_threads, "usable_cores", lambda: 8)
  monkeypatch.setattr(_host_threads, "machine_cores", lambda: 8)
  spec = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"]}
  threading = _Threading(monkeypatch, current=6)  # set_intra_op_parallelism_threads(6)
  assert _host_threads.share_cores(spec, "test") is None and threading.set_to is None
  threading = _Threading(monkeypatch)
  monkeypatch.setenv(_host_threads.THREADS_VARIABLE, "3")
  assert _host_threads.share_cores(spec, "test") is None and threading.set_to is None


def test_nothing_is_set_once_tensorflow_runs_and_the_log_says_so(monkeypatch, caplog):
  monkeypatch.delenv(_host_threads.THREADS_VARIABLE, raising=False)
  monkeypatch.setattr(_host_threads, "usable_cores", lambda: 8)
  monkeypatch.setattr(_host_threads, "machine_cores", lambda: 8)
  monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: 0)
  tf.constant(1.0).numpy()  # TensorFlow's pools exist: it refuses a new size.
  spec = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"]}
  with caplog.at_level("INFO", logger="diststrat"):
    assert _host_threads.share_cores(spec, "test") is None
  assert "TensorFlow already ran in this process" in caplog.text
  assert "give this process its share (4)" in caplog.text


def test_a_pinned_process_keeps_its_cores(monkeypatch):
  # taskset/numactl/--cpu-bind chose 4 of the 16 cores for it: dividing again would
  # leave it 2 threads on 4 cores.
  monkeypatch.delenv(_host_threads.THREADS_VARIABLE, raising=False)
  monkeypatch.setattr(_host_threads, "usable_cores", lambda: 4)
  monkeypatch.setattr(_host_threads, "machine_cores", lambda: 16)
  threading = _Threading(monkeypatch)
  spec = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"]}
  assert _host_threads.share_cores(spec, "test") is None and threading.set_to is None


def _own_address():
  """A non-loopback IPv4 address of this machine (connecting a UDP socket sends nothing)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    try:
      probe.connect(("192.0.2.1", 9))
    except OSError:
      pytest.skip("no IPv4 route here")
    own = probe.getsockname()[0]
  if own.startswith("127."):
    pytest.skip("only a loopback address here")
  return own


def test_an_address_counts_as_local_only_if_this_machine_has_it(monkeypatch):
  own = _own_address()
  spec = {"worker": [f"{own}:1", "127.0.0.1:2", "192.0.2.1:3"]}
  monkeypatch.setattr(_exposure, "_binds_any_address", lambda version: False)
  assert _host_threads.tasks_on_this_machine(spec) == 2  # Its own address binds.
  # ip_nonlocal_bind=1: every address binds, so binding proves nothing; only loopback.
  monkeypatch.setattr(_exposure, "_binds_any_address", lambda version: True)
  assert _host_threads.tasks_on_this_machine(spec) == 1
