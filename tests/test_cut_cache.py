"""The analyses' cache of recursive queries (flake8_amp.analysis.names.CutCache)."""
from flake8_amp.analysis.names import CutCache


def make_values(cache, calls):
    """a = b + 1; b = a if a is known, else 5: a's query reaches b, whose query reaches a."""

    def value(key):
        def compute():
            calls.append(key)
            if key == "a":
                b = value("b")
                return None if b is None else b + 1
            a = value("a")
            return 5 if a is None else a
        return cache.answer(key, compute)

    return value


def test_an_inner_answer_cut_by_a_cycle_is_computed_again_when_asked():
    cache, calls = CutCache(), []
    value = make_values(cache, calls)
    assert value("a") == 6  # b answered 5 there, cut short by the cycle through a
    assert cache.cycles == 1 and cache.cuts == 1
    assert value("b") == 6  # not the 5 of the cut: computed again, with a known
    assert calls == ["a", "b", "b"]
    assert value("b") == 6 and calls == ["a", "b", "b"]  # the outermost answer is kept


def test_too_deep_is_unknown_unless_already_answered():
    cache, calls = CutCache(), []
    assert cache.answer("x", lambda: calls.append("x") or 1) == 1
    assert cache.answer("x", lambda: 2, too_deep=True) == 1
    assert cache.answer("y", lambda: 3, too_deep=True) is None
    assert cache.cuts == 1 and cache.cycles == 0


def test_a_failing_computation_leaves_nothing_behind():
    cache = CutCache()

    def fail():
        raise ValueError("boom")

    try:
        cache.answer("x", fail)
    except ValueError:
        pass
    assert cache.answer("x", lambda: 4) == 4
