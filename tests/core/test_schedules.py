import math

import pytest

from posttrain.core.schedules import SCHEDULES, scheduled_coef


def test_schedules_by_hand():
    args = dict(start=1.0, end=0.2, steps=8, step_every=3)
    assert [scheduled_coef("constant", s, **args) for s in (0, 4, 100)] == [1.0, 1.0, 1.0]
    assert [scheduled_coef("linear", s, **args) for s in (0, 2, 4, 8, 20)] == pytest.approx([1.0, 0.8, 0.6, 0.2, 0.2])
    cosine = [scheduled_coef("cosine", s, **args) for s in (0, 2, 4, 8, 20)]
    half_way_up = 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2
    assert cosine == pytest.approx([1.0, half_way_up, 0.6, 0.2, 0.2])
    # step: the linear value at the last multiple of step_every (0, 3, 6, then steps)
    staircase = [scheduled_coef("step", s, **args) for s in range(10)]
    assert staircase == pytest.approx([1.0] * 3 + [0.7] * 3 + [0.4] * 3 + [0.2])
    # annealing upwards works the same way
    assert scheduled_coef("linear", 4, start=0.0, end=1.0, steps=8) == pytest.approx(0.5)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_starts_at_start_and_ends_at_end(name):
    assert scheduled_coef(name, 0, start=0.5, end=0.1, steps=6, step_every=2) == 0.5
    expected = 0.5 if name == "constant" else 0.1
    assert scheduled_coef(name, 6, start=0.5, end=0.1, steps=6, step_every=2) == pytest.approx(expected)


def test_bad_schedules_raise():
    with pytest.raises(ValueError, match="unknown schedule 'exp'"):
        scheduled_coef("exp", 0, start=1.0)
    with pytest.raises(ValueError, match="steps"):
        scheduled_coef("linear", 0, start=1.0, steps=0)
    with pytest.raises(ValueError, match="step_every"):
        scheduled_coef("step", 0, start=1.0, steps=4, step_every=0)
    with pytest.raises(ValueError, match="step must"):
        scheduled_coef("linear", -1, start=1.0, steps=4)
