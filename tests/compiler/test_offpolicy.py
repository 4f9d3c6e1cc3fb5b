"""Off-policy corrections end to end: ml.with_off_policy_correction on recipes, the recomputed
(proximal) log-probs, the mismatch metrics, and training on the tiny model."""

import copy

import pytest
import torch

import materl as ml
from materl.errors import CompileError, ConfigError, RecipeError
from materl.ops.offpolicy import logprob_mismatch
from materl.recipes import RECIPES, grpo
from tests.tolerance import assert_same_update

from .conftest import toy_reward

PROMPTS = ["a", "b"]
CORRECTED = [("tis", {"cap": 2.0}), ("mis", {"upper": 2.0, "level": "sequence"}), ("decoupled", {"cap": 5.0})]


def toy_grpo():
    return ml.replace(grpo, "rewards", lambda g: ml.reward(toy_reward))


def compiled(recipe, tiny, **kw):
    options = dict(group_size=4, max_new_tokens=6, lr=1e-2, seed=0) | kw
    return ml.compile(recipe, policy=tiny(trainable=True), ref_policy=tiny(), **options)


def teacher_forced(model, episodes, name="completions"):
    """log softmax of each sampled token given everything before it: one unpadded forward per episode."""
    out = []
    with torch.no_grad():
        for ep in episodes:
            r = ep.rollout(name)
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].double()
            out.append(logits.log_softmax(-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("method,hp", CORRECTED)
def test_a_corrected_recipe_prints_compiles_and_trains(method, hp, tiny):
    recipe = ml.with_off_policy_correction(toy_grpo(), method, **hp)
    text = str(recipe)
    assert "%policy_logprobs = logprobs(@policy, %prompts, %completions) {recompute=True} [batch]" in text
    assert f"correction={{method: '{method}'," in text
    assert str(toy_grpo().node("policy_logprobs")) == "%policy_logprobs = logprobs(@policy, %prompts, %completions) [batch]"
    step = compiled(recipe, tiny)
    explain = step.explain()
    assert "%policy_logprobs: old log-probs recomputed by the learner" in explain
    assert f"%policy_loss: off-policy correction {method}(" in explain
    policy = step.agents["policy"]
    before = [p.detach().clone() for p in policy.parameters()]
    for _ in range(2):
        m = step.run(prompts=PROMPTS)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    step.close()


@pytest.mark.parametrize("method,hp", CORRECTED)
def test_with_no_staleness_the_weights_are_one(method, hp, tiny):
    """Sampled and trained on the same weights: prox / mu differs from 1 only by the engine's numerics
    (a KV-cache decode against one forward), so every weight is ~1 and nothing is truncated or rejected."""
    step = compiled(ml.with_off_policy_correction(toy_grpo(), method, **hp), tiny)
    episodes = step.call_blocking(step.rollout, PROMPTS)
    start = copy.deepcopy(step.agents["policy"].model)  # the weights that sampled, before the update
    m = step.call_blocking(step.learn, episodes)
    assert m["policy_loss/is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert m.get("policy_loss/is_truncated", 0.0) == 0.0 and m.get("policy_loss/is_rejected", 0.0) == 0.0
    assert m["policy_loss/ppo_kl"] == 0.0  # the first update's forward IS the proximal policy, exactly
    assert m["mismatch/max_abs"] < 1e-4
    # the proximal log-probs are the learner's own forward under the sampling weights, not a copy
    # of the engine's: equal to an independent teacher-forced forward
    for ep, expected in zip(episodes, teacher_forced(start, episodes)):
        prox = ep.values["policy_logprobs"][: len(expected)].double()
        torch.testing.assert_close(prox, expected, rtol=0, atol=1e-5)
    step.close()


def test_stale_samples_are_reweighted_and_rejected(tiny):
    """Episodes sampled, then the policy moves (two large SGD steps on other batches), then the old
    episodes are learned from: prox / mu is far from 1, so decoupled's cap rejects tokens."""
    recipe = ml.with_off_policy_correction(toy_grpo(), "decoupled", cap=1.05)
    step = compiled(recipe, tiny, lr=3.0, optimizer="sgd")
    stale = step.call_blocking(step.rollout, PROMPTS)
    fresh = step.call_blocking(step.learn, step.call_blocking(step.rollout, PROMPTS))
    step.run(prompts=PROMPTS)
    m = step.call_blocking(step.learn, stale)
    assert m["mismatch/mean_abs"] > 100 * fresh["mismatch/mean_abs"]
    assert m["policy_loss/is_rejected"] > 0.0
    assert m["mismatch/kl"] > 0.0
    step.close()


def test_mismatch_metrics_are_the_batchs(tiny):
    """With recompute the numbers are over the whole batch even with micro- and mini-batches."""
    recipe = ml.with_off_policy_correction(toy_grpo(), "tis", cap=2.0)
    step = compiled(recipe, tiny, micro_batch_size=2, mini_batch_size=4, epochs=2, shuffle=True)
    episodes = step.call_blocking(step.rollout, PROMPTS)
    m = step.call_blocking(step.learn, episodes)
    prox = [ep.values["policy_logprobs"][: len(ep.rollout("completions").completion_ids)] for ep in episodes]
    sampled = [torch.tensor(ep.rollout("completions").sampling_logprobs) for ep in episodes]
    masks = [torch.tensor(ep.rollout("completions").loss_mask, dtype=torch.float32) for ep in episodes]
    expected = logprob_mismatch(torch.cat(prox), torch.cat(sampled), torch.cat(masks))
    for k, v in expected.items():
        assert m[f"mismatch/{k}"] == pytest.approx(v, rel=1e-6, abs=1e-12)
    step.close()


MISMATCH = {"mismatch/mean_abs", "mismatch/max_abs", "mismatch/kl", "mismatch/kl_k1"}


@pytest.mark.parametrize("batching,rows", [
    ({}, 8),
    ({"micro_batch_size": 2}, 8),
    ({"micro_batch_size": 3, "epochs": 2}, 8),
    ({"mini_batch_size": 4, "micro_batch_size": 2, "epochs": 2, "shuffle": False}, 4),
])
def test_plain_grpo_reports_the_mismatch_every_step(batching, rows, tiny):
    """No correction, no recompute: every step reports mismatch/*, the learner's forwards before the
    first optimizer step (under the weights at the start of the step) against the engine's sampling
    log-probs, whatever the micro-batches and epochs; over the first mini-batch (rows 0-3 unshuffled)
    when mini_batch_size splits the batch, as the later ones run after an optimizer step. The
    learned episodes are stale (two large SGD steps since they were sampled), so the numbers are far
    from 0 and checked against an independent teacher-forced forward of the weights the step starts from."""
    step = compiled(toy_grpo(), tiny, lr=3.0, optimizer="sgd", **batching)
    stale = step.call_blocking(step.rollout, PROMPTS)
    for _ in range(2):
        assert MISMATCH <= step.run(prompts=PROMPTS).keys()
    start = copy.deepcopy(step.agents["policy"].model)
    m = step.call_blocking(step.learn, stale)
    assert all(ep.ok for ep in stale) and len(stale) == 8
    used = stale[:rows]
    learner = teacher_forced(start, used)
    sampled = [torch.tensor(ep.rollout("completions").sampling_logprobs, dtype=torch.float64) for ep in used]
    masks = [torch.tensor(ep.rollout("completions").loss_mask, dtype=torch.float64) for ep in used]
    expected = logprob_mismatch(torch.cat(learner), torch.cat(sampled), torch.cat(masks))
    assert expected["mean_abs"] > 1e-2  # stale: not the ~1e-7 of fresh samples
    for k, v in expected.items():
        assert m[f"mismatch/{k}"] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    step.close()


def test_mojo_and_torch_give_the_same_corrected_update(tiny):
    """The fused kernel runs the corrected loss (weights, TRL's KL) as the torch ops do."""
    from materl.kernels import loader

    if loader.load_or_reason("policy_loss")[0] is None:
        pytest.skip("the Mojo policy-loss kernel is unavailable")
    recipe = ml.with_off_policy_correction(ml.with_kl(toy_grpo(), clamp=None, bias_correction=True), "tis", cap=1.02)
    runs = []
    for kernels in ("mojo", "torch"):
        step = compiled(recipe, tiny, kernels=kernels, optimizer="sgd", lr=1.0)
        assert f"<- {kernels} (live)" in [line for line in step.explain().splitlines() if "%policy_loss =" in line][0]
        policy = step.agents["policy"]
        before = [p.detach().clone() for p in policy.parameters()]
        m = step.run(prompts=PROMPTS)
        runs.append((m, [p.detach().clone() for p in policy.parameters()]))
        step.close()
    for k in ("loss", "policy_loss/is_weight", "policy_loss/kl"):  # the loss is ~0 (GRPO's advantages sum to 0)
        assert runs[0][0][k] == pytest.approx(runs[1][0][k], rel=1e-5, abs=1e-7)
    assert_same_update(runs[0][1], runs[1][1], before, rel=1e-5)


def test_composes_with_every_builtin_recipe_with_a_policy_loss(tiny):
    for name, recipe in RECIPES.items():
        if not any(n.op == "policy_loss" for n in recipe.nodes):
            with pytest.raises(RecipeError, match=f"recipe '{name}' has no policy_loss node"):
                ml.with_off_policy_correction(recipe, "tis")
            continue
        corrected = ml.with_off_policy_correction(recipe, "mis", upper=3.0)
        for n in corrected.nodes:
            if n.op == "policy_loss":
                assert n.params["correction"] == {"method": "mis", "upper": 3.0, "lower": 1 / 3, "level": "token"}
                assert corrected.node_map[n.inputs[1]].params["recompute"] is True
        agents = {"policy": tiny(trainable=True)}
        agents |= {"ref_policy": tiny()} if "ref_policy" in recipe.agents else {}
        agents |= {"value_model": tiny(head="value", trainable=True)} if "value_model" in recipe.agents else {}
        agents |= {"teacher": tiny()} if "teacher" in recipe.agents else {}  # distill
        assert "off-policy correction mis(" in ml.compile(corrected, **agents, group_size=2).explain(), name
        assert str(RECIPES[name]) == str(recipe)  # the base is unchanged


def test_errors_name_what_is_wrong(tiny):
    @ml.recipe
    def unrecomputed(policy, prompts):
        c = ml.generate(policy, prompts)
        ml.set_loss(ml.policy_loss(ml.advantages(ml.reward("length")), ml.logprobs(policy, prompts, c),
                                   correction={"method": "tis", "cap": 2.0, "level": "token"}))

    with pytest.raises(CompileError, match="policy loss 'policy_loss' has an off-policy correction \\(tis\\) but its "
                                           "log-probs %logprobs \\(logprobs\\) are not recomputed"):
        ml.compile(unrecomputed, policy=tiny(trainable=True))
    @ml.recipe
    def malformed(policy, prompts):
        c = ml.generate(policy, prompts)
        ml.set_loss(ml.policy_loss(ml.advantages(ml.reward("length")), ml.logprobs(policy, prompts, c, recompute=True),
                                   correction={"cap": 2.0}))

    with pytest.raises(CompileError, match="correction must be {'method': one of decoupled, mis, tis"):
        ml.compile(malformed, policy=tiny(trainable=True))

    @ml.recipe
    def frozen(policy, ref_policy, prompts):
        c = ml.generate(policy, prompts)
        ml.set_loss(ml.grpo_loss(ml.advantages(ml.reward("length")), ml.logprobs(policy, prompts, c),
                                 ml.logprobs(ref_policy, prompts, c, recompute=True, name="ref_logprobs")))

    with pytest.raises(CompileError, match="node 'ref_logprobs' has recompute=True but agent 'ref_policy' is frozen"):
        ml.compile(frozen, policy=tiny(trainable=True), ref_policy=tiny())
    with pytest.raises(ml.UnknownNameError, match="decoupled"):
        ml.with_off_policy_correction(grpo, "decoupld")
    with pytest.raises(ConfigError, match="'decoupled' takes cap, level; got upper"):
        ml.with_off_policy_correction(grpo, "decoupled", upper=2.0)
    with pytest.raises(RecipeError, match=r"ml.logprobs\(recompute=\.\.\.\) takes True or False, got 'yes'"):
        @ml.recipe
        def bad(policy, prompts):
            ml.logprobs(policy, prompts, ml.generate(policy, prompts), recompute="yes")


@pytest.mark.parametrize("batching", [{}, {"micro_batch_size": 3}])
def test_one_update_per_batch_takes_the_proximal_logprobs_from_the_update_forward(batching, tiny, monkeypatch):
    """One epoch, one mini-batch: the update's forward is the proximal policy's (same rows, same
    weights), so no prepare forward runs, and the update, the metrics and the stored proximal
    log-probs are bit for bit those of the path that recomputes them in prepare."""
    from materl.compiler.kinds import forward
    from materl.engines.hf import causal_lm_of

    recipe = ml.with_off_policy_correction(toy_grpo(), "tis", cap=2.0)
    runs, start, copies = [], None, None
    for defer in (True, False):
        if not defer:  # the unoptimised path: a no-gradient forward of every row in prepare
            monkeypatch.setattr(forward, "defers_proximal", lambda learner, node: False)
        step = compiled(recipe, tiny, **batching)
        policy = step.agents["policy"]
        if defer:
            start = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
            episodes = step.call_blocking(step.rollout, PROMPTS)
            copies = copy.deepcopy(episodes)
        else:
            policy.model.load_state_dict(start)
            episodes = copies
        calls = []
        # layer 0's attention runs once per decoder pass, whichever forward the learner uses
        hook = causal_lm_of(policy.model).get_decoder().layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        m = step.call_blocking(step.learn, episodes)
        hook.remove()
        runs.append((m, [p.detach().clone() for p in policy.parameters()],
                     [ep.values["policy_logprobs"] for ep in episodes], len(calls)))
        step.close()
    (m_d, params_d, prox_d, calls_d), (m_r, params_r, prox_r, calls_r) = runs
    assert 0 < calls_d and calls_r == 2 * calls_d  # the prepare's forward is gone
    assert m_d["policy_loss/ppo_kl"] == 0.0 and MISMATCH <= m_d.keys()
    learned = [k for k in m_r if not k.startswith("time/") and k != "step"]  # (only the first did a rollout)
    assert {k: m_d[k] for k in learned} == {k: m_r[k] for k in learned}
    assert all(torch.equal(a, b) for a, b in zip(prox_d, prox_r))
    assert all(torch.equal(a, b) for a, b in zip(params_d, params_r))
    assert any(not torch.equal(a, start_p) for a, start_p in zip(params_d, [start[n] for n, _ in policy.named_parameters()]))
