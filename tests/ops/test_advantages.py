"""Advantage estimators: hand-derived numbers, equality with naive transcriptions of verl 0.9
core_algos (and TRL 1.16's GRPO scaling), invariances (hypothesis) and error paths."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from materl.errors import ConfigError, RewardError, ShapeError, UnknownNameError
from materl.ops.advantages import ADVANTAGES, discounted_returns, dr_grpo, gae, grpo, reinforce_pp, rloo
from tests.ops.test_turn_credit import rollout_inputs

F64 = torch.float64
ALL = ["dr_grpo", "gae", "gigpo", "gpg", "grpo", "opo", "process", "reinforce_pp", "reinforce_pp_baseline", "remax",
       "rloo", "turn_grpo"]


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b.to(a.dtype), atol=tol, rtol=tol)


# ---------------------------------------------------------------- naive transcriptions of verl 0.9
# verl.utils.torch_functional masked_mean / masked_var / masked_whiten


def v_whiten(x, m):
    mean = (x * m).sum() / (m.sum() + 1e-8)
    var = (((x - mean) ** 2) * m).sum() / (m.sum() + 1e-8) * m.sum() / (m.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def v_group_scores(scores, index):
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    return groups


def v_grpo(tlr, mask, index, eps=1e-6, norm=True):  # compute_grpo_outcome_advantage
    scores = tlr.sum(-1).clone()
    groups = v_group_scores(scores.clone(), index)
    mean = {k: torch.tensor(0.0, dtype=F64) if len(v) == 1 else torch.stack(v).mean() for k, v in groups.items()}
    std = {k: torch.tensor(1.0, dtype=F64) if len(v) == 1 else torch.stack(v).std() for k, v in groups.items()}
    for i in range(len(scores)):
        d = scores[i] - mean[index[i]]
        scores[i] = d / (std[index[i]] + eps) if norm else d
    return scores.unsqueeze(-1) * mask


def v_rloo(tlr, mask, index):  # compute_rloo_outcome_advantage
    scores = tlr.sum(-1).clone()
    groups = v_group_scores(scores.clone(), index)
    for i in range(len(scores)):
        n = len(groups[index[i]])
        if n > 1:
            mean = torch.stack(groups[index[i]]).mean()
            scores[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return scores.unsqueeze(-1) * mask


def v_opo(tlr, mask, index):  # compute_opo_outcome_advantage
    scores, lengths = tlr.sum(-1).clone(), mask.sum(-1)
    groups, lens = v_group_scores(scores.clone(), index), v_group_scores(lengths, index)
    for i in range(len(scores)):
        k = index[i]
        if len(groups[k]) > 1:
            s, n = torch.stack(groups[k]), torch.stack(lens[k])
            scores[i] = scores[i] - (n * s).sum() / n.sum()
    return scores.unsqueeze(-1) * mask


def v_gpg(tlr, mask, index, f_norm=1.0):  # compute_gpg_outcome_advantage
    scores = tlr.sum(-1).clone()
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    groups = v_group_scores(scores.clone(), index)
    for i in range(len(scores)):
        g = groups[index[i]]
        mean = torch.stack(g).mean() if len(g) > 1 else 0.0
        scores[i] = alpha * (scores[i] - mean) / f_norm
    return scores.unsqueeze(-1) * mask


def v_rpp_baseline(tlr, mask, index):  # compute_reinforce_plus_plus_baseline_outcome_advantage
    scores = tlr.sum(-1).clone()
    groups = v_group_scores(scores.clone(), index)
    for i in range(len(scores)):
        g = groups[index[i]]
        scores[i] = scores[i] - (torch.stack(g).mean() if len(g) > 1 else 0.0)
    tiled = scores.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
    return v_whiten(tiled, mask) * mask


def v_rpp(tlr, mask, gamma):  # compute_reinforce_plus_plus_outcome_advantage
    returns, running = torch.zeros_like(tlr), 0
    for t in reversed(range(tlr.shape[1])):
        running = tlr[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return v_whiten(returns, mask) * mask, returns


def v_remax(tlr, baseline, mask):  # compute_remax_outcome_advantage
    returns = (tlr * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - baseline.unsqueeze(-1) * mask, returns


def v_gae(tlr, values, mask, gamma, lam):  # compute_gae_advantage_return
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(tlr.shape[-1])):
        delta = tlr[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return v_whiten(adv, mask), adv + values


# ---------------------------------------------------------------- batches


def make_batch(seed, n_groups=3, group_size=4, T=7, interleaved=False):
    """Uneven right-padded masks (row 0 has one token), or masks with holes (tool tokens)."""
    g = torch.Generator().manual_seed(seed)
    B = n_groups * group_size
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 1
    mask = (torch.arange(T) < lengths[:, None]).to(F64)
    if interleaved:
        holes = (torch.rand(B, T, generator=g) < 0.3).to(F64)
        holes[:, 0] = 0
        mask = mask * (1 - holes)
    rewards = torch.randint(-2, 3, (B,), generator=g).to(F64) * 0.5 + torch.rand(B, generator=g, dtype=F64) * (
        torch.rand(B, generator=g) < 0.5
    )
    last = torch.where(mask > 0, torch.arange(T), -1).amax(-1)
    tlr = torch.zeros(B, T, dtype=F64)
    tlr[torch.arange(B), last] = rewards
    index = [f"uid{i // group_size}" for i in range(B)]
    return rewards, tlr, mask, index


def call(name, rewards, mask, g=None, **kw):
    g = g or torch.Generator().manual_seed(1)
    extra = ()
    if name == "remax":
        extra = (torch.randn(mask.shape[0], generator=g, dtype=F64),)
    if name == "gae":
        extra = (torch.randn(mask.shape, generator=g, dtype=F64),)
    extra = (*extra, *rollout_inputs(name, mask))  # turn-level estimators: turns (and states) from the mask
    return ADVANTAGES.get(name)(rewards, mask, *extra, **kw), extra


# ---------------------------------------------------------------- hand-derived numbers


def test_grpo_hand_numbers_group_and_singleton():
    # group "a" scores 1, 2, 3: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> (-1, 0, 1) / (1 + 1e-6)
    # group "b" is a singleton: verl uses mean 0, std 1 -> 5 / (1 + 1e-6)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, ret = grpo(torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=F64), mask, group_ids=["a", "a", "a", "b"])
    expected = torch.tensor([-1.0, 0.0, 1.0, 5.0], dtype=F64)[:, None] / (1 + 1e-6) * mask
    close(adv, expected, 1e-12)
    assert ret is adv or torch.equal(ret, adv)  # verl returns the advantages as returns


def test_grpo_batch_scale_and_trl_eps():
    # scale="batch": std over all four scores 1,2,3,5: mean 2.75, squared deviations
    # 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75, unbiased var 8.75 / 3; group means as before.
    mask = torch.ones(4, 2, dtype=F64)
    adv, _ = grpo(torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=F64), mask, group_ids="aaab", scale="batch", eps=1e-4)
    std = math.sqrt(8.75 / 3)
    close(adv[:, 0], torch.tensor([-1.0, 0.0, 1.0, 5.0], dtype=F64) / (std + 1e-4), 1e-12)


def test_grpo_token_level_rewards_are_summed_and_broadcast_like_verl():
    # row 0: step rewards 1 (token 1) and 2 (token 3): S = 3; row 1: reward 1 on token 2: S = 1
    # group mean 2, unbiased std sqrt(((3-2)^2 + (1-2)^2) / 1) = sqrt(2): every trained token of
    # row 0 gets 1 / sqrt(2), row 1's -1 / sqrt(2) (verl sums token_level_rewards the same way)
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=F64)
    adv, _ = grpo(rewards, mask, group_size=2)
    expected = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, 0.0]], dtype=F64) / (math.sqrt(2) + 1e-6)
    close(adv, expected, 1e-12)


def test_identical_episodes_with_a_step_reward_give_zero_not_r_over_eps():
    # the blow-up: two identical two-turn episodes, step reward 0.3 on turn 1 and outcome
    # 1 on turn 2 (token 4). S = 1.3 for both: std 0, so every group-relative estimator gives 0
    # (the old return-to-go gave turn 2 (1 - 1.3) / 1e-6 = -3e5)
    rewards = torch.tensor([[0.0, 0.3, 0.0, 0.0, 1.0]] * 2, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 1]] * 2, dtype=F64)
    for name in ("grpo", "dr_grpo", "rloo", "opo", "gpg", "reinforce_pp_baseline"):
        adv, ret = ADVANTAGES.get(name)(rewards, mask, group_size=2)
        assert (adv == 0).all() and (ret == 0).all(), name


def test_rloo_and_dr_grpo_hand_numbers():
    # scores 1, 2, 3, 6 (one group, sum 12). RLOO baselines (12 - s) / 3 = 11/3, 10/3, 3, 2
    # -> advantages -8/3, -4/3, 0, 4 (= 4/3 * (s - 3), verl's form). Dr. GRPO: s - 3 = -2, -1, 0, 3.
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=F64)
    adv, _ = rloo(scores, mask, group_size=4)
    close(adv, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0], dtype=F64)[:, None] * mask, 1e-12)
    adv, _ = dr_grpo(scores, mask, group_size=4)
    close(adv, torch.tensor([-2.0, -1.0, 0.0, 3.0], dtype=F64)[:, None] * mask, 1e-12)
    adv, _ = rloo(torch.tensor([4.0], dtype=F64), torch.ones(1, 2, dtype=F64), group_size=1)
    close(adv, torch.tensor([[4.0, 4.0]], dtype=F64), 0)  # verl: a singleton keeps its score


def test_gae_hand_numbers():
    # reward 1 on token 2 (last trained), V = [0.5, 0.25, 0.5, 9 (untrained)], gamma = lam = 1:
    # delta2 = 1 - 0.5 = 0.5; delta1 = 0.5 - 0.25 = 0.25; delta0 = 0.25 - 0.5 = -0.25
    # A = [0.5, 0.75, 0.5] (= 1 - V_t), returns = A + V = [1, 1, 1]
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25, 0.5, 9.0]], dtype=F64)
    adv, ret = gae(torch.tensor([1.0], dtype=F64), mask, values, whiten=False)
    close(adv, torch.tensor([[0.5, 0.75, 0.5, 0.0]], dtype=F64), 1e-12)
    close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64), 1e-12)
    # whitened: mean 7/12, deviations (-1/12, 1/6, -1/12), unbiased var (6/144) / 2 = 1/48
    # -> deviations * sqrt(48) = (-1, 2, -1) / sqrt(3)
    adv, _ = gae(torch.tensor([1.0], dtype=F64), mask, values)
    close(adv, torch.tensor([[-1.0, 2.0, -1.0, 0.0]], dtype=F64) / math.sqrt(3))
    # gamma = lam = 0.5: A2 = 0.5; delta1 = 0.5*0.5 - 0.25 = 0, A1 = 0 + 0.25*0.5 = 0.125
    # delta0 = 0.5*0.25 - 0.5 = -0.375, A0 = -0.375 + 0.25*0.125 = -0.34375
    adv, ret = gae(torch.tensor([1.0], dtype=F64), mask, values, gamma=0.5, lam=0.5, whiten=False)
    close(adv, torch.tensor([[-0.34375, 0.125, 0.5, 0.0]], dtype=F64), 1e-12)
    close(ret, torch.tensor([[0.15625, 0.375, 1.0, 0.0]], dtype=F64), 1e-12)


def test_gae_credits_a_tool_token_reward_to_the_action_before_it():
    # mask [1, 0, 1]: token 1 is tool output carrying reward 2; reward 1 on token 2; V = [0.5, 9, 0.25]
    # materl moves the 2 onto token 0: delta2 = 1 - 0.25 = 0.75 = A2; token 1 skipped;
    # delta0 = 2 + 0.25 - 0.5 = 1.75, A0 = 1.75 + 0.75 = 2.5 (= total return 3 - V0); returns [3, 0, 1].
    # verl drops the 2 (its delta at a mask-0 token is discarded): A0 = -0.25 + 0.75 = 0.5.
    tlr, mask = torch.tensor([[0.0, 2.0, 1.0]], dtype=F64), torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 9.0, 0.25]], dtype=F64)
    adv, ret = gae(tlr, mask, values, whiten=False)
    close(adv, torch.tensor([[2.5, 0.0, 0.75]], dtype=F64), 1e-12)
    close(ret, torch.tensor([[3.0, 0.0, 1.0]], dtype=F64), 1e-12)
    _, verl_ret = v_gae(tlr, values, mask, 1.0, 1.0)
    assert verl_ret[0, 0] - values[0, 0] == 0.5


def test_discounted_returns_hand_numbers():
    # gamma 0.5, rewards [1, 0, 2 | pad]: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    out = discounted_returns(torch.tensor([[1.0, 0.0, 2.0, 0.0]], dtype=F64), torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    close(out, torch.tensor([[1.5, 1.0, 2.0, 0.0]], dtype=F64), 1e-12)
    # token 1 is a tool token (mask 0) carrying reward 3: it is credited to token 0, and the
    # discount counts trained tokens only: G2 = 1, G0 = 3 + 0.5 * 1 = 3.5
    out = discounted_returns(torch.tensor([[0.0, 3.0, 1.0]], dtype=F64), torch.tensor([[1, 0, 1]]), gamma=0.5)
    close(out, torch.tensor([[3.5, 0.0, 1.0]], dtype=F64), 1e-12)


def test_reinforce_pp_skips_tool_tokens_where_verl_resets():
    # reward 1 on the last token, a tool token in the middle. verl resets its running return at
    # the mask-0 token, so token 0 gets return 0; materl credits token 0 with the later reward.
    tlr, mask = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64), torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    _, verl_returns = v_rpp(tlr, mask, 1.0)
    _, ours = reinforce_pp(tlr, mask)
    assert verl_returns[0, 0] == 0.0 and ours[0, 0] == 1.0


# ---------------------------------------------------------------- equality with verl 0.9


VERL = {
    "grpo": lambda tlr, m, idx, _: (v_grpo(tlr, m, idx),) * 2,
    "process": lambda tlr, m, idx, _: (v_grpo(tlr, m, idx),) * 2,  # one step per row: GRPO
    "dr_grpo": lambda tlr, m, idx, _: (v_grpo(tlr, m, idx, norm=False),) * 2,
    "rloo": lambda tlr, m, idx, _: (v_rloo(tlr, m, idx),) * 2,
    "opo": lambda tlr, m, idx, _: (v_opo(tlr, m, idx),) * 2,
    "gpg": lambda tlr, m, idx, _: (v_gpg(tlr, m, idx),) * 2,
    "reinforce_pp_baseline": lambda tlr, m, idx, _: (v_rpp_baseline(tlr, m, idx),) * 2,
    "reinforce_pp": lambda tlr, m, idx, _: v_rpp(tlr, m, 1.0),
    "remax": lambda tlr, m, idx, extra: v_remax(tlr, extra[0], m),
    "gae": lambda tlr, m, idx, extra: v_gae(tlr, extra[0], m, 1.0, 1.0),
    # one turn per row (no holes): turn-level GRPO is GRPO; GiGPO's one state per group (the
    # prompt) makes its step level GRPO too, so omega 1 doubles it; returns: the row's score
    "turn_grpo": lambda tlr, m, idx, _: (v_grpo(tlr, m, idx), tlr.sum(-1, keepdim=True).expand_as(m)),
    "gigpo": lambda tlr, m, idx, _: (2 * v_grpo(tlr, m, idx), tlr.sum(-1, keepdim=True).expand_as(m)),
}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_level", [False, True])
def test_matches_verl(name, seed, token_level):
    rewards, tlr, mask, index = make_batch(seed)
    (adv, ret), extra = call(name, tlr if token_level else rewards, mask, group_ids=index)
    v_adv, v_ret = VERL[name](tlr, mask, index, extra)
    close(adv, v_adv * mask)
    close(ret, v_ret * mask)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_pp_baseline", "remax", "gae"])
def test_matches_verl_with_tool_token_holes(name):
    # masks with untrained tokens inside rows: equal wherever verl skips them (all but REINFORCE++)
    rewards, tlr, mask, index = make_batch(5, interleaved=True)
    (adv, ret), extra = call(name, rewards, mask, group_ids=index)
    v_adv, v_ret = VERL[name](tlr, mask, index, extra)
    close(adv, v_adv * mask)
    close(ret, v_ret * mask)


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.95), (0.5, 1.0), (1.0, 0.0)])
def test_gae_and_reinforce_pp_match_verl_discounted(gamma, lam):
    _, tlr, mask, _ = make_batch(3)
    tlr = tlr + torch.randn(tlr.shape, dtype=F64, generator=torch.Generator().manual_seed(4)) * mask  # dense
    values = torch.randn(tlr.shape, dtype=F64)
    adv, ret = gae(tlr, mask, values, gamma=gamma, lam=lam)
    v_adv, v_ret = v_gae(tlr, values, mask, gamma, lam)
    close(adv, v_adv * mask)
    close(ret, v_ret * mask)
    adv, ret = reinforce_pp(tlr, mask, gamma=gamma)
    v_adv, v_ret = v_rpp(tlr, mask, gamma)
    close(adv, v_adv)
    close(ret, v_ret * mask)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_matches_trl_scale_rewards(scale):
    # TRL 1.16 GRPOTrainer (sum_then_normalize): group mean over view(-1, G); std per group (unbiased)
    # or of the whole batch; advantages / (std + 1e-4) unless scale_rewards == "none".
    rewards, _, mask, _ = make_batch(7, n_groups=3, group_size=4)
    grouped = rewards.view(-1, 4)
    centred = rewards - grouped.mean(1).repeat_interleave(4)
    std = grouped.std(1).repeat_interleave(4) if scale == "group" else rewards.std().expand(12)
    trl = centred if scale == "none" else centred / (std + 1e-4)
    adv, _ = grpo(rewards, mask, group_size=4, scale=scale, eps=1e-4)
    close(adv, trl[:, None] * mask, 1e-12)


# ---------------------------------------------------------------- contract


@pytest.mark.parametrize("name", ALL)
def test_contract_shapes_zeros_no_grad(name):
    rewards, tlr, mask, index = make_batch(11, interleaved=True)
    rewards.requires_grad_(True)
    bool_mask = mask.bool()
    for r in (rewards, tlr):
        for groups in ({"group_ids": index}, {"group_size": 4}):
            (adv, ret), _ = call(name, r, bool_mask, **groups)
            for out in (adv, ret):
                assert out.shape == mask.shape and out.dtype == F64
                assert not out.requires_grad
                assert torch.isfinite(out).all()
                assert (out[mask == 0] == 0).all()


@pytest.mark.parametrize("name", ALL)
def test_outcome_and_last_token_rewards_agree(name):
    rewards, tlr, mask, index = make_batch(13, interleaved=True)
    (a1, r1), _ = call(name, rewards, mask, group_ids=index)
    (a2, r2), _ = call(name, tlr, mask, group_ids=index)
    close(a1, a2, 1e-12)
    close(r1, r2, 1e-12)


def test_registry_holds_every_estimator_with_docs():
    assert ADVANTAGES.names() == sorted(ALL)
    for name in ALL:
        doc = ADVANTAGES.get(name).__doc__
        assert "verl" in doc and "Shapes" in doc and "arXiv" in doc, name


def test_empty_row_gets_zero_and_no_nan():
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]], dtype=F64)
    for name in ALL:
        (adv, ret), _ = call(name, torch.tensor([1.0, 2.0, 0.5], dtype=F64), mask, group_size=3)
        assert torch.isfinite(adv).all() and (adv[1] == 0).all() and (ret[1] == 0).all(), name


# ---------------------------------------------------------------- properties (hypothesis)

batches = st.tuples(
    st.integers(0, 10_000),  # seed
    st.integers(1, 3),  # groups
    st.integers(1, 4),  # group size
    st.integers(1, 6),  # T
    st.booleans(),  # token-level rewards
    st.booleans(),  # holes in the mask
)


def draw(spec):
    seed, n_groups, gsize, T, token_level, holes = spec
    rewards, tlr, mask, index = make_batch(seed, n_groups, gsize, T, interleaved=holes)
    return (tlr if token_level else rewards), mask, index, gsize


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(spec=batches, pad=st.integers(1, 3))
def test_right_padding_changes_nothing(name, spec, pad):
    r, mask, index, _ = draw(spec)
    (adv, ret), extra = call(name, r, mask, group_ids=index)
    B = mask.shape[0]
    mask_p = torch.cat([mask, torch.zeros(B, pad, dtype=F64)], 1)
    r_p = torch.cat([r, torch.zeros(B, pad, dtype=F64)], 1) if r.dim() == 2 else r
    args = [torch.cat([e, torch.full((B, pad), 123.0, dtype=F64)], 1) if e.dim() == 2 else e for e in extra]
    adv_p, ret_p = ADVANTAGES.get(name)(r_p, mask_p, *args, group_ids=index)
    close(adv_p[:, : mask.shape[1]], adv, 1e-12)
    close(ret_p[:, : mask.shape[1]], ret, 1e-12)
    assert (adv_p[:, mask.shape[1] :] == 0).all() and (ret_p[:, mask.shape[1] :] == 0).all()


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(spec=batches, perm_seed=st.integers(0, 1000))
def test_permuting_groups_permutes_results(name, spec, perm_seed):
    r, mask, _, gsize = draw(spec)
    (adv, ret), extra = call(name, r, mask, group_size=gsize)
    n_groups = mask.shape[0] // gsize
    gperm = torch.randperm(n_groups, generator=torch.Generator().manual_seed(perm_seed))
    rows = (gperm[:, None] * gsize + torch.arange(gsize)).reshape(-1)
    adv_p, ret_p = ADVANTAGES.get(name)(r[rows], mask[rows], *(e[rows] for e in extra), group_size=gsize)
    close(adv_p, adv[rows], 1e-9)
    close(ret_p, ret[rows], 1e-9)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(spec=batches, perm_seed=st.integers(0, 1000))
def test_group_ids_match_group_size_in_any_row_order(name, spec, perm_seed):
    r, mask, index, gsize = draw(spec)
    (adv, ret), extra = call(name, r, mask, group_size=gsize)
    (adv_i, ret_i), _ = call(name, r, mask, group_ids=index)
    close(adv_i, adv, 1e-12)
    close(ret_i, ret, 1e-12)
    rows = torch.randperm(mask.shape[0], generator=torch.Generator().manual_seed(perm_seed))
    ids = [index[i] for i in rows.tolist()]
    adv_p, _ = ADVANTAGES.get(name)(r[rows], mask[rows], *(e[rows] for e in extra), group_ids=ids)
    close(adv_p, adv[rows], 1e-9)


# ---------------------------------------------------------------- errors


def test_group_size_must_divide_batch():
    with pytest.raises(ShapeError, match="group_size=3 does not divide the batch of 4 rows"):
        grpo(torch.zeros(4), torch.ones(4, 2), group_size=3)


def test_groups_required_and_exclusive():
    with pytest.raises(ShapeError, match="grpo needs groups"):
        grpo(torch.zeros(4), torch.ones(4, 2))
    with pytest.raises(ShapeError, match="exactly one of group_ids or group_size"):
        rloo(torch.zeros(4), torch.ones(4, 2), group_ids="aabb", group_size=2)


def test_bad_scale_lists_choices():
    with pytest.raises(ConfigError, match=r"unknown scale 'std'; valid: group, batch, none"):
        grpo(torch.zeros(4), torch.ones(4, 2), group_size=2, scale="std")


@pytest.mark.parametrize("shape", [(5,), (4, 3), (4, 2, 1)])
def test_rewards_mask_shape_mismatch(shape):
    with pytest.raises(ShapeError, match=r"mask.*\[4, 2\]"):
        grpo(torch.zeros(shape), torch.ones(4, 2), group_size=2)


def test_extra_tensor_shapes_and_hparam_ranges():
    with pytest.raises(ShapeError, match=r"baseline_rewards must be \(B,\)=\(4,\), got shape \[4, 1\]"):
        ADVANTAGES.get("remax")(torch.zeros(4), torch.ones(4, 2), torch.zeros(4, 1))
    with pytest.raises(ShapeError, match=r"values must match mask"):
        gae(torch.zeros(4), torch.ones(4, 2), torch.zeros(4, 3))
    with pytest.raises(ConfigError, match=r"lam must be in \[0, 1\], got 1.5"):
        gae(torch.zeros(4), torch.ones(4, 2), torch.zeros(4, 2), lam=1.5)
    with pytest.raises(ConfigError, match=r"gamma must be in \[0, 1\], got -0.1"):
        reinforce_pp(torch.zeros(4), torch.ones(4, 2), gamma=-0.1)


def test_non_finite_rewards_name_the_rows():
    with pytest.raises(RewardError, match=r"rows \[2\]"):
        grpo(torch.tensor([0.0, 1.0, float("nan"), 1.0]), torch.ones(4, 2), group_size=2)


def test_unknown_estimator_suggests_closest():
    with pytest.raises(UnknownNameError, match=r"unknown advantage 'grop'.*Did you mean 'grpo'\?"):
        ADVANTAGES.get("grop")
