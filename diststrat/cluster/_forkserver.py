"""Fresh processes without TensorFlow's import each time: a fork server.

Importing TensorFlow costs about 3 s of CPU (10-15 s on a loaded 2-core machine), and a
`LocalCluster` starts many short-lived processes: its PS tasks, one process per worker
task on every `run_on_workers` call, a new PS on every `restart`. So a cluster first
starts one *fork server*: a process that imports TensorFlow, Keras and diststrat once
and then only forks. Every task process is a fork of it: a new process that has run
nothing but those imports, ready in milliseconds, and that behaves as
`python -c CODE ARGS...` would (its own `__main__`, `sys.argv`, environment, working
directory and standard streams; its exit status is the code's).

Why forking is safe here: `fork` copies the calling thread only. The server never
starts TensorFlow's runtime (no device, no context: those start their threads at first
use, in the child), and the only other threads it has are OpenBLAS's idle pools, which
rebuild themselves after a fork. The child starts single-threaded, as a new process does.
What a fork would share with its siblings is made fresh in the child: Python's `random`
reseeds itself after a fork, and numpy's global random state is reseeded here.

Processes and their ends:

- The server is the children's parent, and the only one that reaps them: a process id
  it signals is never one the system has handed to another process meanwhile.
- Each child asks Linux to SIGKILL it when the server dies (`PR_SET_PDEATHSIG`, from the
  server's main thread, which lives as long as the server), and exits at once if the
  server is already gone. The server kills its children and exits when its connection
  to the parent closes: when the parent closes it, or dies. So a parent killed with
  SIGKILL leaves nothing behind.

The parent talks to the server over a socket pair, one request at a time (`spawn`,
`poll`, `signal`), each answered within a bound.
"""

from typing import Dict, Optional, Sequence

import builtins
import fcntl
import importlib
import importlib.machinery
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from multiprocessing import connection
from multiprocessing import reduction

from diststrat import errors
from diststrat.cluster import _processes

_POLL = 0.01
_ANSWER_TIMEOUT = 30.0  # Seconds the server may take to answer one request.
_SERVER_MAIN = "from diststrat.cluster import _forkserver; _forkserver.serve()"


class ForkServerError(errors.ClusterError):
  """The fork server died, or did not answer within its bound."""


