"""Step rewards under a group baseline: DeepSeekMath's process supervision (``process``).

    adv_B_T, ret_B_T = process(rewards_B_T, mask_B_T, group_ids=uids)   # ADVANTAGES["process"]

Shao et al. 2024, DeepSeekMath (arXiv:2402.03300) §4.1.3, "Process Supervision RL with GRPO":
a group of G outputs, output i with steps j = 1..K_i, step rewards r_i^j. Every step reward is
normalised by the mean and std of ALL step rewards of the group,

    r~_i^j = (r_i^j - mean(R)) / std(R),    R = {r_1^1, ..., r_1^K_1, ..., r_G^K_G},

and a token's advantage is the sum of the normalised rewards of the steps from its own onward,
``A_{i,t} = sum_{j : end(j) >= t} r~_i^j``.

materl's choices (the paper leaves them open):
- A step is a maximal run of trained tokens (a model turn; the tool output or environment reply
  after it, untrained, belongs to it). Its reward sums the token rewards inside it, so a step
  reward sits on the step's last token and an outcome reward, on the row's last trained token,
  is the last step's reward (added to that step's own step reward, if any).
- Every step has a reward, 0 when nothing scored it: "no tool call" is a reward of 0 for turn 1.
- ``std`` is unbiased and ``eps`` (1e-6) is added to it, as in verl's GRPO, so rows of one step
  each give exactly ``grpo``. A group with a single step reward gets mean 0 and std 1 (verl's
  singleton convention); a group whose step rewards are all equal gets 0 (no signal, never a
  rounding residue divided by ``eps``). ``scale="none"`` leaves out the std (Dr. GRPO's choice).
- Returns = advantages, as for GRPO.

Note what the method credits: the normalisation is over steps, so in a group of identical
episodes whose turn 2 scored more than turn 1, turn 2's tokens get a positive advantage (above
the group's average step) and turn 1's the sum of both (0 for two steps). It is bounded (at
most about sqrt(#steps) in size), never an ``eps`` blow-up. ``turn_advantages`` (turn j against
turn j) and ``gigpo_advantages`` (episode plus same-state steps) give 0 there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from materl.errors import ConfigError
from materl.ops._masked import group_stats
from materl.ops.advantages import (
    ADVANTAGES,
    GroupIds,
    _groups,
    _prepare,
    _shift_onto_trained,
    group_baseline,
    group_statistics,
)

__all__ = ["GRPO_FAMILY", "STEP_CREDIT", "process", "step_ends"]

PROCESS_SCALES = ("group", "none")
# ml.advantages(step_credit=...): how step rewards are credited under a GRPO-family estimator
STEP_CREDIT = ("process", "sum")
GRPO_FAMILY = {"grpo": "group", "dr_grpo": "none"}  # estimator -> process's scale


def step_ends(mask_B_T: Tensor) -> Tensor:
    """(B,T) bool: the last trained token of each maximal run of trained tokens (each step)."""
    trained = mask_B_T > 0
    nxt = torch.cat([trained[:, 1:], torch.zeros_like(trained[:, :1])], dim=1)
    return trained & ~nxt


def _step_rewards(r_B_T: Tensor, ends_B_T: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, positions) of every step end, row-major, and each step's summed reward."""
    rows, cols = ends_B_T.nonzero(as_tuple=True)
    at_end = r_B_T.cumsum(-1)[rows, cols]
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    prev = torch.cat([at_end.new_zeros(1), at_end[:-1]])
    return (rows, cols), at_end - torch.where(first, torch.zeros_like(prev), prev)


@ADVANTAGES.register("process")
@group_baseline
@group_statistics
@torch.no_grad()
def process(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: GroupIds = None,
    group_size: int | None = None,
    scale: str = "group",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Process-supervision GRPO (DeepSeekMath arXiv:2402.03300 §4.1.3; equations in the module
    docstring).

    Shapes: rewards (B,T) step rewards on each step's last token (or (B,), the outcome on the
    last trained token), mask (B,T) -> (advantages, returns) (B,T), returns = advantages.
    No verl/TRL counterpart (both broadcast the summed reward); with one step per row it is
    verl's ``compute_grpo_outcome_advantage``.
    """
    if scale not in PROCESS_SCALES:
        raise ConfigError(f"process: unknown scale {scale!r}; valid: {', '.join(PROCESS_SCALES)}")
    if eps < 0:
        raise ConfigError(f"process: eps must be >= 0, got {eps!r}")
    tok, mask_f, _ = _prepare("process", rewards, mask)
    index, num_groups = _groups("process", mask_f.shape[0], group_ids, group_size)
    (rows, cols), step_r = _step_rewards(_shift_onto_trained(tok, mask_f), step_ends(mask_f))
    normalised = torch.zeros_like(mask_f)
    if step_r.numel():
        step_group = index.to(rows.device)[rows]
        mean, std, count = group_stats(step_r.cpu(), step_group.cpu(), num_groups)
        mean, std, count = (t.to(step_r.device) for t in (mean, std, count))
        single = count == 1
        mean = torch.where(single, torch.zeros_like(mean), mean)
        denom = torch.where(single, torch.ones_like(std), std) + eps if scale == "group" else 1.0
        normalised[rows, cols] = (step_r - mean) / denom
    adv = normalised.flip(-1).cumsum(-1).flip(-1) * mask_f
    return adv, adv
