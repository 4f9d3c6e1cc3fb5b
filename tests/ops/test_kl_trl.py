"""TRL 1.16's KL term on every materl path: the bias-corrected k3 (``use_bias_correction_kl=True``,
TRL's default) and the k3 clamp switched off, in value and gradient.

``trl_grpo_loss`` transcribes TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss``
(lines 3083-3157: token-level importance weights, the per-token KL, the bias correction, the
two-sided clip, ``loss_type`` "bnpo" and "grpo") and always runs; the test at the end runs TRL's
own ``_compute_loss`` on the tiny model when trl is installed (CI installs only .[dev,mojo])."""

import importlib.util

import pytest
import torch

import materl as ml
from materl.compiler.kinds.losses import torch_policy_loss
from materl.kernels.policy_loss import policy_loss_torch
from materl.ops.kl import bias_corrected_kl, kl_penalty
from tests.tolerance import assert_close_to_scale

F64 = torch.float64


def trl_grpo_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, *, beta,
                  epsilon_low=0.2, epsilon_high=0.2, use_bias_correction_kl=True, loss_type="bnpo", clamp=None):
    """TRL 1.16.0 GRPOTrainer._compute_loss, importance_sampling_level="token", transcribed line by
    line (``clamp`` is not TRL's: it inserts verl's low_var_kl clamp on the k3 before the ratio)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = log_ratio
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = (
        torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    )
    if clamp is not None:
        per_token_kl = per_token_kl.clamp(-clamp, clamp)
    if use_bias_correction_kl:
        per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:  # "bnpo"
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, per_token_kl


def batch(seed=0, dtype=F64, far=False):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    logp = (-torch.rand(B, T, generator=g, dtype=F64) * 3).to(dtype)
    old = logp + (torch.randn(B, T, generator=g, dtype=F64) * 0.3).to(dtype)
    ref = logp + (torch.randn(B, T, generator=g, dtype=F64) * 0.8).to(dtype)
    if far:  # k3 = exp(12) - 13 > 10 on one token, exp(-11) + 10 = 10.00002 on another
        ref[0, 1], ref[2, 3] = logp[0, 1] + 12.0, logp[2, 3] - 11.0
    adv = torch.randn(B, generator=g, dtype=F64).to(dtype)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=dtype)
    return logp.requires_grad_(), old, ref, adv, mask


def value_and_grad(fn, logp):
    logp = logp.detach().clone().requires_grad_()
    value = fn(logp)
    value = value[0] if isinstance(value, tuple) else value
    (grad,) = torch.autograd.grad(value, logp)
    return value.detach(), grad


def test_bias_corrected_kl_by_hand():
    # logp = ln 0.5, ref = ln 0.25, old = ln 0.25: k3 = e^-ln2 + ln2 - 1 = ln2 - 0.5, r = 2
    # value r k3 = 2 ln2 - 1; gradient r (dk3 + k3) = 2 ((1 - e^{ref - logp}) + k3) = 2 (0.5 + ln2 - 0.5) = 2 ln2
    ln2 = torch.log(torch.tensor(2.0, dtype=F64))
    logp = torch.log(torch.tensor([[0.5]], dtype=F64)).requires_grad_()
    quarter = torch.log(torch.tensor([[0.25]], dtype=F64))
    out = bias_corrected_kl(logp, quarter, quarter, estimator="k3", clamp=None)
    out.sum().backward()
    assert out.item() == pytest.approx(2 * ln2.item() - 1)
    assert logp.grad.item() == pytest.approx(2 * ln2.item())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("clamp", [None, 10.0])
def test_per_token_kl_equals_trl_value_and_gradient(bias, clamp):
    logp, old, ref, adv, mask = batch(far=True)

    def trl(lp):
        return trl_grpo_loss(lp, old, ref, torch.zeros_like(adv), torch.ones_like(mask), beta=1.0,
                             use_bias_correction_kl=bias, clamp=clamp)[1].sum()

    def ours(lp):
        kl = bias_corrected_kl(lp, ref, old, clamp=clamp) if bias else kl_penalty(lp, ref, estimator="k3", clamp=clamp)
        return kl.sum()

    v1, g1 = value_and_grad(ours, logp)
    v2, g2 = value_and_grad(trl, logp)
    assert abs(v1 - v2) <= 1e-12 * abs(v2)
    assert_close_to_scale(g1, g2, rel=1e-12)
    if clamp is None:  # TRL's k3 on the far token is exp(12) - 13, not 10: the clamp was really off
        assert ours(logp).item() > 1e5


PATHS = ("ops", "recipe")


def materl_loss(path, logp, old, ref, adv, mask, *, agg, beta, clamp, bias, impl="torch"):
    """materl's GRPO loss with TRL's KL settings, through the op path or a traced recipe's node."""
    kl_kw = ({} if clamp == "default" else {"kl_clamp": clamp}) | ({"kl_bias_correction": True} if bias else {})
    if path == "ops":
        return policy_loss_torch(logp, old, adv, mask, ref_logp=ref, loss="ppo_clip", agg=agg, kl="k3",
                                 kl_coef=beta, **kl_kw)

    @ml.recipe
    def r(policy, ref_policy, prompts):
        c = ml.generate(policy, prompts)
        lp, rf = ml.logprobs(policy, prompts, c), ml.logprobs(ref_policy, prompts, c)
        ml.set_loss(ml.policy_loss(ml.advantages(ml.reward("length")), lp, rf, agg=agg, kl="k3", kl_coef=beta,
                                   **kl_kw))

    node = r.node("policy_loss")
    if impl == "mojo":
        from materl.kernels.policy_loss import learner_policy_loss
        return learner_policy_loss(node, logp, old, adv[:, None].expand_as(logp), mask, ref, denom=None)
    return torch_policy_loss(node, logp, old, adv[:, None].expand_as(logp), mask, ref, denom=None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type,agg", [("bnpo", "token_mean"), ("grpo", "seq_mean_token_mean")])
@pytest.mark.parametrize("bias", [True, False])
def test_grpo_loss_with_trls_kl_equals_trl(path, loss_type, agg, bias):
    """TRL's defaults: k3 unclamped, bias-corrected (beta 0.04 as materl's grpo)."""
    logp, old, ref, adv, mask = batch(seed=1, far=True)
    v1, g1 = value_and_grad(lambda lp: materl_loss(path, lp, old, ref, adv, mask, agg=agg, beta=0.04, clamp=None,
                                                   bias=bias), logp)
    v2, g2 = value_and_grad(lambda lp: trl_grpo_loss(lp, old, ref, adv, mask, beta=0.04, use_bias_correction_kl=bias,
                                                     loss_type=loss_type)[0], logp)
    assert abs(v1 - v2) <= 1e-12 * abs(v2)
    assert_close_to_scale(g1, g2, rel=1e-12)
    # the default clamp (10, verl) is the transcription with the clamp, and not TRL
    v3, g3 = value_and_grad(lambda lp: materl_loss(path, lp, old, ref, adv, mask, agg=agg, beta=0.04,
                                                   clamp="default", bias=bias), logp)
    v4, g4 = value_and_grad(lambda lp: trl_grpo_loss(lp, old, ref, adv, mask, beta=0.04, use_bias_correction_kl=bias,
                                                     loss_type=loss_type, clamp=10.0)[0], logp)
    assert abs(v3 - v4) <= 1e-12 * abs(v4) and abs(v3 - v2) > 1.0
    assert_close_to_scale(g3, g4, rel=1e-12)


def test_kl_metric_is_trls_logged_kl():
    logp, old, ref, adv, mask = batch(seed=2)
    _, metrics = materl_loss("ops", logp, old, ref, adv, mask, agg="token_mean", beta=0.04, clamp=None, bias=True)
    _, per_token_kl = trl_grpo_loss(logp, old, ref, adv, mask, beta=0.04)
    assert metrics["kl"] == pytest.approx(float((per_token_kl.detach() * mask).sum() / mask.sum()), rel=1e-12)


def test_float32_matches_trl_to_1e6():
    logp, old, ref, adv, mask = batch(seed=3, dtype=torch.float32)
    v1, g1 = value_and_grad(lambda lp: materl_loss("recipe", lp, old, ref, adv, mask, agg="token_mean", beta=0.04,
                                                   clamp=None, bias=True), logp)
    v2, g2 = value_and_grad(lambda lp: trl_grpo_loss(lp, old, ref, adv, mask, beta=0.04)[0], logp)
    assert abs(v1 - v2) <= 1e-6 * abs(v2)
    assert_close_to_scale(g1, g2, rel=1e-6)


def test_with_kl_sets_trls_kl_on_a_recipe():
    from materl.recipes import grpo

    trl_kl = ml.with_kl(grpo, estimator="k3", coef=0.04, clamp=None, bias_correction=True)
    node = trl_kl.node("policy_loss")
    assert node.params["kl_clamp"] is None and node.params["kl_bias_correction"] is True
    assert "kl_clamp=None, kl_bias_correction=True" in str(node)
    back = ml.with_kl(trl_kl, estimator="k3", coef=0.04)  # the KL term is replaced whole
    assert "kl_clamp" not in back.node("policy_loss").params
    assert "kl_bias_correction" not in back.node("policy_loss").params


def test_kl_settings_errors():
    with pytest.raises(ml.RecipeError, match="kl_clamp must be a number > 0, or None for no clamp; got 0"):
        ml.with_kl(ml.recipes.grpo, clamp=0)
    with pytest.raises(ml.RecipeError, match="kl_bias_correction takes True or False, got 'yes'"):
        ml.with_kl(ml.recipes.grpo, bias_correction="yes")

    with pytest.raises(ml.RecipeError, match="kl_clamp=None but no ref_logprobs"):
        @ml.recipe
        def r(policy, prompts):
            c = ml.generate(policy, prompts)
            ml.set_loss(ml.ppo_loss(ml.advantages(ml.reward("length")), ml.logprobs(policy, prompts, c),
                                    kl_clamp=None))


# -- TRL's own code -------------------------------------------------------------------------------

HAS_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from materl.engines.models import ensure_cached

    def never(completions, **_):
        return [0.0] * len(completions)

    def make(bias: bool, loss_type: str):
        args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), beta=0.04, loss_type=loss_type,
                          use_bias_correction_kl=bias, per_device_train_batch_size=2, num_generations=2,
                          save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True)
        trainer = GRPOTrainer(model=str(ensure_cached("tiny-random")), reward_funcs=never, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
        trainer.model.double().eval()  # eval: no gradient-accumulation normaliser in _compute_loss
        return trainer
    return make


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install -c constraints.txt trl==1.16.0)")
@pytest.mark.parametrize("bias,loss_type,agg", [(True, "bnpo", "token_mean"), (False, "grpo", "seq_mean_token_mean")])
def test_trls_own_compute_loss_equals_materl(trl_trainer, bias, loss_type, agg):
    """TRL's GRPOTrainer._compute_loss on the tiny model vs materl's loss on the same model's
    log-probs (from TRL's own ``_get_per_token_logps_and_entropies``): loss and parameter gradients."""
    trainer = trl_trainer(bias, loss_type)
    model = trainer.model
    g = torch.Generator().manual_seed(0)
    B, P, T = 3, 4, 6
    prompt_ids, completion_ids = torch.randint(0, 256, (B, P), generator=g), torch.randint(0, 256, (B, T), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    completion_mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    ids, attn = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)

    def logps():
        return trainer._get_per_token_logps_and_entropies(model, ids, attn, T)[0]

    with torch.no_grad():
        now = logps()
    old = now + torch.randn(B, T, generator=g, dtype=now.dtype) * 0.2
    ref = now + torch.randn(B, T, generator=g, dtype=now.dtype) * 0.7
    ref[0, 2] = now[0, 2] + 3.0  # TRL's k3 here is e^3 - 4 = 16.1: no clamp (materl's default would clip it to 10)
    adv = torch.randn(B, generator=g, dtype=now.dtype)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=adv, old_per_token_logps=old,
                  ref_per_token_logps=ref, num_items_in_batch=completion_mask.sum())
    params = [p for p in model.parameters() if p.requires_grad]

    trl_loss = trainer._compute_loss(model, inputs)
    trl_grads = torch.autograd.grad(trl_loss, params)
    ours, _ = policy_loss_torch(logps(), old, adv, completion_mask.to(now.dtype), ref_logp=ref, loss="ppo_clip",
                                agg=agg, kl="k3", kl_coef=0.04, kl_clamp=None, kl_bias_correction=bias)
    our_grads = torch.autograd.grad(ours, params)
    assert abs(ours.item() - trl_loss.item()) <= 1e-6 * abs(trl_loss.item())
    for a, b in zip(our_grads, trl_grads):
        assert_close_to_scale(a, b, rel=1e-6)
    assert max(float(x.abs().max()) for x in trl_grads) > 0
    clamped, _ = policy_loss_torch(logps(), old, adv, completion_mask.to(now.dtype), ref_logp=ref, loss="ppo_clip",
                                   agg=agg, kl="k3", kl_coef=0.04, kl_bias_correction=bias)
    assert abs(clamped.item() - trl_loss.item()) > 1e-3  # the clamp is what kl_clamp=None switched off
