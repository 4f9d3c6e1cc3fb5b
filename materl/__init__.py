"""materl: an asyncio dataflow engine for agentic, tool-use RL of LLMs.

    import materl as ml

    @ml.recipe
    def grpo(policy, ref_policy, prompts): ...

    step = ml.compile(grpo, policy=ml.Agent("smollm2-135m-instruct", trainable=True), ...)
    metrics = step.run(prompts=batch)
"""

from materl.errors import *  # noqa: F403
from materl.registry import Registry
from materl.graph.node import Node, Recipe
from materl.graph.trace import Value
from materl.graph.recipe import algorithm, recipe, replace, transform, with_kl
from materl.graph.custom import op
from materl.graph.constructors import (
    add_loss, advantages, call_tools, cispo_loss, clip_cov_loss, dpo_loss, filter_groups, gae_advantages, generate,
    generate_step, gpg_loss, grpo_loss, gspo_loss, kl_cov_loss, logprobs, policy_loss, ppo_loss,
    reinforce_loss, reward, sapo_loss, set_loss, structure_rollout, value_loss, values,
)
from materl.compile.compiled import Compiled, compile  # noqa: A004
from materl.rollout.mcp import MCPServer, Toolbox, mcp_tools
from materl.agent import Agent

__version__ = "0.1.0"
