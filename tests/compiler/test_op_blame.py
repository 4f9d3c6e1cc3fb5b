"""A custom op (``@ml.op``) whose value a built-in node cannot read is blamed for it: the episode's
failure names the op's node and says what it returned, not the node that read it."""

import pytest
import torch

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.failures import Failure
from materl.compiler.options import CompileOptions
from materl.errors import OpOutputError, StepFailedError


@ml.op
def verdicts(completions) -> {"score": list}:
    """A reward op that returns words where numbers are due."""
    return {"score": ["good"] * len(completions)}


@ml.op
def scores(completions) -> {"score": torch.Tensor}:
    return {"score": torch.ones(len(completions))}


def recipe(op):
    @ml.recipe
    def graded(policy, prompts):
        completions = ml.generate(policy, prompts, name="completions")
        advantages = ml.advantages(op(completions), completions=completions, name="advantages")
        ml.set_loss(ml.policy_loss(advantages, ml.logprobs(policy, prompts, completions)))

    return graded


def rollout(op):
    compiled = Compiled(recipe(op), {"policy": ml.Agent("tiny-random", trainable=True)},
                        CompileOptions(max_new_tokens=3, group_size=2),
                        rollout_only=True)
    try:
        return compiled.call_blocking(compiled.rollout, ["a"])
    finally:
        compiled.close()


def test_the_op_that_returned_the_value_is_blamed():
    episodes = rollout(verdicts)
    failures = {str(e.error) for e in episodes}
    assert len(failures) == 1 and all(e.error.node == "verdicts" for e in episodes)
    (failure,) = failures
    assert failure.startswith("OpOutputError in node 'verdicts': op 'verdicts' (node 'verdicts') returned 'good' "
                              "(str) for episode 0, which node 'advantages' (advantages) reads as 'verdicts.score'")
    # a well-formed op runs through
    assert all(e.error is None for e in rollout(scores))


def test_the_error_keeps_its_node_across_processes_and_in_the_step_error():
    import pickle

    err = pickle.loads(pickle.dumps(OpOutputError("bad value", node="verdicts")))
    assert (str(err), err.node, isinstance(err, TypeError)) == ("bad value", "verdicts", True)
    assert Failure.of("advantages", err).node == "verdicts"
    step = ml.compile(recipe(verdicts), policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=3)
    try:
        with pytest.raises(StepFailedError, match=r"2 x OpOutputError in node 'verdicts': op 'verdicts'"):
            step.run(prompts=["a"])
    finally:
        step.close()
