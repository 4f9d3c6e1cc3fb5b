"""Advantage estimators: rewards (and values / baselines) -> per-token advantages and returns.

Every estimator has one calling convention, so the compiler can call any of them generically::

    adv_B_T, ret_B_T = ADVANTAGES.get(name)(rewards, mask, *extra_tensors,
                                            group_ids=None, group_size=None, **hparams)

- ``rewards``: (B,) outcome rewards, or (B,T) token-level rewards where each step's reward sits on
  the last token of its step. A (B,) reward is placed on the row's last trained token.
- ``mask``: (B,T) loss mask, 1 where a token is trained (tool output is 0, padding is 0).
- groups: ``group_ids`` (one hashable per row, e.g. prompt uids) or ``group_size`` (consecutive
  rows). Estimators that use no groups accept and ignore both.
- Both outputs are (B,T), zero where ``mask`` is 0, and carry no gradient (computed under
  ``torch.no_grad`` as in verl: advantages are constants to the policy loss).

Token-level rewards. The group-relative estimators (grpo, dr_grpo, rloo, opo, gpg,
reinforce++-baseline) reduce the row to one score ``S = sum_t r_t`` and broadcast one scalar over
the row's trained tokens, exactly as verl's outcome estimators do with ``token_level_rewards``.
(materl once applied the group statistics of ``S`` to each token's return-to-go ``G_t``; with
step rewards ``G_t`` leaves out earlier steps' rewards while the baseline includes them, so a
group of identical episodes got ``-r / eps`` on later turns. Step rewards under a group baseline
are credited by a published method instead: ``process`` here (DeepSeekMath's process
supervision), turn-level GRPO and GiGPO in ``materl.ops.turn_credit``.)

No signal from nothing: a group whose scores are all equal gets advantage exactly 0 (its mean is
the common score and its std 0, never a rounding residue divided by ``eps``), and a batch
whitening over equal values gives 0 (``ops._masked``).

The return-to-go estimators (reinforce_pp, remax, gae) keep ``G_t``: their baseline is per
token (whitening, a value) or the greedy rollout's, with no group statistics of ``S``.
Untrained tokens inside a row (tool output) are skipped, not treated as an episode end: a reward
on an untrained token is credited to the last trained token before it, and discounting counts
trained tokens only (verl's GAE skips observation tokens the same way; verl's REINFORCE++
instead resets its running return at every mask-0 token, which differs from materl only when a
row has untrained tokens between trained ones).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from materl.errors import ConfigError, RewardError, ShapeError
from materl.ops._masked import (
    group_index,
    group_stats,
    masked_whiten,
    place_on_last_trained,
)
from materl.registry import Registry

ADVANTAGES: Registry = Registry("advantage")


def group_statistics(fn):
    """Mark an estimator whose statistics stay inside each group (its result for a group does
    not depend on the other groups), so a compiled recipe may compute it as each group
    finishes. Unmarked estimators use batch-wide statistics and run once per batch."""
    fn.statistics = "group"
    return fn


def rollout_inputs(*names: str):
    """Mark an estimator that takes tensors the compiler derives from the scored rollouts, after
    the node's own extra tensors and in this order (``"turns"``: each token's turn, ``"states"``:
    each turn's anchor state id; ``materl.compiler.turns`` builds them)."""
    def mark(fn):
        fn.rollout_inputs = names
        return fn
    return mark


def group_baseline(fn):
    """Mark an estimator whose baseline is a statistic of the group's scores: a group of identical
    episodes gets advantage 0 from it (tests/ops/test_step_credit.py checks every marked one)."""
    fn.baseline = "group"
    return fn


GRPO_SCALES = ("group", "batch", "none")

GroupIds = Sequence[Hashable] | Tensor | None

__all__ = [
    "ADVANTAGES",
    "group_baseline",
    "group_statistics",
    "GRPO_SCALES",
    "discounted_returns",
    "dr_grpo",
    "gae",
    "gpg",
    "grpo",
    "opo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "rollout_inputs",
]


