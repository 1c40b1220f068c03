"""Errors keep their type, message and tower in eager mode and inside tf.function (docs/concepts.md, "Errors").

Each case runs the same tower code twice, eagerly and traced by `tf.function`, and the two
errors must be of the same type with the same text (message and notes).
"""

import threading
import time

import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import errors
from diststrat.strategies import _tower_threads
from conftest import CPUS


def _text(error):
  return str(error) + "".join("\n" + n for n in getattr(error, "__notes__", []))


def _raised(strategy, fn, mode):
  """The exception `call_for_each_tower(fn)` raises, run eagerly or inside tf.function."""
  def call():
    return strategy.call_for_each_tower(fn)

  if mode == "function":
    call = tf.function(call)
  with strategy.scope():
    with pytest.raises(BaseException) as info:
      call()
  return info.value


def _same_in_both_modes(strategy, fn):
  eager = _raised(strategy, fn, "eager")
  traced = _raised(strategy, fn, "function")
  assert type(traced) is type(eager), f"eager: {type(eager)}, tf.function: {type(traced)}"
  assert _text(traced) == _text(eager)
  return eager


def test_a_towers_exception_keeps_type_and_tower():
  def fn():
    if ds.get_tower_context().tower_id == 3:
      raise KeyError("boom")
    ds.get_tower_context().merge_call(lambda s: None)

  error = _same_in_both_modes(ds.MirroredStrategy(CPUS), fn)
  assert isinstance(error, KeyError)
  assert "(raised in tower 3 of MirroredStrategy" in _text(error)


class _MyError(Exception):
  pass


@pytest.mark.parametrize("raised", ["tower", "merge_fn", "zero_division"])
def test_the_default_strategys_errors_keep_type_and_message(raised):
  """The default strategy runs the tower and merge_fn in this thread: AutoGraph rebuilt
  their errors with "in user code:" in front, or a ZeroDivisionError as StagingError."""
  def fn():
    if raised == "tower":
      raise KeyError("boom from the tower")
    if raised == "merge_fn":
      return ds.get_tower_context().merge_call(
          lambda s: (_ for _ in ()).throw(_MyError("boom from merge_fn")))
    return ds.get_tower_context().merge_call(lambda s: 1 / 0)

  error = _same_in_both_modes(ds.get_distribution_strategy(), fn)
  assert type(error) is {"tower": KeyError, "merge_fn": _MyError,
                         "zero_division": ZeroDivisionError}[raised]


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_an_argument_error_keeps_its_message_in_a_tf_function(strategy):
  s = ds.get_distribution_strategy() if strategy == "default" else ds.MirroredStrategy(CPUS)

  def bad():
    return s.reduce("median", tf.constant(1.0))

  with s.scope():
    with pytest.raises(ValueError) as eager:
      bad()
    with pytest.raises(ValueError) as traced:
      tf.function(bad)()
  assert str(traced.value) == str(eager.value)
  assert not str(traced.value).startswith("in user code")


def test_nested_merge_fn_exception_keeps_type_and_every_level():
  strategy = ds.MirroredStrategy(CPUS[:2])

  def inner():
    if ds.get_tower_context().tower_id == 1:
      raise TypeError("deep")

  def fn():
    ds.get_tower_context().merge_call(lambda s: s.call_for_each_tower(inner))

  error = _same_in_both_modes(strategy, fn)
  assert isinstance(error, TypeError) and "deep" in str(error)
  text = _text(error)
  assert "(raised in tower 1 of" in text and "(raised in merge_fn" in text


def test_merge_call_mismatch_is_a_runtime_error_in_both_modes():
  def fn():
    if ds.get_tower_context().tower_id in (1, 3):
      return None
    return ds.get_tower_context().merge_call(lambda s: 1)

  error = _same_in_both_modes(ds.MirroredStrategy(CPUS), fn)
  assert isinstance(error, errors.MergeCallMismatchError) and isinstance(error, RuntimeError)
  assert "Towers [0, 2] called merge_call() but towers [1, 3] returned" in str(error)


