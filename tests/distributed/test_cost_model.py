"""The pipeline's cost model (materl.distributed.cost_model) against hand-computed step times."""

import pytest

from materl.distributed.cost_model import Stages, expected_max, step_time

STAGES = Stages(generate_s=1.2, tool_wait_s=1.0, learn_s=0.4, publish_s=0.01, episodes=16)


def test_lock_step_adds_the_stages_and_workers_divide_generation():
    assert step_time(STAGES, workers=1, staleness=0) == pytest.approx(1.2 + 1.0 + 0.4 + 0.01)
    assert step_time(STAGES, workers=8, staleness=0) == pytest.approx(0.15 + 1.0 + 0.4 + 0.01)
    assert step_time(STAGES, workers=8, staleness=0, learner_ranks=4) == pytest.approx(0.15 + 1.0 + 0.1 + 0.01)


def test_async_step_is_its_slowest_side():
    assert step_time(STAGES, workers=1, staleness=2) == pytest.approx(1.2)  # generation
    assert step_time(STAGES, workers=8, staleness=2) == pytest.approx(0.41)  # the learner
    assert step_time(STAGES, workers=64, staleness=2, learner_ranks=8) == pytest.approx(1.0 / 3)  # the shared tail
    assert step_time(STAGES, workers=1, staleness=2, in_process=True) == pytest.approx(1.2 + 0.41)


def test_the_shared_tail_grows_with_the_wait_distribution():
    flat = Stages(generate_s=0.0, tool_wait_s=6.0, learn_s=0.0, publish_s=0.0, episodes=1, tail=(2.0,) * 5)
    assert flat.wait(3) == 6.0  # every wait alike: three batches end together
    two_point = Stages(generate_s=0.0, tool_wait_s=2.0, learn_s=0.0, publish_s=0.0, episodes=1, tail=(1.0, 3.0))
    # one draw: E = 2; the longer of two draws: 3 unless both are 1 (1/4), E = 2.5
    assert two_point.wait(2) == pytest.approx(2.0 * 2.5 / 2.0, rel=0.05)
    assert step_time(two_point, workers=1, staleness=1) == pytest.approx(2.5 / 2, rel=0.05)
    assert expected_max([1.0, 3.0], 2) == pytest.approx(2.5, rel=0.05)


def test_stages_are_medians_of_a_lock_step_run_after_its_first_step():
    history = [{"time/stage/rollout": 50.0, "time/stage/prepare": 9.0, "time/stage/learner": 9.0, "time/publish": 1.0,
                "episodes": 8}]  # the first step loads and warms up: left out
    history += [{"time/stage/rollout": r, "time/stage/prepare": 0.1, "time/stage/learner": lr, "time/publish": 0.01,
                 "episodes": 16} for r, lr in ((3.0, 0.3), (5.0, 0.5), (4.0, 0.9))]
    s = Stages.measured(history, generate_s=1.0, tail=[1.0, 2.0])
    assert (s.generate_s, s.tool_wait_s, s.learn_s, s.publish_s, s.episodes) == pytest.approx((1.0, 3.0, 0.6, 0.01, 16))
    assert s.tail == (1.0, 2.0)
