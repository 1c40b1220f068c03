"""The fork server (diststrat/cluster/_forkserver.py): its children behave as `python -c`
processes would, are fresh, and never outlive it or the process that started it."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from diststrat.cluster import _forkserver

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("no_child_left")]  # (conftest.py)


@pytest.fixture(scope="module")
def server():
  server = _forkserver.ForkServer(preload=["numpy"]).start(timeout=120)
  yield server
  server.close()


def _run(server, tmp_path, code, argv=(), env=None, timeout=30):
  out, err = tmp_path / "out", tmp_path / "err"
  with open(out, "w") as o, open(err, "w") as e:
    process = server.spawn(code, argv, env=env, cwd=str(tmp_path),
                           fds={1: o.fileno(), 2: e.fileno()})
  status = process.wait(timeout)
  return status, out.read_text(), err.read_text()


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


def test_a_child_runs_code_as_python_c_would(server, tmp_path):
  code = textwrap.dedent("""
      import os, sys
      print(sys.argv, os.getcwd(), os.environ.get("ONLY"), os.environ.get("HOME"),
            __name__)
      print(sorted((k, repr(v)) for k, v in globals().items() if k.startswith("__")))
      sys.exit(7)
      """)
  status, out, _ = _run(server, tmp_path, code, ["a", "b"], env={"ONLY": "yes"})
  assert status == 7
  assert out.split("\n")[0].split() == [
      "['-c',", "'a',", "'b']", str(tmp_path), "yes", "None", "__main__"]
  # `__main__` as Python makes it (AutoGraph reads its __loader__ to find sources).
  expected = subprocess.run([sys.executable, "-c", code, "a", "b"], cwd=tmp_path,
                            env={"ONLY": "yes"}, capture_output=True, text=True,
                            check=False)
  assert (expected.returncode, expected.stdout) == (status, out)


def test_an_exception_exits_1_with_the_code_s_traceback(server, tmp_path):
  status, _, err = _run(server, tmp_path, "def f():\n  raise KeyError('boom')\nf()\n")
  assert status == 1
  assert err.startswith("Traceback (most recent call last):\n  File \"<string>\", line 3")
  assert "KeyError: 'boom'" in err and "_forkserver" not in err
  assert _run(server, tmp_path, "pass")[0] == 0
  assert _run(server, tmp_path, "import sys; sys.exit('bad')")[0] == 1


def test_signals_statuses_and_fresh_random_states(server, tmp_path):
  process = server.spawn("import time; time.sleep(60)")
  assert process.poll() is None
  process.send_signal(signal.SIGSTOP)
  process.kill()
  assert process.wait(10) == -signal.SIGKILL
  process.kill()  # Exited and reaped: a no-op, never another process.
  assert process.poll() == -signal.SIGKILL
  draws = [_run(server, tmp_path, "import numpy, random\n"
                "print(numpy.random.randint(1 << 30), random.randint(0, 1 << 30))")[1]
           for _ in range(2)]
  assert draws[0] != draws[1], draws  # Each child draws its own seed, as new processes do.


_OWNER = """
import sys, time
from diststrat.cluster import _forkserver
server = _forkserver.ForkServer().start(timeout=120)
child = server.spawn("import time; time.sleep(600)")
print(server.pid, child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_nothing_outlives_a_killed_owner():
  owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
  try:
    server_pid, child_pid = map(int, owner.stdout.readline().split())
    assert _alive(server_pid) and _alive(child_pid)
    owner.kill()
    owner.wait(10)
    deadline = time.monotonic() + 15
    while (_alive(server_pid) or _alive(child_pid)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not _alive(server_pid) and not _alive(child_pid)
  finally:
    owner.kill()
    owner.wait(10)


def test_a_stopped_server_refuses_work():
  server = _forkserver.ForkServer().start(timeout=120)
  child = server.spawn("import time; time.sleep(600)")
  server.close()  # Kills and reaps its children.
  assert not _alive(child.pid)
  with pytest.raises(_forkserver.ForkServerError, match="The fork server is stopped"):
    server.spawn("pass")


def test_a_server_that_died_is_named_by_every_request():
  """A request to a fork server that died raised `BrokenPipeError` from the pipe (so a
  `LocalCluster` leaving its `with` block raised it in place of the body's exception):
  it raises `ForkServerError` saying so. A bad request is refused, not fatal to it."""
  server = _forkserver.ForkServer().start(timeout=120)
  try:
    child = server.spawn("import time; time.sleep(600)")
    with pytest.raises(_forkserver.ForkServerError, match="could not signal"):
      child.send_signal(-9)  # No such signal: the server stays up.
    assert child.poll() is None
    server._process.kill()  # pylint: disable=protected-access
    server._process.wait(10)  # pylint: disable=protected-access
    for request in (child.poll, child.kill, lambda: server.spawn("pass")):
      with pytest.raises(_forkserver.ForkServerError,
                         match=r"The fork server (exited while asked|was killed)"):
        request()
  finally:
    server.close()
  deadline = time.monotonic() + 15
  while _alive(child.pid) and time.monotonic() < deadline:  # The death signal.
    time.sleep(0.05)
  assert not _alive(child.pid)
