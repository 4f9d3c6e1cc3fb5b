"""Turn-level credit for multi-turn episodes: GRPO's group statistics per turn position
(``turn_grpo``) and GiGPO's episode plus same-state step advantage (``gigpo``).

    adv_B_T, ret_B_T = ADVANTAGES.get("turn_grpo")(rewards, mask, turns_B_T, group_ids=uids, gamma=1.0)
    adv_B_T, ret_B_T = ADVANTAGES.get("gigpo")(rewards, mask, turns_B_T, states_B_K, group_ids=uids)

A turn is a model turn plus the untrained tokens after it (tool output, an environment's reply).
``turns_B_T`` holds each token's 0-based turn, -1 before the first turn and on padding; a row has
turn j when one of its trained tokens is in turn j. The compiler derives it once per batch from
the rollouts (``materl.compiler.turns``): the estimators below declare it with
``@rollout_inputs("turns")``. Turn j's reward r_j sums the token rewards inside it (a (B,)
outcome reward sits on the row's last trained token, so it counts in the last turn) and its
return is ``R_j = sum_{k >= j} gamma^(k-j) r_k``; the returns output carries R_j on the turn's
trained tokens.

No signal from nothing: a statistic over equal values gives exactly 0 (its mean is the common
value and its std 0, never a rounding residue divided by ``eps``); a statistic over one value
takes verl's singleton convention (mean 0, std 1) where the paper's formula is GRPO's, and 0 where
it compares a step with others that share its state (GiGPO's step level).
"""

from __future__ import annotations

import torch
from torch import Tensor

from materl.errors import ConfigError, ShapeError
from materl.ops._masked import group_stats
from materl.ops.advantages import (
    ADVANTAGES,
    GroupIds,
    _groups,
    _prepare,
    group_baseline,
    group_statistics,
    rollout_inputs,
)

__all__ = ["GIGPO_NORMS", "check_turn_hparams", "gigpo", "turn_grpo"]

GIGPO_NORMS = ("std", "none")


def check_turn_hparams(what: str, *, gamma: float, eps: float, omega: float | None = None, norm: str = "std") -> None:
    """The hyperparameter checks of ``turn_grpo`` and ``gigpo`` (also run by their recipe
    constructors, ``ml.turn_advantages`` / ``ml.gigpo_advantages``, before a node is made)."""
    if not 0.0 <= gamma <= 1.0 or eps < 0 or (omega is not None and omega < 0):
        needs = "gamma must be in [0, 1] and eps >= 0" if omega is None else \
            "gamma must be in [0, 1], eps >= 0 and omega >= 0"
        got = f"gamma={gamma}, eps={eps}" + ("" if omega is None else f", omega={omega}")
        raise ConfigError(f"{what}: {needs}; got {got}")
    if norm not in GIGPO_NORMS:
        raise ConfigError(f"{what}: unknown norm {norm!r}; valid: {', '.join(GIGPO_NORMS)}")


