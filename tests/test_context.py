"""The context state machine (docs/concepts.md, "Contexts"), on the default strategy and a real one."""

import threading

import pytest
import tensorflow as tf

import diststrat as ds
from diststrat import errors
from sequential_strategy import SequentialStrategy
from conftest import CPUS


def _state():
  return (ds.get_tower_context(), ds.get_cross_tower_context(),
          ds.get_distribution_strategy(), ds.has_distribution_strategy())


def test_default_context_row():
  tower, cross, strategy, has = _state()
  assert isinstance(tower, ds.TowerContext)
  assert (tower.tower_id, tower.num_towers, tower.is_single_tower) == (0, 1, True)
  assert cross is None
  assert strategy is ds.DefaultStrategy()
  assert isinstance(strategy, ds.strategies.DefaultStrategy)
  assert has is False
  assert tower.distribution_strategy is strategy


def test_scope_row():
  s = SequentialStrategy(CPUS[:2])
  with s.scope():
    assert _state() == (None, s, s, True)
  assert ds.get_cross_tower_context() is None  # Back to the default.


def test_tower_row():
  s = SequentialStrategy(CPUS[:2])
  seen = []

  def fn():
    tower, cross, strategy, has = _state()
    seen.append((tower.tower_id, tower.num_towers, tower.distribution_strategy is s,
                 tower.device, cross, strategy is s, has))

  with s.scope():
    s.call_for_each_tower(fn)
  assert seen == [(0, 2, True, CPUS[0], None, True, True),
                  (1, 2, True, CPUS[1], None, True, True)]


def test_merge_fn_row():
  s = SequentialStrategy(CPUS[:2])
  seen = []

  def merge_fn(strategy, x):
    seen.append((strategy is s,) + _state()[1:] + (ds.get_tower_context(), x))
    return x * 10

  def fn():
    return ds.get_tower_context().merge_call(merge_fn, ds.get_tower_context().tower_id + 1)

  with s.scope():
    result = s.call_for_each_tower(fn)
  assert result.values == (10, 20)
  assert seen == [(True, s, s, True, None, 1), (True, s, s, True, None, 2)]


def test_default_merge_call_enters_default_cross_tower_context():
  default = ds.get_distribution_strategy()

  def merge_fn(strategy, a, b=None):
    assert strategy is default
    return _state() + (a, b)

  tower, cross, strategy, has, a, b = ds.get_tower_context().merge_call(merge_fn, 1, b=2)
  assert (tower, cross, strategy, has, a, b) == (None, default, default, False, 1, 2)
  assert ds.get_tower_context() is not None


def test_exactly_one_of_tower_and_cross_tower_context():
  s = SequentialStrategy(CPUS[:2])
  states = [_state()]

  def fn():
    states.append(_state())
    ds.get_tower_context().merge_call(lambda st: states.append(_state()))

  with s.scope():
    states.append(_state())
    s.call_for_each_tower(fn)
  for tower, cross, _, _ in states:
    assert (tower is None) != (cross is None)


def test_nested_call_for_each_tower_inside_merge_fn():
  s = SequentialStrategy(CPUS[:2])

  def inner():
    ctx = ds.get_tower_context()
    return ctx.merge_call(lambda st, v: ("inner", ds.get_cross_tower_context() is st, v),
                          ctx.tower_id)

  def merge_fn(strategy, x):
    nested = strategy.call_for_each_tower(inner)
    return (x, nested)

  def outer():
    return ds.get_tower_context().merge_call(merge_fn, "x")

  with s.scope():
    result = s.call_for_each_tower(outer)
  # Each outer tower ran merge_fn (SequentialStrategy merges per tower); each nested
  # tower saw its inner merge_fn in cross-tower context.
  x, nested = result
  assert x == "x"
  assert nested[:2] == ("inner", True)
  # The outer towers each got their own nested result: a PerDevice of PerDevices.
  assert [inner.values for inner in nested[2].values] == [(0, 1), (0, 1)]


def test_scope_reentered_is_noop_and_mixing_raises():
  s1 = SequentialStrategy(CPUS[:2])
  s2 = SequentialStrategy(CPUS[:2])
  with s1.scope():
    with s1.scope():
      assert ds.get_cross_tower_context() is s1
    assert ds.get_cross_tower_context() is s1  # The inner exit did not pop s1.
    with pytest.raises(RuntimeError, match=r"Cannot enter the scope of .*strategies do not mix"):
      with s2.scope():
        pass
    with pytest.raises(errors.ContextError, match="DefaultStrategy"):
      with ds.DefaultStrategy().scope():
        pass
  assert not ds.has_distribution_strategy()


