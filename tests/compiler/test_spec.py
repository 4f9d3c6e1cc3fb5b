"""The op table and what it decides: registration, implementation rules, wiring checks at compile
time, shape checks at run time, reference="none", and batching by tick."""

import importlib.util
import warnings

import pytest
import torch
from materl.recipes import grpo

import materl as ml
from materl.compiler.spec import OPS, Impl, Kind, OpSpec, Output, Role
from materl.errors import (
    CompileError,
    DuplicateNameError,
    RecipeError,
    RecipeWarning,
    StepFailedError,
)
from materl.graph.kinds import KINDS
from materl.kernels import loader
from materl.ops.advantages import ADVANTAGES, group_statistics


def tiny(trainable=False, **kw):
    return ml.Agent("tiny-random", trainable=trainable, **kw)


def test_registering_an_op_kind_twice_is_an_error():
    spec = OpSpec("generate", Role.ROLLOUT, (Output("rollout", Kind.ROLLOUT),), (Impl("x"),))
    with pytest.raises(DuplicateNameError, match="op kind 'generate' is already registered"):
        OPS.register("generate", spec)


def test_rollout_producers_agree_between_graph_and_op_table():
    assert {k for k in OPS.names() if OPS.get(k).role is Role.ROLLOUT} == {k for k, f in KINDS.items() if f.rollout}
    assert {k for k in OPS.names() if OPS.get(k).role is Role.DATA} == {k for k, f in KINDS.items() if f.data}
    assert set(KINDS) <= set(OPS.names())  # the graph knows facts of op kinds only
    assert [OPS.get(k).facts.policy_gradient for k in ("policy_loss", "value_loss")] == [True, False]


def test_named_outputs_print_and_resolve():
    assert [o.name for o in OPS.get("advantages").outputs] == ["advantages", "returns"]
    assert "%value_loss = value_loss(%values, %advantages.returns)" in str(ml.recipes.get("ppo"))


def test_kernels_option_picks_implementations_by_rule():
    torch_plan = ml.compile(grpo, policy=tiny(True), ref_policy=tiny(), kernels="torch").plan
    assert {torch_plan.impls[n] for n in ("rewards", "advantages", "policy_loss")} == {"python", "torch"}
    # with Mojo, the rewards and advantages run on it and reinforce_loss (no Mojo kernel) is refused;
    # without it (CI's second pass), the first node that needs it, the rewards, is refused
    refused = ("policy_loss cannot run it" if importlib.util.find_spec("mojo") and not loader.disabled()
               else "rewards cannot run it: KernelError: the 'mojo' package is not installed")
    with pytest.raises(CompileError, match=f"kernels='mojo' but the Mojo {refused}"):
        rein = ml.replace(grpo, "policy_loss", lambda g: ml.reinforce_loss(g.advantages, g.policy_logprobs))
        ml.compile(rein, policy=tiny(True), ref_policy=tiny(), kernels="mojo")


def test_auto_falls_back_to_torch_and_explain_says_why(monkeypatch):
    monkeypatch.setenv("MATERL_DISABLE_MOJO", "1")
    text = ml.compile(grpo, policy=tiny(True), ref_policy=tiny()).explain()
    assert "%advantages = advantages(%rewards, %completions) {estimator='grpo'} [group]  <- torch " \
           "(mojo unavailable: MATERL_DISABLE_MOJO=1)" in text


# -- wiring mistakes are compile-time errors that say what to write ------------------------------


def test_a_turn_continuing_a_turn_must_get_its_tool_results():
    toolbox = ml.mcp_tools("python -m materl.tools.calculator")

    @ml.recipe
    def forgot(policy, prompts):
        t1 = ml.generate_step(policy, prompts, tools=toolbox, name="turn_1")
        t2 = ml.generate_step(policy, t1.history, name="turn_2")  # no ml.call_tools(t1, ...)
        rollout = ml.structure_rollout(t2)
        adv = ml.advantages(ml.reward("length", rollout=rollout), completions=rollout)
        ml.set_loss(ml.policy_loss(adv, ml.logprobs(policy, prompts, rollout)))

    with pytest.raises(CompileError, match=r"generate_step 'turn_2' continues 'turn_1' without its tool results.*"
                                           r"ml.call_tools\(turn_1, tools=toolbox\)"):
        ml.compile(forgot, policy=tiny(True))


