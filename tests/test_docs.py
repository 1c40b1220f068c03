"""Every Python block of README.md and docs/ runs, so a page that drifts fails CI.

Each page runs in a fresh Python process (four logical CPU devices, as in the tests), in
a scratch directory, its blocks in order in one namespace, as a reader would paste them.
The processes are forks of one fork server (diststrat/cluster/_forkserver.py) that has
imported TensorFlow, Keras and diststrat, so each page does not pay TensorFlow's import;
each is still a new process that has run nothing else, where `python -c` would run it.

- a block of plain code runs as it is;
- a block of `>>>` examples runs as a doctest (ELLIPSIS and NORMALIZE_WHITESPACE), so
  its printed output is checked too.

Nothing is imported for the page: it imports what it uses. The CPU is split into four
logical devices first, unless the page does it itself.

Where a page elides what a reader brings (their data, their model), an HTML comment,
invisible on the rendered page, supplies it:

- `<!-- test-setup ... -->` before a block: Python code run first (small data, a model);
- `<!-- test-replace OLD ==> NEW -->` before a block: that block runs with OLD replaced
  by NEW (a cluster address by a local one), each once at least;
- `<!-- test-after ... -->` after a block: Python code run next, which uses what the
  block defined (calls its step, checks what it claims).

A page with `<!-- test-page-setup ... -->` runs that code before its first block.
"""

import os
import pathlib
import re

import pytest

from diststrat.cluster import _forkserver

pytestmark = pytest.mark.processes
ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
TIMEOUT = 600

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SETUP = re.compile(r"<!-- test-setup\n(.*?)-->", re.S)
_PAGE_SETUP = re.compile(r"<!-- test-page-setup\n(.*?)-->", re.S)
_AFTER = re.compile(r"<!-- test-after\n(.*?)-->", re.S)
_REPLACE = re.compile(r"<!-- test-replace (.*?) ==> (.*?) -->")

_PRELUDE = """\
import doctest, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_globals = {"__name__": "__main__"}
_failures = []

def _run_doctest(text, name, lineno):
  test = doctest.DocTestParser().get_doctest(text, _globals, name, name, lineno)
  runner = doctest.DocTestRunner(
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  runner.run(test, clear_globs=False)
  _globals.update(test.globs)  # The doctest ran on a copy: later blocks see its names.
  if runner.failures:
    _failures.append(name)

def _run_code(text, name):
  exec(compile(text, name, "exec"), _globals)
"""

_FOUR_DEVICES = """\
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4)
del tf
"""


def _blocks(text):
  """(line, code, setup, replacements, after) for each Python block of a page."""
  matches = list(_BLOCK.finditer(text))
  found, previous_end = [], 0
  for k, match in enumerate(matches):
    between = text[previous_end:match.start()]
    following = text[match.end():matches[k + 1].start() if k + 1 < len(matches) else None]
    found.append((text[:match.start()].count("\n") + 2, match.group(1),
                  "".join(_SETUP.findall(between)), _REPLACE.findall(between),
                  "".join(_AFTER.findall(following))))
    previous_end = match.end()
  return found


def _script(page):
  text = page.read_text()
  name = str(page.relative_to(ROOT))
  parts = [_PRELUDE]
  if not any("set_logical_device_configuration" in code for _, code, *_ in _blocks(text)):
    parts.append(_FOUR_DEVICES)  # Else a block of the page does it, first.
  for setup in _PAGE_SETUP.findall(text):
    parts.append(f"_run_code({setup!r}, {name + ' (page setup)'!r})\n")
  for line, code, setup, replacements, after in _blocks(text):
    for old, new in replacements:
      assert old in code, f"{name}:{line}: test-replace {old!r} is not in the block"
      code = code.replace(old, new)
    where = f"{name}:{line}"
    if setup:
      parts.append(f"_run_code({setup!r}, {where + ' (setup)'!r})\n")
    parts.append(f"print('--- {where}', flush=True)\n")
    if code.lstrip().startswith(">>>"):
      parts.append(f"_run_doctest({code!r}, {where!r}, {line - 1})\n")
    else:
      parts.append(f"_run_code({code!r}, {where!r})\n")
    if after:
      parts.append(f"_run_code({after!r}, {where + ' (after)'!r})\n")
  parts.append("sys.exit(1 if _failures else 0)\n")
  return "".join(parts)


def _pages_with_code():
  return [p for p in PAGES if _BLOCK.search(p.read_text())]


def _environment():
  env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
  env.update({k: v for k, v in os.environ.items()
              if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "TF_CPP_MIN_LOG_LEVEL")})
  return env


@pytest.fixture(scope="module")
def python():
  """Starts fresh Python processes as `python -c` would, without TensorFlow's import."""
  server = _forkserver.ForkServer(["tensorflow", "keras", "numpy", "diststrat"],
                                  env=_environment()).start(timeout=120)
  yield server
  server.close()


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs(page, tmp_path, python):
  for folder in ("tests", "examples"):  # Pages refer to these from the repository root.
    (tmp_path / folder).symlink_to(ROOT / folder)
  out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
  with open(out, "w") as o, open(err, "w") as e:
    process = python.spawn(_script(page), env=_environment(), cwd=str(tmp_path),
                           fds={1: o.fileno(), 2: e.fileno()})
  try:
    returncode = process.wait(TIMEOUT - 30)
  finally:
    process.kill()
  assert returncode == 0, (
      f"{page.relative_to(ROOT)} does not run as written (the last block started is the "
      f"last '---' line):\n{out.read_text()[-4000:]}\n{err.read_text()[-4000:]}")


def test_every_page_with_python_is_run():
  names = {str(p.relative_to(ROOT)) for p in _pages_with_code()}
  assert {"README.md", "docs/concepts.md", "docs/keras.md"} <= names, names
