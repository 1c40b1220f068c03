"""The process layer: how diststrat starts, watches and ends the processes of a cluster.

`LocalCluster` (a cluster for tests and examples) and `diststrat-run` (a job of a user's
script) both start, signal and describe their processes here; no other module of
diststrat starts a process (tests/test_architecture.py checks it). The pieces:

- `start_python(code, ...)`: a `python -c CODE` process, the one way to exec one. The
  launcher's tasks are such processes (they run the user's script as it would run
  alone); so are a fork server (`_forkserver.py`, whose forks are `LocalCluster`'s
  tasks) and the holder of a private network (`_isolation.py`).
- One orphan policy, `prologue(parent_pid, network)`: Python statements a task runs
  before anything else. It joins the job's private network, if any (a process that
  has started no thread yet can), asks Linux to SIGKILL the task when its parent dies
  (`PR_SET_PDEATHSIG`), and exits at once if the parent is already gone. The parent is
  the launcher for its tasks, and the fork server for `LocalCluster`'s. The fork server
  itself, which a cluster may start from any thread (the death signal follows the
  thread that started a process, not the process), ends when its connection to the
  cluster's process closes, killing its children: so nothing outlives the process that
  started a job, even one killed with SIGKILL.
- One private network per job, `private_network(...)`, with the one warning text for
  each case where there is none (docs/security.md).
- `free_ports`, `describe_exit`, `exit_status`, `task_environment`: the same ports, words,
  exit statuses and environment variables for both.
- `marked_processes` and `stop_marked`: the processes that carry a job's mark in their
  environment, so the launcher can stop what a task started in a session of its own
  (out of reach of its process group) when the job ends.
"""

from typing import Dict, List, Optional, Sequence

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

from diststrat._cluster_runtime._exposure import ISOLATED_ENV
from diststrat.cluster import _isolation

_PR_SET_PDEATHSIG = 1
ORPHANED_EXIT = 3
"""The exit status of a task whose parent died before its prologue ran."""


def task_name(task_type: str, task_id: int) -> str:
  """The TensorFlow name of a task: "/job:ps/replica:0/task:0"."""
  return f"/job:{task_type}/replica:0/task:{task_id}"


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
  """`count` distinct TCP ports that are free on `host` right now."""
  sockets = []
  try:
    for _ in range(count):
      sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      sock.bind((host, 0))
      sockets.append(sock)
    return [sock.getsockname()[1] for sock in sockets]
  finally:
    for sock in sockets:
      sock.close()


def describe_exit(returncode: Optional[int]) -> str:
  """How a process ended, from its `returncode` (negative: the signal that killed it).

  >>> describe_exit(-9)
  'was killed by signal SIGKILL (exit status -9)'
  >>> describe_exit(7)
  'exited with code 7'
  """
  if returncode is None:
    return "is still running"
  if returncode < 0:
    try:
      return (f"was killed by signal {signal.Signals(-returncode).name} (exit status "
              f"{returncode})")
    except ValueError:
      return f"was killed by signal {-returncode} (exit status {returncode})"
  return f"exited with code {returncode}"


def exit_status(returncode: int) -> int:
  """A shell's exit status for `returncode`: 128 + N for a process killed by signal N."""
  return 128 - returncode if returncode < 0 else returncode


# --- the orphan policy -----------------------------------------------------------------


def _death_signal_code(parent_pid: int) -> str:
  return (
      "import ctypes as _c, os as _o, signal as _s, sys as _y\n"
      "if _y.platform.startswith('linux'):\n"
      f"  if _c.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, int(_s.SIGKILL)) != 0:\n"
      "    raise OSError(_c.get_errno(), 'diststrat: prctl(PR_SET_PDEATHSIG) failed')\n"
      f"if _o.getppid() != {int(parent_pid)}:\n"
      f"  _o._exit({ORPHANED_EXIT})  # The parent died before this line: do not run.\n"
      "del _c, _o, _s, _y\n")


def join_code(network: Optional[_isolation.Namespace]) -> str:
  """Python statements that move the running process into `network` ("" for None)."""
  return "" if network is None else _isolation.join_code(network.holder_pid)


def prologue(parent_pid: int, network: Optional[_isolation.Namespace] = None) -> str:
  """What a task runs first: join `network` (if any), then die with `parent_pid`.

  Python statements, self-contained (they import nothing that starts a thread: joining
  a network namespace needs a single-threaded process).
  """
  return join_code(network) + _death_signal_code(parent_pid)


# --- private networks ------------------------------------------------------------------


@dataclasses.dataclass
class Network:
  """A job's network: its private namespace, or None and why not (`warning`)."""
  namespace: Optional[_isolation.Namespace]
  warning: Optional[str] = None

  def close(self) -> None:
    if self.namespace is not None:
      self.namespace.close()


_EXPOSED = ("TensorFlow's servers listen on every interface and run any graph any client "
            "sends, so whoever can reach {where} can read and overwrite the job's "
            "variables and run code in its processes.")