def test_context_error_in_a_tower_in_both_modes():
  strategy = ds.MirroredStrategy(CPUS[:2])

  def fn():
    return strategy.reduce("sum", 1.0)

  error = _same_in_both_modes(strategy, fn)
  assert isinstance(error, errors.ContextError)
  assert "Use get_tower_context().merge_call(merge_fn, ...)" in str(error)
  assert "(raised in tower 0 of" in _text(error)


def test_structure_mismatch_in_both_modes():
  def fn():
    return (1.0, 2.0) if ds.get_tower_context().tower_id == 0 else [1.0, 2.0]

  error = _same_in_both_modes(ds.MirroredStrategy(CPUS[:2]), fn)
  assert isinstance(error, errors.StructureMismatchError)
  assert "tower 0 gave (*, *) and tower 1 gave [*, *]" in str(error)


def _first(strategy, x):
  return x


def _second(strategy, x):
  return x


def test_different_merge_fns_raise_naming_towers_and_functions():
  def fn():
    tower = ds.get_tower_context()
    merge_fn = _first if tower.tower_id % 2 == 0 else _second
    return tower.merge_call(merge_fn, 1.0)

  error = _same_in_both_modes(ds.MirroredStrategy(CPUS), fn)
  assert isinstance(error, errors.MergeCallMismatchError)
  message = str(error)
  assert "towers [0, 2] passed _first; towers [1, 3] passed _second." in message


def test_closures_of_one_def_and_bound_methods_are_the_same_merge_fn():
  class Holder:
    def merge(self, strategy, x):
      return strategy.reduce("sum", x)

  holder = Holder()

  def fn():
    tower = ds.get_tower_context()

    def local_merge(strategy, x):  # A new function object in every tower.
      return strategy.reduce("sum", x)

    a = tower.merge_call(local_merge, tf.constant(1.0))
    b = tower.merge_call(holder.merge, tf.constant(2.0))
    return a + b

  strategy = ds.MirroredStrategy(CPUS)
  with strategy.scope():
    result = strategy.call_for_each_tower(fn)
  assert [float(v) for v in result.values] == [12.0] * 4


def test_tower_timeout_fires_at_its_bound(no_thread_leak):
  # no_thread_leak joins leftover threads for 5 s: the blocked tower is released at 2 s.
  strategy = ds.MirroredStrategy(CPUS[:2], tower_timeout=1.0)
  release = threading.Event()

  def fn():
    if ds.get_tower_context().tower_id == 0:
      release.wait(30)
    ds.get_tower_context().merge_call(lambda s: None)

  threading.Timer(2.0, release.set).start()
  start = time.monotonic()
  with strategy.scope():
    with pytest.raises(errors.TowerTimeoutError, match=r"Tower 0 of .* neither reached "
                       r"merge_call\(\) nor returned within 1 s"):
      strategy.call_for_each_tower(fn)
  elapsed = time.monotonic() - start
  assert elapsed < 1.5, f"the 1 s timeout fired after {elapsed:.2f} s"
  stuck = _tower_threads.abandoned_tower_threads()
  assert [t.name for t in stuck] == ["diststrat-tower-0"]
  release.set()
  stuck[0].join(10)
  assert not stuck[0].is_alive()
  assert _tower_threads.abandoned_tower_threads() == []


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_merge_call_in_a_tf_function_traced_by_a_tower_says_what_to_do(mode):
  strategy = ds.MirroredStrategy(CPUS[:2])

  @tf.function
  def nested(x):  # Traced by tower 0, which would hold its lock while others wait.
    return ds.get_tower_context().merge_call(lambda s, v: s.reduce("sum", v), x)

  def step():
    return strategy.call_for_each_tower(lambda: nested(tf.constant(1.0)))

  with strategy.scope():
    with pytest.raises(ds.errors.ContextError,
                       match=r"merge_call\(\) was called in tower 0 of .* while the tower "
                             r"was tracing a tf.function .* Put the tf.function around "
                             r"call_for_each_tower"):
      (tf.function(step) if mode == "function" else step)()


