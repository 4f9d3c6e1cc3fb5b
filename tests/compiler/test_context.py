"""The step context is frozen and picklable, and the rollout stage runs from it alone: a worker
process that receives it (plus its own engine and tool servers) produces the same episodes."""

import dataclasses
import multiprocessing
import pickle

import anyio
import pytest

import materl as ml
from materl.compiler.context import StepContext
from materl.compiler.scheduler import rollout_from_context
from materl.recipes import grpo
from materl.recipes.grpo_tools import grpo_tools_recipe


def tool_step():
    recipe = grpo_tools_recipe(ml.mcp_tools("python -m materl.tools.calculator"))
    return ml.compile(recipe, policy=ml.Agent("tiny-random", trainable=True), group_size=2, max_new_tokens=12,
                      max_turns=2)


def episode_tokens(episodes):
    return [(e.uid, e.values["rollout"].completion_ids, e.values["rollout"].sampling_logprobs) for e in episodes]


def worker(blob: bytes, prompts: list[str], queue) -> None:
    """A separate process: only the pickled context; it builds its own agent and tool servers."""
    ctx = pickle.loads(blob)
    agents = {name: spec.build() for name, spec in ctx.agents.items()}

    async def go():
        episodes = await rollout_from_context(ctx, agents, prompts)
        for toolbox in {id(n.params["tools"]): n.params["tools"] for n in ctx.plan.nodes.values()
                        if "tools" in n.params}.values():
            await toolbox.aclose()
        return episodes

    queue.put(episode_tokens(anyio.run(go)))


def test_context_is_frozen_and_pickles_with_the_plan_and_its_toolboxes():
    step = tool_step()
    ctx = step.context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.step = 3  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(ctx))
    assert isinstance(again, StepContext) and again.plan.order == ctx.plan.order
    assert again.plan.impls == ctx.plan.impls and again.options == ctx.options and again.agents == ctx.agents
    toolbox = again.plan.nodes["tools_1"].params["tools"]
    assert toolbox is not step.plan.nodes["tools_1"].params["tools"] and not toolbox.started  # a description


def test_a_worker_process_runs_the_rollout_stage_from_the_pickled_context():
    step = tool_step()
    ctx = step.context()
    prompts = ["What is 2 + 3?", "What is 7 * 6?"]
    agents = {"policy": ml.Agent("tiny-random")}  # the same weights (tiny-random is built from a seed)

    async def here():
        episodes = await rollout_from_context(ctx, agents, prompts)
        await step.aclose()
        for toolbox in {id(n.params["tools"]): n.params["tools"] for n in ctx.plan.nodes.values()
                        if "tools" in n.params}.values():
            await toolbox.aclose()
        return episodes

    local = episode_tokens(anyio.run(here))
    queue = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(target=worker, args=(pickle.dumps(ctx), prompts, queue))
    proc.start()
    remote = queue.get(timeout=240)
    proc.join(60)
    assert proc.exitcode == 0
    assert len(local) == 4 and remote == local  # same uids, tokens and sampling log-probs


def test_training_steps_do_not_need_the_compiled_object_in_the_stages():
    """The stages see a StageEnv (context + agents): the scheduler and learner modules never import
    Compiled (the import contract checks the rest)."""
    import materl.compiler.learner as learner
    import materl.compiler.scheduler as scheduler

    assert "Compiled" not in vars(scheduler) and "Compiled" not in vars(learner)
    step = ml.compile(grpo, policy=ml.Agent("tiny-random", trainable=True), ref_policy=ml.Agent("tiny-random"),
                      group_size=2, max_new_tokens=4)
    assert step.run(prompts=["a"])["episodes"] == 2.0
    step.close()