# ---------------------------------------------------------------------------------------------
# shared plumbing


def _prepare(op: str, rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate; return (token rewards (B,T), float mask (B,T), sequence scores S (B,))."""
    if mask.dim() != 2:
        raise ShapeError(f"{op}: mask must be (B,T), got shape {list(mask.shape)}")
    if rewards.dim() not in (1, 2) or rewards.shape[0] != mask.shape[0]:
        raise ShapeError(
            f"{op}: rewards must be (B,) or (B,T) matching mask (B,T)={list(mask.shape)}, "
            f"got shape {list(rewards.shape)}"
        )
    if rewards.dim() == 2 and rewards.shape != mask.shape:
        raise ShapeError(
            f"{op}: token-level rewards {list(rewards.shape)} and mask {list(mask.shape)} must have the same shape"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = ~torch.isfinite(rewards)
    if bad.any():
        rows = sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})
        raise RewardError(f"{op}: rewards are not finite in rows {rows[:10]} (NaN or inf)")
    mask_f = (mask != 0).to(rewards.dtype)
    if rewards.dim() == 2:
        return rewards, mask_f, rewards.sum(-1)
    return place_on_last_trained(rewards, mask_f), mask_f, rewards


def _shift_onto_trained(rewards_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Move each reward on an untrained token to the last trained token at or before it
    (rewards before a row's first trained token are dropped)."""
    T = mask_B_T.shape[1]
    pos = torch.arange(T, device=mask_B_T.device).expand_as(mask_B_T)
    owner = torch.cummax(torch.where(mask_B_T > 0, pos, -1), dim=1).values
    kept = torch.where(owner >= 0, rewards_B_T, torch.zeros_like(rewards_B_T))
    return torch.zeros_like(rewards_B_T).scatter_add_(1, owner.clamp(min=0), kept)


def _check_unit(op: str, name: str, value: float) -> None:
    if not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{op}: {name} must be in [0, 1], got {value!r}")


def _groups(op: str, n: int, group_ids: GroupIds, group_size: int | None) -> tuple[Tensor, int]:
    if group_ids is None and group_size is None:
        raise ShapeError(f"{op} needs groups: pass group_ids (one per row) or group_size (consecutive rows)")
    return group_index(n, group_ids=group_ids, group_size=group_size)


def _group_stats(scores_B: Tensor, index_B: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (group mean, unbiased group std, group size) on the scores' device."""
    # group_stats allocates its accumulators on the CPU; B scalars make the round trip cheap.
    stats = group_stats(scores_B.cpu(), index_B.cpu(), num_groups)
    return tuple(t.to(scores_B.device) for t in stats)


def _group_mean_verl(
    scores_B: Tensor, group_ids: GroupIds, group_size: int | None, op: str
) -> tuple[Tensor, Tensor, Tensor]:
    """verl's group mean/std: a singleton group gets mean 0 and std 1. Returns (mean, std, count)."""
    index, num_groups = _groups(op, scores_B.shape[0], group_ids, group_size)
    mean, std, count = _group_stats(scores_B, index, num_groups)
    single = count == 1
    return torch.where(single, 0.0, mean), torch.where(single, 1.0, std), count


def _relative(scores_B: Tensor, mask_B_T: Tensor, baseline_B: Tensor, scale_B: Tensor | float = 1.0) -> Tensor:
    """``A = (S - baseline) / scale`` broadcast over trained tokens, 0 elsewhere (verl)."""
    return ((scores_B - baseline_B) / scale_B).unsqueeze(-1) * mask_B_T


# ---------------------------------------------------------------------------------------------
# returns


@torch.no_grad()
def discounted_returns(rewards_B_T: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Per-token discounted return-to-go over trained tokens.

    ``G_t = r'_t + gamma * G_{next trained token after t}`` on trained tokens, 0 elsewhere, where
    ``r'`` moves each reward on an untrained token onto the last trained token before it (module
    docstring). With ``gamma=1``, ``G_t = sum_{t' >= t} r_{t'}``.

    Shapes: rewards (B,T) (or (B,), placed on the last trained token), mask (B,T) -> (B,T).
    verl: the running return of ``compute_reinforce_plus_plus_outcome_advantage`` (equal on
    right-padded masks; verl resets at every mask-0 token, materl skips untrained tokens).
    """
    tok, mask_f, _ = _prepare("discounted_returns", rewards_B_T, mask)
    _check_unit("discounted_returns", "gamma", gamma)
    return _returns(tok, mask_f, gamma)


def _returns(tok_B_T: Tensor, mask_B_T: Tensor, gamma: float) -> Tensor:
    r = _shift_onto_trained(tok_B_T, mask_B_T)
    if gamma == 1.0:
        return r.flip(-1).cumsum(-1).flip(-1) * mask_B_T
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(mask_B_T[:, t] > 0, r[:, t] + gamma * running, running)
        out[:, t] = running * mask_B_T[:, t]
    return out


# ---------------------------------------------------------------------------------------------
# group-relative outcome estimators


@ADVANTAGES.register("grpo")
@group_baseline
@group_statistics
@torch.no_grad()
def grpo(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    scale: str = "group",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``A = (S - mean_g(S)) / (std_g(S) + eps)`` on every trained token, with ``S`` the row's summed
    reward, ``mean_g`` and the unbiased ``std_g`` over the row's group; a singleton group gets
    mean 0, std 1; a group of equal scores gets 0. With step rewards, ``process`` credits each
    step (the compiled ``ml.advantages`` picks it by default, ``step_credit=``).
    ``scale``: ``"group"`` (above), ``"batch"`` (std of all B scores, mean still per group),
    ``"none"`` (no division; = ``dr_grpo``).

    Shapes: rewards (B,) or (B,T), mask (B,T) -> (advantages, returns), both (B,T); returns are
    the advantages, as in verl.

    verl 0.9: ``compute_grpo_outcome_advantage`` (epsilon=1e-6, torch.std is unbiased;
    ``norm_adv_by_std_in_grpo=False`` is ``scale="none"``). TRL 1.16 GRPOTrainer: its
    ``scale_rewards`` "group"/"batch"/"none" are these ``scale`` values with ``eps=1e-4`` (TRL's
    nanstd is unbiased too). Differences from TRL: a singleton group here keeps its reward
    (verl: mean 0, std 1) where TRL's num_generations=1 gives 0.
    """
    if scale not in GRPO_SCALES:
        raise ConfigError(f"grpo: unknown scale {scale!r}; valid: {', '.join(GRPO_SCALES)}")
    if eps < 0:
        raise ConfigError(f"grpo: eps must be >= 0, got {eps!r}")
    _, mask_f, scores = _prepare("grpo", rewards, mask)
    mean, std, _ = _group_mean_verl(scores, group_ids, group_size, "grpo")
    if scale == "group":
        denom = std + eps
    elif scale == "batch":
        batch_std = scores.std() if scores.numel() > 1 else scores.new_zeros(())
        denom = (batch_std + eps).expand_as(scores)
    else:
        denom = 1.0
    adv = _relative(scores, mask_f, mean, denom)
    return adv, adv


@ADVANTAGES.register("dr_grpo")
@group_baseline
@group_statistics
@torch.no_grad()
def dr_grpo(
    rewards: Tensor, mask: Tensor, *, group_ids: GroupIds = None, group_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO advantage: mean-centred, no std division (Liu et al. 2025, "Understanding
    R1-Zero-Like Training", arXiv:2503.20783).

    ``A = S - mean_g(S)`` (singleton group: mean 0). Shapes as ``grpo``; returns = advantages.
    verl 0.9: ``compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)``; TRL 1.16:
    ``scale_rewards="none"``. (Dr. GRPO's other half, the constant loss normaliser, is a loss
    aggregation, not part of the advantage.)
    """
    return grpo(rewards, mask, group_ids=group_ids, group_size=group_size, scale="none")


@ADVANTAGES.register("rloo")
@group_baseline
@group_statistics
@torch.no_grad()
def rloo(
    rewards: Tensor, mask: Tensor, *, group_ids: GroupIds = None, group_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

    ``A = S_i - (sum_g S - S_i) / (n - 1)`` for a group of n > 1 rows; a singleton keeps
    ``A = S_i`` (baseline 0). For outcome rewards this is verl's ``n/(n-1) * (S_i - mean_g S)``.

    Shapes as ``grpo``; returns = advantages. verl 0.9: ``compute_rloo_outcome_advantage``
    (verl's ``rloo_vectorized`` instead gives singletons 0).
    """
    _, mask_f, scores = _prepare("rloo", rewards, mask)
    index, num_groups = _groups("rloo", scores.shape[0], group_ids, group_size)
    mean, _, count = _group_stats(scores, index, num_groups)
    # leave-one-out mean of the others, (n mean - S) / (n - 1), written so that a group of
    # equal scores gives exactly S; a singleton's baseline is 0, verl's convention
    baseline = torch.where(count > 1, mean + (mean - scores) / (count - 1).clamp(min=1), torch.zeros_like(mean))
    adv = _relative(scores, mask_f, baseline)
    return adv, adv


@ADVANTAGES.register("opo")
@group_baseline
@group_statistics
@torch.no_grad()
def opo(
    rewards: Tensor, mask: Tensor, *, group_ids: GroupIds = None, group_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585).

    ``A = S - b_g``, ``b_g = sum_{j in g} L_j S_j / sum_{j in g} L_j`` with ``L_j`` the number
    of trained tokens of row j (the length-weighted baseline); a singleton group has b = 0.

    Shapes as ``grpo``; returns = advantages. verl 0.9: ``compute_opo_outcome_advantage``.
    """
    _, mask_f, scores = _prepare("opo", rewards, mask)
    index, num_groups = _groups("opo", scores.shape[0], group_ids, group_size)
    lengths = mask_f.sum(-1)
    mean_ls, _, count = _group_stats(lengths * scores, index, num_groups)
    mean_l, _, _ = _group_stats(lengths, index, num_groups)
    _, spread, _ = _group_stats(scores, index, num_groups)
    weighted = torch.where(mean_l > 0, mean_ls / mean_l.clamp(min=1e-30), torch.zeros_like(mean_l))
    weighted = torch.where(spread == 0, scores, weighted)  # equal scores: the baseline is the score itself
    baseline = torch.where(count > 1, weighted, torch.zeros_like(weighted))
    adv = _relative(scores, mask_f, baseline)
    return adv, adv


@ADVANTAGES.register("gpg")
@group_baseline
@torch.no_grad()
def gpg(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    f_norm: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546).

    ``A = alpha * (S - mean_g(S)) / f_norm`` with ``alpha = B / max(1, #{i : S_i != 0})``
    (the batch size over the number of rows with a non-zero score, which up-weights batches
    where most rows score 0); singleton group: mean 0.

    Shapes as ``grpo``; returns = advantages. verl 0.9: ``compute_gpg_outcome_advantage``
    (verl's ``alpha`` argument is overwritten by this ratio, so materl does not take one).
    """
    if f_norm == 0:
        raise ConfigError(f"gpg: f_norm must be non-zero, got {f_norm!r}")
    _, mask_f, scores = _prepare("gpg", rewards, mask)
    mean, _, _ = _group_mean_verl(scores, group_ids, group_size, "gpg")
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    adv = _relative(scores, mask_f, mean, f_norm / alpha)
    return adv, adv


@ADVANTAGES.register("reinforce_pp_baseline")
@group_baseline
@torch.no_grad()
def reinforce_pp_baseline(
    rewards: Tensor, mask: Tensor, *, group_ids: GroupIds = None, group_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv:2501.03262).

    ``A_t = whiten_batch((S - mean_g(S)) * mask)`` where ``whiten_batch`` is the masked
    whitening over every trained token of the batch (mean 0, unbiased var 1, eps 1e-8 inside the
    rsqrt); singleton group: mean 0.

    Shapes as ``grpo``; returns = advantages. verl 0.9:
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """
    _, mask_f, scores = _prepare("reinforce_pp_baseline", rewards, mask)
    mean, _, _ = _group_mean_verl(scores, group_ids, group_size, "reinforce_pp_baseline")
    centred = _relative(scores, mask_f, mean)
    adv = masked_whiten(centred, mask_f) * mask_f
    return adv, adv


# ---------------------------------------------------------------------------------------------
# estimators without groups (group_ids / group_size are accepted and ignored)


@ADVANTAGES.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    ``R_t = discounted_returns(r, mask, gamma)``; ``A_t = whiten_batch(R_t) * mask``.
    Shapes: rewards (B,) or (B,T), mask (B,T) -> (advantages, returns R) (B,T).
    verl 0.9: ``compute_reinforce_plus_plus_outcome_advantage`` (gamma = ``algorithm.gamma``,
    default 1.0); equal on right-padded masks, see ``discounted_returns`` for untrained tokens
    inside a row. Groups are ignored.
    """
    tok, mask_f, _ = _prepare("reinforce_pp", rewards, mask)
    _check_unit("reinforce_pp", "gamma", gamma)
    returns = _returns(tok, mask_f, gamma)
    adv = masked_whiten(returns, mask_f) * mask_f
    return adv, returns


@ADVANTAGES.register("remax")
@torch.no_grad()
def remax(
    rewards: Tensor,
    mask: Tensor,
    baseline_rewards: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the greedy rollout's reward is the baseline.

    ``R_t = sum_{t' >= t} r_{t'}``; ``A_t = R_t - b`` with ``b`` the reward of the greedy
    (argmax) response to the same prompt. Shapes: rewards (B,) or (B,T), mask (B,T),
    baseline_rewards (B,) -> (advantages, returns R) (B,T).
    verl 0.9: ``compute_remax_outcome_advantage(token_level_rewards, reward_baselines, mask)``.
    Groups are ignored.
    """
    tok, mask_f, _ = _prepare("remax", rewards, mask)
    if baseline_rewards.shape != (mask.shape[0],):
        raise ShapeError(
            f"remax: baseline_rewards must be (B,)=({mask.shape[0]},), got shape {list(baseline_rewards.shape)}"
        )
    returns = _returns(tok, mask_f, 1.0)
    adv = (returns - baseline_rewards.to(returns.dtype).unsqueeze(-1)) * mask_f
    return adv, returns


@ADVANTAGES.register("gae")
@torch.no_grad()
def gae(
    rewards: Tensor,
    mask: Tensor,
    values: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Over trained tokens only (untrained tokens are skipped; ``next`` is the next trained token):
    ``delta_t = r'_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    ``returns_t = A_t + V_t``; then ``A`` is whitened over the batch when ``whiten``.

    Shapes: rewards (B,) (placed on the last trained token) or (B,T), mask (B,T), values (B,T)
    -> (advantages, returns) (B,T). verl 0.9: ``compute_gae_advantage_return`` (defaults
    gamma = lam = 1.0, always whitens; ``whiten=False`` is materl's). verl drops a reward that
    sits on a mask-0 token; materl credits it to the trained token before. Groups are ignored.
    """
    tok, mask_f, _ = _prepare("gae", rewards, mask)
    if values.shape != mask.shape:
        raise ShapeError(f"gae: values must match mask (B,T)={list(mask.shape)}, got shape {list(values.shape)}")
    _check_unit("gae", "gamma", gamma)
    _check_unit("gae", "lam", lam)
    r = _shift_onto_trained(tok, mask_f)
    v = values.to(r.dtype)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    last_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        trained = mask_f[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        last_adv = torch.where(trained, delta + gamma * lam * last_adv, last_adv)
        next_value = torch.where(trained, v[:, t], next_value)
        adv[:, t] = last_adv
    returns = torch.where(mask_f > 0, adv + v, torch.zeros_like(adv))
    if whiten:
        adv = masked_whiten(adv, mask_f)
    return adv * mask_f, returns
