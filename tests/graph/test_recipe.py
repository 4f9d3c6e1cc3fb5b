"""The graph layer: tracing, printing, lint, transforms and their error messages."""

import pytest

import materl as ml
from materl.errors import RecipeError, UnknownNameError
from materl.recipes import RECIPES, grpo


def test_recipe_traces_without_running():
    calls = []

    @ml.recipe
    def r(policy, prompts):
        calls.append(1)
        c = ml.generate(policy, prompts)
        ml.set_loss(ml.ppo_loss(ml.advantages(ml.reward("length")), ml.logprobs(policy, prompts, c)))

    assert calls == [1]  # traced once, at decoration
    assert [n.op for n in r.nodes] == ["input", "generate", "rewards", "advantages", "logprobs", "policy_loss"]
    assert r.agents == ("policy",)
    assert r.losses == (("policy_loss", 1.0),)


def test_print_is_one_line_per_node():
    text = str(grpo)
    assert text.splitlines()[0] == "recipe grpo(policy, ref_policy, prompts)"
    assert "  %rewards = rewards(%completions) {terms=0.1*length + 0.9*diversity} [episode]" in text
    assert "  %advantages = advantages(%rewards, %completions) [group]" in text
    assert text.splitlines()[-1] == "  loss = %policy_loss"


def test_seed_vapo_transform_rewires_and_leaves_base_alone():
    @ml.algorithm(using=grpo)
    def vapo(graph, value_model):
        values = ml.values(value_model, graph.prompts, graph.completions)
        graph.advantages.replace_with(ml.gae_advantages(graph.rewards, values))
        ml.add_loss(ml.value_loss(values, graph.rewards))

    adv = vapo.node("advantages")
    assert adv.params["estimator"] == "gae" and "values" in adv.inputs
    assert vapo.node("policy_loss").inputs[0] == "advantages"
    assert vapo.losses == (("policy_loss", 1.0), ("value_loss", 1.0))
    assert vapo.origin == "transform of 'grpo'"
    assert "estimator" not in grpo.node("advantages").params  # base not mutated
    assert [n.name for n in grpo.nodes] == [n.name for n in RECIPES["grpo"].nodes]


def test_unknown_node_in_transform_lists_real_ones():
    with pytest.raises(UnknownNameError, match=r"no node 'advantagez'; nodes: prompts, completions"):
        ml.algorithm(using=grpo)(lambda graph: graph.advantagez)


def test_remove_refused_while_used():
    def body(graph):
        graph.remove("rewards")

    with pytest.raises(RecipeError, match="cannot remove node 'rewards' .* used by advantages"):
        ml.transform(grpo, body)


def test_replace_and_with_kl_compose():
    dr = ml.replace(grpo, "advantages", lambda g: ml.advantages(g.rewards, estimator="dr_grpo"))
    both = ml.with_kl(dr, estimator="k1", coef=0.1)
    assert both.node("advantages").params["estimator"] == "dr_grpo"
    assert both.node("policy_loss").params["kl"] == "k1" and both.node("policy_loss").params["kl_coef"] == 0.1
    assert grpo.node("policy_loss").params["kl_coef"] == 0.04


def test_with_kl_needs_reference_logprobs():
    with pytest.raises(RecipeError, match="policy loss 'policy_loss' reads no reference log-probs"):
        ml.with_kl(RECIPES["gspo"], coef=0.1)


def test_replace_with_wrapper_keeps_the_inner_node():
    def body(graph):
        @ml.op(scope="group")
        def clip(adv):
            return adv.clamp(-1, 1)

        graph.advantages.replace_with(clip(graph.advantages))

    r = ml.transform(grpo, body)
    assert r.node("advantages").op == "call"
    assert r.node("advantages").inputs == ("advantages_prev",)
    assert r.node("advantages_prev").op == "advantages"


def test_lint_finds_missing_input_duplicate_and_scope_errors():
    from materl.graph.node import Node, Recipe

    bad = Recipe("bad", ("policy", "prompts"), ("policy",), (
        Node("prompts", "input", (), {}, "episode"),
        Node("lp", "logprobs", ("@policy", "prompts", "completions"), {}, "batch"),
        Node("r", "rewards", ("lp",), {}, "episode"),
        Node("r", "rewards", (), {}, "episode"),
    ), (("lp", 1.0),))
    problems = bad.lint()
    assert any("duplicate node name 'r'" in p for p in problems)
    assert any("node 'lp' needs input 'completions'; recipe provides:" in p for p in problems)
    assert any("scope error: batch-scope value 'lp' feeds episode-scope node 'r'" in p for p in problems)


def test_lint_finds_cycles():
    from materl.graph.node import Node, Recipe

    cyc = Recipe("cyc", (), (), (Node("a", "call", ("b",), {}, "group"), Node("b", "call", ("a",), {}, "group")))
    assert any(p.startswith("cycle: a -> b -> a") for p in cyc.lint())


def test_scope_error_at_recipe_time():
    with pytest.raises(RecipeError, match="scope error"):
        @ml.recipe
        def r(policy, prompts):
            c = ml.generate(policy, prompts)
            lp = ml.logprobs(policy, prompts, c)
            ml.generate_step(policy, lp)


def test_unknown_reward_name_suggests():
    with pytest.raises(UnknownNameError, match="Did you mean 'length'"):
        @ml.recipe
        def r(policy, prompts):
            ml.generate(policy, prompts)
            ml.reward("lenght")


def test_op_arity_and_outputs_checked_at_recipe_time():
    @ml.op
    def scorer(texts: list[str]) -> {"scores": list}:
        return {"scores": [0.0] * len(texts)}

    with pytest.raises(RecipeError, match="op 'scorer' called with the wrong arguments"):
        @ml.recipe
        def r1(policy, prompts):
            c = ml.generate(policy, prompts)
            scorer(c.text, c.text)

    @ml.op(outputs=["a", "b"])
    def two(x):
        return {"a": x, "b": x}

    with pytest.raises(RecipeError, match="op 'two' .* has no output 'c'; outputs: a, b"):
        @ml.recipe
        def r2(policy, prompts):
            c = ml.generate(policy, prompts)
            two(c.text).c


def test_op_scope_defaults_and_direct_call():
    @ml.op
    async def tool(reqs: list) -> {"tool_responses": list}:
        return {"tool_responses": reqs}

    @ml.op
    def score(texts: list[str]) -> {"rewards": list}:
        return {"rewards": [1.0 for _ in texts]}

    assert tool.scope == "episode" and score.scope == "group"
    assert score(["a", "b"]) == {"rewards": [1.0, 1.0]}  # outside a recipe it is the function


def test_agent_used_as_data_is_an_error():
    with pytest.raises(RecipeError, match="'policy' of recipe 'r' is an agent"):
        @ml.recipe
        def r(policy, prompts):
            ml.generate(policy, prompts)
            ml.generate(policy, policy)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_builtin_recipes_lint_clean(name):
    assert RECIPES[name].lint() == []


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_builtin_recipe_golden_print(name):
    """The printed graph of every built-in recipe is pinned (regenerate deliberately if changed)."""
    from pathlib import Path

    golden = (Path(__file__).parent / "golden" / f"{name}.txt").read_text()
    assert str(RECIPES[name]) + "\n" == golden