def _sum_and_scale(strategy, x, scale):
  return strategy.reduce("sum", x), scale


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_partials_of_one_function_are_the_same_merge_fn(mode):
  # functools.partial(f, ...) made in each tower is a new object every time, like a
  # closure; it raised MergeCallMismatchError ("towers [0] passed partial; towers [1]
  # passed partial") while the default strategy ran it.
  import functools

  def fn():
    tower = ds.get_tower_context()
    total, scale = tower.merge_call(functools.partial(_sum_and_scale, scale=2.0),
                                    tf.constant(1.0))
    return total * scale

  assert float(ds.DefaultStrategy().call_for_each_tower(fn)) == 2.0
  strategy = ds.MirroredStrategy(CPUS)
  call = lambda: strategy.call_for_each_tower(fn)  # noqa: E731
  with strategy.scope():
    result = call() if mode == "eager" else tf.function(call)()
  assert [float(v) for v in result.values] == [8.0] * 4


def test_partials_of_different_functions_raise_naming_them():
  import functools

  def fn():
    tower = ds.get_tower_context()
    merge_fn = _first if tower.tower_id % 2 == 0 else _second
    return tower.merge_call(functools.partial(merge_fn), 1.0)

  error = _same_in_both_modes(ds.MirroredStrategy(CPUS), fn)
  assert isinstance(error, errors.MergeCallMismatchError)
  assert "towers [0, 2] passed partial(_first); towers [1, 3] passed partial(_second)." \
      in str(error)


def _call_merge_fn(merge_fn, strategy, x):
  return merge_fn(strategy, x)


def test_partials_that_bind_different_functions_raise():
  """A wrapper bound to each tower's merge_fn (as GPipe's stage context binds one) hides
  nothing: the towers' merge_fns differ when the functions they bind do. They passed as
  one merge_fn (the wrapper's), and tower 0's ran for every tower."""
  import functools

  def fn():
    tower = ds.get_tower_context()
    merge_fn = _first if tower.tower_id % 2 == 0 else _second
    return tower.merge_call(functools.partial(_call_merge_fn, merge_fn), 1.0)

  error = _same_in_both_modes(ds.MirroredStrategy(CPUS), fn)
  assert isinstance(error, errors.MergeCallMismatchError)
  assert "towers [0, 2] passed partial(_call_merge_fn, _first); towers [1, 3] passed " \
      "partial(_call_merge_fn, _second)." in str(error)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_merge_result_missing_a_towers_device_names_merge_fn_and_the_fix(traced):
  """It raised select_device's message, which told the user to pass a device to get()."""
  s = ds.MirroredStrategy(CPUS[:2])

  def tower():
    return ds.get_tower_context().merge_call(
        lambda _: ds.values.Mirrored({CPUS[0]: tf.constant(1.0)}))

  step = lambda: s.call_for_each_tower(tower)  # noqa: E731
  with pytest.raises(ValueError, match=r"merge_fn <lambda> returned a wrapped value with no "
                     r"component on tower 1's device .*CPU:1, so merge_call cannot give "
                     r"that tower its part. Return a value with a component on every "
                     r"tower's device"):
    tf.function(step)() if traced else step()