def test_a_step_reward_on_tool_results_is_refused():
    toolbox = ml.mcp_tools("python -m materl.tools.calculator")

    @ml.recipe
    def misplaced(policy, prompts):
        t1 = ml.generate_step(policy, prompts, tools=toolbox, name="turn_1")
        results = ml.call_tools(t1, tools=toolbox, name="results")
        t2 = ml.generate_step(policy, t1.history, results, name="turn_2")
        rollout = ml.structure_rollout(t2)
        rewards = ml.reward("length", rollout=rollout) + ml.reward("length", rollout=rollout, step=results, name="s")
        ml.set_loss(ml.policy_loss(ml.advantages(rewards, completions=rollout), ml.logprobs(policy, prompts, rollout)))

    with pytest.raises(CompileError, match=r"reward 's' has step='results', a call_tools value, so it would land "
                                           r"nowhere; step= takes a generate_step value"):
        ml.compile(misplaced, policy=tiny(True))


def test_tools_must_be_a_toolbox_not_a_command_line():
    with pytest.raises(RecipeError, match=r"takes a Toolbox .*got \['python -m materl.tools.calculator'\]; "
                                          r"write tools=ml.mcp_tools\('python -m materl.tools.calculator'\)"):
        @ml.recipe
        def wrong(policy, prompts):
            ml.generate_step(policy, prompts, tools=["python -m materl.tools.calculator"])


def test_implicit_scoring_with_two_rollouts_is_ambiguous():
    with pytest.raises(RecipeError, match=r"reward 'length' in recipe 'two' could score any of %a, %b; wire it"):
        @ml.recipe
        def two(policy, prompts):
            ml.generate(policy, prompts, name="a")
            ml.generate(policy, prompts, name="b", greedy=True)
            ml.reward("length")


def test_log_probs_that_advantages_would_ignore_warn():
    with pytest.warns(RecipeWarning, match="read only with kl_coef > 0"):
        @ml.recipe
        def seed_style(policy, ref_policy, prompts):
            c = ml.generate(policy, prompts)
            lp, ref = ml.logprobs(policy, prompts, c), ml.logprobs(ref_policy, prompts, c)
            ml.set_loss(ml.grpo_loss(ml.advantages(ml.reward("length"), ref, lp), lp, ref))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ = ml.recipes.get("grpo")  # the built-in recipe passes only what it uses


def test_value_targets_must_be_returns_and_values_need_a_value_head():
    @ml.recipe
    def wrong_targets(policy, critic, prompts):
        c = ml.generate(policy, prompts)
        values = ml.values(critic, prompts, c)
        adv = ml.gae_advantages(ml.reward("length"), values)
        ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, c)))
        ml.add_loss(ml.value_loss(values, adv))

    with pytest.raises(CompileError, match=r"targets %gae_advantages, the advantages; .* ml.value_loss\(values, "
                                           r"gae_advantages.returns\)"):
        ml.compile(wrong_targets, policy=tiny(True), critic=tiny(True, head="value"))
    critic = tiny(True)  # no value head: refused at compile time, before any model loads
    with pytest.raises(CompileError, match="reads values from agent 'critic', which has no value head"):
        ml.compile(_vapo_with(critic), policy=tiny(True), critic=critic)
    assert not critic.loaded


def _vapo_with(critic):
    @ml.recipe
    def v(policy, critic, prompts):
        c = ml.generate(policy, prompts)
        values = ml.values(critic, prompts, c)
        adv = ml.gae_advantages(ml.reward("length"), values)
        ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, c)))
        ml.add_loss(ml.value_loss(values, adv.returns))
    return v


# -- run-time shapes: a wrong-sized output fails naming the op, never trains -------------------------


