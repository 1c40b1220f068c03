"""A task's output under `diststrat-run`: prefixed copies, a log file, its last lines.

One thread per stream (`TaskOutput.follow`) reads a task's standard output or error and

- copies it to the launcher's stream, each line prefixed with the task's name
  (`[worker:0] `). A line ends with "\\n" or "\\r": a progress bar that redraws its line
  with "\\r" keeps the prefix on every redraw. Only whole lines are copied, so the tasks'
  lines never mix (a line without an end is copied when the stream ends, or once it
  passes 64 KiB);
- writes it, unprefixed and both streams together, to the task's log file (`--log-dir`),
  whole lines at a time as above: a line the task writes in pieces (unbuffered output)
  is not cut by the other stream's;
- keeps the last `LAST_LINES` lines of each stream, for the summary of a failed job;
- notes when the task last wrote anything (`last_output`, for `--heartbeat-timeout`).
"""

from typing import BinaryIO, Deque, Dict, List, Optional

import collections
import os
import re
import threading
import time

LAST_LINES = 20
"""Lines of each stream a task's `TaskOutput` keeps."""

_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
_LONGEST = 1 << 16  # A line without an end is copied once it is this long.
_TRACEBACK = "Traceback (most recent call last):"

_sink_lock = threading.Lock()  # One line at a time on the launcher's streams.


class TaskOutput:
  """What a task wrote: copied (prefixed) to the launcher's streams, logged, remembered."""

  def __init__(self, name: str, log_path: Optional[str] = None):
    self.name = name
    self._prefix = f"[{name}] ".encode()
    self._lock = threading.Lock()
    self._log: Optional[BinaryIO] = open(log_path, "wb") if log_path else None  # noqa: SIM115
    self._lines: Dict[str, Deque[str]] = {}
    self._threads: List[threading.Thread] = []
    self.last_output = time.monotonic()

  def follow(self, stream: str, pipe: BinaryIO, sink: BinaryIO) -> None:
    """Copies `pipe` (the task's `stream`, "stdout" or "stderr") to `sink`, in a thread."""
    self._lines[stream] = collections.deque(maxlen=LAST_LINES)
    thread = threading.Thread(target=self._copy, args=(stream, pipe, sink), daemon=True,
                              name=f"diststrat-run-{stream}-{self.name}")
    thread.start()
    self._threads.append(thread)

  def _copy(self, stream, pipe, sink):
    pending, mid_line = b"", False
    fd = pipe.fileno()
    while True:
      try:
        chunk = os.read(fd, _LONGEST)
      except OSError:
        chunk = b""
      if not chunk:
        break
      self.last_output = time.monotonic()
      pending += chunk
      lines, end = [], 0
      for match in _SEGMENT.finditer(pending):
        lines.append(match.group())
        end = match.end()
      pending = pending[end:]
      if len(pending) >= _LONGEST:
        lines.append(pending)
        pending = b""
      mid_line = self._copy_lines(stream, lines, sink, mid_line)
      self._log_lines(lines)
    if pending:
      self._copy_lines(stream, [pending + b"\n"], sink, mid_line)
      self._log_lines([pending])
    pipe.close()

  def _log_lines(self, lines):
    if self._log is not None and lines:
      with self._lock:
        try:
          self._log.write(b"".join(lines))
          self._log.flush()
        except (OSError, ValueError, AttributeError):  # Closed by `close`; full disk.
          pass

  def _copy_lines(self, stream, lines, sink, mid_line):
    """Writes `lines` to `sink`, each prefixed (but a bare "\\r", and a line's rest after
    a 64 KiB piece); returns whether the last one had no end."""
    out = []
    for line in lines:
      if not mid_line and line != b"\r":
        out.append(self._prefix)
      out.append(line)
      mid_line = not line.endswith((b"\n", b"\r"))
      if line.endswith(b"\n"):  # A redraw ("\r") is not a line of its own.
        with self._lock:
          self._lines[stream].append(line.decode(errors="replace").rstrip("\r\n"))
    with _sink_lock:
      try:
        sink.write(b"".join(out))
        sink.flush()
      except (OSError, ValueError):
        pass
    return mid_line

  def last_lines(self) -> List[str]:
    """The lines that tell why the task failed: its last traceback on stderr (from
    "Traceback (most recent call last):" on), else the last lines of stderr, else of
    stdout (at most `LAST_LINES`)."""
    with self._lock:
      err = list(self._lines.get("stderr", ()))
      out = list(self._lines.get("stdout", ()))
    starts = [i for i, line in enumerate(err) if line.startswith(_TRACEBACK)]
    if starts:
      return err[starts[-1]:]
    return err or out

  def close(self, timeout: float) -> None:
    """Waits up to `timeout` s for the streams to end (the task's processes are gone),
    then closes the log file."""
    deadline = time.monotonic() + timeout
    for thread in self._threads:
      thread.join(max(0.0, deadline - time.monotonic()))
    with self._lock:
      if self._log is not None:
        self._log.close()
        self._log = None
