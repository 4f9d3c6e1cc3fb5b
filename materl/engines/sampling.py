"""What every in-process engine shares: request checks, seeds, stop rules and per-row sampling.

    ids = check_request(prompt_ids, params, limits=RequestLimits.of(model))  # ConfigError / EngineError on bad input
    rule = StopRule(params, eos, tokenizer)          # eos ids, stop_token_ids, stop strings, length
    tokens_B, logprobs_B = sample_tokens(logits_B_V, uniform_B, temperature_B=..., ...)

The in-process engines (transformers, its device loop, Mojo) all sample through
``sample_tokens`` with one uniform per row from ``counter_uniforms(seed, index)``: a
counter-based generator (a hash of the request's seed and the index of the token being drawn, as
Philox/JAX's ``fold_in`` are), so given the same logits they pick the same tokens, a row's draw
depends only on its own logits, seed and position (never on its batch-mates or on how many
steps ran before it joined), and the draw is a handful of integer torch ops that run inside a
captured CUDA graph with no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from materl.engines.base import SamplingParams
from materl.engines.hf import causal_lm_of
from materl.errors import ConfigError, EngineError


@dataclass(frozen=True)
class RequestLimits:
    """What one model accepts: token ids ``0 .. vocab_size - 1`` and at most ``max_positions``
    positions (prompt and completion; None: no limit known). A prompt outside them is refused
    when it enters, alone, so it never reaches a batch that other requests share."""
    vocab_size: int | None = None
    max_positions: int | None = None

    @classmethod
    def of(cls, model) -> RequestLimits:
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embed, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
        return cls(vocab_size=rows, max_positions=getattr(model.config, "max_position_embeddings", None))


def check_request(prompt_ids, params: SamplingParams, *, limits: RequestLimits = RequestLimits()) -> list[int]:
    """The prompt as a list of ints, after checking it (against ``limits``) and ``params``."""
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"params must be a SamplingParams, got {type(params).__name__}")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise EngineError("generate() needs at least one prompt token; got an empty prompt")
    if params.max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if limits.vocab_size is not None and not 0 <= min(ids) <= max(ids) < limits.vocab_size:  # C loops: a long prompt
        at = next(i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size)
        raise EngineError(f"prompt token id {ids[at]} at position {at} is outside the model's vocabulary "
                          f"(ids 0..{limits.vocab_size - 1})")
    if limits.max_positions is not None and len(ids) >= limits.max_positions:
        raise EngineError(f"the prompt has {len(ids)} tokens; the model's context holds {limits.max_positions} "
                          f"positions, so at most {limits.max_positions - 1} prompt tokens leave room to generate")
    return ids


def request_seed(params: SamplingParams) -> int:
    """The request's own seed, or one drawn from torch's global generator (so an unseeded run is
    still reproducible under ``torch.manual_seed``)."""
    if params.seed is not None:
        return int(params.seed)
    return int(torch.randint(0, 2**62, ()).item())


def eos_ids(model, tokenizer) -> frozenset[int]:
    """The model's generation-config eos ids and the tokenizer's eos id."""
    ids: set[int] = set()
    config = getattr(causal_lm_of(model), "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    return frozenset(ids)


@dataclass(frozen=True)
class StopRule:
    """When a row stops: an eos id or one of ``stop_token_ids`` ("stop"), a stop string in the
    decoded tail ("stop_string"), ``max_new_tokens`` ("length"); checked in that order after
    every sampled token (the stopping token is kept)."""

    params: SamplingParams
    stop_ids: frozenset[int]
    tail_tokens: int  # how many trailing tokens to decode when checking stop strings

    @classmethod
    def of(cls, params: SamplingParams, eos: frozenset[int]) -> "StopRule":
        longest = max((len(s) for s in params.stop_strings), default=0)
        return cls(params, eos | frozenset(params.stop_token_ids), 4 * longest + 4)

    def reason(self, ids: list[int], tokenizer) -> str | None:
        """Why generation stops after ``ids`` (the tokens sampled so far), or None."""
        if ids[-1] in self.stop_ids:
            return "stop"
        if self.params.stop_strings:
            tail = tokenizer.decode(ids[-self.tail_tokens:], skip_special_tokens=False)
            if any(s in tail for s in self.params.stop_strings):
                return "stop_string"
        if len(ids) >= self.params.max_new_tokens:
            return "length"
        return None


_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32) (the products
    wrap in int64; masking keeps their low 32 bits, so every value stays non-negative and ``>>``
    is a logical shift)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def seed_words(seeds: list[int]) -> tuple[Tensor, Tensor]:
    """Each seed as two int64 tensors of its low and high 32 bits (any Python int; taken mod 2**64)."""
    return (torch.tensor([s & _M32 for s in seeds], dtype=torch.long),
            torch.tensor([(s >> 32) & _M32 for s in seeds], dtype=torch.long))


def counter_uniforms(seed_lo_B: Tensor, seed_hi_B: Tensor, index_B: Tensor) -> Tensor:
    """One float32 uniform in [0, 1) per row, a pure function of (seed, index): 24 bits of
    ``mix32(mix32(lo ^ mix32(hi + golden)) ^ mix32(index * golden'))``. ``index`` is which token
    of the request is drawn (0 for the first new token). Integer torch ops only: exact and equal
    on every device, capturable in a CUDA graph. (A counter-based generator as Salmon et al.'s
    Philox, "Parallel random numbers: as easy as 1, 2, 3", SC 2011; vLLM/SGLang seed a
    ``torch.Generator`` per request instead, which needs a host call per row.)"""
    key = _mix32(seed_lo_B ^ _mix32((seed_hi_B + 0x9E3779B9) & _M32))
    bits = _mix32(key ^ _mix32((index_B * 0x9E3779B1) & _M32))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_rows(logits_B_V: Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
                ) -> tuple[list[int], list[float]]:
    """One token and its log-prob per row, each row with its own params; row i draws token
    ``indices[i]`` of the request seeded ``seeds[i]`` (``counter_uniforms``)."""
    dev = logits_B_V.device
    lo, hi = seed_words(seeds)
    tokens, logprobs = sample_tokens(
        logits_B_V,
        counter_uniforms(lo, hi, torch.tensor(indices, dtype=torch.long)).to(dev),
        temperature_B=torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev),
        top_k_B=torch.tensor([p.top_k for p in params], device=dev),
        top_p_B=torch.tensor([p.top_p for p in params], device=dev),
        greedy_B=torch.tensor([p.greedy or p.temperature == 0 for p in params], device=dev),
    )
    return tokens.tolist(), logprobs.tolist()


def top_k_top_p_filter(scaled_B_V: Tensor, top_k_B: Tensor, top_p_B: Tensor) -> Tensor:
    """Set logits outside each row's top-k / nucleus to -inf; shapes (B, V), (B,), (B,).

    Order as HF ``generate``, vLLM and SGLang: top-k first, then top-p on the renormalised
    top-k distribution. Top-p keeps the smallest prefix of tokens (by probability, descending)
    whose mass reaches p: token j survives iff the mass of strictly more probable tokens is
    < p, so the most probable token always survives. ``top_k <= 0`` and ``top_p >= 1`` are off.
    (HF: ``TopKLogitsWarper`` + ``TopPLogitsWarper``, which removes ascending cumsum <= 1 - p.)
    """
    vocab = scaled_B_V.size(-1)
    sorted_B_V, order_B_V = scaled_B_V.sort(dim=-1, descending=True)
    ranks_V = torch.arange(vocab, device=scaled_B_V.device)
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=vocab), torch.full_like(top_k_B, vocab))
    remove_B_V = ranks_V[None, :] >= k_B[:, None]
    sorted_B_V = sorted_B_V.masked_fill(remove_B_V, float("-inf"))
    probs_B_V = sorted_B_V.softmax(dim=-1)
    mass_before_B_V = probs_B_V.cumsum(dim=-1) - probs_B_V
    threshold_B = torch.where(top_p_B < 1.0, top_p_B, torch.full_like(top_p_B, float("inf")))
    remove_B_V = remove_B_V | (mass_before_B_V >= threshold_B[:, None])
    sorted_B_V = sorted_B_V.masked_fill(remove_B_V, float("-inf"))
    return torch.empty_like(scaled_B_V).scatter_(-1, order_B_V, sorted_B_V)


def sample_tokens(
    logits_B_V: Tensor,
    uniform_B: Tensor,
    *,
    temperature_B: Tensor,
    top_k_B: Tensor,
    top_p_B: Tensor,
    greedy_B: Tensor,
    filtered: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row and return ``(tokens_B, logprobs_B)``.

    logprob_i = log_softmax(logits_i / T_i)[token_i]   (no top-k/top-p renormalisation; this is
    what the learner recomputes; T_i must be > 0: greedy rows pass their temperature or 1).
    Sampling is inverse-CDF with one uniform per row, u_i in [0, 1):
    token_i = min{j : cdf_i[j] > u_i * cdf_i[V-1]} over the filtered distribution, so a row's
    draw depends only on its own logits and its own uniform. Greedy rows take argmax(logits).
    ``filtered``: whether any row has top-k/top-p on (None: look, one host sync; the device
    loop passes what it knows so a captured step never syncs).
    (HF ``generate`` draws with ``torch.multinomial`` from one global generator; vLLM/SGLang
    report the same un-renormalised log-probs by default.)
    """
    scaled_B_V = logits_B_V.float() / temperature_B[:, None]
    logprobs_B_V = scaled_B_V.log_softmax(dim=-1)
    needs_filter = bool(((top_k_B > 0) | (top_p_B < 1.0)).any()) if filtered is None else filtered
    filtered_B_V = top_k_top_p_filter(scaled_B_V, top_k_B, top_p_B) if needs_filter else scaled_B_V
    cdf_B_V = filtered_B_V.softmax(dim=-1).cumsum(dim=-1)
    target_B1 = (uniform_B.to(cdf_B_V) * cdf_B_V[:, -1])[:, None]
    sampled_B = torch.searchsorted(cdf_B_V, target_B1, right=True).squeeze(-1)
    sampled_B = sampled_B.clamp_(max=logits_B_V.size(-1) - 1)
    tokens_B = torch.where(greedy_B, logits_B_V.argmax(dim=-1), sampled_B)
    return tokens_B, logprobs_B_V.gather(-1, tokens_B[:, None]).squeeze(-1)
