"""``ml.train``, ``ml.train_rlhf`` and ``materl train`` return one shape (``train_result``):
``history``, ``final`` (the last step's metrics without per-node times), ``evals``,
``checkpoint``, ``run_dir``."""

import materl as ml
from materl.recipes import grpo
from materl.runtime.tasks import arithmetic_split
from materl.runtime.train import train

KEYS = {"history", "final", "evals", "checkpoint", "run_dir"}


def test_train_and_train_rlhf_return_the_same_shape(tmp_path):
    rows, _ = arithmetic_split(4, 0, seed=0)
    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=3)
    try:
        direct = train(step, rows, steps=2, batch_size=2, run_dir=tmp_path / "a", progress=False, tensorboard=False)
    finally:
        step.close()
    one_call = ml.train_rlhf("tiny-random", algorithm="grpo", dataset="arithmetic", steps=2, batch_size=2,
                             test_size=2, run_dir=str(tmp_path / "b"), group_size=2, max_new_tokens=3)
    for result in (direct, one_call):
        assert set(result) == KEYS
        assert [h["step"] for h in result["history"]] == [1, 2]
        last = result["history"][-1]
        assert result["final"] == {k: v for k, v in last.items() if not k.startswith("time/node")}
        assert any(k.startswith("time/node") for k in last) and result["final"]["step"] == 2
    assert one_call["run_dir"] == str(tmp_path / "b") and direct["run_dir"] == str(tmp_path / "a")
