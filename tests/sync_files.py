"""Files through which a test process and its cluster's worker processes signal each other."""

import os
import time


def write(path, text=""):
  """Writes `path` at once (through a temporary file), so a reader never sees it half done."""
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def wait_for_file(path, timeout=60.0):
  """The text of `path`, once it exists; TimeoutError after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"{path} did not appear within {timeout} s")
    time.sleep(0.02)
  with open(path) as f:
    return f.read()
