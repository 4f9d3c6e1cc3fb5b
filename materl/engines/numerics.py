"""How far an engine's sampling log-probs are from the learner's recomputation of them.

    delta = logprob_delta(sampling_logprobs_B_T, recomputed_logprobs_B_T, mask_B_T)
    metrics.update(delta.metrics())      # {"logprob_delta/mean": ..., "logprob_delta/max": ...}

The engine reports log softmax(logits / T)[token] of every token it sampled (``base.py``); the
learner recomputes the same numbers teacher-forced (one forward over prompt + completion). They
differ by float rounding only (summation order, a KV cache vs one pass, padding); a larger gap
means the sampler and the learner disagree about the policy, which biases importance ratios.
Both inputs may be float32; the differences are taken in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from materl.errors import ShapeError


@dataclass(frozen=True)
class LogprobDelta:
    mean: float  # mean |sampled - recomputed| over the masked tokens (0 when there are none)
    max: float
    tokens: int

    def metrics(self, prefix: str = "logprob_delta") -> dict[str, float]:
        return {f"{prefix}/mean": self.mean, f"{prefix}/max": self.max}


def logprob_delta(sampled_B_T: Tensor, recomputed_B_T: Tensor, mask_B_T: Tensor) -> LogprobDelta:
    """Mean and max of |sampled - recomputed| over tokens where ``mask`` is non-zero (B, T each)."""
    if sampled_B_T.shape != recomputed_B_T.shape or sampled_B_T.shape != mask_B_T.shape:
        raise ShapeError(f"logprob_delta needs three (B, T) tensors of one shape; got sampled "
                         f"{tuple(sampled_B_T.shape)}, recomputed {tuple(recomputed_B_T.shape)}, "
                         f"mask {tuple(mask_B_T.shape)}")
    keep = mask_B_T.bool()
    diff = (sampled_B_T.detach().double() - recomputed_B_T.detach().double()).abs()[keep]
    if diff.numel() == 0:
        return LogprobDelta(0.0, 0.0, 0)
    return LogprobDelta(diff.mean().item(), diff.max().item(), diff.numel())


def teacher_forced_logprobs(model, prompt_ids: list[int], completion_ids: list[int], *,
                            temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / T) of each completion token given everything before it: one unpadded
    forward of ``model`` (an HF causal LM) in float64 at the end, shape (len(completion_ids),)."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = (logits / temperature).log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1).double()