def test_an_optimizer_made_in_each_tower_is_named_as_the_cause():
  # Once: "towers [0] passed _distributed_apply; towers [1] passed _distributed_apply",
  # two groups with one name and no hint why they differ.
  strategy = ds.MirroredStrategy(CPUS[:2])
  with strategy.scope():
    v = tf.Variable(1.0)

  def fn():
    opt = ds.optimizers.GradientDescent(0.1)  # A new optimizer in every tower.
    return opt.apply_gradients([(tf.constant(1.0), v)])

  error = _same_in_both_modes(strategy, fn)
  assert isinstance(error, errors.MergeCallMismatchError)
  assert ("towers [0] passed GradientDescent._distributed_apply of one object; towers [1] "
          "passed it of another object. Each tower made its own object (such as an "
          "optimizer created inside the tower function): create it once, before "
          "call_for_each_tower, and use it in every tower.") in str(error), str(error)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_merge_call_of_the_default_tower_context_keeps_its_error(mode):
  # Once traced: "in user code:" and a traceback in front of the message.
  fn = lambda: ds.get_tower_context().merge_call(None)  # noqa: E731
  with pytest.raises(TypeError, match=r"^merge_call\(\) takes a callable as merge_fn"):
    tf.function(fn)() if mode == "function" else fn()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_per_device_argument_missing_a_tower_device_names_the_call_and_the_fix(traced):
  """It raised select_device's advice to pass a device to get()."""
  s = ds.MirroredStrategy(CPUS[:2])
  x = ds.values.PerDevice({CPUS[0]: tf.constant(1.0), CPUS[2]: tf.constant(2.0)})
  step = lambda: s.call_for_each_tower(lambda v: v + 1.0, x)  # noqa: E731
  with pytest.raises(ValueError, match=r"An argument of call_for_each_tower\(\) is a "
                     r"PerDevice over .*CPU:0.*CPU:2.*, but the towers of .* are on .*CPU:0.*"
                     r"CPU:1.*Pass a PerDevice with one component per tower device"):
    tf.function(step)() if traced else step()


@pytest.mark.parametrize("where", ["merge_fn", "earlier_towers"])
def test_towers_wait_for_a_slow_merge_fn_or_their_turn_however_long(where, monkeypatch,
                                                                     no_thread_leak):
  # tower_timeout bounds a tower's own code between pauses. A tower waiting at
  # merge_call (for merge_fn) or for its turn (while the towers before it run) gave up
  # after tower_timeout + 30 s (shortened here) and counted as returned None: the call
  # returned None for it silently, or failed with a MergeCallMismatchError.
  monkeypatch.setattr(_tower_threads, "_JOIN_TIMEOUT", 0.1)
  strategy = ds.MirroredStrategy(CPUS[:3], tower_timeout=0.3)

  def fn():
    ctx = ds.get_tower_context()
    if where == "earlier_towers" and ctx.tower_id < 2:
      time.sleep(0.25)  # Under the tower timeout; tower 2 waits 0.5 s for its turn.
    merged = ctx.merge_call(
        lambda st: time.sleep(0.6 if where == "merge_fn" else 0) or "merged")
    return (ctx.tower_id, merged)

  with strategy.scope():
    result = strategy.call_for_each_tower(fn)
  tower_ids, merged = result
  assert (tower_ids.values, merged) == ((0, 1, 2), "merged")


def test_a_tower_unwinding_from_a_failed_call_stops_at_its_next_merge_call(monkeypatch,
                                                                          no_thread_leak):
  # Tower 0, paused at merge_call when tower 1 failed, unwinds through its `finally`,
  # which calls merge_call again: it waited there for a turn that never came, so the
  # call raised only after 30 s (shortened here) and the thread waited for ever.
  monkeypatch.setattr(_tower_threads, "_JOIN_TIMEOUT", 0.5)
  strategy = ds.MirroredStrategy(CPUS[:2])
  merged = []

  def fn():
    ctx = ds.get_tower_context()
    if ctx.tower_id == 1:
      raise KeyError("tower 1 failed")
    try:
      ctx.merge_call(lambda s: merged.append("step"))
    finally:
      ctx.merge_call(lambda s: merged.append("cleanup"))

  with strategy.scope():
    with pytest.raises(KeyError, match="tower 1 failed"):
      strategy.call_for_each_tower(fn)
  assert _tower_threads.abandoned_tower_threads() == []
  assert merged == []


def _yields():
  yield ds.get_tower_context()