def _turn_table(op: str, rewards: Tensor, mask: Tensor, turns: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(float mask (B,T), turn per token clamped to a column (B,T), turn rewards r (B,K), which
    turns each row has (B,K) bool)."""
    tok, mask_f, _ = _prepare(op, rewards, mask)
    if turns.shape != mask.shape:
        raise ShapeError(f"{op}: turns must match mask (B,T)={list(mask.shape)}, got shape {list(turns.shape)}")
    turns = turns.to(device=mask_f.device, dtype=torch.long)
    trained = mask_f > 0
    if (turns[trained] < 0).any():
        rows = sorted({int(i) for i in (trained & (turns < 0)).nonzero()[:, 0].tolist()})
        raise ShapeError(f"{op}: trained tokens without a turn (turn index -1) in rows {rows[:10]}")
    K = int(turns[trained].max()) + 1 if trained.any() else 0
    inside = (turns >= 0) & (turns < K)
    column = torch.where(inside, turns, torch.zeros_like(turns))
    r = tok.new_zeros(mask_f.shape[0], K + 1)  # column K collects what lies in no turn
    r.scatter_add_(1, torch.where(inside, column, K), tok)
    has = torch.zeros(mask_f.shape[0], K + 1, dtype=torch.bool, device=mask_f.device)
    has[trained.nonzero(as_tuple=True)[0], column[trained]] = True
    return mask_f, column, r[:, :K], has[:, :K]


def _turn_returns(r_B_K: Tensor, gamma: float) -> Tensor:
    out = torch.zeros_like(r_B_K)
    running = r_B_K.new_zeros(r_B_K.shape[0])
    for j in reversed(range(r_B_K.shape[1])):
        running = r_B_K[:, j] + gamma * running
        out[:, j] = running
    return out


def _normalised(x: Tensor, mean: Tensor, std: Tensor, eps: float, norm: str = "std") -> Tensor:
    """``(x - mean) / (std + eps)`` (``norm="std"``) or ``x - mean``; exactly 0 where x is the mean."""
    centred = x - mean
    out = centred / (std + eps) if norm == "std" else centred
    return torch.where(x == mean, torch.zeros_like(out), out)


def _keyed_stats(values: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, unbiased std, count) of ``values`` over the entries sharing their key."""
    dense, index = torch.unique(keys, return_inverse=True)
    stats = group_stats(values.cpu(), index.cpu(), len(dense))
    return tuple(t.to(values.device) for t in stats)


def _singleton_convention(mean: Tensor, std: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    single = count == 1
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std)


def _per_token(value_B_K: Tensor, column_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    if value_B_K.shape[1] == 0:
        return torch.zeros_like(mask_B_T)
    return value_B_K.gather(1, column_B_T) * mask_B_T


@ADVANTAGES.register("turn_grpo")
@rollout_inputs("turns")
@group_baseline
@group_statistics
@torch.no_grad()
def turn_grpo(
    rewards: Tensor,
    mask: Tensor,
    turns: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Turn-level GRPO (the credit assignment of MT-GRPO, Zeng et al. 2025, arXiv:2505.11821):
    turn j of an episode is compared with turn j of the other episodes of its group.

    ``A_j = (R_j - mean_g(R_j)) / (std_g(R_j) + eps)`` on every trained token of turn j, the mean
    and unbiased std over the group's rows that have a turn j (module docstring for R_j, turns
    and the conventions: one row with a turn j gets mean 0, std 1; equal returns give 0).
    Whole-episode GRPO compares every token with the group's final scores; this compares turn 1
    with turn 1, so a good first call is not blamed for a bad second answer.

    Shapes: rewards (B,) or (B,T), mask (B,T), turns (B,T) -> (advantages, returns R_j) (B,T).
    No verl counterpart: verl's ``compute_grpo_outcome_advantage`` broadcasts the summed reward
    (with one turn per row and gamma 1 this is it).
    """
    check_turn_hparams("turn_grpo", gamma=gamma, eps=eps)
    mask_f, column, r, has = _turn_table("turn_grpo", rewards, mask, turns)
    index, _ = _groups("turn_grpo", mask_f.shape[0], group_ids, group_size)
    returns = _turn_returns(r, gamma)
    rows, cols = has.nonzero(as_tuple=True)
    adv = torch.zeros_like(returns)
    if rows.numel():
        values = returns[rows, cols]
        mean, std = _singleton_convention(*_keyed_stats(values, index.to(rows.device)[rows] * r.shape[1] + cols))
        adv[rows, cols] = _normalised(values, mean, std, eps)
    return _per_token(adv, column, mask_f), _per_token(returns, column, mask_f)


@ADVANTAGES.register("gigpo")
@rollout_inputs("turns", "states")
@group_baseline
@group_statistics
@torch.no_grad()
def gigpo(
    rewards: Tensor,
    mask: Tensor,
    turns: Tensor,
    states: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    omega: float = 1.0,
    gamma: float = 0.95,
    norm: str = "std",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training",
    arXiv:2505.10978): an episode-level group advantage plus a step-level one over the steps of
    the group that acted from the same anchor state. A step is a turn (module docstring).

        episode level:  A^E_i = (R(tau_i) - mean_g R(tau)) / F_norm,   R(tau_i) = sum_t r_t^(i)
        step level:     A^S_(i,t) = (R_t^(i) - mean over G^S(s) of R) / F_norm,
                        G^S(s): the group's steps whose anchor state is s (``states``)
        A = A^E + omega * A^S on every trained token of the turn

    ``F_norm``: the unbiased std plus ``eps`` (``norm="std"``) or 1 (``norm="none"``), the paper's
    two choices, at both levels; paper defaults gamma 0.95, omega 1. A group of one episode takes
    the singleton convention at the episode level (mean 0, std 1); a state only one step of the
    group acted from has A^S = 0 (the std of one value is undefined); equal values give 0.

    Shapes: rewards (B,) or (B,T), mask (B,T), turns (B,T), states (B,K) long: an id per turn of
    a row (ids compare within a group), at least as many columns as the batch has turns ->
    (advantages, returns R_t) (B,T). verl-agent (GiGPO's code, built on verl):
    ``gigpo/core_gigpo.py``, whose ``mean_std_norm`` / ``mean_norm`` modes are ``norm``'s values.
    """
    check_turn_hparams("gigpo", gamma=gamma, eps=eps, omega=omega, norm=norm)
    mask_f, column, r, has = _turn_table("gigpo", rewards, mask, turns)
    index, num_groups = _groups("gigpo", mask_f.shape[0], group_ids, group_size)
    index = index.to(r.device)
    K = r.shape[1]
    if states.dim() != 2 or states.shape[0] != mask.shape[0] or states.shape[1] < K:
        raise ShapeError(f"gigpo: states must be (B, K) with B={mask.shape[0]} and K >= {K} (the batch's turns), "
                         f"got shape {list(states.shape)}")
    states = states[:, :K].to(device=r.device, dtype=torch.long)
    if (states[has] < 0).any():
        raise ShapeError("gigpo: a turn with trained tokens has no anchor state (state id -1)")
    totals = r.sum(-1)
    mean, std = _singleton_convention(*group_stats(totals.cpu(), index.cpu(), num_groups))
    a_episode = _normalised(totals, mean.to(r.device), std.to(r.device), eps, norm)
    returns = _turn_returns(r, gamma)
    rows, cols = has.nonzero(as_tuple=True)
    adv = torch.zeros_like(returns)
    if rows.numel():
        values, ids = returns[rows, cols], states[rows, cols]
        mean, std, count = _keyed_stats(values, index[rows] * (int(ids.max()) + 1) + ids)
        a_step = torch.where(count > 1, _normalised(values, mean, std, eps, norm), torch.zeros_like(values))
        adv[rows, cols] = a_episode[rows] + omega * a_step
    return _per_token(adv, column, mask_f), _per_token(returns, column, mask_f)