def test_a_custom_op_returning_one_row_too_many_fails_its_episodes():
    @ml.op
    def scores(texts: list[str]) -> {"s": torch.Tensor}:
        return {"s": torch.ones(len(texts) + 1)}

    @ml.recipe
    def r(policy, prompts):
        c = ml.generate(policy, prompts)
        adv = ml.advantages(ml.reward("length") + scores(c.text), completions=c)
        ml.set_loss(ml.ppo_loss(adv, ml.logprobs(policy, prompts, c)))

    step = ml.compile(r, policy=tiny(True), group_size=2, max_new_tokens=3)
    with pytest.raises(StepFailedError, match=r"ShapeError in node 'scores': op 'scores' \(node 'scores'\) output 's' "
                                              r"returned \[3\] for 2 episodes; expected 2 rows"):
        step.run(prompts=["a"])
    step.close()


def test_token_rewards_wider_than_the_completions_are_refused():
    def wide(*, completions, **_):
        return torch.ones(len(completions), 50)

    step = ml.compile(ml.replace(grpo, "rewards", lambda g: ml.reward(wide)), policy=tiny(True), ref_policy=tiny(),
                      group_size=2, max_new_tokens=4)
    # the batched call fails, then each episode alone (so one bad row could not fail the others)
    with pytest.raises(StepFailedError, match=r"reward 'wide' returned token scores of shape \[1, 50\]; "
                                              r"expected \[1, 4\]"):
        step.run(prompts=["a"])
    step.close()


# -- reference="none" ----------------------------------------------------------------------------


def test_reference_none_drops_the_kl_term_and_never_loads_the_reference():
    ref = tiny()
    step = ml.compile(grpo, policy=tiny(True), ref_policy=ref, reference="none", group_size=2, max_new_tokens=4)
    assert "ref_logprobs" in step.plan.pruned
    assert "kl" not in step.plan.nodes["policy_loss"].params and len(step.plan.nodes["policy_loss"].inputs) == 2
    m = step.run(prompts=["a"])
    assert "policy_loss/kl" not in m and not ref.loaded
    step.close()
    with pytest.raises(CompileError, match="reference='none', but node 'advantages' puts a KL penalty"):
        ml.compile(ml.recipes.get("reinforce_pp"), policy=tiny(True), ref_policy=tiny(), reference="none")


def test_agent_refuses_learner_settings_it_would_ignore():
    with pytest.raises(TypeError, match="lr"):
        ml.Agent("tiny-random", trainable=True, lr=1e-6)


# -- batching by tick ----------------------------------------------------------------------------------


def test_episodes_and_groups_that_arrive_together_share_one_call():
    reward_calls, estimator_calls = [], []

    def length_reward(*, completions, **_):
        reward_calls.append(len(completions))
        return [len(c) / 10 for c in completions]

    @group_statistics
    def counted(rewards, mask, *, group_ids=None, group_size=None):
        estimator_calls.append(len(set(group_ids)))
        return ADVANTAGES.get("grpo")(rewards, mask, group_ids=group_ids, group_size=group_size)

    ADVANTAGES.register("counted_grpo", counted)
    try:
        recipe = ml.replace(grpo, "rewards", lambda g: ml.reward(length_reward))
        recipe = ml.replace(recipe, "advantages", lambda g: ml.advantages(g.rewards, estimator="counted_grpo"))
        # the transformers engine returns a decode batch's rows together (the Mojo engine returns
        # each row when it finishes, so its episodes need not arrive in one tick)
        step = ml.compile(recipe, policy=tiny(True, engine="transformers"), ref_policy=tiny(), group_size=4,
                          max_new_tokens=4)
        assert step.plan.stage_of("advantages") == "group"
        step.run(prompts=["a", "b", "c"])
        step.close()
    finally:
        ADVANTAGES.unregister("counted_grpo")
    assert reward_calls == [12]  # one call over the 12 episodes of one decode batch, not 12 calls
    assert estimator_calls == [3]  # the 3 groups finished together: one call over all of them
