"""A private network for the processes of a local cluster, where Linux allows it.

TensorFlow's gRPC server listens on every interface (`0.0.0.0:port`, whatever host the
cluster spec names) and runs any graph any client sends (docs/security.md). A cluster
whose processes all run on this machine needs no network but loopback, so its processes
can live in a network namespace of their own: one with only a loopback interface, which
no other process, local or remote, can reach. Making one needs no privileges where the
kernel allows unprivileged user namespaces (most Linux distributions do; some containers
and hardened kernels do not).

`Namespace.create()` starts a small holder process that makes the namespace (a user
namespace that maps this user to itself, and a network namespace in it, with loopback
up) and keeps it alive until the cluster stops. Each child process joins it first thing
(`join_code`), before it imports anything that starts a thread (joining a user namespace
needs a single-threaded process). Processes inside reach each other on 127.0.0.1, and
nothing else: a task that needs the network (to read data from a remote store, say)
needs `LocalCluster(isolate=False)`.
"""

import os
import select
import subprocess
import sys
import time

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_READY_TIMEOUT = 30.0

# Runs in the holder: makes the namespaces, brings loopback up, says READY, then waits
# for its stdin to close (the parent stopped the cluster, or died).
_HOLDER = rf"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare({_CLONE_NEWUSER} | {_CLONE_NEWNET}) != 0:
  print("FAILED unshare:", os.strerror(ctypes.get_errno()), flush=True)
  sys.exit(1)
try:
  with open("/proc/self/setgroups", "w") as f:
    f.write("deny")
  with open("/proc/self/uid_map", "w") as f:
    f.write(f"{{uid}} {{uid}} 1")
  with open("/proc/self/gid_map", "w") as f:
    f.write(f"{{gid}} {{gid}} 1")
  s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  request = struct.pack("16sh", b"lo", 0)
  flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, request))[1]  # SIOCGIFFLAGS
  fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))      # SIOCSIFFLAGS, IFF_UP
  s.close()
except OSError as e:
  print("FAILED setup:", e, flush=True)
  sys.exit(1)
print("READY", flush=True)
sys.stdin.read()
"""


def join_code(holder_pid):
  """Python statements that move the running (single-threaded) process into the holder's
  namespaces; a child runs them before anything else."""
  return (
      "import ctypes as _c, os as _o\n"
      "_l = _c.CDLL(None, use_errno=True)\n"
      f"for _n, _f in (('user', {_CLONE_NEWUSER}), ('net', {_CLONE_NEWNET})):\n"
      f"  _d = _o.open('/proc/{holder_pid}/ns/' + _n, _o.O_RDONLY)\n"
      "  if _l.setns(_d, _f) != 0:\n"
      "    raise OSError(_c.get_errno(), 'diststrat could not join the cluster network "
      "namespace (' + _n + '): ' + _o.strerror(_c.get_errno()))\n"
      "  _o.close(_d)\n"
      "del _c, _o, _l, _n, _f, _d\n")


class Namespace:
  """A private network namespace, kept alive by a holder process until `close()`."""

  def __init__(self, process):
    self._process = process

  @property
  def holder_pid(self):
    return self._process.pid

  @classmethod
  def create(cls):
    """A new namespace; raises `OSError` saying why where the system does not allow it."""
    if not sys.platform.startswith("linux"):
      raise OSError(f"network namespaces are a Linux feature (this is {sys.platform})")
    process = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + _READY_TIMEOUT
    out = b""
    while b"\n" not in out:
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not select.select([process.stdout], [], [], remaining)[0]:
        break
      chunk = os.read(process.stdout.fileno(), 256)
      if not chunk:  # The holder exited.
        break
      out += chunk
    line = out.decode(errors="replace")
    if line.strip() != "READY":
      _stop(process)
      raise OSError(line.strip() or "the namespace holder did not start within "
                    f"{_READY_TIMEOUT:g} s")
    return cls(process)

  def close(self):
    _stop(self._process)


def _stop(process):
  try:
    process.stdin.close()
  except OSError:
    pass
  try:
    process.wait(5)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait(5)
