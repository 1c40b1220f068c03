"""Saying, once per process, who can reach a TensorFlow server that diststrat starts.

TensorFlow's gRPC server listens on every interface of the machine (`0.0.0.0:port`,
whatever host the cluster spec names) and runs any graph any client sends, with no
authentication: whoever reaches the port can read and overwrite every variable and run
ops in the process. diststrat starts one in every cluster task (a parameter server, a
parameter-server worker connecting, every `MultiWorkerMirroredStrategy` worker) and
says so once per process. See docs/security.md.

It also knows the addresses of the isolated `LocalCluster`s this process runs (in a
private network namespace that nothing outside reaches), so that connecting to one from
outside fails at once with the fix (`_cluster_spec.check_reachable`), not with "cannot
be reached".

And it tells whether an IP address is this machine's (`is_this_machines_address`), for
the launcher's check of `--hosts` and for the tasks of a cluster that share a machine's
cores (`_host_threads.py`).

It imports no TensorFlow (nor `diststrat.errors`, which does): the process layer under
`diststrat-run` reads `ISOLATED_ENV` from it, and the launcher must answer `--help`
without TensorFlow (tests/test_launcher.py).
"""

import ipaddress
import logging
import os
import socket
import threading
import time


logger = logging.getLogger("diststrat")

ISOLATED_ENV = "DISTSTRAT_PRIVATE_NETWORK"
"""Set to "1" in the processes of a `LocalCluster` or `diststrat-run` job that run in its
private network."""

_warned: list[str] = []  # The task whose server was warned about (at most one).
_lock = threading.Lock()


def server_started(task, address, warm_up_port=None):
  """Logs the warning for `task`'s server at `address` (host:port), once per process.

  `warm_up_port`: a parameter server's second server, the one of its own warm-up client
  (job `diststrat_warm_up`, cluster/_serve.py), on a port outside the cluster spec; the
  warning names it too.
  """
  with _lock:
    if _warned:
      return
    _warned.append(task)
  port = address.rsplit(":", 1)[-1]
  ports = f"port {port}"
  listens = f"0.0.0.0:{port}"
  if warm_up_port is not None:
    ports = (f"port {port}, and a second one on port {warm_up_port} (job diststrat_warm_up: "
             "the parameter server's own client, which warms it up; it is not in the "
             "cluster spec and accepts the same)")
    listens = f"0.0.0.0:{port} and 0.0.0.0:{warm_up_port}"
  if os.environ.get(ISOLATED_ENV) == "1":
    logger.warning(
        "diststrat started TensorFlow's gRPC server of %s on %s. It runs any graph "
        "any client sends, without authentication; here it is reachable only from the "
        "job's own processes (a LocalCluster's or a diststrat-run job's: they share a "
        "private network namespace). See "
        "docs/security.md.", task, ports)
    return
  logger.warning(
      "diststrat started TensorFlow's gRPC server of %s on %s. TensorFlow listens on "
      "every network interface (%s, whatever host the cluster spec names) and "
      "runs any graph any client sends, without authentication: whoever can reach these "
      "ports can read and overwrite every variable and run code in this process. Run "
      "clusters on a private network or behind a firewall that admits only the cluster's "
      "hosts, on every port; see docs/security.md.", task, ports, listens)


# "host:port" of each task of an isolated LocalCluster of this process -> the cluster's
# description (its repr).
_isolated: dict[str, str] = {}


def register_isolated(addresses, owner):
  """Records `addresses` as tasks of `owner` (a description), an isolated cluster."""
  with _lock:
    for address in addresses:
      _isolated[address] = owner


def forget_isolated(addresses):
  """Forgets `addresses` (the cluster stopped)."""
  with _lock:
    for address in addresses:
      _isolated.pop(address, None)


def _split(address):
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  try:
    loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
  except ValueError:
    loopback = False
  return ("loopback" if loopback else host), port


def is_loopback_address(address):
  """Whether "host:port" `address` names a loopback host (no name lookup)."""
  return _split(address)[0] == "loopback"


def in_private_network():
  """Whether this process runs in a LocalCluster's or diststrat-run job's private network."""
  return os.environ.get(ISOLATED_ENV) == "1"


def isolated_owner(address):
  """The description of the isolated cluster of this process that has `address`, or None.

  Loopback spellings are one host ("localhost:5", "127.0.0.1:5" and "[::1]:5").
  """
  key = _split(address)
  with _lock:
    for known, owner in _isolated.items():
      if _split(known) == key:
        return owner
  return None


def is_this_machines_address(ip: str, sockaddr_tail: tuple = ()) -> bool:
  """Whether `ip` (an IP address, not a name) is this machine's: a loopback address, or
  one a socket here can bind. `sockaddr_tail`: an IPv6 socket address's flow info and
  scope id, as `getaddrinfo` gives them.

  On a machine that lets sockets bind addresses it does not have (Linux's
  `ip_nonlocal_bind`, set on load balancers), binding proves nothing: only loopback
  addresses count there.
  """
  try:
    address = ipaddress.ip_address(ip.split("%")[0])
  except ValueError:
    return False
  if address.is_loopback:
    return True
  if _binds_any_address(address.version):
    return False
  family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
      sock.bind((ip, 0, *sockaddr_tail))
      return True
  except OSError:  # Not this machine's (or no such address family here).
    return False


def resolve_hosts(hosts, timeout: float) -> dict:
  """{host: its addresses as [(family, sockaddr)], or the error resolving it raised} for
  each of `hosts` that answered within `timeout` seconds in all; a host still resolving
  then is left out. A bad DNS can hang `getaddrinfo`: each host resolves at once in a
  daemon thread, and one that outlives this call ends when `getaddrinfo` returns."""
  found: dict = {}

  def resolve(host):
    try:
      found[host] = [(info[0], info[4])
                     for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError) as e:
      found[host] = e

  threads = [threading.Thread(target=resolve, args=(host,), daemon=True,
                              name="diststrat-resolve-host") for host in hosts]
  for thread in threads:
    thread.start()
  deadline = time.monotonic() + timeout
  for thread in threads:
    thread.join(max(0.0, deadline - time.monotonic()))
  return dict(found)


def _binds_any_address(version):
  path = f"/proc/sys/net/ipv{4 if version == 4 else 6}/ip_nonlocal_bind"
  try:
    with open(path, encoding="ascii") as f:
      return f.read().strip() != "0"
  except OSError:
    return False