class ForkedProcess:
  """A process forked by a `ForkServer`: the parts of `subprocess.Popen` diststrat uses."""

  def __init__(self, server: "ForkServer", pid: int) -> None:
    self._server = server
    self.pid = pid
    self.returncode: Optional[int] = None

  def __repr__(self):
    return f"ForkedProcess(pid={self.pid}, returncode={self.returncode})"

  def poll(self) -> Optional[int]:
    """The exit status (negative: killed by that signal), or None while it runs."""
    if self.returncode is None:
      self.returncode = self._server._request("poll", self.pid)
    return self.returncode

  def wait(self, timeout: Optional[float] = None) -> int:
    """Waits at most `timeout` s; raises `subprocess.TimeoutExpired` after that."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (returncode := self.poll()) is None:
      if timeout is not None and deadline is not None and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
      time.sleep(_POLL)
    return returncode

  def send_signal(self, sig: int) -> None:
    """Sends `sig` unless the process has exited (a no-op then)."""
    if self.returncode is None:
      self._server._request("signal", self.pid, int(sig))

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


class ForkServer:
  """A process that has imported `preload` and forks fresh processes on request.

  Args:
    preload: modules the server imports once (its children find them imported).
    env: the server's environment (default: this process's).
  """

  def __init__(self, preload: Sequence[str] = (),
               env: Optional[Dict[str, str]] = None) -> None:
    self._preload = list(preload)
    self._env = dict(os.environ if env is None else env)
    self._lock = threading.Lock()
    self._conn: Optional[connection.Connection] = None
    self._process: Optional[subprocess.Popen] = None

  @property
  def pid(self) -> Optional[int]:
    return None if self._process is None else self._process.pid

  def start(self, timeout: float) -> "ForkServer":
    """Starts the server; returns once it has imported `preload` (at most `timeout` s)."""
    parent_end, child_end = connection.Pipe(duplex=True)
    env = dict(self._env, DISTSTRAT_FORKSERVER_FD=str(child_end.fileno()),
               DISTSTRAT_FORKSERVER_PRELOAD=",".join(self._preload))
    try:
      self._process = _processes.start_python(_SERVER_MAIN, env=env,
                                              pass_fds=(child_end.fileno(),))
    except BaseException:
      parent_end.close()
      raise
    finally:
      child_end.close()
    self._conn = parent_end
    try:
      answer = self._receive(timeout, "to start")
    except BaseException:
      self.close()
      raise
    if answer != ("ready",):
      self.close()
      raise ForkServerError(f"The fork server answered {answer!r} instead of 'ready'.")
    return self

  def spawn(self, code: str, argv: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None, fds: Optional[Dict[int, int]] = None,
            prologue: str = "") -> ForkedProcess:
    """A new process that runs `code` as `python -c code *argv` would.

    Args:
      code: Python source, run as the child's `__main__`.
      argv: `sys.argv[1:]` of the child (`sys.argv[0]` is "-c").
      env: the child's environment (default: the server's).
      cwd: the child's working directory (default: the server's).
      fds: {fd number in the child: an open fd of this process}, e.g. {1: f.fileno()}
        for its standard output, {3: sock.fileno()} to hand it a socket. By default the
        child's standard output and error are this process's (as with `subprocess`),
        and its standard input is /dev/null.
      prologue: Python statements the child runs first, while it is still
        single-threaded (joining a network namespace, say).
    """
    fds = {1: 1, 2: 2, **(fds or {})}
    with self._lock:
      conn, process = self._check_alive()
      self._send(("spawn", code, ["-c"] + list(argv), env, cwd, list(fds), prologue),
                 "to fork", [(source, process.pid) for source in fds.values()])
      answer = self._receive(_ANSWER_TIMEOUT, "to fork")
    if answer[0] != "spawned":
      raise ForkServerError(f"The fork server could not fork: {answer[1]}")
    return ForkedProcess(self, answer[1])

  def alive(self) -> bool:
    """Whether the server runs and takes requests."""
    return (self._conn is not None and self._process is not None and
            self._process.poll() is None)

  def close(self) -> None:
    """Stops the server, which SIGKILLs and reaps every child still running. Bounded."""
    with self._lock:
      conn, self._conn = self._conn, None
      if conn is not None:
        conn.close()  # The server sees EOF: it kills its children and exits.
      process = self._process
    if process is not None:
      try:
        process.wait(10)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)

  def _request(self, *request):
    with self._lock:
      self._check_alive()
      self._send(request, f"to {request[0]}")
      answer = self._receive(_ANSWER_TIMEOUT, f"to {request[0]}")
    if answer[0] == "failed":
      raise ForkServerError(f"The fork server could not {request[0]} as asked "
                            f"{request[1:]!r}: {answer[1]}")
    return answer[1]

  def _send(self, request, what, handles=()):
    """Sends `request` (then each (fd, server pid) of `handles`); a server that died
    raises `ForkServerError`, as in `_receive`."""
    try:
      self._conn.send(request)
      for fd, pid in handles:
        reduction.send_handle(self._conn, fd, pid)
    except OSError as e:  # BrokenPipeError: the server is gone.
      raise ForkServerError(f"The fork server exited while asked {what} "
                            f"({_describe(self._process)}).") from e

  def _check_alive(self) -> "tuple[connection.Connection, subprocess.Popen]":
    """The connection to the running server and its process; raises once stopped."""
    # `start` sets the process before the connection; `close` unsets the connection only.
    conn, process = self._conn, self._process
    if conn is None or process is None:
      raise ForkServerError("The fork server is stopped (its cluster was stopped).")
    return conn, process

  def _receive(self, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
      try:
        if self._conn.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
          return self._conn.recv()
      except (EOFError, OSError) as e:
        raise ForkServerError(f"The fork server exited while asked {what} "
                              f"({_describe(self._process)}).") from e
      if self._process.poll() is not None:
        raise ForkServerError(f"The fork server {_describe(self._process)} while asked "
                              f"{what} (its error output, if any, is above).")
      if time.monotonic() > deadline:
        raise ForkServerError(f"The fork server did not answer within {timeout:g} s when "
                              f"asked {what}.")


def _describe(process):
  code = process.poll()
  if code is None:
    return "is still running"
  if code < 0:
    return f"was killed by signal {-code}"
  return f"exited with code {code}"


# --- in the server process ---------------------------------------------------------------


def serve() -> None:
  """The server's main loop (its process runs only this); see the module docstring."""
  conn = connection.Connection(int(os.environ.pop("DISTSTRAT_FORKSERVER_FD")))
  for name in filter(None, os.environ.pop("DISTSTRAT_FORKSERVER_PRELOAD").split(",")):
    importlib.import_module(name)
  conn.send(("ready",))
  server_pid = os.getpid()
  children: Dict[int, Optional[int]] = {}
  answer: tuple  # (kind, detail): what the server sends back for each request.
  while True:
    try:
      request = conn.recv()
    except (EOFError, OSError):
      break  # The parent closed the connection, or died.
    kind = request[0]
    if kind == "spawn":
      _, code, argv, env, cwd, targets, prologue = request
      received = [reduction.recv_handle(conn) for _ in targets]
      sys.stdout.flush()
      sys.stderr.flush()
      try:
        pid = os.fork()
      except OSError as e:
        answer = ("failed", str(e))
      else:
        if pid == 0:
          _run_child(conn, code, argv, env, cwd, dict(zip(targets, received, strict=True)),
                     prologue, server_pid)
        children[pid] = None
        answer = ("spawned", pid)
      for fd in received:
        os.close(fd)
    elif kind == "poll":
      answer = ("status", _reap(children, request[1], os.WNOHANG))
    elif kind == "signal":
      answer = ("done", None)
      if _reap(children, request[1], os.WNOHANG) is None:
        try:
          os.kill(request[1], request[2])  # Not reaped: the pid is still this child's.
        except (OSError, OverflowError) as e:  # No such signal: the server stays up.
          answer = ("failed", str(e))
    else:
      answer = ("failed", f"unknown request {kind!r}")
    conn.send(answer)
  for pid, status in children.items():
    if status is None:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for pid, status in children.items():
    if status is None:
      _reap(children, pid, 0)