def private_network(isolate: Optional[bool], loopback: bool, who: str,
                    without: str = "isolate=False") -> Network:
  """The network of a job that `who` ("LocalCluster", "diststrat-run") starts.

  Args:
    isolate: True (a private namespace, or `OSError` saying why there cannot be one),
      None (one where the system allows it, else a warning), False (none, and a warning
      that the servers are reachable).
    loopback: whether the job's tasks reach each other on loopback (one machine): only
      then can they share a private network.
    who: what starts the job, for the warnings.
    without: how the caller asked for no private network, for the warning.

  Raises:
    OSError: `isolate` is True and the system does not allow a private namespace.
  """
  if not loopback:
    return Network(None, (
        "a job across machines cannot run in a private network: "
        + _EXPOSED.format(where="the ports of its hosts") +
        " Run it on a private network or behind a firewall that admits only the job's "
        "hosts; see docs/security.md."))
  if isolate is False:
    return Network(None, (
        f"{without}: the job runs without a private network. "
        + _EXPOSED.format(where="this machine's ports") + " See docs/security.md."))
  try:
    return Network(_isolation.Namespace.create())
  except OSError as e:
    if isolate:
      raise
    return Network(None, (
        f"this system does not allow a private network namespace ({e}), so {who}'s "
        "TensorFlow servers are reachable: " + _EXPOSED.format(where="this machine's ports")
        + " Allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        "or the container's seccomp profile), or run on a machine whose ports are closed "
        "to others; see docs/security.md."))


# --- starting processes ----------------------------------------------------------------


def task_environment(base: Dict[str, str], task_type: str, network: Network,
                     extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
  """The environment of a task: `base`, whether it is in a private network, `extra`.

  A parameter server sees no GPU: its variables live on its CPU.
  """
  env = dict(base)
  env[ISOLATED_ENV] = "1" if network.namespace is not None else "0"
  if task_type == "ps":
    env["CUDA_VISIBLE_DEVICES"] = ""
  env.update(extra or {})
  return env


def start_python(code: str, argv: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                 *, new_session: bool = False, pass_fds: Sequence[int] = (),
                 capture: bool = False) -> subprocess.Popen:
  """`python -c code *argv`: this interpreter, standard input /dev/null.

  Args:
    new_session: in a process group of its own (signalled as a group by `signal_group`).
    pass_fds: descriptors the process inherits.
    capture: standard output and error are pipes (else this process's).
  """
  pipe = subprocess.PIPE if capture else None
  return subprocess.Popen([sys.executable, "-c", code, *argv], env=env,
                          stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe,
                          start_new_session=new_session, pass_fds=tuple(pass_fds))


def signal_group(process: subprocess.Popen, sig: int) -> None:
  """Sends `sig` to the process group of `process` (started with `new_session`)."""
  try:
    os.killpg(process.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


# --- what a job leaves behind ------------------------------------------------------------


def marked_processes(name: str, value: str) -> List[int]:
  """The ids of this user's processes (not this one) whose environment holds
  `name=value`, as they were started (Linux's /proc; elsewhere none).

  A process inherits its parent's environment, so a mark set in a task's environment is
  also in every process the task starts, in whatever session or process group, unless
  one of them is started with an environment that drops it.
  """
  if not sys.platform.startswith("linux"):
    return []
  needle = f"{name}={value}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          found.append(int(entry))
    except OSError:  # Another user's process, or one that just ended.
      continue
  return found


def stop_marked(name: str, value: str, grace: float,
                killed_groups: Sequence[int] = ()) -> Dict[int, str]:
  """Stops every process marked `name=value` (`marked_processes`) outside
  `killed_groups` (process groups the caller already sent SIGKILL: their members are
  going): SIGTERM, then SIGKILL to those still there after `grace` seconds. Returns
  {pid: command line} of the processes it signalled.

  Bounded: it looks for processes started meanwhile for at most `grace` seconds, then
  waits at most 1 s for the killed ones to go.
  """
  signalled: Dict[int, str] = {}
  deadline = time.monotonic() + grace
  while True:
    left = [pid for pid in marked_processes(name, value)
            if _group_of(pid) not in killed_groups]
    for pid in left:
      if pid not in signalled:
        signalled[pid] = _command_line(pid)
        _signal(pid, signal.SIGTERM)
    if not left or time.monotonic() >= deadline:
      break
    time.sleep(0.1)
  for pid in left:
    signalled.setdefault(pid, _command_line(pid))
    _signal(pid, signal.SIGKILL)
  end = time.monotonic() + 1.0  # Killed processes leave /proc's listing a moment later.
  while left and time.monotonic() < end:
    time.sleep(0.05)
    left = [pid for pid in marked_processes(name, value) if pid in signalled]
  return signalled


def _group_of(pid: int) -> Optional[int]:
  try:
    return os.getpgid(pid)
  except OSError:  # Gone already.
    return None


def _command_line(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return b" ".join(f.read().rstrip(b"\0").split(b"\0")).decode(errors="replace")
  except OSError:
    return "?"


def _signal(pid: int, sig: int) -> None:
  try:
    os.kill(pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
