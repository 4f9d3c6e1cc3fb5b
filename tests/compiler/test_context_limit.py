"""The model's context at every turn: a multi-turn episode whose next turn would not fit (context
so far + max_new_tokens > the model's context) ends before that turn, truncated, counted in
``episodes/truncated_context`` and scored as it stands; ``context_limit="fail"`` fails it."""

import pytest

import materl as ml
from materl.compiler.compiled import Compiled
from materl.compiler.options import CompileOptions
from materl.rollout.mcp import PythonTools, mcp_tools
from tests.compiler.test_step_metrics import Clock, tool_recipe

NEW = 3  # max_new_tokens


def _rollout(context: int | None, **options):
    """Two episodes of the forced-tool-call recipe (turn 1, a tool answer, turn 2) with the
    policy's context set to ``context`` tokens; their episodes and the step's rollout metrics."""
    policy = ml.Agent("tiny-random")
    if context is not None:
        policy.model.config.max_position_embeddings = context
    compiled = Compiled(tool_recipe(mcp_tools(PythonTools(Clock)), force=True), {"policy": policy},
                        CompileOptions(max_new_tokens=NEW, group_size=2, **options), rollout_only=True)
    try:
        episodes = compiled.call_blocking(compiled.rollout, ["a"])
        return episodes, compiled.rollout_metrics(episodes)
    finally:
        compiled.close()


def test_a_turn_that_would_overflow_the_context_is_not_sampled():
    episodes, m = _rollout(None)
    assert m["episodes/truncated_context"] == 0.0
    full = episodes[0].values["rollout"]
    assert [s.kind for s in full.steps] == ["generate", "tool", "generate"]
    # the context turn 2 starts from: the prompt, turn 1's tokens and the tool answer's glue
    before_turn_2 = len(full.prompt_ids) + len(full.steps[0].token_ids) + len(full.steps[1].token_ids)
    fits = before_turn_2 + NEW  # turn 2 fits exactly
    episodes, m = _rollout(fits)
    assert m["episodes/truncated_context"] == 0.0 and len(episodes[0].values["rollout"].steps) == 3
    episodes, m = _rollout(fits - 1)  # one token short: both episodes end after the tool answer
    assert m["episodes/truncated_context"] == 2.0 and m["failed_episodes"] == 0.0
    cut = episodes[0].values["rollout"]
    assert [s.kind for s in cut.steps] == ["generate", "tool"] and cut.metadata["truncated"] == "context"
    assert cut.completion_ids == full.completion_ids[:len(cut.completion_ids)]  # the episode as it stood
    assert episodes[0].values["turn_2"].step is None and episodes[0].values["turn_2"].done
    assert m["tokens"] == 2 * len(full.steps[0].token_ids)  # turn 1 is still trained on


def test_context_limit_fail_fails_the_episode_naming_the_numbers():
    episodes, m = _rollout(None)
    full = episodes[0].values["rollout"]
    before_turn_2 = len(full.prompt_ids) + len(full.steps[0].token_ids) + len(full.steps[1].token_ids)
    episodes, m = _rollout(before_turn_2 + NEW - 1, context_limit="fail", max_failed_fraction=1.0)
    assert m["failed_episodes"] == 2.0
    message = str(episodes[0].error)
    assert f"{before_turn_2} tokens of context + max_new_tokens={NEW}" in message
    assert f"context of {before_turn_2 + NEW - 1} tokens" in message


def test_context_limit_is_a_validated_option():
    with pytest.raises(ml.errors.ConfigError, match="context_limit"):
        CompileOptions.from_kwargs(context_limit="truncate")
