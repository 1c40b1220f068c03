"""Keras's per-thread state in towers: the calling thread's seed generator and dtype
policy, and its name counters (tower 0) or a copy of them (the other towers).

Keras 3 keeps its global state per thread, the global `SeedGenerator` among it: the one
`keras.random.normal(shape)` (any `keras.random` draw without a seed) uses, made on the
first such draw in a thread and dropped by `keras.utils.set_random_seed` in the thread
that calls it. Towers run in pooled threads (strategies/_tower_threads.py), so each
tower thread kept a generator of its own across calls and strategies: a program that
set the seed and trained twice drew other numbers the second time (without a strategy
it repeats), and a second strategy on other devices reused the first one's variable and
failed.

`diststrat._keras.install()` registers `capture` as a thread state carrier
(`_context.add_thread_state_carrier`): a tower draws from the calling thread's
generator, as the same code does without a strategy. If the calling thread has none (or
one whose state variable another strategy made), the towers make one on their first
draw without a seed (seeded from Python's `random`, as Keras seeds it), and it becomes
the calling thread's when the tower that made it returns. Its state variable is then the
strategy's, read in tower i > 0 with i hashed in as every `SeedGenerator`'s is
(docs/keras.md, "Dropout and random layers").

Keras also numbers the default names of new layers (`dense`, `dense_1`, ...) per
thread. Tower 0 counts in the calling thread's counters, as the default strategy's
tower (the calling thread itself) does, and every other tower in a copy of them taken
when the call began, so each tower names the layers it creates as tower 0 does (the
towers' variables must have the same names, docs/mirrored.md). Counting in the pooled
thread itself gave names that depended on what that thread ran before, from any
calling thread: they varied from run to run when two threads called
`call_for_each_tower` at once. A helper thread that runs the calling thread's code for
it (a parameter-server worker's bounded step, slot None) counts in the calling thread's
counters too.

The global dtype policy (`keras.config.set_dtype_policy("mixed_bfloat16")`) is the
calling thread's too: a layer created in a tower computes in it, as without a strategy
(it was float32, a tower thread's own default).
"""

import collections
import contextlib

from diststrat import _context
from diststrat import _tf_internal
from diststrat.values import _variables


def capture():
  """In the calling thread: what a thread entering its state shares (see above)."""
  caller = _tf_internal.keras_thread_globals()
  if caller is None:
    return lambda slot: None
  counters = collections.defaultdict(int, _tf_internal.keras_name_counters(caller))
  return lambda slot: _shared_with(caller, slot, counters)


def _usable(generator, strategy):
  """Whether towers of `strategy` may draw from `generator`: its state variable is not
  another strategy's."""
  variable = _tf_internal.keras_backing_variable(getattr(generator, "state", None))
  creator = _variables.created_by(variable) if variable is not None else None
  return creator is None or creator is strategy


@contextlib.contextmanager
def _shared_with(caller, slot, counters_at_start):
  own = _tf_internal.keras_thread_globals()
  if own is None or own is caller:
    yield
    return
  counters = (_tf_internal.keras_name_counters(caller) if not slot
              else collections.defaultdict(int, counters_at_start))
  with _swapped(_tf_internal.keras_name_counters, _tf_internal.set_keras_name_counters,
                own, counters), \
      _swapped(_tf_internal.keras_dtype_policy, _tf_internal.set_keras_dtype_policy,
               own, _tf_internal.keras_dtype_policy(caller)), \
      _seed_generator(caller, own):
    yield


@contextlib.contextmanager
def _swapped(get, set_, own, value):
  """`own`'s setting (read by `get`, written by `set_`) is `value` for the body."""
  saved = get(own)
  set_(own, value)
  try:
    yield
  finally:
    set_(own, saved)


@contextlib.contextmanager
def _seed_generator(caller, own):
  strategy = _context.get_distribution_strategy()
  generator = _tf_internal.keras_global_seed_generator(caller)
  if generator is not None and not _usable(generator, strategy):
    generator = None
  saved = _tf_internal.keras_global_seed_generator(own)
  _tf_internal.set_keras_global_seed_generator(own, generator)
  try:
    yield
  finally:
    made = _tf_internal.keras_global_seed_generator(own)
    _tf_internal.set_keras_global_seed_generator(own, saved)
    current = _tf_internal.keras_global_seed_generator(caller)
    if made is not None and made is not current and (
        current is None or not _usable(current, strategy)):
      _tf_internal.set_keras_global_seed_generator(caller, made)