def test_one_scope_object_entered_again_inside_itself_is_a_noop():
  # A helper that keeps `scope = s.scope()` and enters it in nested calls: the inner
  # `with` replaced the outer one's exit state, so the outer scope was left (variables
  # in the inner body were plain ones) before its body ended.
  s = SequentialStrategy(CPUS[:3])
  scope = s.scope()
  with scope:
    with scope:
      assert ds.get_cross_tower_context() is s
      v = tf.Variable(1.0)
    assert ds.get_cross_tower_context() is s
    w = tf.Variable(1.0)
  assert _state()[1:] == (None, ds.DefaultStrategy(), False)
  assert v.device == w.device == CPUS[2]  # SequentialStrategy's policy, in both bodies.
  with scope:  # Reusable afterwards.
    assert ds.get_cross_tower_context() is s
  assert ds.get_cross_tower_context() is None


def test_mixing_message_names_both_strategies():
  s1 = SequentialStrategy(CPUS[:2])
  s2 = SequentialStrategy(CPUS[1:3])
  with s1.scope():
    with pytest.raises(RuntimeError) as info:
      with s2.scope():
        pass
  assert repr(s1) in str(info.value) and repr(s2) in str(info.value)


def test_cross_tower_method_in_tower_context_says_merge_call():
  s = SequentialStrategy(CPUS[:2])
  x = tf.constant(1.0)
  with s.scope():
    for method, args in [("reduce", ("sum", x)), ("broadcast", (x,)), ("unwrap", (x,)),
                         ("batch_reduce", ("sum", [(x, None)])),
                         ("call_for_each_tower", (lambda: None,)), ("read_var", (x,))]:
      def fn(method=method, args=args):
        getattr(s, method)(*args)
      with pytest.raises(RuntimeError,
                         match=rf"{method}\(\) needs the cross-tower context.*"
                               r"get_tower_context\(\)\.merge_call"):
        s.call_for_each_tower(fn)
      assert ds.get_cross_tower_context() is s


def test_worker_device_index_in_tower_context_raises():
  s = SequentialStrategy(CPUS[:2])
  with s.scope():
    with pytest.raises(RuntimeError, match="worker_device_index.*merge_call"):
      s.call_for_each_tower(lambda: s.worker_device_index)


def test_method_of_other_strategy_raises():
  s1 = SequentialStrategy(CPUS[:2])
  s2 = SequentialStrategy(CPUS[:2])
  with s1.scope():
    with pytest.raises(RuntimeError, match="strategies do not mix"):
      s2.reduce("sum", tf.constant(1.0))


def test_cross_tower_method_from_default_context_enters_scope():
  s = SequentialStrategy(CPUS[:2])
  seen = []
  s.call_for_each_tower(lambda: seen.append(ds.get_distribution_strategy() is s))
  assert seen == [True, True]
  assert not ds.has_distribution_strategy()


def test_default_strategy_tower_context_requires_merge_call():
  default = ds.DefaultStrategy()
  with default.scope():
    with pytest.raises(RuntimeError, match=r"reduce\(\) needs the cross-tower context"):
      default.call_for_each_tower(lambda: default.reduce("sum", 1.0))


def test_tower_context_used_outside_its_tower_raises():
  s = SequentialStrategy(CPUS[:2])
  contexts = []
  with s.scope():
    s.call_for_each_tower(lambda: contexts.append(ds.get_tower_context()))
    with pytest.raises(RuntimeError, match=r"merge_call\(\) needs a tower context.*Call "
                       r"merge_call\(\) from the function you pass to strategy."
                       r"call_for_each_tower\(fn\)"):
      contexts[0].merge_call(lambda st: None)

    def fn():
      # Tower 1 uses tower 0's context.
      if ds.get_tower_context().tower_id == 1:
        contexts[0].merge_call(lambda st: None)
    with pytest.raises(RuntimeError, match="TowerContext of tower 0"):
      s.call_for_each_tower(fn)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_merge_call_from_the_cross_tower_context_names_call_for_each_tower(mode):
  # Once: the message told to call merge_call on get_tower_context(), which is None there.
  s = ds.MirroredStrategy(CPUS[:2])
  default_tower = ds.get_tower_context()
  message = (r"merge_call\(\) needs a tower context: it pauses the towers that "
             r"call_for_each_tower runs. It was called on the TowerContext of tower {} of {} "
             r"in the cross-tower context of MirroredStrategy.*, where there are no towers to "
             r"pause \(and get_tower_context\(\) is None\). Call merge_call\(\) from the "
             r"function you pass to strategy.call_for_each_tower\(fn\), or, in cross-tower "
             r"code, call merge_fn\(strategy, \*args\) directly.")

  def run(fn):
    return tf.function(fn)() if mode == "function" else fn()

  with s.scope():
    with pytest.raises(ds.errors.ContextError,
                       match=message.format(0, r"DefaultStrategy\(\)")):
      run(lambda: default_tower.merge_call(lambda strategy: 1.0))

    def tower_fn():
      tower = ds.get_tower_context()
      # merge_fn runs in the cross-tower context: the tower's context cannot merge again.
      return tower.merge_call(lambda strategy: tower.merge_call(lambda st: 1.0))

    with pytest.raises(ds.errors.ContextError,
                       match=message.format(r"\d", r"MirroredStrategy.*")):
      run(lambda: s.call_for_each_tower(tower_fn))


