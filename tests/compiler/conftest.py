import pytest

import materl as ml


def toy_reward(*, completion_ids, **_):
    """Fraction of completion tokens below 128: learnable by a tiny random model in a few steps."""
    return [sum(t < 128 for t in ids) / max(1, len(ids)) for ids in completion_ids]


@pytest.fixture
def tiny():
    def make(**kw):
        return ml.Agent("tiny-random", **kw)

    return make