def _reap(children, pid, flags):
  """The exit status of child `pid` (as `Popen.returncode`), or None while it runs."""
  if children.get(pid) is None:
    try:
      done, status = os.waitpid(pid, flags)
    except ChildProcessError:
      return children.get(pid)
    if done:
      children[pid] = os.waitstatus_to_exitcode(status)
  return children.get(pid)


def _run_child(conn, code, argv, env, cwd, fds, prologue, server_pid):
  """Turns the forked child into `python -c code argv...`; never returns."""
  try:
    # Dies with the server (the process layer's orphan policy), then whatever the caller's
    # prologue does; first, while the child is single-threaded.
    prologue = _processes.prologue(server_pid) + prologue
    exec(compile(prologue, "<prologue>", "exec"), {})  # pylint: disable=exec-used
    conn.close()
    # Out of the way first, so that no target number overwrites a source.
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 10 + max(fds)) for target, fd in fds.items()}
    for fd in fds.values():
      os.close(fd)
    for target, fd in moved.items():
      os.dup2(fd, target)
      os.close(fd)
    if 0 not in fds:
      null = os.open(os.devnull, os.O_RDONLY)
      os.dup2(null, 0)
      os.close(null)
    if cwd is not None:
      os.chdir(cwd)
    if env is not None:
      os.environ.clear()
      os.environ.update(env)
    sys.argv[:] = argv
    numpy = sys.modules.get("numpy")
    if numpy is not None:
      numpy.random.seed()  # A fresh process draws its own seed.
    main = types.ModuleType("__main__")  # As `python -c` makes it:
    main.__dict__.update(__builtins__=builtins, __annotations__={},
                         __loader__=importlib.machinery.BuiltinImporter)
    sys.modules["__main__"] = main
    compiled = compile(code, "<string>", "exec")
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
  try:
    exec(compiled, main.__dict__)  # pylint: disable=exec-used
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    # As `python -c` prints it: from the code's first frame on.
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    raise SystemExit(1) from None
  raise SystemExit(0)
