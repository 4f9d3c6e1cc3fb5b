"""Integration on the real pretrained model (slow; still run in CI): two steps of grpo_tools with
the shipped calculator MCP server."""

import pytest
import torch

import materl as ml
from materl.recipes.grpo_tools import grpo_tools_recipe
from materl.runtime.tasks import arithmetic_rows


@pytest.mark.slow
def test_two_steps_of_grpo_tools_on_smollm2():
    toolbox = ml.mcp_tools("python -m materl.tools.calculator")
    policy = ml.Agent("smollm2-135m-instruct", trainable=True)
    step = ml.compile(grpo_tools_recipe(toolbox, turns=2), policy=policy, ref_policy=ml.Agent("smollm2-135m-instruct"),
                      group_size=2, max_new_tokens=24, lr=1e-5, seed=0)
    rows = arithmetic_rows(2, seed=0)
    try:
        for _ in range(2):
            metrics = step.run([r["prompt"] for r in rows], answer=[r["answer"] for r in rows])
            assert metrics["failed_episodes"] == 0 and metrics["tokens"] > 0
            assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert {"reward/answer/mean", "reward/tool_format/mean", "reward/tool_success/mean"} <= set(metrics)
        ro = step.episode_rollout(step.last_episodes[0])
        assert ro.prompt_ids and ro.generate_steps
    finally:
        step.close()
    assert step.step_count == 2 and "grad_norm" in metrics  # both steps reached the optimizer