def test_get_update_device():
  s = SequentialStrategy(CPUS[:2])
  assert ds.get_update_device() is None
  with s.scope():
    v = tf.Variable(1.0)
    seen = s.update(v, lambda var: ds.get_update_device())
  assert seen == v.device == CPUS[1]  # SequentialStrategy keeps variables on its last device.
  assert ds.get_update_device() is None


def test_new_thread_starts_in_default_context():
  s = SequentialStrategy(CPUS[:2])
  seen = {}

  def other():
    seen["state"] = _state()

  with s.scope():
    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=30)
  tower, cross, strategy, has = seen["state"]
  assert tower is not None and tower.tower_id == 0
  assert (cross, strategy, has) == (None, ds.DefaultStrategy(), False)


def test_scope_restored_after_exception():
  s = SequentialStrategy(CPUS[:2])
  with pytest.raises(ZeroDivisionError):
    with s.scope():
      _ = 1 / 0
  assert _state()[1:] == (None, ds.DefaultStrategy(), False)
  with pytest.raises(KeyError):
    with s.scope():
      s.call_for_each_tower(lambda: ds.get_tower_context().merge_call(
          lambda st: {}["missing"]))
  assert _state()[1:] == (None, ds.DefaultStrategy(), False)


def test_variable_creation_policy_applies_inside_scope_only():
  s = SequentialStrategy(CPUS[:3])
  with s.scope():
    v = tf.Variable(1.0)
    w = s.call_for_each_tower(lambda: tf.Variable(2.0))
  u = tf.Variable(3.0)
  assert v.device == CPUS[2]  # SequentialStrategy places variables on the last device.
  assert [x.device for x in w.values] == [CPUS[2]] * 3  # Each sequential tower made one.
  assert u.device != CPUS[2]


def test_colocate_vars_with():
  s = SequentialStrategy(CPUS[:3])
  with tf.device(CPUS[1]):
    anchor = tf.Variable(0.0)
  with s.scope():
    with s.colocate_vars_with(anchor):
      v = tf.Variable(1.0)
    w = tf.Variable(1.0)
  assert v.device == CPUS[1]
  assert w.device == CPUS[2]
  with pytest.raises(RuntimeError, match=r"colocate_vars_with\(\) .* must be used inside its scope"):
    s.colocate_vars_with(anchor)


def test_a_default_strategy_method_inside_another_strategy_names_the_one_in_effect():
  # Code that kept get_distribution_strategy() from outside any scope (the default
  # strategy) and used it inside one was told to "call it inside its own scope()",
  # which raises there too: the default strategy's scope cannot be entered inside s.
  s = SequentialStrategy(CPUS[:2])
  kept = ds.get_distribution_strategy()
  with s.scope():
    for call in (lambda: kept.reduce("sum", 1.0),
                 lambda: s.call_for_each_tower(lambda: kept.reduce("sum", 1.0))):
      with pytest.raises(errors.ContextError,
                         match=r"DefaultStrategy.reduce\(\) was called in the (cross-)?"
                               r"tower.* where SequentialStrategy\(.*\) is in effect: .*"
                               r"Call the method of the strategy in effect, "
                               r"ds.get_distribution_strategy\(\)"):
        call()
    in_effect = ds.get_distribution_strategy()  # The fix the message names works.
    assert [float(x) for x in in_effect.reduce("sum", 1.0).values] == [1.0, 1.0]