async def _awaits():
  return ds.get_tower_context()


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_a_generator_or_coroutine_function_as_fn_or_merge_fn_is_refused(strategy):
  # It was called and gave back its generator (coroutine) unrun, as the towers' result:
  # its body ran later, when consumed, outside the towers (or never, for a coroutine).
  s = ds.DefaultStrategy() if strategy == "default" else ds.MirroredStrategy(CPUS[:2])
  for fn, kind in [(_yields, "generator"), (_awaits, "coroutine")]:
    with s.scope():
      with pytest.raises(TypeError, match=rf"call_for_each_tower\(\) runs fn and uses what "
                         rf"it returns, but fn={fn.__name__} is a {kind} function"):
        s.call_for_each_tower(fn)
      with pytest.raises(TypeError, match=rf"merge_call\(\) runs merge_fn .* but "
                         rf"merge_fn={fn.__name__} is a {kind} function"):
        s.call_for_each_tower(lambda f=fn: ds.get_tower_context().merge_call(f))
  assert s.call_for_each_tower(lambda: 1) == 1  # A plain function still runs.


def test_a_timeout_longer_than_python_can_wait_is_refused_when_given():
  # tower_timeout=float("inf") (or 1e10) was taken, then every call_for_each_tower failed
  # with OverflowError: "timestamp out of range for platform time_t".
  for too_long in (float("inf"), 1e10):
    with pytest.raises(ValueError, match=r"tower_timeout must be a positive number of "
                       r"seconds, at most 1e\+09 .* pass a large number such as 86400"):
      ds.MirroredStrategy(CPUS[:2], tower_timeout=too_long)
  strategy = ds.MirroredStrategy(CPUS[:2], tower_timeout=1e9)  # The longest works.
  with strategy.scope():
    merged = strategy.call_for_each_tower(
        lambda: ds.get_tower_context().merge_call(lambda s: "merged"))
  assert merged == "merged"


def test_a_merge_fn_error_names_the_towers_that_called_it():
  # The note said "called by towers 0-<count - 1>" whatever the towers' ids: "towers 0-0"
  # for one tower, and "towers 0-1" for a worker whose towers are 2 and 3 (a strategy
  # over several processes numbers its towers from its first_tower_id).
  def fn():
    return ds.get_tower_context().merge_call(lambda s: {}["missing"])

  one = ds.MirroredStrategy(CPUS[:1])
  with one.scope(), pytest.raises(KeyError) as info:
    one.call_for_each_tower(fn)
  assert f"(raised in merge_fn <lambda> called by tower 0 of {one!r})" in _text(info.value)
  four = ds.MirroredStrategy(CPUS)
  second_half = _tower_threads.TowerRunner(four, CPUS[2:], first_tower_id=2, num_towers=4)
  with four.scope(), pytest.raises(KeyError) as info:
    second_half.run(fn, (), {})
  assert f"(raised in merge_fn <lambda> called by towers 2-3 of {four!r})" in _text(info.value)


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_tf_distributes_form_of_merge_call_says_to_pass_the_arguments(strategy):
  # merge_call(merge_fn, args=(x,)), tf.distribute's form, called merge_fn(strategy,
  # args=(x,)): Python's "merge_fn() got an unexpected keyword argument 'args'".
  s = ds.DefaultStrategy() if strategy == "default" else ds.MirroredStrategy(CPUS[:2])

  def merge_fn(strategy, x):
    return strategy.reduce("sum", x)

  def fn():
    return ds.get_tower_context().merge_call(merge_fn, args=(tf.constant(1.0),))

  error = _same_in_both_modes(s, fn)
  assert isinstance(error, TypeError)
  assert str(error).startswith(
      "merge_call() calls merge_fn(strategy, *args, **kwargs) with its arguments as they "
      "are, but merge_fn=merge_fn takes no keyword argument 'args': merge_call(merge_fn, "
      "args=(...), kwargs={...}) is the form of tf.distribute's")
  with s.scope():  # A merge_fn that takes such keywords gets them.
    got = s.call_for_each_tower(
        lambda: ds.get_tower_context().merge_call(lambda st, args: args, args="mine"))
  assert got == "mine"
